// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"strings"
	"testing"
	"time"
)

// rateSettings: failure-rate mode, 10 s window, 5 calls, threshold 0.2.
func rateSettings(mut ...func(*Settings)) Settings {
	return testSettings(append([]func(*Settings){func(s *Settings) { s.Mode = ModeFailureRate }}, mut...)...)
}

// play observes a pattern on ep, one outcome every step: r refused, s
// success, S slow success (handshake 100ms). It returns every transition.
func (h *harness) play(ep uint32, pattern string, step time.Duration) []Transition {
	h.t.Helper()
	var all []Transition
	for _, c := range pattern {
		var o Outcome
		switch c {
		case 'r':
			o = fail(ep, KindRefused)
		case 's':
			o = succ(ep)
		case 'S':
			o = succ(ep)
			o.Handshake = 100 * time.Millisecond
		default:
			h.t.Fatalf("bad pattern %q", pattern)
		}
		all = append(all, h.obs(o)...)
		h.step(step)
	}
	return all
}

func ejections(ts []Transition) []Transition {
	var out []Transition
	for _, t := range ts {
		if t.To == Ejected && t.From != Ejected {
			out = append(out, t)
		}
	}
	return out
}

// The endpoint that fails 30% of its connections: consecutive accrual
// never sees 3 in a row; the failure-rate rule ejects it once the window
// holds MinCalls connections.
func TestFailureRateEjectsWhatConsecutiveMisses(t *testing.T) {
	pattern := strings.Repeat("rssrsssrss", 3) // 30%, never two in a row
	for _, tc := range []struct {
		mode  Mode
		eject bool
	}{{ModeConsecutive, false}, {ModeFailureRate, true}, {ModeUnified, true}, {ModeNone, false}} {
		t.Run(string(tc.mode), func(t *testing.T) {
			h := newHarness(t, nil)
			h.set(1, rateSettings(func(s *Settings) { s.Mode = tc.mode }), 1, 2)
			ej := ejections(h.play(1, pattern, 10*time.Millisecond))
			if !tc.eject {
				if len(ej) != 0 {
					t.Fatalf("ejected: %v", ej)
				}
				return
			}
			if len(ej) != 1 || ej[0].Reason != ReasonFailureRate {
				t.Fatalf("ejections %v, want one for failure-rate", ej)
			}
			// "rssrs": the 5th call makes 2 of 5 = 0.4 > 0.2.
			if w := ej[0].Window; w.Calls != 5 || w.Failures != 2 || ej[0].Threshold != 0.2 {
				t.Fatalf("ejected on %+v against %v, want 2 of 5 against 0.2", w, ej[0].Threshold)
			}
			if c := h.counters(1); c.EjectionsBy.FailureRate != 1 || c.Ejections != 1 {
				t.Fatalf("counters %+v", c)
			}
		})
	}
}

func TestFailureRateThresholdAndMinCalls(t *testing.T) {
	for _, tc := range []struct {
		name     string
		minCalls int
		pattern  string
		ejectAt  int // 1-based outcome that ejects, 0: none
	}{
		{"1 of 5 is not above 0.2", 5, "rssss", 0},
		{"2 of 5 is", 5, "rsssr", 5},
		{"below min calls nothing is judged", 5, "rrrr", 0},
		{"the min-th call judges", 5, "rrrrr", 5},
		{"1 of 1 with min 1", 1, "r", 1},
		{"2 of 7 is", 5, "rsssssr", 7},
		{"1 of 6 is not", 5, "srssss", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.set(1, rateSettings(func(s *Settings) { s.MinCalls = tc.minCalls; s.MaxFailures = 100 }), 1, 2)
			at := 0
			for i, c := range tc.pattern {
				o := succ(1)
				if c == 'r' {
					o = fail(1, KindRefused)
				}
				if len(ejections(h.obs(o))) > 0 && at == 0 {
					at = i + 1
				}
			}
			if at != tc.ejectAt {
				t.Fatalf("ejected at outcome %d, want %d", at, tc.ejectAt)
			}
		})
	}
}

func TestTimeWindowForgets(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, rateSettings(), 1, 2)
	// Two failures, then a quiet 10 s: they leave the window.
	h.play(1, "rr", 100*time.Millisecond)
	h.step(10 * time.Second)
	if ej := ejections(h.play(1, "sss", 100*time.Millisecond)); len(ej) != 0 {
		t.Fatalf("ejected on failures older than the window: %v", ej)
	}
	if w := h.snap(1).Window; w == nil || w.Calls != 3 || w.Failures != 0 {
		t.Fatalf("window %+v, want 3 calls, no failure", w)
	}
	// A bucket at a time: a failure 5 s ago is still in, one 10 s ago not.
	h2 := newHarness(t, nil)
	h2.set(1, rateSettings(), 1, 2)
	h2.play(1, "r", 5*time.Second)
	h2.play(1, "sss", 0)
	if w := h2.snap(1).Window; w.Calls != 4 || w.Failures != 1 {
		t.Fatalf("window %+v, want the failure 5 s ago still in", w)
	}
	h2.step(5 * time.Second)
	if w := h2.snap(1).Window; w.Calls != 3 || w.Failures != 0 {
		t.Fatalf("window %+v, want the failure 10 s ago gone", w)
	}
}

func TestCountWindow(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, rateSettings(func(s *Settings) { s.WindowCalls = 20; s.FailureRateThreshold = 0.3 }), 1, 2)
	// Exactly the last 20 connections. 3 failures among 20, never above
	// 0.3 on the way; time does not age a count window.
	h.play(1, "rsssssrsssssrsssssss", time.Second)
	h.step(time.Hour)
	if w := h.snap(1).Window; w.Calls != 20 || w.Failures != 3 {
		t.Fatalf("window %+v, want 20 calls, 3 failures", w)
	}
	// The next call pushes out the oldest, a failure.
	h.play(1, "s", 0)
	if w := h.snap(1).Window; w.Calls != 20 || w.Failures != 2 {
		t.Fatalf("window %+v, want the oldest connection gone", w)
	}
	// Each failure now pushes out a success: 3, 4, 5, 6 of 20 (0.3 is not
	// above 0.3), then 7 of 20.
	ej := ejections(h.play(1, "rrrrr", 0))
	if len(ej) != 1 || ej[0].Reason != ReasonFailureRate || ej[0].Window.Calls != 20 || ej[0].Window.Failures != 7 {
		t.Fatalf("ejections %v", ej)
	}
	// A window smaller than its buckets' count is exact too: the last 5.
	h2 := newHarness(t, nil)
	h2.set(1, rateSettings(func(s *Settings) { s.WindowCalls, s.MinCalls = 5, 5 }), 1, 2)
	ej = ejections(h2.play(1, "ssssssssrr", 0)) // the last 5 hold 2 failures: 0.4
	if len(ej) != 1 || ej[0].Window.Calls != 5 || ej[0].Window.Failures != 2 {
		t.Fatalf("ejections %v, want one on 2 of the last 5", ej)
	}
}

func TestSlowConnects(t *testing.T) {
	slow := func(s *Settings) {
		s.Mode = ModeConsecutive
		s.SlowConnectThreshold = 50 * time.Millisecond
	}
	t.Run("a slow share above the threshold ejects", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(slow), 1, 2)
		// 2 of 4 slow: not judged below 5 calls; 3 of 5 is above 0.5.
		ej := ejections(h.play(1, "SsSsS", time.Millisecond))
		if len(ej) != 1 || ej[0].Reason != ReasonSlowConnects || ej[0].Window.Slow != 3 || ej[0].Threshold != 0.5 {
			t.Fatalf("ejections %v", ej)
		}
		if c := h.counters(1); c.SlowConnects != 3 || c.Successes != 5 || c.EjectionsBy.SlowConnects != 1 {
			t.Fatalf("counters %+v", c)
		}
	})
	t.Run("a slow connect is a success for the streak", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(slow), 1, 2)
		if ej := ejections(h.play(1, "rrSrrSrr", time.Millisecond)); len(ej) != 0 {
			t.Fatalf("ejected: %v", ej)
		}
	})
	t.Run("below the threshold is not slow", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(slow, func(s *Settings) { s.SlowConnectThreshold = 200 * time.Millisecond }), 1, 2)
		if ej := ejections(h.play(1, "SSSSSSSSSS", time.Millisecond)); len(ej) != 0 {
			t.Fatalf("ejected: %v", ej)
		}
	})
	t.Run("off by default", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(), 1, 2)
		if h.e.eps.at(1).win != nil {
			t.Fatal("a consecutive service without slow connects keeps a window")
		}
		if ej := ejections(h.play(1, "SSSSSSSSSS", time.Millisecond)); len(ej) != 0 {
			t.Fatalf("ejected: %v", ej)
		}
	})
}

// A probe is judged alone, and an endpoint back from probation starts with
// an empty window: the failures that ejected it are not held against it
// twice.
func TestWindowAndProbation(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, rateSettings(), 1, 2)
	if ej := ejections(h.play(1, "rsrsr", time.Millisecond)); len(ej) != 1 {
		t.Fatalf("ejections %v", ej)
	}
	// Stragglers while ejected are not window calls.
	h.play(1, "rrrr", time.Millisecond)
	h.toProbation(1)
	wantReasons(t, h.obs(probeOK(1)), ReasonProbeSucceeded)
	if w := h.snap(1).Window; w.Calls != 0 {
		t.Fatalf("window after return %+v, want empty", w)
	}
	// One failure after return is 1 of 1, below min calls: still in.
	if ej := ejections(h.play(1, "rssss", time.Millisecond)); len(ej) != 0 {
		t.Fatalf("ejected again at once: %v", ej)
	}
	// Ejected again within a window of its return: a relapse, the penalty
	// doubles although its probe succeeded.
	ts := ejections(h.play(1, "r", time.Millisecond)) // 2 of 6
	if len(ts) != 1 || ts[0].Penalty != 2*time.Second {
		t.Fatalf("relapse %v, want one ejection with a 2s penalty", ts)
	}
	// A failed probe doubles it again, as for streaks.
	h.toProbation(1)
	tr := h.obs(probeFail(1, KindRefused))
	wantReasons(t, tr, ReasonProbeFailed)
	if tr[0].Penalty != 4*time.Second {
		t.Fatalf("penalty after a failed probe %v, want 4s", tr[0].Penalty)
	}
	// Ready for longer than a window after its return: forgiven, the next
	// ejection starts from minPenalty.
	h.toProbation(1)
	h.obs(probeOK(1))
	h.step(11 * time.Second)
	ts = ejections(h.play(1, "rrrrr", time.Millisecond))
	if len(ts) != 1 || ts[0].Penalty != time.Second {
		t.Fatalf("ejection after a window of health %v, want a 1s penalty", ts)
	}
}

func TestWindowRulesAndEjectionCap(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, rateSettings(func(s *Settings) { s.MaxEjectionPercent = 50 }), 1, 2, 3, 4)
	h.play(1, "rrrrr", time.Millisecond)
	h.wantState(1, Ejected)
	h.play(2, "rrrrr", time.Millisecond)
	h.wantState(2, Ejected)
	// The cap (2 of 4) is full: endpoint 3's due ejection is suppressed
	// once, however many due outcomes follow, successes included.
	ts := h.play(3, "rrrrrsrsr", time.Millisecond)
	wantReasons(t, ts, ReasonEjectionSuppressed)
	if ts[0].Cause != ReasonFailureRate || !strings.Contains(ts[0].String(), "failure-rate") {
		t.Fatalf("suppression %+v (%v), want its cause", ts[0], ts[0])
	}
	if c := h.counters(3); c.SuppressedEjections != 1 {
		t.Fatalf("suppressed %d, want 1", c.SuppressedEjections)
	}
	// Room again: the next due outcome ejects.
	h.toProbation(1)
	h.obs(probeOK(1))
	h.play(3, "r", time.Millisecond)
	h.wantState(3, Ejected)
}

func TestUnifiedTripsOnEither(t *testing.T) {
	h := newHarness(t, nil)
	// A streak of 3 before the window holds 5.
	h.set(1, rateSettings(func(s *Settings) { s.Mode = ModeUnified }), 1, 2)
	ej := ejections(h.play(1, "rrr", time.Millisecond))
	if len(ej) != 1 || ej[0].Reason != ReasonConsecutiveFailures {
		t.Fatalf("ejections %v, want the streak", ej)
	}
	h2 := newHarness(t, nil)
	h2.set(1, rateSettings(func(s *Settings) { s.Mode = ModeUnified }), 1, 2)
	ej = ejections(h2.play(1, "rsrsrs", time.Millisecond))
	if len(ej) != 1 || ej[0].Reason != ReasonFailureRate {
		t.Fatalf("ejections %v, want the rate", ej)
	}
}

// outlierSettings: consecutive mode with the outlier rule; 5 hosts of 100
// calls, factor 1.9.
func outlierSettings() Settings {
	return testSettings(func(s *Settings) { s.MaxFailures = 1000; s.Outliers = true })
}

// feed gives each endpoint n calls of which the given share fails, spread
// evenly.
func (h *harness) feed(n int, failShare map[uint32]float64) {
	h.t.Helper()
	for i := range n {
		for ep, share := range failShare {
			o := succ(ep)
			if int(float64(i+1)*share) > int(float64(i)*share) {
				o = fail(ep, KindRefused)
			}
			h.obs(o)
		}
	}
}

func TestOutliers(t *testing.T) {
	// With n hosts one outlier among equals is at most √(n−1) deviations
	// from the mean: six hosts leave room above the factor 1.9.
	six := []uint32{1, 2, 3, 4, 5, 6}
	for _, tc := range []struct {
		name  string
		calls int
		share map[uint32]float64
		hosts []uint32
		want  []uint32
	}{
		{"one much worse than its peers", 100, map[uint32]float64{1: 0.5, 2: 0, 3: 0.01, 4: 0, 5: 0.01, 6: 0}, six, []uint32{1}},
		{"all degraded together", 100, map[uint32]float64{1: 0.3, 2: 0.3, 3: 0.3, 4: 0.3, 5: 0.3, 6: 0.3}, six, nil},
		{"too few hosts with volume", 100, map[uint32]float64{1: 0.5, 2: 0, 3: 0, 4: 0}, six, nil},
		{"too little volume", 99, map[uint32]float64{1: 0.5, 2: 0, 3: 0, 4: 0, 5: 0, 6: 0}, six, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.set(1, outlierSettings(), tc.hosts...)
			next, ok := h.e.NextDeadline()
			if !ok || !next.Equal(t0.Add(time.Second)) {
				t.Fatalf("next deadline %v %v, want the first judgement a bucket from now", next, ok)
			}
			h.feed(tc.calls, tc.share)
			if ts := h.advance(); len(ts) != 0 {
				t.Fatalf("judged before its time: %v", ts)
			}
			h.step(time.Second)
			var got []uint32
			for _, tr := range h.advance() {
				if tr.Reason != ReasonOutlier {
					t.Fatalf("transition %v", tr)
				}
				got = append(got, tr.Endpoint)
				if !strings.Contains(tr.String(), "among peers") {
					t.Fatalf("String() %q", tr.String())
				}
			}
			if len(got) != len(tc.want) || (len(got) == 1 && got[0] != tc.want[0]) {
				t.Fatalf("ejected %v, want %v", got, tc.want)
			}
			if next, _ := h.e.NextDeadline(); !next.Equal(t0.Add(2 * time.Second)) {
				t.Fatalf("next judgement %v", next)
			}
		})
	}
	t.Run("off: no schedule", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, testSettings(), six...)
		if _, ok := h.e.NextDeadline(); ok {
			t.Fatal("a deadline without outliers or ejections")
		}
		h.set(1, outlierSettings(), six...)
		if _, ok := h.e.NextDeadline(); !ok {
			t.Fatal("no deadline after turning outliers on")
		}
		h.e.RemoveService(1)
		if _, ok := h.e.NextDeadline(); ok {
			t.Fatal("a removed service is still judged")
		}
	})
}

func TestWindowFollowsSettings(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, testSettings(), 1, 2)
	if h.e.eps.at(1).win != nil {
		t.Fatal("window without a window rule")
	}
	h.set(1, rateSettings(), 1, 2)
	h.play(1, "rss", time.Millisecond)
	if w := h.snap(1).Window; w == nil || w.Calls != 3 {
		t.Fatalf("window %+v", w)
	}
	// Same shape, other threshold: the window is kept.
	h.set(1, rateSettings(func(s *Settings) { s.FailureRateThreshold = 0.5 }), 1, 2)
	if w := h.snap(1).Window; w.Calls != 3 {
		t.Fatalf("window %+v after a threshold change, want kept", w)
	}
	// Another length: gathered under other rules, it starts again.
	h.set(1, rateSettings(func(s *Settings) { s.Window = time.Minute }), 1, 2)
	if w := h.snap(1).Window; w.Calls != 0 {
		t.Fatalf("window %+v after a length change, want empty", w)
	}
	h.set(1, rateSettings(func(s *Settings) { s.Mode = ModeNone }), 1, 2)
	if h.e.eps.at(1).win != nil {
		t.Fatal("window in mode none")
	}
}

func TestWindowNoAlloc(t *testing.T) {
	h := newHarness(t, nil)
	h.set(1, rateSettings(func(s *Settings) { s.FailureRateThreshold = 0.9 }), 1, 2)
	o := succ(1)
	o.At = t0
	if n := testing.AllocsPerRun(1000, func() {
		o.At = o.At.Add(time.Millisecond)
		h.e.Observe(o)
	}); n != 0 {
		t.Fatalf("Observe with a window allocates %v times", n)
	}
}

// snap returns endpoint ep's snapshot.
func (h *harness) snap(ep uint32) EndpointSnapshot {
	h.t.Helper()
	for _, s := range h.e.Snapshot() {
		for _, e := range s.Endpoints {
			if e.ID == ep {
				return e
			}
		}
	}
	h.t.Fatalf("no endpoint %d", ep)
	return EndpointSnapshot{}
}

// Review findings, each a scenario that once went wrong.
func TestWindowEdges(t *testing.T) {
	t.Run("the threshold stays on an ejection that starts fail-open", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, rateSettings(), 1)
		ts := h.play(1, "rsrsr", time.Millisecond)
		wantReasons(t, ts, ReasonFailureRate, ReasonFailOpenStart)
		if ts[0].Threshold != 0.2 || ts[1].Threshold != 0 {
			t.Fatalf("thresholds %v and %v, want 0.2 on the ejection only", ts[0].Threshold, ts[1].Threshold)
		}
	})
	t.Run("an outlier's suppression is reported once per spell", func(t *testing.T) {
		h := newHarness(t, nil)
		st := outlierSettings()
		st.MaxEjectionPercent = 10 // 6 hosts: none may go
		h.set(1, st, 1, 2, 3, 4, 5, 6)
		share := map[uint32]float64{1: 0.5, 2: 0, 3: 0, 4: 0, 5: 0, 6: 0}
		var all []Transition
		for range 5 {
			h.feed(20, share) // successes among them, as real traffic has
			h.step(time.Second)
			all = append(all, h.advance()...)
		}
		h.feed(100, share)
		h.step(time.Second)
		all = append(all, h.advance()...)
		wantReasons(t, all, ReasonEjectionSuppressed)
		if all[0].Cause != ReasonOutlier || h.counters(1).SuppressedEjections != 1 {
			t.Fatalf("suppression %+v, counters %+v", all[0], h.counters(1))
		}
	})
	t.Run("a return through fail-open is no relapse of an older probe", func(t *testing.T) {
		h := newHarness(t, nil)
		h.set(1, rateSettings(func(s *Settings) { s.Mode = ModeUnified }), 1)
		h.play(1, "rrr", time.Millisecond) // the streak ejects; fail-open
		h.toProbation(1)
		h.obs(probeFail(1, KindRefused)) // level 1
		h.toProbation(1)
		h.obs(probeOK(1)) // returned at level 1
		h.play(1, "rrr", time.Millisecond)
		h.wantState(1, Ejected)
		h.obs(succ(1)) // back through fail-open, level 0
		h.wantState(1, Ready)
		ej := ejections(h.play(1, "rsrsr", time.Millisecond))
		if len(ej) != 1 || ej[0].Reason != ReasonFailureRate || ej[0].Penalty != time.Second {
			t.Fatalf("ejections %v, want a failure-rate ejection with the 1s minimum", ej)
		}
	})
}
