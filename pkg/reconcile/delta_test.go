// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/desired"
)

// deltaOf is what a source hands over for next after prev (both complete,
// in name order): the services new or changed, the keys gone.
func deltaOf(prev, next desired.State) desired.State {
	had := map[desired.Key]*desired.Service{}
	for i := range prev.Services {
		had[prev.Services[i].Key] = &prev.Services[i]
	}
	d := desired.State{Delta: true, HandBack: next.HandBack}
	for i := range next.Services {
		s := &next.Services[i]
		if p, ok := had[s.Key]; !ok || !p.Equal(s) {
			d.Services = append(d.Services, *s)
		}
		delete(had, s.Key)
	}
	for k := range had {
		d.Gone = append(d.Gone, k)
	}
	slices.SortFunc(d.Gone, func(a, b desired.Key) int { return strings.Compare(a.String(), b.String()) })
	return d
}

// Random sequences of service and endpoint changes, applied to one
// reconciler as complete states and to another as deltas (now and then a
// complete state too, as a source's safety net), leave the same services,
// ids, backends and maps after every step.
func TestDeltaApplyMatchesComplete(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { deltaMatchesComplete(t, seed) })
	}
}

func deltaMatchesComplete(t *testing.T, seed uint64) {
	rnd := rand.New(rand.NewPCG(seed, 35))
	opts := func(o *Options) {
		o.MaxServices, o.MaxBackends = 256, 4096
		o.HandBack = time.Minute // removed services may be handed back
	}
	full, delta := newEnv(t, opts), newEnv(t, opts)
	accFull, accDelta := &admitAll{r: full.r}, &admitAll{r: delta.r}

	const nKeys = 12
	key := func(i int) desired.Key {
		return desired.Key{VIP: netip.AddrFrom4([4]byte{198, 18, 0, byte(10 + i)}), Port: 80, Protocol: desired.TCP}
	}
	endpoint := func() desired.Endpoint {
		return ep(fmt.Sprintf("198.19.0.%d:%d", 1+rnd.IntN(12), 8080+rnd.IntN(2)))
	}
	endpoints := func() []desired.Endpoint {
		var eps []desired.Endpoint
		seen := map[netip.AddrPort]bool{}
		for range rnd.IntN(5) {
			if e := endpoint(); !seen[e.Addr] {
				seen[e.Addr] = true
				eps = append(eps, e)
			}
		}
		return eps
	}
	// The services asked for, by key index; back: those handed back.
	cur := map[int]desired.Service{}
	back := map[int]bool{}
	build := func() desired.State {
		var st desired.State
		for i := range nKeys {
			if s, ok := cur[i]; ok {
				st.Services = append(st.Services, s)
			}
			if back[i] {
				st.HandBack = append(st.HandBack, key(i))
			}
		}
		slices.SortFunc(st.Services, func(a, b desired.Service) int { return strings.Compare(a.Name, b.Name) })
		slices.SortFunc(st.HandBack, func(a, b desired.Key) int { return strings.Compare(a.String(), b.String()) })
		return st
	}

	var prev desired.State
	for step := range 60 {
		// A few changes per hand-over, as a debounce gathers them.
		for range 1 + rnd.IntN(3) {
			i := rnd.IntN(nKeys)
			s, ok := cur[i]
			switch op := rnd.IntN(6); {
			case !ok:
				s = desired.Service{Name: fmt.Sprintf("svc-%02d", i), Key: key(i), Endpoints: endpoints()}
				cur[i], back[i] = s, false
			case op == 0: // removed, or handed back
				delete(cur, i)
				back[i] = rnd.IntN(2) == 0
			case op == 1: // a setting
				s.MaxInflight = uint32(rnd.IntN(3))
				cur[i] = s
			case op == 2: // renamed (a port's name)
				s.Name = fmt.Sprintf("svc-%02d-%d", i, rnd.IntN(3))
				cur[i] = s
			case op == 3: // an endpoint replaced or added
				eps := slices.Clone(s.Endpoints)
				if e := endpoint(); !slices.ContainsFunc(eps, func(x desired.Endpoint) bool { return x.Addr == e.Addr }) {
					if len(eps) > 0 && rnd.IntN(2) == 0 {
						eps[rnd.IntN(len(eps))] = e
					} else {
						eps = append(eps, e)
					}
				}
				s.Endpoints = eps
				cur[i] = s
			case op == 4: // an endpoint gone
				if len(s.Endpoints) > 0 {
					j := rnd.IntN(len(s.Endpoints))
					s.Endpoints = slices.Delete(slices.Clone(s.Endpoints), j, j+1)
				}
				cur[i] = s
			default: // the endpoints all new
				s.Endpoints = endpoints()
				cur[i] = s
			}
		}
		// A handed-back service that is gone for good leaves HandBack.
		for i := range nKeys {
			if back[i] && rnd.IntN(8) == 0 {
				back[i] = false
			}
		}
		next := build()
		d := deltaOf(prev, next)
		if step == 0 || rnd.IntN(10) == 0 {
			d = next // a complete state, as at start or a resync
		}
		if merged := prev.Merge(d); !merged.Equal(&next) {
			t.Fatalf("step %d: the delta merged is not the state: %+v", step, d)
		}
		_, errFull := full.r.Apply(next, accFull)
		_, errDelta := delta.r.Apply(d, accDelta)
		if (errFull == nil) != (errDelta == nil) {
			t.Fatalf("step %d: Apply: complete %v, delta %v", step, errFull, errDelta)
		}
		full.prepare()
		delta.prepare()
		sameReconcilers(t, step, full, delta)
		prev = next
		full.clk.Step(time.Second)
		delta.clk.Step(time.Second)
	}
}

// sameReconcilers compares what two reconcilers hold and what they wrote.
func sameReconcilers(t *testing.T, step int, a, b *env) {
	t.Helper()
	sa, sb := a.r.Services(), b.r.Services()
	if len(sa) != len(sb) {
		t.Fatalf("step %d: %d services, delta %d", step, len(sa), len(sb))
	}
	for i := range sa {
		x, y := sa[i], sb[i]
		if x.ID != y.ID || !x.Spec.Equal(&y.Spec) || !slices.Equal(x.Backends, y.Backends) ||
			!slices.Equal(x.Active, y.Active) || x.value != y.value || x.sizes != y.sizes {
			t.Fatalf("step %d: service %d %s: complete %+v, delta %+v", step, x.ID, x.Spec.Name, *x, *y)
		}
	}
	if a.r.backends.len() != b.r.backends.len() {
		t.Fatalf("step %d: %d backends, delta %d", step, a.r.backends.len(), b.r.backends.len())
	}
	for id, x := range a.r.backends.all() {
		if y, ok := b.r.backends.lookup(id); !ok || *x != *y {
			t.Fatalf("step %d: backend %d: complete %+v, delta %+v", step, id, x, y)
		}
	}
	if !maps.Equal(a.r.removedAt, b.r.removedAt) {
		t.Fatalf("step %d: removal times: complete %v, delta %v", step, a.r.removedAt, b.r.removedAt)
	}
	if len(a.r.handingBack) != len(b.r.handingBack) {
		t.Fatalf("step %d: %d handed back, delta %d", step, len(a.r.handingBack), len(b.r.handingBack))
	}
	before := snapshotOf(a.f)
	before.diff(t, snapshotOf(b.f))
	if t.Failed() {
		t.Fatalf("step %d: the maps differ (complete -> delta)", step)
	}
}

// A delta before any complete state is refused: it would leave whatever
// the maps held (a previous agent's services) in place.
func TestDeltaFirstRefused(t *testing.T) {
	e := newEnv(t)
	d := state(svc("web", vip1, 80, ep("198.19.0.1:80")))
	d.Delta = true
	if _, err := e.r.Apply(d, e.acc); err == nil {
		t.Fatal("a first delta was applied")
	}
	if len(e.r.Services()) != 0 {
		t.Fatal("a refused delta programmed services")
	}
}
