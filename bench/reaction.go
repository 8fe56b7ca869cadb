// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

type reactionOpts struct {
	// Admitted is each run's length in the new-flows-after-the-deciding-
	// failure rows (one run per variant per round).
	Admitted     time.Duration
	AdmittedRate float64       // new connections per second in those runs
	Ejections    int           // at least this many
	Services     int           // services, each with one healthy and one refusing backend
	Rate         float64       // new connections per second over all services
	Timeout      time.Duration // give up after
	Rounds       int           // the ejections are split into this many consecutive rounds
}

// The rows of the agent's part of the reaction (each with ", p50", ...)
// and of the floor process's bpf() calls (each followed by p50 or p99).
const (
	reactionOwn     = "of which the agent's own part (reader's hand-over of the batch → maps written)"
	reactionJudge   = "of the agent's part, judging (hand-over → accrual's decision: the lock, the batch's events before it, accrual)"
	reactionProgram = "of the agent's part, programming (accrual's decision → maps written: Maglev rebuild, table fill, map writes)"
	bpfFirstRow     = "diagnostic: the floor process's first bpf() call after its wake-up (a map lookup), "
	bpfAgainRow     = "diagnostic: the floor process's next bpf() call at once after it, "
)

// split is one ejection's reaction time (µs) and its parts, from its log
// line: own, after the reader handed the deciding event over (the agent's
// own work: reaction_us − reaction_read_us); judge, of that the part up to
// accrual's decision (reaction_decided_us − reaction_read_us: the lock,
// the batch's events before it, accrual); program, the rest (reaction_us −
// reaction_decided_us: the Maglev rebuild and the map writes). NaN where
// the line has no split.
type split struct{ reaction, own, judge, program float64 }

// ejections parses the agent's "endpoint ejected" log lines and returns
// their reaction times and splits, in log order.
func ejections(logPath string) (out []split, err error) {
	f, err := os.Open(logPath)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if !strings.Contains(string(line), `"endpoint ejected"`) {
			continue
		}
		var rec struct {
			Msg        string   `json:"msg"`
			ReactionUS *float64 `json:"reaction_us"`
			ReadUS     *float64 `json:"reaction_read_us"`
			DecidedUS  *float64 `json:"reaction_decided_us"`
		}
		if json.Unmarshal(line, &rec) != nil || rec.Msg != "endpoint ejected" || rec.ReactionUS == nil {
			continue
		}
		sp := split{reaction: *rec.ReactionUS, own: math.NaN(), judge: math.NaN(), program: math.NaN()}
		if rec.ReadUS != nil {
			sp.own = *rec.ReactionUS - *rec.ReadUS
			if rec.DecidedUS != nil {
				sp.judge = *rec.DecidedUS - *rec.ReadUS
				sp.program = *rec.ReactionUS - *rec.DecidedUS
			}
		}
		out = append(out, sp)
	}
	return out, sc.Err()
}

// swapLatencies times updates of a private ARRAY_OF_MAPS (a fresh
// 1021-slot inner table each time, as the agent's SwapTable does) every
// 10 ms until stop, in µs.
func swapLatencies(stop <-chan struct{}) []float64 {
	innerSpec := &ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1021}
	outer, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.ArrayOfMaps, KeySize: 4, ValueSize: 4, MaxEntries: 1, InnerMap: innerSpec})
	if err != nil {
		return nil
	}
	defer outer.Close()
	var out []float64
	for {
		select {
		case <-stop:
			return out
		case <-time.After(10 * time.Millisecond):
		}
		in, err := ebpf.NewMap(innerSpec)
		if err != nil {
			return out
		}
		t0 := time.Now()
		err = outer.Put(uint32(0), in)
		d := time.Since(t0)
		in.Close()
		if err != nil {
			return out
		}
		out = append(out, float64(d.Microseconds()))
	}
}

func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

// reactionConfig is the reaction part's config: services svc0..svc(n-1),
// each with one healthy backend (b1) and b3, ejected at every refusal
// (maxFailures 1, 5-20 ms penalties); retryRefused is off, so no replay is
// on the agent's path. It returns the services' targets too.
func reactionConfig(r *rig, n int) (string, []string) {
	var sb strings.Builder
	fmt.Fprintf(&sb, "interfaces: [%s]\nmaglev:\n  tableSize: 1021\nservices:\n", strings.Join(r.topo.NodeIfaces(), ", "))
	var targets []string
	for i := range n {
		vip := fmt.Sprintf("198.18.100.%d", 10+i)
		targets = append(targets, fmt.Sprintf("%s:%d", vip, vipPort))
		fmt.Fprintf(&sb, `  - name: svc%d
    vip: %s
    port: %d
    backends: ["198.18.1.2:%d", "198.18.3.2:%d"]
    retryRefused: false
    failureAccrual:
      maxFailures: 1
      minPenalty: 5ms
      maxPenalty: 20ms
      jitterRatio: 0
      connectTimeout: 1s
`, i, vip, vipPort, backendPrt, backendPrt)
	}
	return sb.String(), targets
}

// loadAll opens rate new connections per second for d, spread over
// targets (connect and close); it returns how many it started.
func loadAll(r *rig, targets []string, rate float64, d time.Duration) (int, error) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	attempts := 0
	for _, t := range targets {
		wg.Go(func() {
			rs, err := testnet.Load(context.Background(), r.topo.Client, testnet.LoadSpec{
				Target: t, Rate: rate / float64(len(targets)), Duration: d,
				ConnectOnly: true, ConnectTimeout: time.Second,
			})
			mu.Lock()
			defer mu.Unlock()
			attempts += len(rs)
			if err != nil && firstErr == nil {
				firstErr = err
			}
		})
	}
	wg.Wait()
	return attempts, firstErr
}

func runReaction(res *Results, o reactionOpts, agentBin string, logf func(string, ...any)) error {
	r, err := newRig(agentBin, 3)
	if err != nil {
		return err
	}
	defer r.close()
	if err := r.topo.Backend(3).SetMode(testnet.Refuse); err != nil {
		return err
	}
	cfg, targets := reactionConfig(r, o.Services)
	a, err := r.startAgent(cfg)
	if err != nil {
		return err
	}
	defer a.Close()

	// Diagnostic: what one Maglev table swap (an update of a map-in-map,
	// which the kernel follows with synchronize_rcu) takes under the same
	// load, measured from this process on a private map pair.
	swaps := make(chan []float64, 1)
	stopSwaps := make(chan struct{})
	go func() { swaps <- swapLatencies(stopSwaps) }()
	floor, err := startWakeFloor()
	if err != nil {
		return err
	}
	floorStopped := false
	defer func() {
		if !floorStopped {
			floor.stop()
		}
	}()

	deadline := time.Now().Add(o.Timeout)
	var ej []split
	attempts := 0
	for len(ej) < o.Ejections && time.Now().Before(deadline) {
		n, err := loadAll(r, targets, o.Rate, time.Second)
		attempts += n
		if err != nil {
			return err
		}
		if ej, err = ejections(a.LogPath()); err != nil {
			return err
		}
		logf("reaction: %d ejections after %d connections", len(ej), attempts)
	}
	close(stopSwaps)
	sw := <-swaps
	floorStopped = true
	ft, err := floor.stop()
	if err != nil {
		return err
	}
	wake := ft.Wake
	if len(ej) < o.Ejections {
		return fmt.Errorf("only %d ejections within %v (want %d)", len(ej), o.Timeout, o.Ejections)
	}
	rounds := max(1, o.Rounds)
	per, wper := len(ej)/rounds, len(wake)/rounds
	if wper == 0 {
		return fmt.Errorf("wake floor: only %d events", len(wake))
	}
	// field lists one field of a run of ejections, leaving out NaNs: the
	// agent's parts exist where its log line splits the reaction (an
	// ejection adopted in the reader's batch; one found otherwise has no
	// split).
	field := func(sps []split, f func(split) float64) []float64 {
		var out []float64
		for _, sp := range sps {
			if x := f(sp); !math.IsNaN(x) {
				out = append(out, x)
			}
		}
		return out
	}
	reactionOf := func(sp split) float64 { return sp.reaction }
	parts := []struct {
		name string
		of   func(split) float64
	}{
		{reactionOwn, func(sp split) float64 { return sp.own }},
		{reactionJudge, func(sp split) float64 { return sp.judge }},
		{reactionProgram, func(sp split) float64 { return sp.program }},
	}
	quantiles := []struct {
		name string
		q    float64
	}{{"p50", 50}, {"p99", 99}, {"max", 100}}
	for i := range rounds {
		round := ej[i*per : (i+1)*per]
		chunk, wchunk := field(round, reactionOf), wake[i*wper:(i+1)*wper]
		for _, p := range quantiles {
			fl := res.figure("reaction", floorName+p.name, "µs")
			fl.Samples = append(fl.Samples, percentile(wchunk, p.q))
			f := res.figure("reaction", "reaction time "+p.name, "µs")
			f.Samples = append(f.Samples, percentile(chunk, p.q))
			f.Baseline = fl.Name
		}
		for _, part := range parts {
			xs := field(round, part.of)
			if len(xs) == 0 {
				continue // an agent whose log lines have no such split
			}
			for _, p := range quantiles {
				f := res.figure("reaction", part.name+", "+p.name, "µs")
				f.Samples = append(f.Samples, percentile(xs, p.q))
			}
		}
	}
	// The diagnostics' rows: p50 and p99.
	for _, p := range quantiles[:2] {
		f := res.figure("reaction", "diagnostic: one Maglev-table swap (map-in-map update) under the same load, "+p.name, "µs")
		f.Samples = append(f.Samples, percentile(sw, p.q))
	}
	if len(ft.BPF) > 0 {
		for _, p := range quantiles[:2] {
			again := res.figure("reaction", bpfAgainRow+p.name, "µs")
			again.Samples = append(again.Samples, percentile(ft.BPFAgain, p.q))
			f := res.figure("reaction", bpfFirstRow+p.name, "µs")
			f.Samples = append(f.Samples, percentile(ft.BPF, p.q))
			f.Baseline = again.Name
		}
	}
	got := field(ej, reactionOf)
	partsText := ""
	for _, part := range parts {
		if xs := field(ej, part.of); len(xs) > 0 {
			partsText += fmt.Sprintf("; %s of the %d with a split: p50 %.0f µs, p99 %.0f µs, max %.0f µs",
				part.name, len(xs), percentile(xs, 50), percentile(xs, 99), percentile(xs, 100))
		}
	}
	res.extra("reaction", "Over all %d ejections: p50 %.0f µs, p99 %.0f µs, max %.0f µs (the rows above split them into %d consecutive rounds of %d)%s. Wake-up floor over all %d events: p50 %.0f µs, p99 %.0f µs, max %.0f µs.",
		len(got), percentile(got, 50), percentile(got, 99), percentile(got, 100), rounds, per, partsText,
		len(wake), percentile(wake, 50), percentile(wake, 99), percentile(wake, 100))
	res.note("reaction", "%d services, each with one healthy backend (b1) and one refusing backend (b3), failure accrual maxFailures 1, minPenalty 5ms, maxPenalty 20ms, jitterRatio 0: every refused connection to b3 (the first one, and every probe after a penalty) is an ejection, and retryRefused is off (no replay in the agent's path). The datapath's kernel trip already excludes b3 in the XDP run that sees the deciding RST; this figure is the agent's part after it: adopting the ejection and rewriting the service's table. Load: %.0f new TCP connections per second spread over the services (connect and close). The figure is the agent's own `reaction_us` from its \"endpoint ejected\" log line: kernel timestamp (bpf_ktime_get_ns) of the RST that decided it → the service's maps rewritten (CLOCK_MONOTONIC in the agent). It includes the ring buffer wake-up, the agent's loop, the Maglev rebuild and the map writes; the \"agent's own part\" rows are the same minus the log line's `reaction_read_us` (kernel timestamp → the reader handing the batch with the deciding event to the agent, taken before the agent's lock): the lock, the events before it in the batch, accrual, the Maglev rebuild and the map writes, split at accrual's decision (the line's `reaction_decided_us`) into judging (the lock, the batch's events before the deciding one, accrual) and programming (the Maglev rebuild, the table's fill through its memory map, the map writes: the backend's state, the service's entry); the machine is busy with the load generator, the servers and the agent on its 2 cores meanwhile. Ejections are handled one at a time by the agent's loop, so one that arrives while the loop programs another waits: the load is kept low enough (a few dozen ejections per second) that this queueing is the exception. The diagnostic rows time, from this process, one update of a private map-in-map with a fresh 1021-slot inner map every 10 ms under the same load: the kernel follows every such update with synchronize_rcu (maybe_wait_bpf_programs). An ejection does not pay it when the service's two tables are already installed (the agent fills the idle table and flips the pb_services entry); installing a table does. The bpf() diagnostic rows time, in the floor's process below, the first system call its reader's handler makes after each wake-up (a lookup in a private array map) and the same call at once after it: what the agent's first map write after its own wake-up pays for the system call alone. The baseline rows are the floor under the reaction time on this machine at that moment: a process of its own (this benchmark re-executed, idle between events like the agent) waits in pkg/outcomes.Reader, exactly as the agent does, on a private ring buffer into which bench/xdpbase's emit_event submits one event every %v (one BPF_PROG_TEST_RUN, from that process's other thread), during the same load; the figure is the event's kernel timestamp → the reader's handler running. It is the ring buffer's wake-up (irq_work, a wake-up of a sleeping thread, the Go netpoller) and the scheduler: nothing of penaltybox but the reader. The reaction's ratio to it is what the agent adds.", o.Services, o.Rate, wakeFloorEvery)
	res.target("reaction", "reaction p99 < 1 ms (all ejections)", percentile(got, 99), 1000, true, "%.0f µs")
	if err := a.Close(); err != nil {
		return err
	}
	return runAdmitted(r, res, o, logf)
}

// runAdmitted counts the new flows that reach an endpoint after the
// failure that decided its ejection: the agent's
// penaltybox_new_flows_to_ejected_total, with kernel trips and with the
// agent alone (--kernel-trips=false), one run of each per round. b3
// refuses half of its connections at random, so its probes pass half the
// time and most ejections are of an active endpoint, the case where new
// flows keep coming until the endpoint is out.
func runAdmitted(r *rig, res *Results, o reactionOpts, logf func(string, ...any)) error {
	b3 := r.topo.Backend(3)
	if err := b3.SetMode(testnet.Serve); err != nil {
		return err
	}
	if err := b3.RefuseShare(0.5); err != nil {
		return err
	}
	defer b3.RefuseShare(0)
	cfg, targets := reactionConfig(r, o.Services)
	const (
		vTrips = "kernel trips (default)"
		vAgent = "agent alone (--kernel-trips=false)"
	)
	for round := range max(1, o.Rounds) {
		for _, v := range []struct {
			name string
			args []string
		}{{vAgent, []string{"--kernel-trips=false"}}, {vTrips, nil}} {
			if err := r.flushConntrack(); err != nil {
				return err
			}
			a, err := r.startAgent(cfg, v.args...)
			if err != nil {
				return err
			}
			attempts, err := loadAll(r, targets, o.AdmittedRate, o.Admitted)
			if err != nil {
				a.Close()
				return err
			}
			// The last events read: the agent reads them within
			// milliseconds of the load's end.
			time.Sleep(200 * time.Millisecond)
			m, err := a.Metrics(context.Background())
			if err != nil {
				a.Close()
				return err
			}
			var leaked, ejections, trips float64
			for i := range o.Services {
				svc := fmt.Sprintf("svc%d", i)
				leaked += m.Get("penaltybox_new_flows_to_ejected_total", "svc_name", svc)
				trips += m.Get("penaltybox_kernel_trips_total", "svc_name", svc, "result", "adopted")
				ejections += m.Get("penaltybox_accrual_transitions_total", "svc_name", svc, "reason", "consecutive-failures")
			}
			if err := a.Close(); err != nil {
				return err
			}
			if ejections == 0 {
				return fmt.Errorf("admitted: %s: no ejection in %d connections", v.name, attempts)
			}
			add := func(what string, val float64, base bool) {
				f := res.figure("reaction", v.name+": "+what, "count")
				f.Samples = append(f.Samples, val)
				if !base && v.name == vTrips {
					f.Baseline = vAgent + ": " + what
				}
			}
			add("ejections of an active endpoint per run", ejections, true)
			add("kernel trips adopted per run", trips, true)
			add("new flows admitted to an endpoint after its deciding failure, per run", leaked, false)
			add("the same, per 100 ejections", 100*leaked/ejections, false)
			logf("reaction: admitted: round %d/%d: %-36s %d connections, %.0f ejections (%.0f kernel trips), %.0f new flows after the deciding failure",
				round+1, o.Rounds, v.name, attempts, ejections, trips, leaked)
		}
	}
	res.note("reaction", "New flows admitted after the deciding failure: the same services at %.0f new connections per second (the more flows, the more of them reach an endpoint during the agent's reaction), b3 refusing half of its connections at random (nftables in its namespace), so that half of the probes pass and most ejections are of an active endpoint, for %v per run, a fresh agent per run, the two variants alternating in every round. The count is the agent's `penaltybox_new_flows_to_ejected_total`: NEW_FLOW events (probes aside) of an endpoint the agent holds ejected, read in the datapath's order after the event of the failure that ejected it, so each is a flow the datapath gave the endpoint after that failure. Ejections: of an active endpoint only (`penaltybox_accrual_transitions_total{reason=\"consecutive-failures\"}`; a probe's failure re-ejects an endpoint in probation, which takes no flow but its probe anyway). With kernel trips the endpoint is out within the XDP run of the deciding RST (part 1c); without them it stays in until the agent has rewritten the service's table, and new flows keep reaching it meanwhile.", o.AdmittedRate, o.Admitted)
	res.target("reaction", "new flows admitted to an endpoint after its deciding failure: 0 (kernel trips)", res.median("reaction", vTrips+": new flows admitted to an endpoint after its deciding failure, per run"), 0, true, "%.0f")
	return nil
}
