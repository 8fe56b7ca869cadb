// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"
)

// model replays transitions. If the engine changed a state without
// reporting it, or reported a change twice, the model and the engine part
// ways and the test says where.
type model struct {
	t        *testing.T
	svcOf    map[uint32]uint32 // endpoint → service
	state    map[uint32]State
	failOpen map[uint32]bool
	// what SetService was last given, to rebuild an engine after a "restart"
	settings map[uint32]Settings
	members  map[uint32][]uint32
	seen     map[Reason]int // reasons replayed, to show the run reached them
}

func newModel(t *testing.T) *model {
	return &model{t: t, svcOf: map[uint32]uint32{}, state: map[uint32]State{}, failOpen: map[uint32]bool{},
		settings: map[uint32]Settings{}, members: map[uint32][]uint32{}, seen: map[Reason]int{}}
}

func (m *model) clone() *model {
	c := newModel(m.t)
	for k, v := range m.settings {
		c.settings[k] = v
	}
	for k, v := range m.members {
		c.members[k] = slices.Clone(v)
	}
	return c
}

// setService mirrors SetService's membership effects (not its transitions).
func (m *model) setService(id uint32, st Settings, eps []uint32) {
	want := map[uint32]bool{}
	for _, ep := range eps {
		want[ep] = true
	}
	for ep, s := range m.svcOf {
		if s == id && !want[ep] {
			delete(m.svcOf, ep)
			delete(m.state, ep)
		}
	}
	for ep := range want {
		if s, ok := m.svcOf[ep]; !ok || s != id {
			if ok {
				m.members[s] = slices.DeleteFunc(m.members[s], func(x uint32) bool { return x == ep })
			}
			m.svcOf[ep] = id
			m.state[ep] = Ready
		}
	}
	m.settings[id] = st
	m.members[id] = slices.Clone(eps)
}

func (m *model) removeService(id uint32) {
	for ep, s := range m.svcOf {
		if s == id {
			delete(m.svcOf, ep)
			delete(m.state, ep)
		}
	}
	delete(m.settings, id)
	delete(m.members, id)
}

func (m *model) out(svc uint32) (n, out int) {
	for ep, s := range m.svcOf {
		if s == svc {
			n++
			if m.state[ep] != Ready {
				out++
			}
		}
	}
	return n, out
}

func (m *model) apply(op string, ts []Transition) {
	m.t.Helper()
	for _, tr := range ts {
		m.seen[tr.Reason]++
		switch tr.Reason {
		case ReasonFailOpenStart, ReasonFailOpenEnd:
			start := tr.Reason == ReasonFailOpenStart
			if m.failOpen[tr.Service] == start {
				m.t.Fatalf("%s: %v while failOpen=%v", op, tr, start)
			}
			m.failOpen[tr.Service] = start
			continue
		}
		if s, ok := m.svcOf[tr.Endpoint]; !ok || s != tr.Service {
			m.t.Fatalf("%s: transition for endpoint %d of svc %d, model has svc %d (%v)", op, tr.Endpoint, tr.Service, s, ok)
		}
		if got := m.state[tr.Endpoint]; got != tr.From {
			m.t.Fatalf("%s: %v but model state is %v", op, tr, got)
		}
		if tr.Reason == ReasonConsecutiveFailures {
			n, out := m.out(tr.Service)
			if cap := EjectionCap(n, m.settings[tr.Service].MaxEjectionPercent); out+1 > cap {
				m.t.Fatalf("%s: ejection beyond cap %d with %d of %d out", op, cap, out, n)
			}
		}
		if (tr.From == tr.To) != (tr.Reason == ReasonEjectionSuppressed || tr.Reason == ReasonProbeInconclusive) {
			m.t.Fatalf("%s: %v", op, tr)
		}
		m.state[tr.Endpoint] = tr.To
	}
}

// compare checks the engine against the model, and NextDeadline and
// Admitted against the engine's endpoints.
func (m *model) compare(op string, e *Engine) {
	m.t.Helper()
	checkInvariants(m.t, e)
	for id := range e.eps.len() {
		ep := e.eps.at(uint32(id))
		want, ok := m.state[uint32(id)]
		if (ep.svc != nil) != ok {
			m.t.Fatalf("%s: endpoint %d membership: engine %v model %v", op, id, ep.svc != nil, ok)
		}
		if ok && ep.state != want {
			m.t.Fatalf("%s: endpoint %d engine %v model %v", op, id, ep.state, want)
		}
	}
	for id, s := range e.svcs {
		if s.failOpen != m.failOpen[id] {
			m.t.Fatalf("%s: svc %d failOpen engine %v model %v", op, id, s.failOpen, m.failOpen[id])
		}
		active, probation, fo := e.Admitted(id)
		var wa, wp []uint32
		for _, ep := range s.members {
			switch {
			case fo || e.eps.at(ep).state == Ready:
				wa = append(wa, ep)
			case e.eps.at(ep).state == Probation:
				wp = append(wp, ep)
			}
		}
		if !slices.Equal(active, wa) || !slices.Equal(probation, wp) {
			m.t.Fatalf("%s: svc %d admitted %v %v, want %v %v", op, id, active, probation, wa, wp)
		}
	}
	var earliest time.Time
	for id := range e.eps.len() {
		if ep := e.eps.at(uint32(id)); ep.svc != nil && ep.state == Ejected && (earliest.IsZero() || ep.seen().probationAt.Before(earliest)) {
			earliest = ep.seen().probationAt
		}
	}
	if d, ok := e.NextDeadline(); ok != !earliest.IsZero() || !d.Equal(earliest) {
		m.t.Fatalf("%s: NextDeadline %v %v, want %v", op, d, ok, earliest)
	}
}

// TestModelRandomized drives the engine with random operations and checks,
// after every one, that the transitions account for every state change
// exactly once, that ejections respect the cap, that fail-open events
// alternate, and that a restart (Export, new engine, Restore) reproduces the
// state.
func TestModelRandomized(t *testing.T) {
	seen := map[Reason]int{}
	defer func() {
		t.Logf("transitions replayed: %v", seen)
		for _, r := range []Reason{ReasonConsecutiveFailures, ReasonProbeFailed, ReasonPenaltyOver,
			ReasonProbeSucceeded, ReasonFailOpenSuccess, ReasonAccrualDisabled, ReasonRestored,
			ReasonEjectionSuppressed, ReasonProbeInconclusive, ReasonFailOpenStart, ReasonFailOpenEnd} {
			if seen[r] == 0 {
				t.Errorf("the random run never produced %s", r)
			}
		}
	}()
	for seed := range uint64(8) {
		t.Run("", func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 99))
			clk := testingclock.NewFakePassiveClock(t0)
			e := New(clk, r.Float64)
			m := newModel(t)
			defer func() {
				for r, n := range m.seen {
					seen[r] += n
				}
			}()
			const maxEP = 30
			randomSettings := func() Settings {
				return testSettings(func(s *Settings) {
					s.MaxFailures = 1 + r.IntN(4)
					s.MaxEjectionPercent = []int{0, 30, 50, 75, 100, 100}[r.IntN(6)]
					s.MinPenalty = time.Duration(1+r.IntN(3)) * time.Second
					s.MaxPenalty = s.MinPenalty * time.Duration(1+r.IntN(8))
					s.JitterRatio = []float64{0, 0.2, 0.5, 1}[r.IntN(4)]
					s.FailureKinds = Kinds(r.IntN(32)) &^ 1
					if r.IntN(5) == 0 {
						s.Mode = ModeNone
					}
				})
			}
			for i := range 10000 {
				switch p := r.IntN(100); {
				case p < 70:
					o := Outcome{Endpoint: uint32(r.IntN(maxEP + 5)), Success: r.IntN(3) == 0,
						Kind: Kind(r.IntN(6)), Probe: r.IntN(4) == 0, At: clk.Now()}
					m.apply("observe", own(e.Observe(o)))
				case p < 85:
					clk.SetTime(clk.Now().Add(time.Duration(r.IntN(4000)) * time.Millisecond))
					m.apply("advance", own(e.Advance()))
				case p < 95:
					// Mostly gentle changes (settings only, one endpoint in
					// or out) so that endpoints live long enough to go
					// through probation; sometimes a whole new set.
					id := uint32(r.IntN(3))
					st, ok := m.settings[id]
					eps := slices.Clone(m.members[id])
					switch q := r.IntN(10); {
					case !ok || q == 0:
						st, eps = randomSettings(), nil
						for range r.IntN(9) {
							eps = append(eps, uint32(r.IntN(maxEP)))
						}
					case q < 5:
						st = randomSettings()
					case q < 8:
						eps = append(eps, uint32(r.IntN(maxEP)))
					case len(eps) > 0:
						eps = slices.Delete(eps, 0, 1)
					}
					ts := own(e.SetService(id, "svc", st, eps))
					m.setService(id, sanitize(st), eps)
					m.apply("set", ts)
				case p < 97:
					id := uint32(r.IntN(3))
					ts := own(e.RemoveService(id))
					m.apply("remove", ts)
					m.removeService(id)
					delete(m.failOpen, id)
				default:
					// Restart: a fresh engine set up like the old one
					// adopts the exported records.
					recs := e.Export()
					e2 := New(clk, r.Float64)
					m2 := m.clone()
					for id, st := range m.settings {
						m2.setService(id, st, m.members[id])
						m2.apply("restart-set", own(e2.SetService(id, "svc", st, m.members[id])))
					}
					ts, skipped := e2.Restore(recs)
					if skipped != 0 {
						t.Fatalf("step %d: restore skipped %d", i, skipped)
					}
					m2.apply("restore", own(ts))
					for r, n := range m2.seen {
						m.seen[r] += n
					}
					m2.compare("restore", e2)
					m.compare("before restore", e)
					for ep, s := range m.state {
						if m2.state[ep] != s {
							t.Fatalf("step %d: endpoint %d restored as %v, was %v", i, ep, m2.state[ep], s)
						}
					}
					for id := range min(e.eps.len(), e2.eps.len()) {
						a, b := e.eps.at(uint32(id)), e2.eps.at(uint32(id))
						if a.svc != nil && (!a.seen().probationAt.Equal(b.seen().probationAt) || a.level != b.level || a.consecutive != b.consecutive) {
							t.Fatalf("step %d: endpoint %d restored %+v, was %+v", i, id, *b, *a)
						}
					}
					e = e2
				}
				m.compare("step", e)
			}
		})
	}
}
