// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"
)

func TestStateText(t *testing.T) {
	for _, s := range []State{Ready, Ejected, Probation} {
		b, err := s.MarshalText()
		if err != nil || string(b) != s.String() {
			t.Fatalf("%v: MarshalText %q, %v", s, b, err)
		}
		var back State
		if err := back.UnmarshalText(b); err != nil || back != s {
			t.Fatalf("%v: round trip %v, %v", s, back, err)
		}
	}
	if got := State(9).String(); got != "state(9)" {
		t.Fatalf("State(9) = %q", got)
	}
	if _, err := State(9).MarshalText(); err == nil {
		t.Fatal("MarshalText of invalid state succeeded")
	}
	var s State
	if err := s.UnmarshalText([]byte("gone")); err == nil {
		t.Fatal("UnmarshalText accepted an unknown state")
	}
}

// TestCounting checks streak counting, success resets and per-kind
// counters over outcome sequences. Tokens: r refused, t timeout, x reset,
// d reset-after-data (not counted by default), s success.
func TestCounting(t *testing.T) {
	tests := []struct {
		name        string
		seq         string
		maxFailures int
		wantState   State
		wantConsec  uint32
		want        Counters
	}{
		{"empty", "", 3, Ready, 0, Counters{}},
		{"one failure", "r", 3, Ready, 1, Counters{Failures: KindCounts{Refused: 1}}},
		{"mixed kinds accumulate", "rtx", 4, Ready, 3, Counters{Failures: KindCounts{Refused: 1, Timeout: 1, Reset: 1}}},
		{"success resets", "rrs", 3, Ready, 0, Counters{Successes: 1, Failures: KindCounts{Refused: 2}}},
		{"reset then count again", "rrsrr", 3, Ready, 2, Counters{Successes: 1, Failures: KindCounts{Refused: 4}}},
		{"ignored kind neither counts nor resets", "rrdd", 3, Ready, 2, Counters{Failures: KindCounts{Refused: 2, ResetAfterData: 2}, Ignored: 2}},
		{"ignored kind between counted", "rdrdr", 3, Ejected, 3, Counters{Failures: KindCounts{Refused: 3, ResetAfterData: 2}, Ignored: 2, Ejections: 1, EjectionsBy: EjectionCounts{ConsecutiveFailures: 1}}},
		{"stragglers after ejection", "rrrsr", 3, Ejected, 3, Counters{Successes: 1, Failures: KindCounts{Refused: 4}, Ejections: 1, EjectionsBy: EjectionCounts{ConsecutiveFailures: 1}, Stragglers: 2}},
		{"many successes", "sssss", 1, Ready, 0, Counters{Successes: 5}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.set(1, testSettings(func(s *Settings) { s.MaxFailures = tc.maxFailures }), 0, 1)
			for _, c := range tc.seq {
				var o Outcome
				switch c {
				case 'r':
					o = fail(0, KindRefused)
				case 't':
					o = fail(0, KindTimeout)
				case 'x':
					o = fail(0, KindReset)
				case 'd':
					o = fail(0, KindResetAfterData)
				case 's':
					o = succ(0)
				}
				h.obs(o)
			}
			h.wantState(0, tc.wantState)
			if got := h.e.eps.at(0).consecutive; got != tc.wantConsec {
				t.Errorf("consecutive %d, want %d", got, tc.wantConsec)
			}
			if got := h.counters(0); got != tc.want {
				t.Errorf("counters\n got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestEjectionAtExactlyN(t *testing.T) {
	for _, n := range []int{1, 2, 7, 20} {
		for _, k := range []Kind{KindRefused, KindTimeout, KindReset} {
			t.Run(fmt.Sprintf("%v/%d", k, n), func(t *testing.T) {
				h := newHarness(t, nil)
				h.set(1, testSettings(func(s *Settings) { s.MaxFailures = n }), 0, 1)
				h.step(time.Minute)
				at := func(i int) time.Time { return t0.Add(time.Duration(i) * time.Millisecond) }
				for i := 1; i < n; i++ {
					if ts := h.obs(Outcome{Endpoint: 0, Kind: k, At: at(i)}); ts != nil {
						t.Fatalf("failure %d of %d: transitions %v", i, n, ts)
					}
				}
				h.wantState(0, Ready)
				ts := h.obs(Outcome{Endpoint: 0, Kind: k, At: at(n)})
				wantReasons(t, ts, ReasonConsecutiveFailures)
				tr := ts[0]
				want := Transition{
					Service: 1, Endpoint: 0, From: Ready, To: Ejected, Reason: ReasonConsecutiveFailures,
					Kind: k, Failures: uint32(n), Penalty: time.Second,
					ProbationAt: t0.Add(time.Minute + time.Second), At: t0.Add(time.Minute), FailureAt: at(n),
				}
				if tr != want {
					t.Fatalf("transition\n got %+v\nwant %+v", tr, want)
				}
				h.wantState(0, Ejected)
			})
		}
	}
}

func TestFailureAtDefaultsToNow(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, testSettings(func(s *Settings) { s.MaxFailures = 1 }), 0, 1)
	ts := h.obs(fail(0, KindRefused)) // zero At
	if len(ts) != 1 || !ts[0].FailureAt.Equal(t0) {
		t.Fatalf("FailureAt %v, want now %v", ts, t0)
	}
}

func TestIgnoredKinds(t *testing.T) {
	tests := []struct {
		name    string
		kinds   Kinds
		outcome Kind
		counted bool
	}{
		{"default counts refused", Defaults().FailureKinds, KindRefused, true},
		{"default counts timeout", Defaults().FailureKinds, KindTimeout, true},
		{"default counts reset", Defaults().FailureKinds, KindReset, true},
		{"default ignores reset-after-data", Defaults().FailureKinds, KindResetAfterData, false},
		{"timeout only ignores refused", KindsOf(KindTimeout), KindRefused, false},
		{"reset-after-data opted in", KindsOf(KindResetAfterData), KindResetAfterData, true},
		{"unknown kind ignored", Defaults().FailureKinds, Kind(42), false},
		{"zero kind ignored", Defaults().FailureKinds, Kind(0), false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.set(1, testSettings(func(s *Settings) { s.FailureKinds = tc.kinds }), 0, 1)
			h.obs(fail(0, KindTimeout)) // may or may not count
			before := h.e.eps.at(0).consecutive
			var ts []Transition
			for range 10 {
				ts = append(ts, h.obs(fail(0, tc.outcome))...)
			}
			c := h.counters(0)
			if tc.counted {
				if h.state(0) != Ejected || len(ts) == 0 {
					t.Fatalf("counted kind did not eject: %v", ts)
				}
				return
			}
			if ts != nil || h.state(0) != Ready {
				t.Fatalf("ignored kind changed state: %v", ts)
			}
			if got := h.e.eps.at(0).consecutive; got != before {
				t.Fatalf("ignored kind changed streak %d → %d", before, got)
			}
			if c.Ignored != 10 {
				t.Fatalf("ignored %d, want 10", c.Ignored)
			}
			if tc.outcome > KindResetAfterData || tc.outcome == 0 {
				if c.Failures.Other != 10 {
					t.Fatalf("unknown kinds counted as %+v", c.Failures)
				}
			}
			if h.e.eps.at(0).lastKind != tc.outcome {
				t.Fatalf("last failure kind %v, want %v", h.e.eps.at(0).lastKind, tc.outcome)
			}
		})
	}
}

func TestPenaltyDoublingAndCap(t *testing.T) {
	tests := []struct {
		name     string
		min, max time.Duration
		want     []time.Duration // first ejection, then after each failed probe
	}{
		{"1s to 10s", time.Second, 10 * time.Second, []time.Duration{1, 2, 4, 8, 10, 10, 10}},
		{"3s to 10s", 3 * time.Second, 10 * time.Second, []time.Duration{3, 6, 10, 10}},
		{"min equals max", 5 * time.Second, 5 * time.Second, []time.Duration{5, 5, 5}},
		{"1s to 1h", time.Second, time.Hour, []time.Duration{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3600, 3600}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func() float64 { t.Fatal("rnd called with zero jitter"); return 0 })
			h.set(1, testSettings(func(s *Settings) {
				s.MinPenalty, s.MaxPenalty, s.MaxFailures = tc.min, tc.max, 1
			}), 0, 1)
			tr := h.eject(0, 1)
			var got []time.Duration
			got = append(got, tr.Penalty/time.Second)
			for i := 1; i < len(tc.want); i++ {
				h.toProbation(0)
				ts := h.obs(probeFail(0, KindTimeout))
				wantReasons(t, ts, ReasonProbeFailed)
				if ts[0].From != Probation || ts[0].To != Ejected || ts[0].Kind != KindTimeout {
					t.Fatalf("probe failure transition %+v", ts[0])
				}
				if !ts[0].ProbationAt.Equal(h.clk.Now().Add(ts[0].Penalty)) {
					t.Fatalf("probation at %v, want now+%v", ts[0].ProbationAt, ts[0].Penalty)
				}
				got = append(got, ts[0].Penalty/time.Second)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("penalties (s) %v, want %v", got, tc.want)
			}
			// A successful probe resets the level: the next ejection is
			// MinPenalty again.
			h.toProbation(0)
			wantReasons(t, h.obs(probeOK(0)), ReasonProbeSucceeded)
			if ep := h.e.eps.at(0); ep.level != 0 || ep.consecutive != 0 {
				t.Fatalf("after probe success level %d consecutive %d", ep.level, ep.consecutive)
			}
			if tr := h.eject(0, 1); tr.Penalty != tc.min {
				t.Fatalf("penalty after reset %v, want %v", tr.Penalty, tc.min)
			}
		})
	}
}

func TestPenaltyNoOverflow(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, testSettings(func(s *Settings) {
		s.MinPenalty, s.MaxPenalty, s.MaxFailures = time.Nanosecond, time.Duration(math.MaxInt64), 1
	}), 0, 1)
	h.eject(0, 1)
	prev := time.Duration(0)
	for range 70 {
		h.toProbation(0)
		ts := h.obs(probeFail(0, KindRefused))
		if p := ts[0].Penalty; p <= 0 || p < prev {
			t.Fatalf("penalty went %v → %v", prev, p)
		}
		prev = ts[0].Penalty
		if ts[0].ProbationAt.Before(h.clk.Now()) {
			t.Fatal("probation time wrapped")
		}
		h.clk.SetTime(t0) // keep the clock from running past year 2262
	}
}

func TestJitterBounds(t *testing.T) {
	tests := []struct {
		name      string
		base      time.Duration
		ratio     float64
		lo, hi    time.Duration
		meanSlack time.Duration
	}{
		{"0.2 on 10s", 10 * time.Second, 0.2, 8 * time.Second, 12 * time.Second, 200 * time.Millisecond},
		{"0.5 on 1s (Linkerd default)", time.Second, 0.5, 500 * time.Millisecond, 1500 * time.Millisecond, 40 * time.Millisecond},
		{"1.0 on 4s", 4 * time.Second, 1, 0, 8 * time.Second, 300 * time.Millisecond},
	}
	const draws = 2000
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, pcg(7))
			h.set(1, testSettings(func(s *Settings) {
				s.MinPenalty, s.MaxPenalty, s.JitterRatio, s.MaxFailures = tc.base, tc.base, tc.ratio, 1
			}), 0, 1)
			seen := map[time.Duration]bool{}
			var sum time.Duration
			for range draws {
				tr := h.eject(0, 1)
				if tr.Penalty < tc.lo || tr.Penalty > tc.hi {
					t.Fatalf("penalty %v outside [%v, %v]", tr.Penalty, tc.lo, tc.hi)
				}
				seen[tr.Penalty] = true
				sum += tr.Penalty
				h.toProbation(0)
				h.obs(probeOK(0))
			}
			if len(seen) < draws/2 {
				t.Fatalf("only %d distinct penalties in %d draws", len(seen), draws)
			}
			if mean := sum / draws; mean < tc.base-tc.meanSlack || mean > tc.base+tc.meanSlack {
				t.Fatalf("mean penalty %v, want about %v", mean, tc.base)
			}
		})
	}
}

func TestJitterEdges(t *testing.T) {
	tests := []struct {
		name string
		r    float64
		want time.Duration
	}{
		{"r=0 lowest", 0, 8 * time.Second},
		{"r=0.5 middle", 0.5, 10 * time.Second},
		{"r=0.75", 0.75, 11 * time.Second},
		{"r=1 highest", 1, 12 * time.Second},
		{"r>1 clamped", 7, 12 * time.Second},
		{"r<0 clamped", -3, 8 * time.Second},
		{"NaN clamped", math.NaN(), 8 * time.Second},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, seqRand(tc.r))
			h.set(1, testSettings(func(s *Settings) {
				s.MinPenalty, s.MaxPenalty, s.JitterRatio, s.MaxFailures = 10*time.Second, time.Minute, 0.2, 1
			}), 0, 1)
			if tr := h.eject(0, 1); tr.Penalty != tc.want {
				t.Fatalf("penalty %v, want %v", tr.Penalty, tc.want)
			}
		})
	}
	// Jitter applies after the cap: a capped 10s penalty still varies.
	h := newHarness(t, seqRand(1))
	h.set(1, testSettings(func(s *Settings) {
		s.MinPenalty, s.MaxPenalty, s.JitterRatio, s.MaxFailures = 10*time.Second, 10*time.Second, 0.2, 1
	}), 0, 1)
	h.eject(0, 1)
	h.toProbation(0)
	if ts := h.obs(probeFail(0, KindRefused)); ts[0].Penalty != 12*time.Second {
		t.Fatalf("jittered capped penalty %v, want 12s", ts[0].Penalty)
	}
}

func TestProbe(t *testing.T) {
	tests := []struct {
		name      string
		outcome   Outcome
		want      []Reason
		wantState State
		check     func(t *testing.T, c Counters)
	}{
		{"success", probeOK(0), []Reason{ReasonProbeSucceeded}, Ready,
			func(t *testing.T, c Counters) {
				if c.ProbeSuccesses != 1 {
					t.Errorf("probe successes %d", c.ProbeSuccesses)
				}
			}},
		{"counted failure", probeFail(0, KindRefused), []Reason{ReasonProbeFailed}, Ejected,
			func(t *testing.T, c Counters) {
				if c.ProbeFailures != 1 || c.Ejections != 2 {
					t.Errorf("probe failures %d ejections %d", c.ProbeFailures, c.Ejections)
				}
			}},
		{"timeout failure", probeFail(0, KindTimeout), []Reason{ReasonProbeFailed}, Ejected, nil},
		{"ignored kind is inconclusive", probeFail(0, KindResetAfterData), []Reason{ReasonProbeInconclusive}, Probation,
			func(t *testing.T, c Counters) {
				if c.ProbeInconclusive != 1 {
					t.Errorf("inconclusive %d", c.ProbeInconclusive)
				}
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.set(1, testSettings(), 0, 1)
			h.eject(0, 3)
			h.toProbation(0)
			active, probation, fo := h.e.Admitted(1)
			if !slices.Equal(active, []uint32{1}) || !slices.Equal(probation, []uint32{0}) || fo {
				t.Fatalf("admitted in probation: %v %v %v", active, probation, fo)
			}
			h.step(time.Second)
			ts := h.obs(tc.outcome)
			wantReasons(t, ts, tc.want...)
			if ts[0].Endpoint != 0 || ts[0].From != Probation || ts[0].To != tc.wantState || !ts[0].At.Equal(h.clk.Now()) {
				t.Fatalf("transition %+v", ts[0])
			}
			h.wantState(0, tc.wantState)
			if tc.check != nil {
				tc.check(t, h.counters(0))
			}
			if tc.wantState == Ready {
				if a, p, _ := h.e.Admitted(1); !slices.Equal(a, []uint32{0, 1}) || p != nil {
					t.Fatalf("admitted after probe success: %v %v", a, p)
				}
			}
		})
	}
}

// TestProbeOnReadyIsOrdinary: a late outcome of a probe flow after the
// endpoint is ready again counts like any outcome.
func TestProbeOnReadyIsOrdinary(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, testSettings(), 0, 1)
	h.obs(probeFail(0, KindRefused))
	h.obs(probeFail(0, KindRefused))
	if ts := h.obs(probeFail(0, KindRefused)); len(ts) != 1 || ts[0].Reason != ReasonConsecutiveFailures {
		t.Fatalf("probe-flagged failures on a ready endpoint: %v", ts)
	}
}

func TestStragglers(t *testing.T) {
	outcomes := []struct {
		name string
		o    Outcome
	}{
		{"success", succ(0)},
		{"counted failure", fail(0, KindRefused)},
		{"ignored failure", fail(0, KindResetAfterData)},
	}
	for _, st := range []State{Ejected, Probation} {
		for _, oc := range outcomes {
			t.Run(st.String()+"/"+oc.name, func(t *testing.T) {
				h := newHarness(t, nil)
				h.set(1, testSettings(), 0, 1)
				h.eject(0, 3)
				if st == Probation {
					h.toProbation(0)
				}
				before, beforeAct := *h.e.eps.at(0), *h.e.eps.at(0).seen()
				for range 5 {
					if ts := h.obs(oc.o); ts != nil {
						t.Fatalf("straggler caused %v", ts)
					}
				}
				after := *h.e.eps.at(0)
				if after.state != st || after.consecutive != before.consecutive || after.level != before.level ||
					!after.seen().probationAt.Equal(beforeAct.probationAt) {
					t.Fatalf("straggler changed state: %+v → %+v", before, after)
				}
				if c := h.counters(0); c.Stragglers != 5 {
					t.Fatalf("stragglers %d, want 5", c.Stragglers)
				}
			})
		}
	}
	// A probe flag on an ejected endpoint is a stale probe: a straggler.
	h := newHarness(t, nil)
	h.set(1, testSettings(), 0, 1)
	h.eject(0, 3)
	h.toProbation(0)
	h.obs(probeFail(0, KindRefused))
	for _, o := range []Outcome{probeOK(0), probeFail(0, KindRefused)} {
		if ts := h.obs(o); ts != nil {
			t.Fatalf("stale probe on ejected endpoint: %v", ts)
		}
	}
	h.wantState(0, Ejected)
}

func TestMaxEjectionPercent(t *testing.T) {
	tests := []struct {
		n, pct, want int
	}{
		{10, 0, 0},
		{10, 100, 10},
		{10, 25, 2},
		{10, 29, 2},
		{10, 30, 3},
		{3, 50, 1},
		{1, 50, 0},
		{1, 99, 0},
		{1, 100, 1},
		{4, 99, 3},
		{5, 10, 0},
		{7, 15, 1},
		{2, 50, 1},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%d endpoints at %d%%", tc.n, tc.pct), func(t *testing.T) {
			if got := EjectionCap(tc.n, tc.pct); got != tc.want {
				t.Fatalf("EjectionCap(%d, %d) = %d, want %d", tc.n, tc.pct, got, tc.want)
			}
			h := newHarness(t, nil)
			eps := make([]uint32, tc.n)
			for i := range eps {
				eps[i] = uint32(i)
			}
			h.set(1, testSettings(func(s *Settings) { s.MaxEjectionPercent = tc.pct }), eps...)
			var all []Transition
			for _, ep := range eps {
				all = append(all, h.fails(ep, 3, KindRefused)...)
			}
			ejected, suppressed, foStart := 0, 0, 0
			for _, tr := range all {
				switch tr.Reason {
				case ReasonConsecutiveFailures:
					ejected++
				case ReasonEjectionSuppressed:
					suppressed++
					if tr.From != Ready || tr.To != Ready || tr.Failures != 3 {
						t.Fatalf("suppression event %+v", tr)
					}
				case ReasonFailOpenStart:
					foStart++
				}
			}
			if ejected != tc.want || suppressed != tc.n-tc.want {
				t.Fatalf("ejected %d suppressed %d, want %d and %d", ejected, suppressed, tc.want, tc.n-tc.want)
			}
			if wantFO := tc.want == tc.n; (foStart == 1) != wantFO || foStart > 1 {
				t.Fatalf("fail-open starts %d (all ejected: %v)", foStart, wantFO)
			}
			// More failures on suppressed endpoints neither eject nor emit.
			for _, ep := range eps {
				if h.state(ep) == Ready {
					if ts := h.fails(ep, 5, KindRefused); ts != nil {
						t.Fatalf("further failures while capped: %v", ts)
					}
					if c := h.counters(ep); c.SuppressedEjections != 1 {
						t.Fatalf("suppressed count %d, want 1 per streak", c.SuppressedEjections)
					}
				}
			}
		})
	}
}

func TestSuppressedEjectionRetries(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, testSettings(func(s *Settings) { s.MaxEjectionPercent = 50 }), 0, 1, 2, 3) // cap 2
	h.eject(0, 3)
	h.eject(1, 3)
	wantReasons(t, h.fails(2, 3, KindRefused), ReasonEjectionSuppressed)
	// Probation still counts against the cap.
	h.toProbation(0)
	if ts := h.obs(fail(2, KindRefused)); ts != nil {
		t.Fatalf("ejected while cap full of probation: %v", ts)
	}
	// A success ends the streak; a new streak is a new suppression.
	h.obs(succ(2))
	wantReasons(t, h.fails(2, 3, KindRefused), ReasonEjectionSuppressed)
	if c := h.counters(2); c.SuppressedEjections != 2 {
		t.Fatalf("suppressed %d, want 2", c.SuppressedEjections)
	}
	// Room frees up: the next counted failure of the pending streak ejects.
	wantReasons(t, h.obs(probeOK(0)), ReasonProbeSucceeded)
	ts := h.obs(Outcome{Endpoint: 2, Kind: KindTimeout, At: h.clk.Now()})
	wantReasons(t, ts, ReasonConsecutiveFailures)
	if ts[0].Failures != 4 || ts[0].Kind != KindTimeout {
		t.Fatalf("late ejection %+v", ts[0])
	}
}

func TestFailOpen(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, testSettings(func(s *Settings) { s.MaxFailures = 1 }), 0, 1, 2)
	h.eject(0, 1) // penalty ends at t0+1s
	h.step(10 * time.Second)
	h.eject(1, 1) // these two at t0+11s
	ts := h.obs(fail(2, KindRefused))
	wantReasons(t, ts, ReasonConsecutiveFailures, ReasonFailOpenStart)
	if fo := ts[1]; fo.Service != 1 || fo.Endpoint != 2 || !fo.ServiceLevel() || !fo.At.Equal(h.clk.Now()) {
		t.Fatalf("fail-open start %+v", fo)
	}
	active, probation, failOpen := h.e.Admitted(1)
	if !failOpen || !slices.Equal(active, []uint32{0, 1, 2}) || probation != nil {
		t.Fatalf("admitted while failing open: %v %v %v", active, probation, failOpen)
	}
	// Failures during fail-open change nothing.
	for ep := range uint32(3) {
		if ts := h.obs(fail(ep, KindTimeout)); ts != nil {
			t.Fatalf("failure during fail-open: %v", ts)
		}
	}
	// Penalties keep running; probation does not end fail-open, and the
	// table still holds everything as active.
	h.toProbation(0)
	if _, p, fo := h.e.Admitted(1); !fo || p != nil {
		t.Fatalf("probation during fail-open: probation %v failOpen %v", p, fo)
	}
	// A success on an ejected endpoint returns it at once and ends
	// fail-open; the others leave the table again.
	h.step(time.Millisecond)
	ts = h.obs(succ(1))
	wantReasons(t, ts, ReasonFailOpenSuccess, ReasonFailOpenEnd)
	if ts[0].From != Ejected || ts[0].To != Ready || ts[1].Endpoint != 1 {
		t.Fatalf("fail-open exit %+v", ts)
	}
	if ep := h.e.eps.at(1); ep.level != 0 || ep.consecutive != 0 {
		t.Fatalf("fail-open success did not reset: %+v", ep)
	}
	active, probation, failOpen = h.e.Admitted(1)
	if failOpen || !slices.Equal(active, []uint32{1}) || !slices.Equal(probation, []uint32{0}) {
		t.Fatalf("admitted after fail-open: %v %v %v", active, probation, failOpen)
	}
	if h.counters(1).FailOpenRecoveries != 1 {
		t.Fatal("fail-open recovery not counted")
	}
	// A success on a probation endpoint also works, and a second episode
	// is counted.
	h.eject(1, 1)
	snap := h.e.Snapshot()[0]
	if !snap.FailOpen || snap.FailOpenEpisodes != 2 || !snap.FailOpenSince.Equal(h.clk.Now()) {
		t.Fatalf("snapshot %+v", snap)
	}
	ts = h.obs(succ(0)) // 0 is in probation, not a probe flow
	wantReasons(t, ts, ReasonFailOpenSuccess, ReasonFailOpenEnd)
	if ts[0].From != Probation {
		t.Fatalf("from %v", ts[0].From)
	}
	if snap := h.e.Snapshot()[0]; snap.FailOpen || !snap.FailOpenSince.IsZero() || snap.FailOpenEpisodes != 2 {
		t.Fatalf("snapshot after second episode %+v", snap)
	}
}

func TestFailOpenProbeFailure(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, testSettings(func(s *Settings) { s.MaxFailures = 1 }), 0)
	ts := h.obs(fail(0, KindRefused))
	wantReasons(t, ts, ReasonConsecutiveFailures, ReasonFailOpenStart)
	h.toProbation(0)
	// A probe flagged before fail-open, failing: ejected again, still
	// failing open, no duplicate fail-open events.
	wantReasons(t, h.obs(probeFail(0, KindRefused)), ReasonProbeFailed)
	h.toProbation(0)
	wantReasons(t, h.obs(probeOK(0)), ReasonProbeSucceeded, ReasonFailOpenEnd)
}

func TestEndpointAddRemove(t *testing.T) {
	t.Run("remove mid-penalty and re-add", func(t *testing.T) {
		h := newHarness(t, nil)
		st := testSettings()
		h.set(1, st, 0, 1, 2)
		h.eject(0, 3)
		if _, ok := h.e.NextDeadline(); !ok {
			t.Fatal("no deadline while ejected")
		}
		if ts := h.set(1, st, 1, 2); ts != nil {
			t.Fatalf("removal emitted %v", ts)
		}
		if d, ok := h.e.NextDeadline(); ok {
			t.Fatalf("deadline %v after removing the ejected endpoint", d)
		}
		if ts := h.obs(fail(0, KindRefused)); ts != nil || h.e.UnknownOutcomes() != 1 {
			t.Fatalf("outcome for removed endpoint: %v, unknown %d", ts, h.e.UnknownOutcomes())
		}
		h.set(1, st, 0, 1, 2)
		h.wantState(0, Ready)
		if c := h.counters(0); c != (Counters{}) || h.e.eps.at(0).consecutive != 0 {
			t.Fatalf("re-added endpoint kept state: %+v", c)
		}
		if ts := h.advance(); ts != nil {
			t.Fatalf("advance after re-add: %v", ts)
		}
	})
	t.Run("removing the last ready endpoint starts fail-open", func(t *testing.T) {
		h := newHarness(t, nil)
		st := testSettings()
		h.set(1, st, 0, 1)
		h.eject(0, 3)
		ts := h.set(1, st, 0)
		wantReasons(t, ts, ReasonFailOpenStart)
		if ts[0].Endpoint != NoEndpoint {
			t.Fatalf("cause %d, want NoEndpoint", ts[0].Endpoint)
		}
		// Adding a ready endpoint ends it.
		ts = h.set(1, st, 0, 5)
		wantReasons(t, ts, ReasonFailOpenEnd)
		if a, _, fo := h.e.Admitted(1); fo || !slices.Equal(a, []uint32{5}) {
			t.Fatalf("admitted %v %v", a, fo)
		}
		// Removing everything ends fail-open too: nothing to fail open to.
		h.set(1, st, 0)
		wantReasons(t, h.set(1, st), ReasonFailOpenEnd)
		if a, p, fo := h.e.Admitted(1); a == nil || len(a) != 0 || p != nil || fo {
			t.Fatalf("empty service admitted %v %v %v", a, p, fo)
		}
	})
	t.Run("duplicates and order", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(), 9, 3, 9, 3, 0)
		if a, _, _ := h.e.Admitted(1); !slices.Equal(a, []uint32{0, 3, 9}) {
			t.Fatalf("admitted %v", a)
		}
	})
	t.Run("endpoint moves to another service", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(), 0, 1)
		h.set(2, testSettings(), 7)
		h.eject(0, 3)
		h.set(2, testSettings(), 0, 7)
		if h.e.eps.at(0).svc.id != 2 {
			t.Fatal("endpoint did not move")
		}
		h.wantState(0, Ready)
		if a, _, _ := h.e.Admitted(1); !slices.Equal(a, []uint32{1}) {
			t.Fatalf("old service admitted %v", a)
		}
		if _, ok := h.e.NextDeadline(); ok {
			t.Fatal("moved endpoint left a deadline")
		}
	})
	t.Run("move ends the old service in fail-open", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(), 0, 1)
		h.eject(0, 3)
		ts := h.set(2, testSettings(), 1)
		wantReasons(t, ts, ReasonFailOpenStart)
		if ts[0].Service != 1 {
			t.Fatalf("fail-open of service %d", ts[0].Service)
		}
	})
	t.Run("remove service", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(), 0)
		h.eject(0, 3)
		ts := own(h.e.RemoveService(1))
		checkInvariants(t, h.e)
		wantReasons(t, ts, ReasonFailOpenEnd)
		if ts := h.e.RemoveService(1); ts != nil {
			t.Fatalf("second removal: %v", ts)
		}
		if a, p, fo := h.e.Admitted(1); a != nil || p != nil || fo {
			t.Fatal("removed service still admitted")
		}
		if _, ok := h.e.NextDeadline(); ok {
			t.Fatal("removed service left a deadline")
		}
		if ts := h.obs(fail(0, KindRefused)); ts != nil {
			t.Fatalf("outcome after removal: %v", ts)
		}
		if len(h.e.Snapshot()) != 0 || len(h.e.Export()) != 0 {
			t.Fatal("removed service in snapshot/export")
		}
	})
	t.Run("id beyond limit panics", func(t *testing.T) {
		h := newHarness(t, nil)
		defer func() {
			if recover() == nil {
				t.Fatal("no panic")
			}
		}()
		h.e.SetService(1, "svc", testSettings(), []uint32{NoEndpoint - 1})
	})
}

func TestSettingsChange(t *testing.T) {
	t.Run("lower max failures applies at next failure", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(func(s *Settings) { s.MaxFailures = 5 }), 0, 1)
		h.fails(0, 3, KindRefused)
		if ts := h.set(1, testSettings(func(s *Settings) { s.MaxFailures = 2 }), 0, 1); ts != nil {
			t.Fatalf("settings change emitted %v", ts)
		}
		h.wantState(0, Ready)
		ts := h.obs(fail(0, KindRefused))
		wantReasons(t, ts, ReasonConsecutiveFailures)
		if ts[0].Failures != 4 {
			t.Fatalf("failures %d", ts[0].Failures)
		}
	})
	t.Run("failure kinds", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(), 0, 1)
		h.fails(0, 2, KindRefused)
		h.set(1, testSettings(func(s *Settings) { s.FailureKinds = KindsOf(KindTimeout) }), 0, 1)
		if ts := h.fails(0, 5, KindRefused); ts != nil {
			t.Fatalf("refused counted after removal from kinds: %v", ts)
		}
		wantReasons(t, h.obs(fail(0, KindTimeout)), ReasonConsecutiveFailures)
	})
	t.Run("lower max penalty shortens running penalty", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(func(s *Settings) { s.MinPenalty = 40 * time.Second }), 0, 1)
		h.eject(0, 3)
		h.step(time.Second)
		h.set(1, testSettings(func(s *Settings) { s.MaxPenalty = 10 * time.Second; s.JitterRatio = 0.5 }), 0, 1)
		d, _ := h.e.NextDeadline()
		if want := t0.Add(15 * time.Second); !d.Equal(want) {
			t.Fatalf("deadline %v, want %v (ejected-at + 10s·1.5)", d, want)
		}
		// Raising never lengthens it.
		h.set(1, testSettings(func(s *Settings) { s.MinPenalty, s.MaxPenalty = time.Minute, time.Hour }), 0, 1)
		if d2, _ := h.e.NextDeadline(); !d2.Equal(d) {
			t.Fatalf("deadline moved to %v", d2)
		}
		// The next penalty uses the new settings.
		h.toProbation(0)
		if ts := h.obs(probeFail(0, KindRefused)); ts[0].Penalty != 2*time.Minute {
			t.Fatalf("next penalty %v, want 2m", ts[0].Penalty)
		}
	})
	t.Run("lower max ejection percent un-ejects nothing", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(), 0, 1, 2)
		h.eject(0, 3)
		h.eject(1, 3)
		if ts := h.set(1, testSettings(func(s *Settings) { s.MaxEjectionPercent = 0 }), 0, 1, 2); ts != nil {
			t.Fatalf("emitted %v", ts)
		}
		h.wantState(0, Ejected)
		h.wantState(1, Ejected)
		h.toProbation(0)
		h.obs(probeOK(0))
		wantReasons(t, h.fails(0, 3, KindRefused), ReasonEjectionSuppressed)
	})
	t.Run("mode none returns everything", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(), 0, 1)
		h.eject(0, 3)
		h.toProbation(0)
		h.eject(1, 3)
		ts := h.set(1, testSettings(func(s *Settings) { s.Mode = ModeNone }), 0, 1)
		wantReasons(t, ts, ReasonAccrualDisabled, ReasonFailOpenEnd, ReasonAccrualDisabled)
		if ts[0].From != Probation || ts[2].From != Ejected {
			t.Fatalf("transitions %v", ts)
		}
		if _, ok := h.e.NextDeadline(); ok {
			t.Fatal("deadline after accrual disabled")
		}
		if ts := h.fails(0, 20, KindRefused); ts != nil {
			t.Fatalf("mode none ejected: %v", ts)
		}
	})
	t.Run("settings clamped", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, Settings{Mode: ModeConsecutive, JitterRatio: math.NaN(), MaxEjectionPercent: 300, FailureKinds: KindsOf(KindRefused)}, 0, 1)
		got := h.e.Snapshot()[0].Settings
		if got.MaxFailures != 1 || got.MinPenalty != time.Second || got.MaxPenalty != time.Second ||
			got.JitterRatio != 0 || got.MaxEjectionPercent != 100 {
			t.Fatalf("clamped settings %+v", got)
		}
		h.eject(0, 1)
	})
}

func TestModeNone(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, testSettings(func(s *Settings) { s.Mode = ModeNone; s.MaxFailures = 1 }), 0)
	for i := range 100 {
		k := []Kind{KindRefused, KindTimeout, KindReset}[i%3]
		if ts := h.obs(fail(0, k)); ts != nil {
			t.Fatalf("mode none: %v", ts)
		}
	}
	h.obs(fail(0, KindResetAfterData))
	snap := h.e.Snapshot()[0].Endpoints[0]
	if snap.State != Ready || snap.ConsecutiveFailures != 100 || snap.LastFailureKind != KindResetAfterData {
		t.Fatalf("snapshot %+v", snap)
	}
	want := KindCounts{Refused: 34, Timeout: 33, Reset: 33, ResetAfterData: 1}
	if snap.Counters.Failures != want || snap.Counters.Ignored != 1 || snap.Counters.Ejections != 0 {
		t.Fatalf("counters %+v", snap.Counters)
	}
	h.obs(succ(0))
	if h.e.eps.at(0).consecutive != 0 {
		t.Fatal("success did not reset in mode none")
	}
	// Unknown modes never eject either.
	h.set(2, testSettings(func(s *Settings) { s.Mode = "bogus"; s.MaxFailures = 1 }), 1)
	if ts := h.fails(1, 5, KindRefused); ts != nil {
		t.Fatalf("unknown mode ejected: %v", ts)
	}
}

func TestNextDeadline(t *testing.T) {
	h := newHarness(t, seqRand(0.5, 0, 1, 0.25)) // jitter 0.5 on 8s: 8s, 4s, 12s, 6s
	h.set(1, testSettings(func(s *Settings) {
		s.MaxFailures, s.MinPenalty, s.MaxPenalty, s.JitterRatio = 1, 8*time.Second, time.Minute, 0.5
	}), 0, 1, 2, 3, 4)
	if _, ok := h.e.NextDeadline(); ok {
		t.Fatal("deadline with nothing ejected")
	}
	type step struct {
		eject uint32
		want  time.Duration // expected NextDeadline offset from t0
	}
	for _, s := range []step{{0, 8 * time.Second}, {1, 4 * time.Second}, {2, 4 * time.Second}, {3, 4 * time.Second}} {
		h.eject(s.eject, 1)
		if d, ok := h.e.NextDeadline(); !ok || !d.Equal(t0.Add(s.want)) {
			t.Fatalf("after ejecting %d: deadline %v %v, want t0+%v", s.eject, d, ok, s.want)
		}
	}
	// Deadlines: 0@8s, 1@4s, 2@12s, 3@6s.
	h.clk.SetTime(t0.Add(3 * time.Second))
	if ts := h.advance(); ts != nil {
		t.Fatalf("early advance: %v", ts)
	}
	h.clk.SetTime(t0.Add(7 * time.Second))
	ts := h.advance()
	wantReasons(t, ts, ReasonPenaltyOver, ReasonPenaltyOver)
	if ts[0].Endpoint != 1 || ts[1].Endpoint != 3 || ts[0].From != Ejected || ts[0].To != Probation {
		t.Fatalf("advance order %v", ts)
	}
	if d, _ := h.e.NextDeadline(); !d.Equal(t0.Add(8 * time.Second)) {
		t.Fatalf("deadline %v", d)
	}
	// Removing the earliest moves the deadline on.
	h.set(1, testSettings(func(s *Settings) {
		s.MaxFailures, s.MinPenalty, s.MaxPenalty, s.JitterRatio = 1, 8*time.Second, time.Minute, 0.5
	}), 1, 2, 3, 4)
	if d, _ := h.e.NextDeadline(); !d.Equal(t0.Add(12 * time.Second)) {
		t.Fatalf("deadline after removal %v", d)
	}
	// Exactly at the deadline counts as due.
	h.clk.SetTime(t0.Add(12 * time.Second))
	wantReasons(t, h.advance(), ReasonPenaltyOver)
	if _, ok := h.e.NextDeadline(); ok {
		t.Fatal("deadline left")
	}
	// Equal deadlines come out in endpoint order.
	h2 := newHarness(t, nil)
	h2.set(1, testSettings(func(s *Settings) { s.MaxFailures = 1 }), 0, 1, 2, 3, 4, 5)
	for _, ep := range []uint32{4, 1, 3, 0} {
		h2.eject(ep, 1)
	}
	h2.step(time.Hour)
	var order []uint32
	for _, tr := range h2.advance() {
		order = append(order, tr.Endpoint)
	}
	if !slices.Equal(order, []uint32{0, 1, 3, 4}) {
		t.Fatalf("order %v", order)
	}
}

func TestRestore(t *testing.T) {
	st := testSettings(func(s *Settings) { s.MinPenalty, s.MaxPenalty = 30*time.Second, 10*time.Minute })
	// Engine one: 0 ejected at t0 (30s), 1 in probation, 2 ready with a
	// streak of 2, 3 ejected at level 2 (120s), 4 ready.
	h1 := newHarness(t, nil)
	h1.set(7, st, 0, 1, 2, 3, 4)
	h1.set(8, st, 10)
	h1.eject(1, 3)
	h1.eject(3, 3)
	for range 2 {
		h1.toProbation(3)
		h1.obs(probeFail(3, KindTimeout))
	}
	// Now t0+90s: 1 is in probation, 3 ejected until t0+210s.
	h1.clk.SetTime(t0.Add(200 * time.Second))
	ejectAt := h1.clk.Now()
	h1.eject(0, 3)
	h1.fails(2, 2, KindReset)
	recs := h1.e.Export()
	if len(recs) != 6 {
		t.Fatalf("%d records", len(recs))
	}
	blob, err := json.Marshal(recs)
	if err != nil {
		t.Fatal(err)
	}
	var back []Record
	if err := json.Unmarshal(blob, &back); err != nil {
		t.Fatal(err)
	}
	if !slices.EqualFunc(recs, back, func(a, b Record) bool {
		return a.State == b.State && a.ProbationAt.Equal(b.ProbationAt) && a.Penalty == b.Penalty &&
			a.PenaltyLevel == b.PenaltyLevel && a.Ejections == b.Ejections && a.LastFailureAt.Equal(b.LastFailureAt)
	}) {
		t.Fatalf("JSON round trip\n%+v\n%+v", recs, back)
	}

	restart := func(t *testing.T, at time.Time) (*harness, []Transition, int) {
		h := newHarness(t, nil)
		h.clk.SetTime(at)
		h.set(7, st, 0, 1, 2, 3, 4)
		h.set(8, st, 10)
		ts, skipped := h.e.Restore(back)
		ts = own(ts)
		checkInvariants(t, h.e)
		return h, ts, skipped
	}

	t.Run("penalty honoured", func(t *testing.T) {
		h, ts, skipped := restart(t, ejectAt.Add(5*time.Second))
		if skipped != 0 {
			t.Fatalf("skipped %d", skipped)
		}
		for _, tr := range ts {
			if tr.Reason != ReasonRestored || tr.From != Ready {
				t.Fatalf("restore transition %+v", tr)
			}
		}
		h.wantState(0, Ejected)
		h.wantState(1, Probation)
		h.wantState(2, Ready)
		h.wantState(3, Ejected)
		if h.e.eps.at(2).consecutive != 2 || h.e.eps.at(2).lastKind != KindReset {
			t.Fatalf("ready endpoint record not adopted: %+v", h.e.eps.at(2))
		}
		a, p, _ := h.e.Admitted(7)
		if !slices.Equal(a, []uint32{2, 4}) || !slices.Equal(p, []uint32{1}) {
			t.Fatalf("admitted %v %v", a, p)
		}
		if ts := h.advance(); ts != nil {
			t.Fatalf("advance before penalty end: %v", ts)
		}
		if d, _ := h.e.NextDeadline(); !d.Equal(t0.Add(210 * time.Second)) {
			t.Fatalf("deadline %v, want t0+210s", d)
		}
		h.clk.SetTime(t0.Add(210 * time.Second))
		ts = h.advance()
		wantReasons(t, ts, ReasonPenaltyOver)
		if ts[0].Endpoint != 3 {
			t.Fatalf("advanced %v", ts)
		}
		// The restored level keeps doubling: 30s·2² → 30s·2³.
		if ts := h.obs(probeFail(3, KindRefused)); ts[0].Penalty != 240*time.Second {
			t.Fatalf("penalty after restored level 2: %v", ts[0].Penalty)
		}
		if c := h.counters(3); c.Ejections != 4 {
			t.Fatalf("ejections %d, want restored 3 + 1", c.Ejections)
		}
		if d, _ := h.e.NextDeadline(); !d.Equal(ejectAt.Add(30 * time.Second)) {
			t.Fatalf("deadline %v, want %v", d, ejectAt.Add(30*time.Second))
		}
		h.clk.SetTime(ejectAt.Add(30*time.Second - 1))
		if ts := h.advance(); ts != nil {
			t.Fatalf("advance a nanosecond early: %v", ts)
		}
		h.clk.SetTime(ejectAt.Add(30 * time.Second))
		ts = h.advance()
		wantReasons(t, ts, ReasonPenaltyOver)
		if ts[0].Endpoint != 0 {
			t.Fatalf("advanced %v", ts)
		}
	})
	t.Run("expired penalty goes to probation at first advance", func(t *testing.T) {
		h, _, _ := restart(t, ejectAt.Add(24*time.Hour))
		h.wantState(0, Ejected)
		ts := h.advance()
		wantReasons(t, ts, ReasonPenaltyOver, ReasonPenaltyOver)
		h.wantState(0, Probation)
		h.wantState(3, Probation)
	})
	t.Run("unknown endpoints and bad records skipped", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(7, st, 0, 1)
		h.set(9, st, 2)
		bad := append(slices.Clone(back), Record{Service: 7, Endpoint: 1, State: 9})
		_, skipped := h.e.Restore(bad)
		checkInvariants(t, h.e)
		// 2 (now in service 9), 3, 4, 10 (unknown ids) and the bad state.
		if skipped != 5 {
			t.Fatalf("skipped %d, want 5", skipped)
		}
		h.wantState(2, Ready)
	})
	t.Run("mode none adopts counters only", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(7, testSettings(func(s *Settings) { s.Mode = ModeNone }), 0, 1, 2, 3, 4)
		ts, _ := h.e.Restore(back)
		if ts != nil {
			t.Fatalf("restore under mode none: %v", ts)
		}
		checkInvariants(t, h.e)
		if h.counters(3).Ejections != 3 {
			t.Fatal("ejections not adopted")
		}
	})
	t.Run("far-future probation clamped", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(7, st, 0, 1)
		ts, _ := h.e.Restore([]Record{{Service: 7, Endpoint: 0, State: Ejected, Penalty: 30 * time.Second,
			ProbationAt: t0.Add(1000 * time.Hour), PenaltyLevel: 200}})
		wantReasons(t, ts, ReasonRestored)
		checkInvariants(t, h.e)
		if d, _ := h.e.NextDeadline(); !d.Equal(t0.Add(10 * time.Minute)) {
			t.Fatalf("deadline %v, want now+maxPenalty", d)
		}
		if lvl := h.e.eps.at(0).level; lvl != 5 { // 30s·2⁵ = 16m ≥ 10m
			t.Fatalf("level %d, want 5", lvl)
		}
	})
	t.Run("restoring every endpoint ejected fails open", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(7, st, 0)
		ts, _ := h.e.Restore([]Record{{Service: 7, Endpoint: 0, State: Ejected, Penalty: time.Second, ProbationAt: t0.Add(time.Second)}})
		wantReasons(t, ts, ReasonRestored, ReasonFailOpenStart)
		checkInvariants(t, h.e)
		// Restoring it ready again ends it.
		ts, _ = h.e.Restore([]Record{{Service: 7, Endpoint: 0, State: Ready}})
		wantReasons(t, ts, ReasonRestored, ReasonFailOpenEnd)
		checkInvariants(t, h.e)
	})
}

func TestSnapshot(t *testing.T) {
	h := newHarness(t, nil)
	h.set(2, testSettings(), 5, 4)
	h.set(1, testSettings(func(s *Settings) { s.MaxEjectionPercent = 50 }), 3, 0, 1, 2)
	h.step(time.Second)
	at := h.clk.Now()
	h.obs(Outcome{Endpoint: 0, Kind: KindTimeout, At: at})
	h.obs(Outcome{Endpoint: 0, Kind: KindTimeout, At: at})
	h.obs(Outcome{Endpoint: 0, Kind: KindReset, At: at})
	h.obs(succ(1))
	snap := h.e.Snapshot()
	if len(snap) != 2 || snap[0].ID != 1 || snap[1].ID != 2 {
		t.Fatalf("services %+v", snap)
	}
	s := snap[0]
	if s.Ready != 3 || s.Ejected != 1 || s.Probation != 0 || s.EjectionCap != 2 || s.FailOpen {
		t.Fatalf("service %+v", s)
	}
	var ids []uint32
	for _, ep := range s.Endpoints {
		ids = append(ids, ep.ID)
	}
	if !slices.Equal(ids, []uint32{0, 1, 2, 3}) {
		t.Fatalf("endpoint order %v", ids)
	}
	ep := s.Endpoints[0]
	want := EndpointSnapshot{
		ID: 0, State: Ejected, ConsecutiveFailures: 3, Penalty: time.Second,
		EjectedAt: at, ProbationAt: at.Add(time.Second), LastFailureKind: KindReset, LastFailureAt: at,
		Counters: Counters{Failures: KindCounts{Timeout: 2, Reset: 1}, Ejections: 1, EjectionsBy: EjectionCounts{ConsecutiveFailures: 1}},
	}
	if ep != want {
		t.Fatalf("endpoint\n got %+v\nwant %+v", ep, want)
	}
	if s.Endpoints[1].Counters.Successes != 1 {
		t.Fatal("success not counted")
	}
	if _, err := json.Marshal(snap); err != nil {
		t.Fatal(err)
	}
}

func TestTransitionString(t *testing.T) {
	tests := []struct {
		tr   Transition
		want string
	}{
		{Transition{Service: 3, Endpoint: 7, From: Ready, To: Ejected, Reason: ReasonConsecutiveFailures, Kind: KindRefused, Failures: 7, Penalty: 1200 * time.Millisecond},
			"svc 3 ep 7: ready → ejected (7 consecutive failures (refused), penalty 1.2s)"},
		{Transition{Service: 3, Endpoint: 7, From: Probation, To: Ejected, Reason: ReasonProbeFailed, Kind: KindTimeout, Penalty: 2 * time.Second},
			"svc 3 ep 7: probation → ejected (probe failed (timeout), penalty 2s)"},
		{Transition{Service: 3, Endpoint: 7, From: Probation, To: Ready, Reason: ReasonProbeSucceeded},
			"svc 3 ep 7: probation → ready (probe-succeeded)"},
		{Transition{Service: 3, Endpoint: 7, Reason: ReasonEjectionSuppressed, Kind: KindReset, Failures: 7},
			"svc 3 ep 7: ready → ready (ejection suppressed: max-ejection-percent (7 consecutive failures (reset)))"},
		{Transition{Service: 3, Endpoint: 7, From: Probation, To: Probation, Reason: ReasonProbeInconclusive, Kind: KindResetAfterData},
			"svc 3 ep 7: probation → probation (probe inconclusive (reset-after-data does not count))"},
		{Transition{Service: 3, Endpoint: NoEndpoint, Reason: ReasonFailOpenStart}, "svc 3: fail-open started (no endpoint ready)"},
		{Transition{Service: 3, Reason: ReasonFailOpenEnd}, "svc 3: fail-open ended"},
	}
	for _, tc := range tests {
		if got := tc.tr.String(); got != tc.want {
			t.Errorf("got  %q\nwant %q", got, tc.want)
		}
	}
}

// TestObserveNoAlloc pins the hot-path promise: no allocation per outcome
// when nothing changes state, and none either when transitions fit the
// reused buffer.
func TestObserveNoAlloc(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, testSettings(func(s *Settings) { s.MaxFailures = 7 }), 0, 1, 2, 3)
	os := []Outcome{fail(0, KindRefused), succ(0), fail(1, KindTimeout), fail(2, KindResetAfterData), succ(3), fail(99, KindRefused)}
	i := 0
	if n := testing.AllocsPerRun(1000, func() {
		h.e.Observe(os[i%len(os)])
		i++
	}); n != 0 {
		t.Fatalf("%v allocations per Observe", n)
	}
	// Transition path: single-endpoint fail-open cycle.
	h.set(2, testSettings(func(s *Settings) { s.MaxFailures = 1 }), 50)
	cycle := []Outcome{fail(50, KindRefused), succ(50)}
	i = 0
	if n := testing.AllocsPerRun(1000, func() {
		if len(h.e.Observe(cycle[i%2])) != 2 {
			t.Fatal("expected two transitions")
		}
		i++
	}); n != 0 {
		t.Fatalf("%v allocations per transitioning Observe", n)
	}
}

// TestConcurrentReaders runs the read-only methods against a mutating
// goroutine; meaningful under -race.
func TestConcurrentReaders(t *testing.T) {
	h := newHarness(t, pcg(3))
	h.set(1, testSettings(func(s *Settings) { s.MaxFailures = 1 }), 0, 1, 2, 3)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 2000 {
			ep := uint32(i % 4)
			if i%3 == 0 {
				h.e.Observe(succ(ep))
			} else {
				h.e.Observe(fail(ep, KindRefused))
			}
			h.e.Advance()
		}
	}()
	for {
		select {
		case <-done:
			return
		default:
			h.e.Snapshot()
			h.e.Export()
			h.e.Admitted(1)
			h.e.NextDeadline()
			h.e.UnknownOutcomes()
		}
	}
}

// TestPenaltyJitterNoOverflow: settings that bypassed Validate (the
// engine clamps, it does not fail) with a penalty of the largest Duration
// and jitter: a draw above the base used to wrap negative, so the endpoint
// came back at once. It stays positive and within the clamped cap.
func TestPenaltyJitterNoOverflow(t *testing.T) {
	for _, r := range []float64{0.999999, 0, 0.5} {
		h := newHarness(t, func() float64 { return r })
		h.set(1, testSettings(func(s *Settings) {
			s.MinPenalty, s.MaxPenalty, s.JitterRatio, s.MaxFailures = time.Duration(math.MaxInt64), time.Duration(math.MaxInt64), 0.5, 1
		}), 0, 1)
		tr := h.eject(0, 1)
		if tr.Penalty <= 0 || tr.Penalty > MaxPenaltyLimit*3/2 {
			t.Fatalf("rnd %v: penalty %v, want within (0, %v]", r, tr.Penalty, MaxPenaltyLimit*3/2)
		}
		if !tr.ProbationAt.After(h.clk.Now()) {
			t.Fatalf("rnd %v: probation at %v, not after now", r, tr.ProbationAt)
		}
	}
}

// TestRestoreClampsPenalty: a record's penalty (read back from disk) that
// is negative or huge is clamped like its probation time, so the ejected-at
// time derived from it cannot wrap.
func TestRestoreClampsPenalty(t *testing.T) {
	for _, p := range []time.Duration{math.MinInt64, -time.Second, math.MaxInt64} {
		h := newHarness(t, nil)
		h.set(7, testSettings(), 0, 1)
		ts, _ := h.e.Restore([]Record{{Service: 7, Endpoint: 0, State: Ejected, Penalty: p, ProbationAt: t0.Add(time.Second)}})
		wantReasons(t, ts, ReasonRestored)
		checkInvariants(t, h.e)
		ep := h.e.eps.at(0).seen()
		if ep.penalty < 0 || ep.penalty > time.Minute {
			t.Fatalf("restored penalty %v from %v, want within [0, maxPenalty]", ep.penalty, p)
		}
		if ep.ejectedAt.After(ep.probationAt) || ep.probationAt.Sub(ep.ejectedAt) > time.Minute {
			t.Fatalf("restored penalty %v: ejected at %v, probation at %v", p, ep.ejectedAt, ep.probationAt)
		}
	}
}

// Services with the same settings share one copy; a change to one
// service's settings is its own.
func TestSettingsSharedAndOwn(t *testing.T) {
	h := newHarness(t, nil)
	a, b := testSettings(), testSettings(func(s *Settings) { s.MaxFailures = 5 })
	h.set(1, a, 1)
	h.set(2, a, 2)
	if h.e.svcs[1].st != h.e.svcs[2].st {
		t.Error("two services with the same settings hold a copy each")
	}
	h.set(3, b, 3)
	h.set(1, b, 1) // 1 changes; 2 keeps a
	h.set(4, a, 4)
	for id, want := range map[uint32]Settings{1: b, 2: a, 3: b, 4: a} {
		if got := *h.e.svcs[id].st; got != sanitize(want) {
			t.Errorf("service %d: MaxFailures %d, want %d", id, got.MaxFailures, want.MaxFailures)
		}
	}
	// Service 2 still judges on its own settings: three failures eject.
	h.fails(2, 2, KindRefused)
	h.wantState(2, Ready)
	h.fails(2, 1, KindRefused)
	h.wantState(2, Ejected)
}
