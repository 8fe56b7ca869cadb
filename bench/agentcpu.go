// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"fmt"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// agentCPUOpts sizes the agentcpu part: the agent's own CPU per healthy
// connection at a fixed, paced rate of new connections.
type agentCPUOpts struct {
	Rounds           int
	Rate             float64 // new connections per second, open loop
	Duration, Warmup time.Duration
	// Hold keeps the agent running after the last round, for a profiler
	// (perf record -g -p PID): the pid is logged.
	Hold time.Duration
	// ConntrackSize is the agents' --conntrack-size (0: the agent's
	// default).
	ConntrackSize int
}

// agentCPUSources are the client's addresses in the agentcpu part: 16 of
// its /24, so a tuple comes round every 100 s or so at 10,000 new
// connections/s, long after its flow's conntrack entries were swept.
var agentCPUSources = func() []netip.Addr {
	var a []netip.Addr
	for i := range 16 {
		a = append(a, netip.AddrFrom4([4]byte{198, 18, 0, byte(30 + i)}))
	}
	return a
}()

// agentCPUOldConntrack is the conntrack table the agents ran with here
// before the datapath deleted closed flows itself (280ce5a): a closed
// flow's two entries stayed 10 s (Timeouts.TCPClosed) and the sweep runs
// every 10 s, so 10,000 connections/s kept up to 400,000 entries, and the
// default (262,144) overflowed. Now the table holds 4,000-8,000 entries at
// that rate (2026-12-07) and the agents run with the default, as an
// operator would; --agentcpu-conntrack-size 524288 measures the old way.
const agentCPUOldConntrack = 1 << 19

// agentCPUModes are the accrual modes measured: the verdict work differs
// (a streak, a rate window, both, handshake times for slow connects).
var agentCPUModes = []struct{ name, accrual string }{
	{"consecutive (default)", ""},
	{"failure-rate", "    failureAccrual:\n      mode: failure-rate\n"},
	{"unified, slow connects", "    failureAccrual:\n      mode: unified\n      slowConnectThreshold: 50ms\n      slowConnectRateThreshold: 0.3\n"},
}

// schedCPU is the CPU time a process's live threads have run
// (/proc/PID/task/*/schedstat, nanoseconds): /proc/PID/stat's ticks
// (10 ms) are too coarse for a microsecond a connection over seconds.
// Go's threads do not exit, so none of the window's time is lost with one.
func schedCPU(pid int) time.Duration {
	dirs, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	var sum int64
	for _, p := range dirs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		f := strings.Fields(string(b))
		if len(f) == 0 {
			continue
		}
		n, _ := strconv.ParseInt(f[0], 10, 64)
		sum += n
	}
	return time.Duration(sum)
}

// runAgentCPU measures the agent process's CPU (user + system, all its
// threads) per healthy connection while clients open new connections at
// a fixed rate (open loop: the schedule does not wait for answers), each
// one HTTP request and its response, through the XDP_PASS variant. Every
// connection is a success the agent must count; none needs judgment.
func runAgentCPU(res *Results, o agentCPUOpts, agentBin string, logf func(string, ...any)) error {
	r, err := newRig(agentBin, 3)
	if err != nil {
		return err
	}
	defer r.close()
	// The clients' ports: 10,000 new connections a second, each leaving a
	// TIME_WAIT on the backend (the server closes first), reuse the range.
	if err := r.topo.Client.Sysctl("net/ipv4/ip_local_port_range", "1024 65535"); err != nil {
		return err
	}
	// Clients on agentCPUSources addresses, as a node's are many: from one
	// address the ports came round every 6.4 s, and each new flow took over
	// its tuple's closed entry, which the conntrack sweep, as on a node,
	// must otherwise find and delete 10 s after its close.
	if err := r.topo.Client.AddAddrs(agentCPUSources...); err != nil {
		return err
	}
	load := func(d time.Duration) (testnet.Results, error) {
		return testnet.Load(context.Background(), r.topo.Client, testnet.LoadSpec{
			Target: vipTarget, Rate: o.Rate, Duration: d, Concurrency: 2000,
			ConnectTimeout: 3 * time.Second, RequestTimeout: 3 * time.Second,
			Sources: agentCPUSources,
		})
	}
	worst := 0.0
	for round := range o.Rounds {
		for mi, m := range agentCPUModes {
			l, err := r.fresh(m.name, func() (lb, error) {
				if o.ConntrackSize == 0 {
					return r.penaltybox(false, m.accrual)
				}
				return r.penaltybox(false, m.accrual, "--conntrack-size", strconv.Itoa(o.ConntrackSize))
			})
			if err != nil {
				return err
			}
			pid := l.pid()
			if _, err := load(o.Warmup); err != nil {
				l.stop()
				return err
			}
			c0, t0 := schedCPU(pid), time.Now()
			rs, err := load(o.Duration)
			cpu, el := schedCPU(pid)-c0, time.Since(t0)
			if err == nil && o.Hold > 0 && round == o.Rounds-1 && mi == len(agentCPUModes)-1 {
				logf("agentcpu: holding the agent (pid %d) under load for %v", pid, o.Hold)
				_, err = load(o.Hold)
			}
			if serr := l.stop(); serr != nil && err == nil {
				err = serr
			}
			if err != nil {
				return fmt.Errorf("%s: %w", m.name, err)
			}
			ok, failed := 0, 0
			for _, x := range rs {
				switch {
				case x.Class == testnet.OK:
					ok++
				case x.Class.Failed():
					failed++
				}
			}
			if ok == 0 || failed*100 > len(rs) {
				return fmt.Errorf("%s: %d of %d connections failed, %d succeeded", m.name, failed, len(rs), ok)
			}
			per := float64(cpu.Nanoseconds()) / 1e3 / float64(ok)
			f := res.figure("agentcpu", m.name+": agent CPU per healthy connection", "µs/conn")
			f.Samples = append(f.Samples, per)
			f.Digits = 2
			g := res.figure("agentcpu", m.name+": healthy connections/s achieved", "conn/s")
			g.Samples = append(g.Samples, float64(ok)/el.Seconds())
			logf("agentcpu: round %d/%d: %-24s %6.0f conn/s ok, %d failed, agent %v = %.2f µs/conn (pid %d)",
				round+1, o.Rounds, m.name, float64(ok)/el.Seconds(), failed, cpu.Round(time.Microsecond), per, pid)
		}
	}
	for _, m := range agentCPUModes {
		worst = math.Max(worst, res.median("agentcpu", m.name+": agent CPU per healthy connection"))
	}
	ctNote := "Each agent runs with the default conntrack table (262,144 entries), as an operator would now size it for this rate: since closed flows leave at their last ACK it holds 4,000-8,000 entries here. Before, the agents ran with 524,288, sized for closed flows that stayed 10 s (up to 400,000 entries at 10,000 connections/s); the sweep's walk visits every bucket, so that table cost the agent more (1.95 / 2.37 / 3.52 µs against 1.60 / 1.93 / 3.38 µs a connection on the default, min / median / max of 15 samples, the same agent, alternating, 2026-12-07)."
	if o.ConntrackSize != 0 {
		ctNote = fmt.Sprintf("Each agent runs with --conntrack-size %d (--agentcpu-conntrack-size).", o.ConntrackSize)
	}
	res.note("agentcpu", "Same topology as e2e (client, node, 3 HTTP backends), penaltybox with XDP_PASS after NAT (the e2e part's first penaltybox variant). Open loop: new connections scheduled at %.0f/s (testnet.Load, up to 2,000 in flight), each one HTTP GET with `Connection: close` and its 200 response; %v warm-up, then %v measured, per mode per round, modes interleaved in every round, a fresh agent for each. Agent CPU = the agent process's on-CPU time (the sum over its threads of /proc/PID/task/*/schedstat, nanoseconds: user and system, the ring buffer reads and every wake-up included) during the measured window ÷ the connections that succeeded in it. Per-second costs (the reader's poll, timers, the Go runtime) are in it, so the figure is for this rate; so is the conntrack sweep (every 10 s: a %v window holds one), whose walk visits every bucket of the table. The clients come from %d addresses of the client's /24, so a tuple comes round every 100 s or so, long after its flow's entries went, as on a node with many clients. Since 280ce5a (2026-12-07) the datapath deletes a flow closed by a FIN each way at its last ACK; before, each closed flow's two entries stayed 10 s for the sweep to delete, and the window's sweep deleted about 90,000 flows. Before 2026-12-06 the window held no such deletes: one client address, whose ports came round every 6.4 s and took over their tuples' closed entries, and a 1 s warm-up. Modes: consecutive (the default settings), failure-rate (its default window), unified with slowConnectThreshold 50ms and slowConnectRateThreshold 0.3 (handshake times judged). %s", o.Rate, o.Warmup, o.Duration, o.Duration, len(agentCPUSources), ctNote)
	res.note("agentcpu", "Where the agent's CPU goes at this rate, held past its first sweeps (perf record -F 999 -g -p on the agent, 15 s of a 40 s hold in the unified mode, 2026-12-07 21:51 UTC, 1f56f98, the table at 524,288 entries: 23 ms of CPU a second): the outcome events' handling 52%% (Tracker.Classify with what it calls 38%%, runtime.mapaccess2 alone 10%%; the 3 events of each connection, NEW_FLOW, ESTABLISHED and FIRST_DATA under the default settle rule) and the reader's own reads 8%%; the conntrack sweep 19%%, nearly all of it its walk over empty buckets (bpf_for_each_hash_elem and its rcu_read_unlock); the scheduler 12%%. The part's agents now run on the default table (262,144 entries; about 4,000-8,000 of them used at this rate), where the walk has half the buckets to visit. Before the datapath deleted closed flows (fdd1866, held the same way, 03:49 UTC, on an Intel Xeon: 39 ms of CPU a second) the events were about 40%% and the sweep about 30%%: its lookups, deletes and walks over 400,000 entries. Before, polling the ring every 5 ms, wake-ups were most of it (finish_task_switch, sysmon, findRunnable) and the figure was 5.3-7.6 µs. The 1 µs target needs no agent work per healthy connection: successes counted in the kernel and read in batches instead of NEW_FLOW/ESTABLISHED/FIRST_DATA records (bench/AGENTCPU.md: the design, what it would save and what it must keep).")
	res.target("agentcpu", fmt.Sprintf("agent CPU per healthy connection ≤ 1 µs at %.0f connections/s (worst mode)", o.Rate), worst, 1, true, "%.2f µs")
	return nil
}
