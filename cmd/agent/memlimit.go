// SPDX-License-Identifier: Apache-2.0

package main

import (
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"strings"
)

// The DaemonSet sets GOMEMLIMIT to the container's memory limit (the
// downward API, resourceFieldRef limits.memory). The container's cgroup
// is charged for more than the Go runtime's memory, though: the BPF maps
// (kernel >= 5.11), over a hundred MiB at the default sizes and more with
// every CPU, so a Go soft limit of the whole container limit would never
// make the collector work harder before the cgroup runs out. Once the
// datapath is loaded, fitMemoryLimit lowers the soft limit by what the
// cgroup holds outside the Go runtime, when the soft limit is the
// cgroup's limit (an operator's own GOMEMLIMIT is left alone).

// minGoMemoryLimit is the least soft limit fitMemoryLimit sets: below it
// the collector would run all the time; a container limit that leaves
// less for the agent is too small, and the log says so.
const minGoMemoryLimit = 32 << 20

// cgroupMemory reads the memory limit and usage of the process's cgroup
// under root (/sys/fs/cgroup): cgroup v2's memory.max and memory.current,
// else v1's memory controller. ok is false when there is no limit or
// nothing could be read.
func cgroupMemory(root string) (limit, current int64, ok bool) {
	read := func(name string) (int64, bool) {
		b, err := os.ReadFile(filepath.Join(root, name))
		if err != nil {
			return 0, false
		}
		v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		return v, err == nil && v > 0
	}
	if l, ok := read("memory.max"); ok {
		c, ok := read("memory.current")
		return l, c, ok
	}
	// cgroup v1 reports no limit as a huge number, which is no limit.
	if l, ok := read("memory/memory.limit_in_bytes"); ok && l < math.MaxInt64/2 {
		c, ok := read("memory/memory.usage_in_bytes")
		return l, c, ok
	}
	return 0, 0, false
}

// fittedLimit is the Go soft limit for a container whose cgroup allows
// cgLimit and holds cgCurrent, of which goTotal is the Go runtime's:
// goLimit less the rest, when goLimit is the cgroup's limit. ok is false
// when goLimit is something else (left alone).
func fittedLimit(goLimit, cgLimit, cgCurrent, goTotal int64) (limit int64, ok bool) {
	if goLimit != cgLimit {
		return goLimit, false
	}
	outside := max(cgCurrent-goTotal, 0)
	return max(goLimit-outside, minGoMemoryLimit), true
}

// fitMemoryLimit applies fittedLimit to this process (see above). Call it
// once the datapath's maps are loaded.
func fitMemoryLimit(root string, log *slog.Logger) {
	if os.Getenv("GOMEMLIMIT") == "" {
		return // main set the default soft limit
	}
	cgLimit, cgCurrent, ok := cgroupMemory(root)
	if !ok {
		return
	}
	sample := []metrics.Sample{{Name: "/memory/classes/total:bytes"}}
	metrics.Read(sample)
	goTotal := int64(sample[0].Value.Uint64())
	goLimit := debug.SetMemoryLimit(-1)
	limit, ok := fittedLimit(goLimit, cgLimit, cgCurrent, goTotal)
	if !ok {
		return
	}
	debug.SetMemoryLimit(limit)
	args := []any{"container_limit", cgLimit, "outside_go", max(cgCurrent-goTotal, 0), "go_soft_limit", limit}
	if limit == minGoMemoryLimit {
		log.Warn("the container's memory limit leaves the agent's heap too little beside the BPF maps: raise it (deploy/daemonset.yaml) or shrink the maps (--max-backends, --max-services)", args...)
		return
	}
	log.Info("Go soft memory limit: the container's limit less the BPF maps and kernel memory charged to it", args...)
}
