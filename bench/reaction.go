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
	Ejections int           // at least this many
	Services  int           // services, each with one healthy and one refusing backend
	Rate      float64       // new connections per second over all services
	Timeout   time.Duration // give up after
	Rounds    int           // the ejections are split into this many consecutive rounds
}

// ejections parses the agent's "endpoint ejected" log lines and returns
// their reaction times in microseconds, in log order.
func ejections(logPath string) ([]float64, error) {
	f, err := os.Open(logPath)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []float64
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
		}
		if json.Unmarshal(line, &rec) != nil || rec.Msg != "endpoint ejected" || rec.ReactionUS == nil {
			continue
		}
		out = append(out, *rec.ReactionUS)
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

func runReaction(res *Results, o reactionOpts, agentBin string, logf func(string, ...any)) error {
	r, err := newRig(agentBin, 3)
	if err != nil {
		return err
	}
	defer r.close()
	if err := r.topo.Backend(3).SetMode(testnet.Refuse); err != nil {
		return err
	}
	ifs := strings.Join(r.topo.NodeIfaces(), ", ")
	var sb strings.Builder
	fmt.Fprintf(&sb, "interfaces: [%s]\nmaglev:\n  tableSize: 1021\nservices:\n", ifs)
	var targets []string
	for i := range o.Services {
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
	a, err := r.startAgent(sb.String())
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
	var got []float64
	attempts := 0
	for len(got) < o.Ejections && time.Now().Before(deadline) {
		var wg sync.WaitGroup
		var mu sync.Mutex
		var firstErr error
		for _, t := range targets {
			wg.Go(func() {
				rs, err := testnet.Load(context.Background(), r.topo.Client, testnet.LoadSpec{
					Target: t, Rate: o.Rate / float64(len(targets)), Duration: time.Second,
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
		if firstErr != nil {
			return firstErr
		}
		if got, err = ejections(a.LogPath()); err != nil {
			return err
		}
		logf("reaction: %d ejections after %d connections", len(got), attempts)
	}
	close(stopSwaps)
	sw := <-swaps
	floorStopped = true
	wake, err := floor.stop()
	if err != nil {
		return err
	}
	if len(got) < o.Ejections {
		return fmt.Errorf("only %d ejections within %v (want %d)", len(got), o.Timeout, o.Ejections)
	}
	rounds := max(1, o.Rounds)
	per, wper := len(got)/rounds, len(wake)/rounds
	if wper == 0 {
		return fmt.Errorf("wake floor: only %d events", len(wake))
	}
	for i := range rounds {
		chunk, wchunk := got[i*per:(i+1)*per], wake[i*wper:(i+1)*wper]
		for _, p := range []struct {
			name string
			q    float64
		}{{"p50", 50}, {"p99", 99}, {"max", 100}} {
			fl := res.figure("reaction", floorName+p.name, "µs")
			fl.Samples = append(fl.Samples, percentile(wchunk, p.q))
			f := res.figure("reaction", "reaction time "+p.name, "µs")
			f.Samples = append(f.Samples, percentile(chunk, p.q))
			f.Baseline = fl.Name
		}
	}
	for _, p := range []struct {
		name string
		q    float64
	}{{"p50", 50}, {"p99", 99}} {
		f := res.figure("reaction", "diagnostic: one Maglev-table swap (map-in-map update) under the same load, "+p.name, "µs")
		f.Samples = append(f.Samples, percentile(sw, p.q))
	}
	res.extra("reaction", "Over all %d ejections: p50 %.0f µs, p99 %.0f µs, max %.0f µs (the rows above split them into %d consecutive rounds of %d). Wake-up floor over all %d events: p50 %.0f µs, p99 %.0f µs, max %.0f µs.",
		len(got), percentile(got, 50), percentile(got, 99), percentile(got, 100), rounds, per,
		len(wake), percentile(wake, 50), percentile(wake, 99), percentile(wake, 100))
	res.note("reaction", "%d services, each with one healthy backend (b1) and one refusing backend (b3), failure accrual maxFailures 1, minPenalty 5ms, maxPenalty 20ms, jitterRatio 0: every refused connection to b3 (the first one, and every probe after a penalty) is an ejection, and retryRefused is off (no replay in the agent's path). The datapath's kernel trip already excludes b3 in the XDP run that sees the deciding RST; this figure is the agent's part after it: adopting the ejection and rewriting the service's table. Load: %.0f new TCP connections per second spread over the services (connect and close). The figure is the agent's own `reaction_us` from its \"endpoint ejected\" log line: kernel timestamp (bpf_ktime_get_ns) of the RST that decided it → the service's maps rewritten (CLOCK_MONOTONIC in the agent). It includes the ring buffer wake-up, the agent's loop, the Maglev rebuild and the map writes; the machine is busy with the load generator, the servers and the agent on its 2 cores meanwhile. Ejections are handled one at a time by the agent's loop, so one that arrives while the loop programs another waits: the load is kept low enough (a few dozen ejections per second) that this queueing is the exception. The diagnostic rows time, from this process, one update of a private map-in-map with a fresh 1021-slot inner map every 10 ms under the same load: the kernel follows every such update with synchronize_rcu (maybe_wait_bpf_programs). An ejection does not pay it when the service's two tables are already installed (the agent fills the idle table and flips the pb_services entry); installing a table does. The baseline rows are the floor under the reaction time on this machine at that moment: a process of its own (this benchmark re-executed, idle between events like the agent) waits in pkg/outcomes.Reader, exactly as the agent does, on a private ring buffer into which bench/xdpbase's emit_event submits one event every %v (one BPF_PROG_TEST_RUN, from that process's other thread), during the same load; the figure is the event's kernel timestamp → the reader's handler running. It is the ring buffer's wake-up (irq_work, a wake-up of a sleeping thread, the Go netpoller) and the scheduler: nothing of penaltybox but the reader. The reaction's ratio to it is what the agent adds.", o.Services, o.Rate, wakeFloorEvery)
	res.target("reaction", "reaction p99 < 1 ms (all ejections)", percentile(got, 99), 1000, true, "%.0f µs")
	return nil
}
