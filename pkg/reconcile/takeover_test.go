package reconcile

import (
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
)

// flags reads the service's pb_services flags as the fake holds them.
func (e *env) flags(name string) uint32 {
	e.t.Helper()
	for _, s := range e.r.Services() {
		if s.Spec.Name == name {
			var v bpf.LbSvcValue
			for _, fv := range e.f.PbServices {
				if fv.Id == s.ID {
					v = fv
				}
			}
			return v.Flags
		}
	}
	e.t.Fatalf("no service %s", name)
	return 0
}

// A service first served leaves kube-proxy's flows to it for the grace
// (pb_services flag), then takes them; a restart within the grace keeps
// the flag, and its grace starts again.
func TestTakeoverGrace(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.TakeoverGrace = time.Hour })
	web := svc("web", vip1, 80, ep("198.19.0.1:8080"))
	e.apply(web)
	s := e.service(web.Key)
	e.program(s.ID, s.Backends, nil, false)
	if e.flags("web")&pbmaps.ServiceTakenOver == 0 {
		t.Fatal("a service first served is not marked taken over")
	}
	e.clk.Step(30 * time.Minute)
	if got := e.r.EndTakeovers(); len(got) != 0 {
		t.Fatalf("grace ended after half of it: %v", got)
	}
	e.restart()
	e.apply(web)
	e.program(s.ID, s.Backends, nil, false)
	if e.flags("web")&pbmaps.ServiceTakenOver == 0 {
		t.Fatal("a restart within the grace dropped the flag")
	}
	e.clk.Step(59 * time.Minute) // 89 minutes since the first, 59 since the restart
	if got := e.r.EndTakeovers(); len(got) != 0 {
		t.Fatalf("grace ended %v after the restart", 59*time.Minute)
	}
	e.clk.Step(2 * time.Minute)
	if got := e.r.EndTakeovers(); len(got) != 1 {
		t.Fatalf("grace over: %d services rewritten, want 1", len(got))
	}
	if e.flags("web")&pbmaps.ServiceTakenOver != 0 {
		t.Fatal("the flag outlived the grace")
	}
	// Without a grace (standalone) nothing is marked.
	e2 := newEnv(t)
	e2.apply(web)
	s2 := e2.service(web.Key)
	e2.program(s2.ID, s2.Backends, nil, false)
	if e2.flags("web")&pbmaps.ServiceTakenOver != 0 {
		t.Fatal("marked taken over with no grace")
	}
}
