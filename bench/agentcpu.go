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

// agentCPUConntrack is the conntrack table the agents run with here,
// sized for the rate as an operator would size it: a closed flow's two
// entries stay 10 s (Timeouts.TCPClosed) and the sweep runs every 10 s,
// so 10,000 connections/s keep up to 400,000 entries. The default
// (262,144) overflows: the LRU then evicts live flows, whose backend's
// first data the datapath no longer reports (the flow is picked up
// midstream), and each such flow's settle deadline woke the agent (about
// 300 every 10 s, 2026-12-07).
const agentCPUConntrack = 1 << 19

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
				return r.penaltybox(false, m.accrual, "--conntrack-size", strconv.Itoa(agentCPUConntrack))
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
	res.note("agentcpu", "Same topology as e2e (client, node, 3 HTTP backends), penaltybox with XDP_PASS after NAT (the e2e part's first penaltybox variant). Open loop: new connections scheduled at %.0f/s (testnet.Load, up to 2,000 in flight), each one HTTP GET with `Connection: close` and its 200 response; %v warm-up, then %v measured, per mode per round, modes interleaved in every round, a fresh agent for each. Agent CPU = the agent process's on-CPU time (the sum over its threads of /proc/PID/task/*/schedstat, nanoseconds: user and system, the ring buffer reads and every wake-up included) during the measured window ÷ the connections that succeeded in it. Per-second costs (the reader's poll, timers, the Go runtime) are in it, so the figure is for this rate; so is the conntrack sweep (every 10 s: a %v window holds one), whose work grows with the table, i.e. with the rate. The clients come from %d addresses of the client's /24, so a tuple comes round every 100 s or so and each closed flow's two entries are the sweep's to delete 10 s after its close, as on a node with many clients; with the warm-up, the window's sweep finds the flows that closed in the warm-up's first seconds due (about 90,000 at 10,000/s after an 11 s warm-up). Before 2026-12-06 the window held no such deletes: one client address, whose ports came round every 6.4 s and took over their tuples' closed entries, and a 1 s warm-up. Modes: consecutive (the default settings), failure-rate (its default window), unified with slowConnectThreshold 50ms and slowConnectRateThreshold 0.3 (handshake times judged). Each agent runs with --conntrack-size %d, sized for the rate: closed flows' entries stay 10 s and the sweep runs every 10 s, so 10,000 connections/s want up to 400,000 entries; before 2026-12-07 the agents ran with the default 262,144, whose LRU then evicted live flows (their first data unreported, each decided by its settle deadline) and closed ones the sweep would otherwise have deleted.", o.Rate, o.Warmup, o.Duration, o.Duration, len(agentCPUSources), agentCPUConntrack)
	res.note("agentcpu", "Where the agent's CPU goes at this rate, held past its first sweeps (perf record -F 999 -g -p on the agent, 10 s of a 40 s hold in the unified mode, 2026-12-07 03:49 UTC, fdd1866, the table sized as above: 39 ms of CPU a second): the outcome events' handling about 40%% (the tracker's map lookups, runtime.mapaccess2, 10%%; its put and Classify; the events counter's increments 3%%; the 3 events of each connection, NEW_FLOW, ESTABLISHED and FIRST_DATA under the default settle rule), the conntrack sweep about 30%% (pb_ct_sweep_run: the forward halves' lookups, the walks over every bucket, the LRU's frees), the scheduler's switches 2%%. Since the replay deadlines are run by the reader (d1bc808: a due one woke the agent's loop, which kicked the reader and woke again after it read) and the reader no longer takes its lock after every record (5f0d74c): 7cbad6b's agent, held the same way, had 448 samples against 390. On 2026-12-07 01:07 UTC (the default table, full): the events about 45%%, the sweep about 19%%, the scheduling about 13%%, sysmon 7%%; on 2026-12-04 the events about 40%% and the sweep, when it still copied a table of ~200,000 entries, about 25%% of a window that held one. Before, polling the ring every 5 ms, wake-ups were most of it (finish_task_switch, sysmon, findRunnable) and the figure was 5.3-7.6 µs. The 1 µs target needs no agent work per healthy connection at all: successes counted in the kernel and read in batches instead of NEW_FLOW/ESTABLISHED/FIRST_DATA records (bench/AGENTCPU.md: the design, what it would save and what it must keep), and a sweep whose work does not grow with closed flows.")
	res.target("agentcpu", fmt.Sprintf("agent CPU per healthy connection ≤ 1 µs at %.0f connections/s (worst mode)", o.Rate), worst, 1, true, "%.2f µs")
	return nil
}
