// SPDX-License-Identifier: Apache-2.0

package datapath

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// ConventionalBPFFS is where a bpffs is mounted on a host (systemd does it).
const ConventionalBPFFS = "/sys/fs/bpf"

// RootError is a pin root that cannot hold pins that outlive the agent.
// Root is the --bpffs-root the agent was given.
type RootError struct {
	Root string
	Err  error
}

func (e *RootError) Error() string { return e.Root + ": " + e.Err.Error() }
func (e *RootError) Unwrap() error { return e.Err }

// PinRoot says where the pins live.
type PinRoot struct {
	Root string
	// Mount is the bpffs mount point that holds Root.
	Mount string
	// Mounted: the agent mounted that bpffs itself (none was there).
	Mounted bool
}

// isBPFFS reports whether dir lives on a bpf filesystem.
func isBPFFS(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, err
	}
	return st.Type == unix.BPF_FS_MAGIC, nil
}

// ensureBPFFS makes root a directory on a bpf filesystem whose pins outlive
// the process. A root that is on a bpffs (a mount point or a directory
// under one) is used as it is. Otherwise a bpffs is mounted, on
// /sys/fs/bpf when root is directly under it (the conventional mount
// point), else on root itself, and only where that is safe: on an empty
// directory that is not a mount point already (never over someone's
// files), and only in the host's mount namespace. A bpffs the agent mounts
// in a mount namespace of its own (a container's, `ip netns exec`'s)
// vanishes with the process, and with it the pinned XDP links: the
// datapath would stop when the agent does. That is refused.
func ensureBPFFS(root string) (PinRoot, error) {
	root = filepath.Clean(root)
	pr := PinRoot{Root: root}
	fail := func(err error) (PinRoot, error) { return pr, &RootError{Root: root, Err: err} }
	// The nearest directory that exists (root itself, or an ancestor).
	dir := root
	for {
		if _, err := os.Stat(dir); err == nil {
			break
		} else if !errors.Is(err, os.ErrNotExist) {
			return fail(err)
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			break
		}
		dir = parent
	}
	on, err := isBPFFS(dir)
	if err != nil {
		return fail(fmt.Errorf("statfs %s: %w", dir, err))
	}
	if on {
		if err := os.MkdirAll(root, 0o700); err != nil {
			return fail(err)
		}
		pr.Mount = mountPoint(root)
		return pr, nil
	}

	target := root
	if filepath.Dir(root) == ConventionalBPFFS {
		target = ConventionalBPFFS
	}
	if err := outlivesProcess(); err != nil {
		return fail(fmt.Errorf("no bpffs there, and one the agent mounted at %s would vanish when it exits, "+
			"releasing the datapath's XDP links (%v); mount a bpffs at or above it where it outlives the agent "+
			"(the host's %s; in Kubernetes a hostPath volume)", target, err, ConventionalBPFFS))
	}
	if err := os.MkdirAll(target, 0o700); err != nil {
		return fail(err)
	}
	if err := safeMountTarget(target); err != nil {
		return fail(fmt.Errorf("no bpffs there, and the agent mounts one only on an empty directory of its own: %w", err))
	}
	if err := unix.Mount("bpf", target, "bpf", 0, "mode=0700"); err != nil {
		return fail(fmt.Errorf("mount bpf on %s: %w", target, err))
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return fail(err)
	}
	pr.Mount, pr.Mounted = target, true
	return pr, nil
}

// safeMountTarget: dir is empty and not a mount point.
func safeMountTarget(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if len(ents) > 0 {
		return fmt.Errorf("%s is not empty", dir)
	}
	if mountPoint(dir) == dir {
		return fmt.Errorf("%s is a mount point of another filesystem", dir)
	}
	return nil
}

// mountPoint is the mount point of the filesystem dir is on: the highest
// ancestor on the same device.
func mountPoint(dir string) string {
	var st unix.Stat_t
	if unix.Stat(dir, &st) != nil {
		return dir
	}
	for {
		parent := filepath.Dir(dir)
		var pst unix.Stat_t
		if parent == dir || unix.Stat(parent, &pst) != nil || pst.Dev != st.Dev {
			return dir
		}
		dir = parent
	}
}

// initialPIDNS is the initial PID namespace, whose inode number the kernel
// fixes (PROC_PID_INIT_INO).
const initialPIDNS = "pid:[4026531836]"

// outlivesProcess reports why a mount this process makes would not
// outlive it. A mount lives as long as its mount namespace, and that as
// long as a process in it: the agent is fine in the host's namespace (PID
// 1's, in the initial PID namespace), or, where PID 1's cannot be read, in
// one it shares with other processes. It is refused in a PID namespace of
// its own (a container) and when alone in its mount namespace (`ip netns
// exec`).
func outlivesProcess() error {
	if os.Getpid() == 1 {
		return errors.New("the agent is its PID namespace's init, as in a container")
	}
	// In a PID namespace of its own (a container), PID 1 is the
	// container's init, which shares the container's mount namespace: it
	// says nothing about the host's.
	if pidns, err := os.Readlink("/proc/self/ns/pid"); err != nil || pidns != initialPIDNS {
		return fmt.Errorf("the agent runs in a PID namespace of its own (%s), as in a container", pidns)
	}
	self, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		return fmt.Errorf("cannot tell which mount namespace this is: %w", err)
	}
	if host, err := os.Readlink("/proc/1/ns/mnt"); err == nil {
		if self != host {
			return fmt.Errorf("the agent runs in a mount namespace of its own, %s, not the host's %s", self, host)
		}
		return nil
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return err
	}
	me := strconv.Itoa(os.Getpid())
	for _, e := range ents {
		if e.Name() == me || e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		if ns, err := os.Readlink("/proc/" + e.Name() + "/ns/mnt"); err == nil && ns == self {
			return nil
		}
	}
	return fmt.Errorf("the agent is alone in its mount namespace %s", self)
}
