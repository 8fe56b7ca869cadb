// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"math/bits"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"
)

var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// testSettings are deterministic defaults for tests: no jitter, 3 failures,
// 1s..1m, every endpoint ejectable.
func testSettings(mut ...func(*Settings)) Settings {
	s := Defaults()
	s.MaxFailures = 3
	s.JitterRatio = 0
	s.MinPenalty = time.Second
	s.MaxPenalty = time.Minute
	s.MaxEjectionPercent = 100
	for _, m := range mut {
		m(&s)
	}
	return s
}

type harness struct {
	t   *testing.T
	clk *testingclock.FakePassiveClock
	e   *Engine
}

func newHarness(t *testing.T, rnd func() float64) *harness {
	t.Helper()
	if rnd == nil {
		rnd = func() float64 { return 0.5 }
	}
	clk := testingclock.NewFakePassiveClock(t0)
	return &harness{t: t, clk: clk, e: New(clk, rnd)}
}

// own copies a result out of the engine's reused buffer.
func own(ts []Transition) []Transition { return slices.Clone(ts) }

func (h *harness) set(id uint32, st Settings, eps ...uint32) []Transition {
	h.t.Helper()
	ts := own(h.e.SetService(id, "svc", st, eps))
	checkInvariants(h.t, h.e)
	return ts
}

func (h *harness) obs(o Outcome) []Transition {
	h.t.Helper()
	ts := own(h.e.Observe(o))
	checkInvariants(h.t, h.e)
	return ts
}

func (h *harness) advance() []Transition {
	h.t.Helper()
	ts := own(h.e.Advance())
	checkInvariants(h.t, h.e)
	return ts
}

// step moves the fake clock forward by d.
func (h *harness) step(d time.Duration) { h.clk.SetTime(h.clk.Now().Add(d)) }

// fails observes n counted failures of kind k on ep and returns all
// transitions.
func (h *harness) fails(ep uint32, n int, k Kind) []Transition {
	h.t.Helper()
	var all []Transition
	for range n {
		all = append(all, h.obs(fail(ep, k))...)
	}
	return all
}

func (h *harness) state(ep uint32) State { return h.e.eps.at(ep).state }

func (h *harness) wantState(ep uint32, want State) {
	h.t.Helper()
	if got := h.state(ep); got != want {
		h.t.Fatalf("endpoint %d: state %v, want %v", ep, got, want)
	}
}

func (h *harness) counters(ep uint32) Counters { return h.e.eps.at(ep).seen().c.export() }

// eject drives ep (in a service with MaxFailures n) to ejected.
func (h *harness) eject(ep uint32, n int) Transition {
	h.t.Helper()
	ts := h.fails(ep, n, KindRefused)
	for _, tr := range ts {
		if tr.Endpoint == ep && tr.To == Ejected {
			return tr
		}
	}
	h.t.Fatalf("endpoint %d not ejected after %d failures: %v", ep, n, ts)
	return Transition{}
}

// toProbation moves the clock to ep's probation time and advances.
func (h *harness) toProbation(ep uint32) {
	h.t.Helper()
	h.clk.SetTime(h.e.eps.at(ep).seen().probationAt)
	h.advance()
	h.wantState(ep, Probation)
}

func fail(ep uint32, k Kind) Outcome { return Outcome{Endpoint: ep, Kind: k} }
func succ(ep uint32) Outcome         { return Outcome{Endpoint: ep, Success: true} }
func probeOK(ep uint32) Outcome      { return Outcome{Endpoint: ep, Success: true, Probe: true} }
func probeFail(ep uint32, k Kind) Outcome {
	return Outcome{Endpoint: ep, Kind: k, Probe: true}
}

// reasons lists the transitions' reasons for compact comparisons.
func reasons(ts []Transition) []Reason {
	var out []Reason
	for _, t := range ts {
		out = append(out, t.Reason)
	}
	return out
}

func wantReasons(t *testing.T, ts []Transition, want ...Reason) {
	t.Helper()
	if got := reasons(ts); !slices.Equal(got, want) {
		t.Fatalf("reasons %v, want %v\n%v", got, want, ts)
	}
}

// checkInvariants verifies the engine's internal bookkeeping: per-service
// state counts, the deadline heap holding exactly the ejected endpoints in
// heap order, fail-open flags, and the ready-means-no-penalty rule.
func checkInvariants(t *testing.T, e *Engine) {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	ejected := 0
	for _, s := range e.svcs {
		var count [numStates]int
		if !slices.IsSorted(s.members) || len(slices.Compact(slices.Clone(s.members))) != len(s.members) {
			t.Fatalf("svc %d: members not sorted/unique: %v", s.id, s.members)
		}
		for _, id := range s.members {
			ep := e.eps.at(uint32(id))
			if ep.svc != s {
				t.Fatalf("svc %d member %d points to another service", s.id, id)
			}
			count[ep.state]++
			if ep.state == Ejected {
				ejected++
				if ep.heapIdx < 0 || int(ep.heapIdx) >= len(e.heap) || e.heap[ep.heapIdx] != id {
					t.Fatalf("ejected endpoint %d not at its heap index %d", id, ep.heapIdx)
				}
			} else if ep.heapIdx != -1 {
				t.Fatalf("%v endpoint %d has heap index %d", ep.state, id, ep.heapIdx)
			}
			if ep.state == Ready && (ep.level != 0 || ep.seen().penalty != 0) {
				t.Fatalf("ready endpoint %d has level %d penalty %v", id, ep.level, ep.seen().penalty)
			}
			if ep.state != Ready && ep.act == nil {
				t.Fatalf("%v endpoint %d has no activity (its penalty times)", ep.state, id)
			}
			if (ep.win != nil) != s.st.Windowed() {
				t.Fatalf("endpoint %d: window %v, settings judge one: %v", id, ep.win != nil, s.st.Windowed())
			}
			if w := ep.win; w != nil {
				var sum tally
				for _, b := range w.b {
					sum.calls += b.calls
					sum.failures += b.failures
					sum.slow += b.slow
				}
				if s.st.WindowCalls > 0 {
					sum = tally{calls: w.held}
					for i := range w.failed {
						sum.failures += uint32(bits.OnesCount64(w.failed[i]))
						sum.slow += uint32(bits.OnesCount64(w.slowed[i]))
					}
				}
				if sum != w.sum || sum.failures+sum.slow > sum.calls {
					t.Fatalf("endpoint %d: window sum %+v, buckets add up to %+v", id, w.sum, sum)
				}
				if ep.state != Ready && sum.calls != 0 {
					t.Fatalf("%v endpoint %d has a window of %d calls", ep.state, id, sum.calls)
				}
			}
		}
		if count != s.count {
			t.Fatalf("svc %d: counts %v, recount %v", s.id, s.count, count)
		}
		if want := len(s.members) > 0 && count[Ready] == 0; s.failOpen != want {
			t.Fatalf("svc %d: failOpen %v, want %v (counts %v)", s.id, s.failOpen, want, count)
		}
	}
	if idle != (activity{}) {
		t.Fatalf("the shared idle activity was written: %+v", idle)
	}
	if ejected != len(e.heap) {
		t.Fatalf("heap has %d entries, %d endpoints ejected", len(e.heap), ejected)
	}
	for i := 1; i < len(e.heap); i++ {
		if e.heapLess(i, (i-1)/2) {
			t.Fatalf("heap order violated at %d", i)
		}
	}
	for id := range e.eps.len() {
		if ep := e.eps.at(uint32(id)); ep.svc != nil && !slices.Contains(ep.svc.members, uint32(id)) {
			t.Fatalf("endpoint %d claims svc %d but is not a member", id, ep.svc.id)
		}
	}
}

// seqRand is a deterministic source that returns vals in turn.
func seqRand(vals ...float64) func() float64 {
	i := 0
	return func() float64 {
		v := vals[i%len(vals)]
		i++
		return v
	}
}

func pcg(seed uint64) func() float64 {
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)).Float64
}
