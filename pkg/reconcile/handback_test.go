// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/desired"

	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
)

// kernelFlags is the pb_services flags the fake holds for service id
// (found: an entry exists).
func (e *env) kernelFlags(id uint32) (flags uint32, found bool) {
	for _, v := range e.f.PbServices {
		if v.Id == id {
			return v.Flags, true
		}
	}
	return 0, false
}

// A service no longer served, which still exists, is handed back to
// kube-proxy: its entry stays, flagged, while its flows live and for the
// hand-back time after the last, then goes and its id cools down as any
// removed service's. Desired again before that, it is the same service
// (same id), taken over anew, unflagged.
func TestHandBack(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.TakeoverGrace = time.Hour; o.HandBack = 5 * time.Minute })
	web := svc("web", vip1, 80, ep("198.19.0.1:8080"))
	api := svc("api", vip2, 80, ep("198.19.0.2:8080"))
	e.apply(web, api)
	for _, s := range []*Service{e.service(web.Key), e.service(api.Key)} {
		e.program(s.ID, s.Backends, nil, false)
	}
	webID := e.service(web.Key).ID
	e.clk.Step(2 * time.Hour)
	e.r.EndTakeovers()

	back := []desired.Key{web.Key}
	changes := e.applyBack(back, api)
	if len(changes) != 1 || !changes[0].Removed || changes[0].Service.ID != webID {
		t.Fatalf("changes %+v, want web removed", changes)
	}
	if f, ok := e.kernelFlags(webID); !ok || f&pbmaps.ServiceHandedBack == 0 {
		t.Fatalf("removed service: entry present %v, flags %#x; want it kept, handed back", ok, f)
	}
	e.checkKernel()

	// Its flows live on: the entry stays past the hand-back time.
	e.clk.Step(10 * time.Minute)
	e.sweep(InUse{Services: map[uint32]bool{webID: true}})
	if _, ok := e.kernelFlags(webID); !ok {
		t.Fatal("entry deleted while the service's flows live")
	}
	// The last ended: it goes the hand-back time later.
	e.clk.Step(4 * time.Minute)
	e.sweep(InUse{})
	if _, ok := e.kernelFlags(webID); !ok {
		t.Fatal("entry deleted 4 minutes after the last flow")
	}
	e.clk.Step(2 * time.Minute)
	e.sweep(InUse{})
	if _, ok := e.kernelFlags(webID); ok {
		t.Fatal("entry kept 6 minutes after the last flow")
	}
	if e.r.HandingBack() != 0 {
		t.Fatalf("%d still handed back", e.r.HandingBack())
	}
	e.checkKernel()

	// Served again while handed back: the same id, unflagged, taken over.
	e.apply(web, api)
	id := e.service(web.Key).ID
	e.program(id, e.service(web.Key).Backends, nil, false)
	e.applyBack(back, api)
	e.apply(web, api)
	s := e.service(web.Key)
	e.program(s.ID, s.Backends, nil, false)
	if s.ID != id {
		t.Fatalf("taken back with id %d, was %d", s.ID, id)
	}
	f, _ := e.kernelFlags(id)
	if f&pbmaps.ServiceHandedBack != 0 || f&pbmaps.ServiceTakenOver == 0 {
		t.Fatalf("taken back: flags %#x, want taken over and not handed back", f)
	}
	e.checkKernel()

	// A restart adopts a service handed back: not desired, it is handed
	// back again; its hand-back time starts over.
	e.applyBack(back, api)
	e.restart()
	e.applyBack(back, api)
	if f, ok := e.kernelFlags(id); !ok || f&pbmaps.ServiceHandedBack == 0 {
		t.Fatalf("after a restart: entry present %v, flags %#x", ok, f)
	}
	e.checkKernel()

	// Deleted, not handed back: the entry goes at once (its flows finish
	// on conntrack alone), also when it was being handed back.
	e.apply(api)
	if _, ok := e.kernelFlags(id); ok || e.r.HandingBack() != 0 {
		t.Fatalf("a service handed back, then deleted: entry present %v, %d handed back", ok, e.r.HandingBack())
	}
	e.checkKernel()
}

// Without a hand-back time a removed service's entry goes at once; with
// one, a service gone (deleted, not handed back) goes at once too.
func TestNoHandBack(t *testing.T) {
	for _, c := range []struct {
		name string
		opt  func(*Options)
		back bool
	}{
		{"no hand-back time", func(*Options) {}, true},
		{"deleted", func(o *Options) { o.HandBack = 5 * time.Minute }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, c.opt)
			web := svc("web", vip1, 80, ep("198.19.0.1:8080"))
			e.apply(web)
			s := e.service(web.Key)
			e.program(s.ID, s.Backends, nil, false)
			var back []desired.Key
			if c.back {
				back = []desired.Key{web.Key}
			}
			e.applyBack(back)
			if _, ok := e.kernelFlags(s.ID); ok || e.r.HandingBack() != 0 {
				t.Fatalf("entry kept (%d handed back)", e.r.HandingBack())
			}
			e.checkKernel()
		})
	}
}

// After the dead-man's switch tripped, every service is taken over anew,
// as the restarted agent finds them pinned (before its first Apply, only
// the flag changes).
func TestTakeOverAll(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.TakeoverGrace = time.Hour })
	web := svc("web", vip1, 80, ep("198.19.0.1:8080"))
	web.MaxInflight = 7
	e.apply(web)
	s := e.service(web.Key)
	e.program(s.ID, s.Backends, nil, false)
	e.clk.Step(2 * time.Hour)
	e.r.EndTakeovers()
	if f, _ := e.kernelFlags(s.ID); f&pbmaps.ServiceTakenOver != 0 {
		t.Fatal("still taken over after the grace")
	}
	before := e.f.PbServices[keyOf(web.Key)]
	e.restart()
	if err := e.r.TakeOverAll(); err != nil {
		t.Fatal(err)
	}
	after := e.f.PbServices[keyOf(web.Key)]
	if after.Flags != before.Flags|pbmaps.ServiceTakenOver || after.MaxInflight != 7 || after.TableSize != before.TableSize {
		t.Fatalf("pinned %+v, after TakeOverAll %+v: want only the flag added", before, after)
	}
	e.apply(web)
	s = e.service(web.Key)
	e.program(s.ID, s.Backends, nil, false)
	if f, _ := e.kernelFlags(s.ID); f&pbmaps.ServiceTakenOver == 0 {
		t.Fatal("the first Apply dropped the flag")
	}
	e.checkKernel()
}
