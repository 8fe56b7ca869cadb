// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"io"
	"log/slog"
	"net/netip"
	"slices"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/admin"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/desired"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/maps/mapsfake"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// Addresses: VIPs in 198.18.100.0/24, backends in 198.18.1.0/24, the
// client 198.18.0.2.
var (
	vip    = netip.MustParseAddr("198.18.100.1")
	client = netip.MustParseAddr("198.18.0.2")
)

type env struct {
	t     testing.TB
	clk   *testingclock.FakeClock
	f     *mapsfake.Maps
	hooks *fakeHooks
	sweep *fakeSweeper
	// links: interfaces that exist (name → index); veths among them.
	links   map[string]int
	veths   map[string]bool
	masters map[string]int
	a       *Agent
	ev      *fakeEvents
	port    uint16 // the client's next source port
	// noTrips: the agents built run with --kernel-trips=false.
	noTrips bool
	// guard: the agents' SYN guard settings.
	guard pbmaps.SYNGuard
	// logTo, if set, takes the agents' log as JSON (warnings and up).
	logTo io.Writer
}

func newEnv(t testing.TB) *env {
	t.Helper()
	e := &env{t: t, clk: testingclock.NewFakeClock(time.Now()), f: mapsfake.New(t),
		hooks: &fakeHooks{attached: map[string]bool{}}, sweep: &fakeSweeper{},
		links: map[string]int{}, veths: map[string]bool{}, port: 40000}
	e.sweep.inUse = conntrack.InUse{Services: map[uint32]bool{}, Backends: map[uint32]bool{}}
	e.restart()
	return e
}

// restart builds a new agent over the same maps, as a restarted process
// gets them.
func (e *env) restart() {
	e.t.Helper()
	log := slog.New(slog.NewTextHandler(e.t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	if e.logTo != nil {
		log = slog.New(slog.NewJSONHandler(e.logTo, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	a, err := New(Config{
		Log:   log,
		Clock: e.clk, Writer: e.f, Stats: e.f, Inflight: noInflight{}, Sweeper: e.sweep, Hooks: e.hooks,
		Link: func(name string) (LinkInfo, error) {
			idx, ok := e.links[name]
			if !ok {
				return LinkInfo{}, &netErr{name}
			}
			return LinkInfo{Index: idx, Veth: e.veths[name], Master: e.masters[name]}, nil
		},
		MaxServices: 64, MaxBackends: 256, TableSize: 31, NoKernelTrips: e.noTrips,
		SYNGuard: e.guard,
	})
	if err != nil {
		e.t.Fatalf("New: %v", err)
	}
	e.a = a
}

type netErr struct{ name string }

func (n *netErr) Error() string { return "route ip+net: no such network interface" }

// settings are the defaults with 3 failures to eject, a 1s..4s penalty
// and no jitter, so penalties are exact.
func settings(mut ...func(*accrual.Settings)) accrual.Settings {
	s := accrual.Defaults()
	s.MaxFailures = 3
	s.MinPenalty, s.MaxPenalty = time.Second, 4*time.Second
	s.JitterRatio = 0
	for _, m := range mut {
		m(&s)
	}
	return s
}

// web is a TCP service on vip:port with n endpoints 198.18.1.1..n:8080.
func web(port uint16, n int, st accrual.Settings) desired.Service {
	s := desired.Service{Name: "web", Key: desired.Key{VIP: vip, Port: port, Protocol: desired.TCP}, Accrual: st}
	for i := range n {
		s.Endpoints = append(s.Endpoints, desired.Endpoint{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 1, byte(i + 1)}), 8080)})
	}
	return s
}

func state(svcs ...desired.Service) desired.State { return desired.State{Services: svcs} }

// start applies st and begins, as the agent does at start.
func (e *env) start(st desired.State) {
	e.t.Helper()
	e.a.Apply(st)
	if err := e.a.PrefiltersWritten(); err != nil {
		e.t.Fatal(err)
	}
	e.ev = &fakeEvents{clk: e.clk}
	e.a.Begin(e.ev)
	if err := e.a.Ready(); err != nil {
		e.t.Fatalf("not ready after start: %v", err)
	}
}

func kernelKey(s desired.Service) bpf.LbSvcKey {
	return pbmaps.ServiceKey(s.Key.VIP, s.Key.Port, uint8(s.Key.Protocol))
}

// ids are the backend ids of s's endpoints, in order.
func (e *env) ids(s desired.Service) (svc uint32, bes []uint32) {
	e.t.Helper()
	rs, ok := e.a.rec.ServiceByKey(s.Key)
	if !ok {
		e.t.Fatalf("service %s not programmed", s.Name)
	}
	return rs.ID, slices.Clone(rs.Backends)
}

// sweepDone hands the agent a sweep's result, as the loop does.
func (e *env) sweepDone(inUse conntrack.InUse) { e.a.SweepDone(inUse, e.a.BeginSweep()) }

// reachable: the backends new flows to s can reach in the kernel.
func (e *env) reachable(s desired.Service) []uint32 { return e.f.Reachable(kernelKey(s)) }

func (e *env) wantReachable(s desired.Service, want ...uint32) {
	e.t.Helper()
	if got := e.reachable(s); !slices.Equal(got, want) {
		e.t.Fatalf("new flows reach %v, want %v", got, want)
	}
}

func (e *env) event(typ outcomes.Type, svc, be uint32, port uint16, flags uint8) outcomes.Event {
	now := e.clk.Now()
	return outcomes.Event{Type: typ, Flags: flags, Service: svc, Backend: be,
		Client: netip.AddrPortFrom(client, port), At: now, Mono: now.UnixNano() - outcomes.MonoOffset()}
}

func (e *env) nextPort() uint16 { e.port++; return e.port }

// unanswered: one new connection to be, with no answer yet.
func (e *env) unanswered(svc, be uint32) {
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be, e.nextPort(), 0)})
}

// timeOut: n connections to be that get no answer, judged by their
// connect deadline (the settings' 1 s).
func (e *env) timeOut(svc, be uint32, n int) {
	for range n {
		e.unanswered(svc, be)
	}
	e.clk.Step(time.Second)
	e.a.Advance()
}

// refused: one connection to be that the backend refuses.
func (e *env) refused(svc, be uint32, probe bool) {
	var fl uint8
	if probe {
		fl = outcomes.FlagProbe
	}
	p := e.nextPort()
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be, p, fl), e.event(outcomes.Refused, svc, be, p, fl)})
}

// served: one connection to be that the backend accepts and answers.
func (e *env) served(svc, be uint32, probe bool) {
	var fl uint8
	if probe {
		fl = outcomes.FlagProbe
	}
	p := e.nextPort()
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be, p, fl),
		e.event(outcomes.Established, svc, be, p, fl), e.event(outcomes.FirstData, svc, be, p, fl)})
}

// endpoint is be's row of /admin/endpoints.
func (e *env) endpoint(be uint32) admin.Endpoint {
	e.t.Helper()
	for _, s := range e.a.EndpointsView().Services {
		for _, ep := range s.Endpoints {
			if ep.ID == be {
				return ep
			}
		}
	}
	e.t.Fatalf("endpoint %d not in /admin/endpoints", be)
	return admin.Endpoint{}
}

func (e *env) wantState(be uint32, st string) {
	e.t.Helper()
	if got := e.endpoint(be).State; got != st {
		e.t.Fatalf("endpoint %d is %s, want %s", be, got, st)
	}
}

func (e *env) kernel(be uint32) (pbmaps.BackendState, int32) {
	b := e.f.PbBackends[be]
	return pbmaps.BackendState(b.State), b.ProbeGrants
}

// eject refuses enough connections to be to eject it.
func (e *env) eject(svc, be uint32, n int) {
	e.t.Helper()
	for range n {
		e.refused(svc, be, false)
	}
	e.wantState(be, "ejected")
}

// endPenalty moves time to the end of be's penalty and runs the deadline.
func (e *env) endPenalty(be uint32) {
	e.t.Helper()
	at := e.endpoint(be).ProbationAt
	if at == nil {
		e.t.Fatalf("endpoint %d has no penalty running", be)
	}
	e.clk.SetTime(*at)
	e.a.Advance()
}

func (e *env) addr(be uint32) netip.AddrPort {
	b, _ := e.a.rec.Backend(be)
	return b.Addr
}
