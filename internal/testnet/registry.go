// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Stale cleanup
//
// Every namespace name carries the creating process's PID: "pbt" + base36(pid)
// + "_" + base36(seq) + "-" + role (e.g. "pbt2n9c_1-node"). Before creating
// anything, Build also writes a registry file RegistryDir/<id>.json with the
// PID, the process start time (from /proc/<pid>/stat, to detect PID reuse),
// the PID namespace (a PID from another PID namespace cannot be judged) and
// the planned namespace names. CleanupStale deletes a topology's namespaces
// only if its creator is provably gone.

// RegistryDir holds one JSON file per live topology.
const RegistryDir = "/run/penaltybox-testnet"

var nsNameRE = regexp.MustCompile(`^pbt([0-9a-z]+)_([0-9a-z]+)-(node|cl|b[0-9]+|[a-z]+)$`)

type registryEntry struct {
	PID        int      `json:"pid"`
	StartTime  string   `json:"start_time"` // field 22 of /proc/<pid>/stat
	PIDNS      string   `json:"pid_ns"`     // readlink /proc/self/ns/pid
	Namespaces []string `json:"namespaces"`
}

func registryPath(id string) string { return filepath.Join(RegistryDir, id+".json") }

func writeRegistry(id string, names []string) error {
	st, err := procStartTime(os.Getpid())
	if err != nil {
		return fmt.Errorf("testnet: registry: %w", err)
	}
	pidns, _ := os.Readlink("/proc/self/ns/pid")
	b, err := json.Marshal(registryEntry{PID: os.Getpid(), StartTime: st, PIDNS: pidns, Namespaces: names})
	if err != nil {
		return err
	}
	if err := os.MkdirAll(RegistryDir, 0o755); err != nil {
		return fmt.Errorf("testnet: registry: %w", err)
	}
	if err := os.WriteFile(registryPath(id), b, 0o644); err != nil {
		return fmt.Errorf("testnet: registry: %w", err)
	}
	return nil
}

func removeRegistry(id string) error {
	if err := os.Remove(registryPath(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("testnet: registry: %w", err)
	}
	return nil
}

func readRegistry(id string) (*registryEntry, error) {
	b, err := os.ReadFile(registryPath(id))
	if err != nil {
		return nil, err
	}
	var e registryEntry
	if err := json.Unmarshal(b, &e); err != nil {
		return nil, err
	}
	return &e, nil
}

// procStat returns the state (field 3) and start time (field 22) of
// /proc/<pid>/stat.
func procStat(pid int) (state, start string, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "", "", err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')') // comm may contain spaces and ')'
	if i < 0 {
		return "", "", fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3 (state)
	if len(f) < 20 {
		return "", "", fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	return f[0], f[19], nil
}

func procStartTime(pid int) (string, error) {
	_, st, err := procStat(pid)
	return st, err
}

// creatorAlive reports whether the process that created topology id may
// still be running; it errs on the side of "alive". A zombie (killed but
// not yet reaped by its parent) is dead.
func creatorAlive(id string, pid int) bool {
	e, regErr := readRegistry(id)
	if regErr == nil && e.PIDNS != "" {
		if own, _ := os.Readlink("/proc/self/ns/pid"); own != e.PIDNS {
			return true // created in another PID namespace: cannot tell
		}
	}
	state, start, err := procStat(pid)
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	if state == "Z" || state == "X" {
		return false
	}
	if regErr != nil || e.PID != pid {
		return true // no usable registry entry: the PID alone says alive
	}
	return start == e.StartTime // otherwise the PID was reused
}

// CleanupStale deletes the namespaces (and registry files) of topologies
// whose creating process has exited — left behind by a test binary that was
// killed or crashed. Namespaces of live processes, and anything not named
// by this package, are left alone. It returns the deleted namespace names.
// Build calls it before building.
func CleanupStale() ([]string, error) {
	byID := map[string][]string{}
	pids := map[string]int{}
	ents, err := os.ReadDir(netnsDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	for _, e := range ents {
		m := nsNameRE.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		pid, err := strconv.ParseInt(m[1], 36, 32)
		if err != nil || pid <= 0 {
			continue
		}
		id := m[1] + "_" + m[2]
		byID[id] = append(byID[id], e.Name())
		pids[id] = int(pid)
	}
	// Registry files whose namespaces are already gone.
	regs, _ := os.ReadDir(RegistryDir)
	for _, r := range regs {
		id, ok := strings.CutSuffix(r.Name(), ".json")
		if !ok {
			continue
		}
		if _, seen := byID[id]; seen {
			continue
		}
		pidStr, _, ok := strings.Cut(id, "_")
		pid, err := strconv.ParseInt(pidStr, 36, 32)
		if !ok || err != nil {
			continue
		}
		byID[id] = nil
		pids[id] = int(pid)
	}

	ids := make([]string, 0, len(byID))
	for id := range byID {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var removed []string
	var errs []error
	for _, id := range ids {
		if creatorAlive(id, pids[id]) {
			continue
		}
		ok := true
		for _, name := range byID[id] {
			if err := deleteNetns(name); err != nil {
				errs = append(errs, err)
				ok = false
				continue
			}
			removed = append(removed, name)
		}
		if ok {
			if err := removeRegistry(id); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return removed, errors.Join(errs...)
}
