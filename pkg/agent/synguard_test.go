package agent

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
)

// lastGuard is the SYN guard as last written.
func (e *env) lastGuard() pbmaps.SYNGuard {
	e.t.Helper()
	if len(e.f.Guards) == 0 {
		e.t.Fatal("the SYN guard was never written")
	}
	return e.f.Guards[len(e.f.Guards)-1]
}

// Flood mode turns the SYN guard on with a lease that Maintain renews; SYNs
// the guard drops keep flood mode going (nothing else shows the flood
// once the guard stops it); when they stop, flood mode ends after its
// quiet spell and the guard goes off.
func TestFloodModeHoldsTheSYNGuard(t *testing.T) {
	e := newEnv(t)
	e.guard = pbmaps.SYNGuard{Rate: 100, Burst: 10, Trust: time.Hour}
	e.restart()
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	if g := e.lastGuard(); g.Lease != 0 {
		t.Fatalf("a starting agent left the guard on: %+v", g)
	}

	e.unanswered(svc, be[1])
	e.f.Global.EventsLost += 1000
	e.clk.Step(time.Second)
	e.a.Advance()
	want := pbmaps.SYNGuard{Lease: 5 * 2 * time.Second, Rate: 100, Burst: 10, Trust: time.Hour}
	if g := e.lastGuard(); g != want {
		t.Fatalf("guard in flood mode = %+v, want %+v", g, want)
	}
	if testutil.ToFloat64(e.a.Metrics().SYNGuard) != 1 {
		t.Fatal("syn_guard_active is not 1")
	}

	// Three quiet spells' worth of Maintain rounds, the guard dropping
	// more than a CPU's budget (200 a round) all along: each round renews
	// the lease.
	writes := len(e.f.Guards)
	rounds := int(3 * floodQuiet / (2 * time.Second))
	for range rounds {
		e.f.GuardStats.Dropped += 500
		e.clk.Step(2 * time.Second)
		e.a.Maintain()
	}
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 1 || e.lastGuard() != want {
		t.Fatalf("flood mode ended while the guard dropped SYNs (guard %+v)", e.lastGuard())
	}
	if n := len(e.f.Guards) - writes; n != rounds {
		t.Errorf("%d lease renewals in %d rounds", n, rounds)
	}

	// The drops fall to what a burst of new clients causes (less than a
	// CPU's budget): the guard holds through the quiet spell, then goes.
	for range int(floodQuiet/(2*time.Second)) - 1 {
		e.f.GuardStats.Dropped += 150
		e.clk.Step(2 * time.Second)
		e.a.Maintain()
	}
	if e.lastGuard() != want {
		t.Fatal("guard off before the quiet spell ended")
	}
	e.f.GuardStats.Dropped += 150
	e.clk.Step(3 * time.Second)
	e.a.Maintain()
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 0 {
		t.Fatal("flood mode did not end")
	}
	if g := e.lastGuard(); g.Lease != 0 || testutil.ToFloat64(e.a.Metrics().SYNGuard) != 0 {
		t.Fatalf("guard after flood mode = %+v", g)
	}
}

// A CPU that armed the guard itself (the datapath saw the flood first)
// puts the agent in flood mode at its next look, which leases the guard.
func TestDatapathArmingStartsFloodMode(t *testing.T) {
	e := newEnv(t)
	e.guard = pbmaps.SYNGuard{Rate: 100, Burst: 10, Trust: time.Hour, ArmRate: 20000}
	e.f.GuardStats.Armed = 3 // before this agent: no news
	e.restart()
	e.start(state(web(80, 2, settings())))
	if g := e.lastGuard(); g.Lease != 0 || g.ArmRate != 20000 {
		t.Fatalf("a starting agent wrote %+v, want the guard's settings without a lease", g)
	}
	e.clk.Step(2 * time.Second)
	e.a.Maintain()
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 0 {
		t.Fatal("old armings started flood mode")
	}
	e.f.GuardStats.Armed++
	e.clk.Step(2 * time.Second)
	e.a.Maintain()
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 1 || e.lastGuard().Lease == 0 {
		t.Fatalf("arming did not start flood mode with a lease (guard %+v)", e.lastGuard())
	}
}

// Without a rate (--syn-guard-rate 0) flood mode never turns the guard on,
// and a failed write is counted, not fatal.
func TestSYNGuardOffAndFailing(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.unanswered(svc, be[1])
	e.f.Global.EventsLost += 1000
	e.clk.Step(time.Second)
	e.a.Advance()
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 1 {
		t.Fatal("not in flood mode")
	}
	for _, g := range e.f.Guards {
		if g.Lease != 0 {
			t.Fatalf("guard turned on without a rate: %+v", g)
		}
	}

	e = newEnv(t)
	e.guard = pbmaps.SYNGuard{Rate: 100, Burst: 10, Trust: time.Hour}
	e.restart()
	e.start(state(s))
	svc, be = e.ids(s)
	e.f.Fail["SetSYNGuard"] = 1000
	errs := testutil.ToFloat64(e.a.Metrics().ProgramErrors)
	e.unanswered(svc, be[1])
	e.f.Global.EventsLost += 1000
	e.clk.Step(time.Second)
	e.a.Advance()
	e.a.Maintain()
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 1 || testutil.ToFloat64(e.a.Metrics().SYNGuard) != 0 {
		t.Fatal("flood mode and the guard's gauge disagree with a failing write")
	}
	if got := testutil.ToFloat64(e.a.Metrics().ProgramErrors) - errs; got != 2 {
		t.Errorf("program errors +%v, want +2 (flood start and one renewal)", got)
	}
}
