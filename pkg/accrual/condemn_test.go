package accrual

import (
	"testing"
	"time"
)

func TestFleetWindowsAndCondemn(t *testing.T) {
	h := newHarness(t, nil)
	diluted := rateSettings(func(s *Settings) { s.MinCalls = 20 })
	h.set(1, diluted, 1, 2, 3)
	h.set(2, rateSettings(func(s *Settings) { s.MinCalls = 20; s.FleetEvidence = false }), 4)
	h.set(3, testSettings(), 5) // consecutive: no window to share
	h.play(1, "rsr", 100*time.Millisecond)
	h.play(2, "ss", 100*time.Millisecond)
	h.play(4, "rr", 100*time.Millisecond)
	h.play(5, "rr", 100*time.Millisecond)

	got := map[uint32]FleetWindow{}
	for _, w := range h.e.FleetWindows() {
		got[w.Endpoint] = w
	}
	if len(got) != 2 || got[1].Calls != 3 || got[1].Failures != 2 || got[1].MinCalls != 20 || got[2].Calls != 2 || got[2].Failures != 0 {
		t.Fatalf("FleetWindows = %+v, want endpoints 1 (3 calls, 2 failed) and 2 (2 calls) of the fleet service only", got)
	}

	// Nothing to condemn where fleet evidence is off or not the mode.
	for _, id := range []uint32{4, 5, 99} {
		if ts := h.e.Condemn(id, 100, 50, 0); len(ts) != 0 {
			t.Fatalf("Condemn(%d) = %v, want nothing", id, ts)
		}
	}
	ts := own(h.e.Condemn(1, 100, 30, 0))
	checkInvariants(t, h.e)
	if len(ts) != 1 || ts[0].Reason != ReasonFleet || ts[0].To != Ejected || ts[0].Window.Calls != 100 || ts[0].Window.Failures != 30 {
		t.Fatalf("Condemn(1) = %+v, want an ejection for fleet carrying the fleet's 30 of 100", ts)
	}
	if ts[0].Penalty != time.Second {
		t.Errorf("penalty %v, want the first penalty, 1s", ts[0].Penalty)
	}
	if ts := h.e.Condemn(1, 100, 30, 0); len(ts) != 0 {
		t.Fatalf("Condemn of an ejected endpoint = %v, want nothing", ts)
	}
	if ws := h.e.FleetWindows(); len(ws) != 1 || ws[0].Endpoint != 2 {
		t.Fatalf("FleetWindows after the ejection = %+v, want only endpoint 2 (ejected ones do not report)", ws)
	}
	if c := h.e.Snapshot()[0].Endpoints[0].Counters; c.Ejections != 1 || c.EjectionsBy.Of(ReasonFleet) != 1 {
		t.Errorf("counters %+v, want one ejection for fleet", c)
	}
}

// The ejection cap binds fleet ejections as any other.
func TestCondemnRespectsTheEjectionCap(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, rateSettings(func(s *Settings) { s.MaxEjectionPercent = 50 }), 1, 2)
	if ts := own(h.e.Condemn(1, 100, 50, 3)); len(ts) != 1 || ts[0].To != Ejected {
		t.Fatalf("first = %+v, want ejected", ts)
	}
	ts := own(h.e.Condemn(2, 100, 50, 3))
	if len(ts) != 1 || ts[0].Reason != ReasonEjectionSuppressed || ts[0].Cause != ReasonFleet {
		t.Fatalf("second = %+v, want suppressed (cap 50%% of 2)", ts)
	}
}

// The fleet's level doubles the penalty: a third condemnation in a row
// (level 2) draws 4 × minPenalty, capped at maxPenalty.
func TestCondemnLevel(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, rateSettings(func(s *Settings) { s.MaxPenalty = 3 * time.Second }), 1, 2, 3)
	if ts := own(h.e.Condemn(1, 100, 50, 1)); len(ts) != 1 || ts[0].Penalty != 2*time.Second {
		t.Fatalf("level 1 = %+v, want a 2s penalty", ts)
	}
	if ts := own(h.e.Condemn(2, 100, 50, 200)); len(ts) != 1 || ts[0].Penalty != 3*time.Second {
		t.Fatalf("level 200 = %+v, want maxPenalty", ts)
	}
	checkInvariants(t, h.e)
}

// A renewal after a probe returned the endpoint is a relapse: its level
// already counts it, so the penalty doubles once, not twice.
func TestCondemnAfterAProbeDoublesOnce(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, rateSettings(), 1, 2, 3)
	for level, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second} {
		ts := own(h.e.Condemn(1, 100, 50, level))
		if len(ts) != 1 || ts[0].Penalty != want {
			t.Fatalf("condemnation at level %d = %+v, want a %v penalty", level, ts, want)
		}
		h.step(want)
		h.advance()
		h.obs(Outcome{Endpoint: 1, Success: true, Probe: true}) // back through its probe
		checkInvariants(t, h.e)
	}
}

// Every suppressed condemnation is reported, not only the first.
func TestCondemnSuppressedEachTime(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, rateSettings(func(s *Settings) { s.MaxEjectionPercent = 0 }), 1, 2)
	for i := range 3 {
		if ts := own(h.e.Condemn(1, 100, 50, 0)); len(ts) != 1 || ts[0].Reason != ReasonEjectionSuppressed {
			t.Fatalf("condemnation %d = %+v, want a suppression", i, ts)
		}
	}
}
