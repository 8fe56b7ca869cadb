package main

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/fleet"
)

// fleetOpts size the dilution scenario.
type fleetOpts struct {
	Rounds int
	Nodes  []int         // fleet sizes, the first the undiluted baseline (1)
	Rate   float64       // the fleet's connections per second to the Service
	Limit  time.Duration // how long the endpoint fails in a run
}

// The scenario: a Service of 10 endpoints under failure-rate accrual
// (window 10 s, min-calls 20, threshold 20%), the fleet offering Rate
// connections a second spread evenly over its nodes' clients and the
// endpoints; one endpoint starts refusing 30% of its connections. The
// API's latency (a write until the watchers see it) is modelled, the rest
// is the agent's own code: every node runs a real accrual engine, selects
// its report with fleet.Select every report interval (each node at its
// own phase), the aggregator judges every second with fleet.Aggregator,
// and each node acts on the verdicts with fleet.Consumer and
// Engine.Condemn. Simulated time (a fake clock), so the figures are the
// protocol's, not this machine's speed: the real transport's are in
// TestFleetEvidence.
const (
	fleetEndpoints  = 10
	fleetBad        = 3 // the failing endpoint's id
	fleetFailShare  = 0.3
	fleetWindow     = 10 * time.Second
	fleetMinCalls   = 20
	fleetInterval   = 5 * time.Second // --fleet-report-interval's default
	fleetJudgeEvery = time.Second
	fleetAPIDelay   = 100 * time.Millisecond
	fleetStep       = 10 * time.Millisecond
	fleetWarmup     = 20 * time.Second // two windows of healthy traffic first
	fleetService    = "shop/web:http"
)

func fleetSettings() accrual.Settings {
	s := accrual.Defaults() // penalties 1 s doubling to 1 min, as shipped
	s.Mode = accrual.ModeFailureRate
	s.Window, s.MinCalls, s.FailureRateThreshold = fleetWindow, fleetMinCalls, 0.2
	s.JitterRatio = 0
	return s
}

func fleetAddr(id uint32) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 253, byte(10 + id)}), 8080)
}

// fleetRun is one run's outcome.
type fleetRun struct {
	// ejected: when each node first ejected the failing endpoint, since
	// the failure began (0: not within the run).
	ejected []time.Duration
	// bad, all: connections to the failing endpoint and to any, from the
	// failure's start to the run's end.
	bad, all int
	wrongful int // ejections of healthy endpoints
	reports  int // report writes, fleet-wide
}

func (r fleetRun) share() float64 {
	n := 0
	for _, d := range r.ejected {
		if d > 0 {
			n++
		}
	}
	return 100 * float64(n) / float64(len(r.ejected))
}

func (r fleetRun) last() time.Duration {
	var m time.Duration
	for _, d := range r.ejected {
		if d == 0 {
			return 0
		}
		m = max(m, d)
	}
	return m
}

// admitted is the failing endpoint's traffic while it failed, as a share
// of its fair share (100%: never ejected).
func (r fleetRun) admitted() float64 {
	return 100 * float64(r.bad) / (float64(r.all) / fleetEndpoints)
}

type pendingVerdicts struct {
	at time.Time
	v  fleet.Verdicts
}

// simulateFleet runs the scenario on nodes nodes, with or without fleet
// evidence, for o.Limit after the failure starts. Ejected endpoints come
// back through a probe (the first connection of a node after the penalty
// goes to the endpoint in probation), as in the datapath.
func simulateFleet(nodes int, withFleet bool, o fleetOpts, seed uint64) fleetRun {
	rnd := rand.New(rand.NewPCG(seed, uint64(nodes)))
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	clk := testingclock.NewFakePassiveClock(t0)
	st := fleetSettings()
	st.FleetEvidence = withFleet
	eps := make([]uint32, fleetEndpoints)
	all := make(map[netip.AddrPort]bool, fleetEndpoints)
	for i := range eps {
		eps[i] = uint32(i)
		all[fleetAddr(uint32(i))] = true
	}
	engines := make([]*accrual.Engine, nodes)
	consumers := make([]*fleet.Consumer, nodes)
	phase := make([]time.Duration, nodes)
	for i := range engines {
		engines[i] = accrual.New(clk, func() float64 { return 0.5 })
		engines[i].SetService(1, fleetService, st, eps)
		consumers[i] = fleet.NewConsumer()
		phase[i] = time.Duration(rnd.Int64N(int64(fleetInterval)))
	}
	judges := map[string]fleet.Judge{fleetService: {Window: fleetWindow, MinCalls: fleetMinCalls, Threshold: st.FailureRateThreshold, Endpoints: all}}
	agg := fleet.NewAggregator()
	reports := map[int]fleet.Report{} // as the aggregator sees them
	type pendingReport struct {
		at   time.Time
		node int
		r    fleet.Report
	}
	var inflight []pendingReport
	var verdictQ []pendingVerdicts
	suspects := map[fleet.Key]bool{}

	run := fleetRun{ejected: make([]time.Duration, nodes)}
	failFrom := t0.Add(fleetWarmup)
	end := failFrom.Add(o.Limit)
	perStep := o.Rate / float64(nodes) * fleetStep.Seconds()
	owed := make([]float64, nodes)
	nextJudge := t0
	lastReport := make([]time.Time, nodes)
	note := func(node int, ts []accrual.Transition, now time.Time) {
		for _, t := range ts {
			if t.To != accrual.Ejected || t.From == accrual.Ejected {
				continue
			}
			if t.Endpoint == fleetBad && !now.Before(failFrom) {
				if run.ejected[node] == 0 {
					run.ejected[node] = max(now.Sub(failFrom), time.Nanosecond)
				}
			} else if t.Reason != accrual.ReasonProbeFailed {
				run.wrongful++
			}
		}
	}
	outcome := func(id uint32, failing, probe bool, now time.Time) accrual.Outcome {
		ok := !(failing && id == fleetBad && rnd.Float64() < fleetFailShare)
		out := accrual.Outcome{Endpoint: id, Success: ok, Probe: probe, At: now, Started: now}
		if !ok {
			out.Kind = accrual.KindRefused
		}
		return out
	}
	for now := t0; now.Before(end); now = now.Add(fleetStep) {
		clk.SetTime(now)
		failing := !now.Before(failFrom)
		// Connections: each node's clients, spread over the endpoints
		// this node admits; an endpoint in probation gets the next one.
		for n, e := range engines {
			note(n, e.Advance(), now)
			owed[n] += perStep
			for owed[n] >= 1 {
				owed[n]--
				active, probation, _ := e.Admitted(1)
				var id uint32
				probe := len(probation) > 0
				switch {
				case probe:
					id = probation[0]
				case len(active) > 0:
					id = active[rnd.IntN(len(active))]
				default:
					continue
				}
				if failing {
					run.all++
					if id == fleetBad {
						run.bad++
					}
				}
				note(n, e.Observe(outcome(id, failing, probe, now)), now)
			}
		}
		if !withFleet {
			continue
		}
		// Reports, each node at its own phase of the interval.
		for n, e := range engines {
			if now.Sub(t0) < phase[n] || now.Sub(lastReport[n]) < fleetInterval {
				continue
			}
			lastReport[n] = now
			var ws []fleet.Window
			out := consumers[n].Out()
			for _, w := range e.FleetWindows() {
				k := fleet.Key{Service: fleetService, Addr: fleetAddr(w.Endpoint)}
				ws = append(ws, fleet.Window{Key: k, Calls: w.Calls, Failures: w.Failures, MinCalls: w.MinCalls, Acted: out[k]})
			}
			counts := fleet.Select(ws, suspects)
			if len(counts) == 0 {
				delete(reports, n) // its delete, at once
				continue
			}
			run.reports++
			inflight = append(inflight, pendingReport{at: now.Add(fleetAPIDelay), node: n,
				r: fleet.Report{Node: fmt.Sprint(n), At: now, Expires: now.Add(3 * fleetInterval), Counts: counts}})
		}
		for len(inflight) > 0 && !inflight[0].at.After(now) {
			reports[inflight[0].node] = inflight[0].r
			inflight = inflight[1:]
		}
		if !now.Before(nextJudge) {
			nextJudge = now.Add(fleetJudgeEvery)
			rs := make([]fleet.Report, 0, len(reports))
			for _, r := range reports {
				rs = append(rs, r)
			}
			verdictQ = append(verdictQ, pendingVerdicts{at: now.Add(fleetAPIDelay), v: agg.Judge(now, rs, judges)})
		}
		for len(verdictQ) > 0 && !verdictQ[0].at.After(now) {
			v := verdictQ[0].v
			verdictQ = verdictQ[1:]
			suspects = map[fleet.Key]bool{}
			for _, k := range v.Suspects {
				suspects[k] = true
			}
			for n, e := range engines {
				for _, c := range consumers[n].Fresh(now, v.Condemned) {
					id := uint32(c.Addr.Addr().As4()[3] - 10)
					note(n, e.Condemn(id, c.Calls, c.Failures, c.Level), now)
					consumers[n].Done(now, c, e.StateOf(id) != accrual.Ready)
				}
			}
		}
	}
	return run
}

func runFleet(res *Results, o fleetOpts, logf func(string, ...any)) error {
	const part = "fleet"
	label := func(n int, what string) string { return nodesLabel(n) + ", " + what }
	base := label(o.Nodes[0], "(undiluted) local: time to eject")
	baseShare := label(o.Nodes[0], "(undiluted) local: failing endpoint's traffic while failing, of its fair share")
	add := func(name, unit, baseline string, digits int, v float64) {
		f := res.figure(part, name, unit)
		f.Baseline, f.Digits = baseline, digits
		f.Samples = append(f.Samples, v)
	}
	for round := range o.Rounds {
		seed := uint64(round + 1)
		for _, n := range o.Nodes {
			local := simulateFleet(n, false, o, seed)
			if local.wrongful > 0 {
				return fmt.Errorf("%s, local: %d healthy endpoints ejected", nodesLabel(n), local.wrongful)
			}
			if n == o.Nodes[0] {
				if local.last() == 0 {
					return fmt.Errorf("the undiluted baseline did not eject within %v", o.Limit)
				}
				add(base, "s", "", 2, local.last().Seconds())
				add(baseShare, "%", "", 1, local.admitted())
				continue
			}
			add(label(n, "local only: nodes that ejected it"), "%", "", 0, local.share())
			if d := local.last(); d > 0 { // only where every node ejects it
				add(label(n, "local only: time until every node ejected it"), "s", base, 2, d.Seconds())
			}
			add(label(n, "local only: failing endpoint's traffic while failing, of its fair share"), "%", baseShare, 1, local.admitted())
			fl := simulateFleet(n, true, o, seed)
			if fl.wrongful > 0 {
				return fmt.Errorf("%s, fleet: %d healthy endpoints ejected", nodesLabel(n), fl.wrongful)
			}
			if fl.last() == 0 {
				return fmt.Errorf("%s, fleet: not every node ejected it within %v", nodesLabel(n), o.Limit)
			}
			add(label(n, "fleet evidence: time until every node ejected it"), "s", base, 2, fl.last().Seconds())
			add(label(n, "fleet evidence: failing endpoint's traffic while failing, of its fair share"), "%", baseShare, 1, fl.admitted())
			add(label(n, "fleet evidence: report writes per node per minute"), "writes", "", 1,
				float64(fl.reports)/float64(n)/(o.Limit+fleetWarmup).Minutes())
			logf("fleet: round %d, %d nodes: local: %.0f%% of nodes ejected it, %.0f%% of its traffic admitted; fleet: all ejected after %v, %.0f%% admitted",
				round+1, n, local.share(), local.admitted(), fl.last(), fl.admitted())
		}
	}
	res.note(part, "Simulated with the agent's own decision code (a real accrual engine per node, fleet.Select, fleet.Aggregator, fleet.Consumer, Engine.Condemn) on a fake clock: "+
		"%.0f connections/s from the whole fleet, spread evenly over its nodes and a Service's %d endpoints; one endpoint refuses %.0f%% of its connections for %v (after %v of healthy traffic). "+
		"Failure-rate accrual as shipped but the window rule's settings (window %v, min-calls %d, threshold 20%%) and no jitter: penalties 1 s doubling to 1 min, an ejected endpoint back through one probe connection per node. "+
		"Reports every %v per node at random phases, the aggregator judging every %v, %v of API latency on every write. "+
		"\"Traffic of its fair share\": the failing endpoint's connections while it failed, over a tenth of all connections (100%%: never ejected). "+
		"Time is simulated, so these are the protocol's figures, not this machine's: TestFleetEvidence measures the real thing through kube-apiserver (3 nodes: every node ejected it 6.0-7.8 s after fleet evidence was turned on, and again, a level up, 18-34 s after).",
		o.Rate, fleetEndpoints, 100*fleetFailShare, o.Limit, fleetWarmup, fleetWindow, fleetMinCalls, fleetInterval, fleetJudgeEvery, fleetAPIDelay)
	for _, n := range o.Nodes[1:] {
		if f := res.find(part, label(n, "fleet evidence: time until every node ejected it")); f != nil {
			res.target(part, fmt.Sprintf("%s: every node ejects it within two windows with fleet evidence", nodesLabel(n)), maxOf(f.Samples), 2*fleetWindow.Seconds(), true, "%.1f s (max)")
		}
	}
	return nil
}

func nodesLabel(n int) string {
	if n == 1 {
		return "1 node"
	}
	return fmt.Sprintf("%d nodes", n)
}

func maxOf(xs []float64) float64 {
	m := xs[0]
	for _, x := range xs[1:] {
		m = max(m, x)
	}
	return m
}
