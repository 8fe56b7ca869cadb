// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"math/rand/v2"
	"slices"
	"time"

	"testing"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/maps/mapsfake"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// kernelTrip: the datapath ejected be at a refusal on its own, as it does
// at its maxFailures-th one (the fake maps only record writes, so the test
// writes the kernel's mark itself).
func (e *env) kernelTrip(svc, be uint32) {
	e.kernelTripLost(svc, be)
	p := e.nextPort()
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be, p, 0),
		e.event(outcomes.Refused, svc, be, p, outcomes.FlagTripped)})
}

// kernelTripLost: the datapath ejected be on its own, and the event that
// says so was lost.
func (e *env) kernelTripLost(svc, be uint32) {
	b := e.f.PbBackends[be]
	b.State = uint8(pbmaps.BackendEjected)
	e.f.PbBackends[be] = b
	t := e.f.PbSvcTrip[svc]
	t.Trips++
	if t.Budget > 0 {
		t.Budget--
	}
	e.f.PbSvcTrip[svc] = t
}

// The agent writes each service's trip settings and budget: its
// consecutive rule and the kinds the datapath can see, the room the
// max-ejection cap leaves.
func TestKernelTripSettings(t *testing.T) {
	e := newEnv(t)
	s := web(80, 4, settings(func(s *accrual.Settings) { s.MaxEjectionPercent = 50 }))
	e.start(state(s))
	svc, bes := e.ids(s)
	tr := e.f.PbSvcTrip[svc]
	if tr.MaxFailures != 3 || tr.Kinds != pbmaps.TripRefused|pbmaps.TripReset || tr.Budget != 2 {
		t.Fatalf("pb_svc_trip %+v: want maxFailures 3, refused|reset, budget 2 (50%% of 4)", tr)
	}
	e.eject(svc, bes[0], 3)
	if tr := e.f.PbSvcTrip[svc]; tr.Budget != 1 {
		t.Errorf("budget %d after one ejection, want 1", tr.Budget)
	}
	// A mode without a consecutive rule: no kernel trips.
	s.Accrual.Mode = accrual.ModeFailureRate
	e.a.Apply(state(s))
	if tr := e.f.PbSvcTrip[svc]; tr.MaxFailures != 0 || tr.Budget != 0 {
		t.Errorf("failure-rate mode: pb_svc_trip %+v, want trips off", tr)
	}
}

// A kernel trip is adopted as the ejection even when accrual had counted
// fewer failures (events lost): penalty, probation, the metric; one the
// max-ejection cap does not allow is undone, the backend put back.
func TestKernelTripAdoptedOrUndone(t *testing.T) {
	e := newEnv(t)
	s := web(80, 3, settings(func(s *accrual.Settings) { s.MaxEjectionPercent = 34 })) // one of three
	e.start(state(s))
	svc, bes := e.ids(s)

	e.refused(svc, bes[0], false) // accrual saw one refusal of the kernel's three
	e.kernelTrip(svc, bes[0])
	e.wantState(bes[0], "ejected")
	if st, _ := e.kernel(bes[0]); st != pbmaps.BackendEjected {
		t.Fatalf("kernel state %v, want the trip kept", st)
	}
	if got := e.a.metrics.KernelTrips.Get("web", "adopted"); got != 1 {
		t.Errorf("kernel_trips_total{adopted} = %v", got)
	}
	e.endPenalty(bes[0])
	e.wantState(bes[0], "probation")

	// The cap is full (one in probation): a second trip is undone.
	e.kernelTrip(svc, bes[1])
	e.wantState(bes[1], "ready")
	if st, _ := e.kernel(bes[1]); st != pbmaps.BackendActive {
		t.Fatalf("kernel state %v, want the trip undone (active)", st)
	}
	if got := e.a.metrics.KernelTrips.Get("web", "undone"); got != 1 {
		t.Errorf("kernel_trips_total{undone} = %v", got)
	}
	if tr := e.f.PbSvcTrip[svc]; tr.Budget != 0 {
		t.Errorf("budget %d with the cap full, want 0", tr.Budget)
	}
}

// One RST, one programming of its service: the refusal that trips the
// endpoint in the kernel is the failure that ejects it here too, and
// adopting the trip writes nothing more. Each write is counted: the
// service's trip budget once, its table flipped once, the endpoint's
// state once. The same when the failures before were lost (accrual
// ejects on the trip itself), and when accrual keeps the endpoint in (the
// trip is undone: the entry rewritten once, active again).
func TestOneRSTProgramsItsServiceOnce(t *testing.T) {
	writes := func(e *env, svc, be uint32) (budgets, flips, states int) {
		calls := e.f.TakeCalls()
		for _, o := range e.f.TakeOps() {
			switch {
			case o.Kind == mapsfake.OpUpsertService && o.ID == svc:
				flips++
			case o.Kind == mapsfake.OpSetBackend && o.ID == be:
				states++
			}
		}
		return calls["SetServiceTrip"], flips, states
	}
	for _, c := range []struct {
		name  string
		seen  int // refusals accrual saw before the tripping one
		cap   int // maxEjectionPercent
		state string
	}{
		{"adopted", 2, 100, "ejected"},
		{"adopted, earlier failures lost", 0, 100, "ejected"},
		{"undone", 2, 34, "ready"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			s := web(80, 3, settings(func(s *accrual.Settings) { s.MaxEjectionPercent = c.cap }))
			e.start(state(s))
			svc, bes := e.ids(s)
			if c.state == "ready" {
				e.eject(svc, bes[2], 3) // the cap's one ejection taken
			}
			for range c.seen {
				e.refused(svc, bes[0], false)
			}
			writes(e, svc, bes[0])

			e.kernelTrip(svc, bes[0])
			e.wantState(bes[0], c.state)
			budgets, flips, states := writes(e, svc, bes[0])
			if budgets != 1 {
				t.Errorf("the service's trip budget written %d times for one RST, want once", budgets)
			}
			wantFlips := 1
			if c.state == "ready" {
				wantFlips = 0 // the table keeps the endpoint as it is
			}
			if flips != wantFlips {
				t.Errorf("the service's table went live %d times for one RST, want %d", flips, wantFlips)
			}
			if states != 1 {
				t.Errorf("the endpoint's entry written %d times for one RST, want once", states)
			}
		})
	}
}

// Every endpoint tripped in the kernel: accrual fails open, and the
// kernel's entries say so too (each trip is written over, even where the
// reconciler had last written "active").
func TestKernelTripsIntoFailOpen(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, bes := e.ids(s)
	e.kernelTrip(svc, bes[0])
	e.kernelTrip(svc, bes[1])
	for _, be := range bes {
		if st, _ := e.kernel(be); st != pbmaps.BackendActive {
			t.Errorf("backend %d is %v in the kernel while failing open, want active", be, st)
		}
	}
	e.wantReachable(s, bes...)
}

// A trip whose event was lost is found by Maintain (the datapath counted
// more trips than the agent read) and adopted like any other; until then,
// the budget counts it as spent.
func TestKernelTripWithoutItsEvent(t *testing.T) {
	e := newEnv(t)
	s := web(80, 4, settings(func(s *accrual.Settings) { s.MaxEjectionPercent = 50 }))
	e.start(state(s))
	svc, bes := e.ids(s)
	e.kernelTripLost(svc, bes[2])
	// Something else reprograms the service first: the unread trip is
	// not handed back as budget.
	e.eject(svc, bes[0], 3)
	if tr := e.f.PbSvcTrip[svc]; tr.Budget != 0 {
		t.Fatalf("budget %d with one ejection read and one trip unread (cap 2), want 0", tr.Budget)
	}
	e.a.Maintain()
	e.wantState(bes[2], "ejected")
	if got := e.a.metrics.KernelTrips.Get("web", "adopted"); got != 1 {
		t.Errorf("kernel_trips_total{adopted} = %v, want 1", got)
	}
	if st, _ := e.kernel(bes[2]); st != pbmaps.BackendEjected {
		t.Errorf("kernel state %v", st)
	}
	// Found once: Maintain again finds nothing more.
	e.a.Maintain()
	if got := e.a.metrics.KernelTrips.Get("web", "adopted"); got != 1 {
		t.Errorf("kernel_trips_total{adopted} = %v after a second Maintain, want 1", got)
	}
}

// The replay deadline: cautious (half the connect timeout) until the
// service's first 8 handshakes are known, then four times their 99th
// percentile, at least 16ms, a power of two of milliseconds; none without
// retryRefused.
func TestReplayAfter(t *testing.T) {
	s := web(80, 3, settings())
	s.RetryRefused = true
	if d := replayAfter(&s, nil); d != 500*time.Millisecond {
		t.Errorf("no handshakes yet: %v, want 500ms (half of the 1s connect timeout)", d)
	}
	h := &handshakes{}
	for i := range replayFirst {
		h.ring[i] = 300 * time.Microsecond
		h.n = i + 1
		want := 500 * time.Millisecond
		if h.n == replayFirst {
			want = replayFloor
		}
		if d := replayAfter(&s, h); d != want {
			t.Errorf("%d LAN handshakes: %v, want %v", h.n, d, want)
		}
	}
	for i := range replaySamples {
		h.ring[i] = time.Duration(100+i) * time.Microsecond
	}
	h.n = replaySamples
	if d := replayAfter(&s, h); d != replayFloor {
		t.Errorf("LAN handshakes (p99 ~230µs): %v, want the floor %v", d, replayFloor)
	}
	for i := range replaySamples {
		h.ring[i] = 20 * time.Millisecond
	}
	if d := replayAfter(&s, h); d != 128*time.Millisecond {
		t.Errorf("20ms handshakes: %v, want 128ms (80ms rounded up to a power of two)", d)
	}
	s.RetryRefused = false
	if d := replayAfter(&s, h); d != 0 {
		t.Errorf("retryRefused off: %v, want no replays", d)
	}
}

// largest agrees with a sort for every k, on rings with repeats, in any
// order, including the k beyond its kept top that falls back to sorting.
func TestLargest(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for trial := range 200 {
		n := 1 + r.IntN(replaySamples)
		s := make([]time.Duration, n)
		for i := range s {
			s[i] = time.Duration(r.IntN(20)) * time.Microsecond // repeats on purpose
		}
		sorted := slices.Sorted(slices.Values(s))
		for k := 1; k <= min(n, maxTop+2); k++ {
			if got, want := largest(s, k), sorted[n-k]; got != want {
				t.Fatalf("trial %d: largest(%v, %d) = %v, want %v", trial, s, k, got, want)
			}
		}
	}
	if got := largest(nil, 1); got != 0 {
		t.Errorf("largest(nil, 1) = %v, want 0", got)
	}
}

// --kernel-trips=false: the datapath gets no trip settings, so the
// agent's accrual alone ejects.
func TestKernelTripsOff(t *testing.T) {
	e := newEnv(t)
	e.noTrips = true
	e.restart()
	s := web(80, 3, settings())
	e.start(state(s))
	svc, bes := e.ids(s)
	if tr := e.f.PbSvcTrip[svc]; tr.MaxFailures != 0 || tr.Kinds != 0 {
		t.Fatalf("pb_svc_trip %+v with kernel trips off, want no max_failures, no kinds", tr)
	}
	e.eject(svc, bes[0], 3)
	if tr := e.f.PbSvcTrip[svc]; tr.MaxFailures != 0 {
		t.Errorf("pb_svc_trip %+v after an ejection, want trips still off", tr)
	}
}

// A new flow the datapath admits to an endpoint the agent has ejected
// (it got in before the maps changed) is counted; probes, flows of ready
// endpoints and flows of a service failing open are not.
func TestNewFlowsToEjectedCounted(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, bes := e.ids(s)
	leaked := func() float64 { return e.a.metrics.FlowsToEjected.Get("web") }
	newFlow := func(be uint32, flags uint8) {
		e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be, e.nextPort(), flags)})
	}

	newFlow(bes[0], 0) // ready: no leak
	e.eject(svc, bes[0], 3)
	if got := leaked(); got != 0 {
		t.Fatalf("%v flows counted before any reached an ejected endpoint", got)
	}
	newFlow(bes[0], 0)
	newFlow(bes[1], 0)
	if got := leaked(); got != 1 {
		t.Errorf("new_flows_to_ejected_total = %v after one flow to the ejected endpoint, want 1", got)
	}
	e.endPenalty(bes[0])
	e.wantState(bes[0], "probation")
	newFlow(bes[0], outcomes.FlagProbe)
	if got := leaked(); got != 1 {
		t.Errorf("new_flows_to_ejected_total = %v after a probe, want 1", got)
	}

	// Both out: the service fails open and every endpoint takes flows.
	e2 := newEnv(t)
	s2 := web(80, 2, settings())
	e2.start(state(s2))
	svc2, bes2 := e2.ids(s2)
	e2.eject(svc2, bes2[0], 3)
	for range 3 {
		e2.refused(svc2, bes2[1], false)
	}
	e2.a.HandleEvents([]outcomes.Event{e2.event(outcomes.NewFlow, svc2, bes2[0], e2.nextPort(), 0)})
	if got := e2.a.metrics.FlowsToEjected.Get("web"); got != 0 {
		t.Errorf("new_flows_to_ejected_total = %v while failing open, want 0", got)
	}
}

// Every decision of a batch is in the maps before any is reported (log
// line, persistence, Notify): an ejection behind another in the same
// batch does not wait for the first one's report.
func TestBatchProgramsEveryEjectionBeforeReporting(t *testing.T) {
	e := newEnv(t)
	one := settings(func(s *accrual.Settings) { s.MaxFailures = 1 })
	web80, api := web(80, 3, one), web(81, 3, one)
	api.Name = "api"
	var reached [][2][]uint32 // at each notification: what each service reaches
	e.a.SetNotify(func(Transition) {
		reached = append(reached, [2][]uint32{e.reachable(web80), e.reachable(api)})
	})
	e.start(state(web80, api))
	s1, b1 := e.ids(web80)
	s2, b2 := e.ids(api)
	p1, p2 := e.nextPort(), e.nextPort()
	e.a.HandleEvents([]outcomes.Event{
		e.event(outcomes.NewFlow, s1, b1[0], p1, 0), e.event(outcomes.NewFlow, s2, b2[0], p2, 0),
		e.event(outcomes.Refused, s1, b1[0], p1, 0), e.event(outcomes.Refused, s2, b2[0], p2, 0),
	})
	e.wantState(b1[0], "ejected")
	e.wantState(b2[0], "ejected")
	if len(reached) != 2 {
		t.Fatalf("%d notifications, want 2", len(reached))
	}
	for i, r := range reached {
		if slices.Contains(r[0], b1[0]) || slices.Contains(r[1], b2[0]) {
			t.Errorf("notification %d: %s reaches %v, %s reaches %v: an ejection reported before the batch's maps were written",
				i, web80.Name, r[0], api.Name, r[1])
		}
	}
}
