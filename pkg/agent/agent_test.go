// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/desired"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/maps/mapsfake"
	"github.com/penaltybox/penaltybox/pkg/nodelinks"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

func TestNotReadyBeforeBegin(t *testing.T) {
	e := newEnv(t)
	e.a.Apply(state(web(80, 3, settings())))
	if err := e.a.Ready(); err == nil {
		t.Fatal("ready before the datapath was attached")
	}
}

// The N-th consecutive failure ejects the endpoint: the kernel steers new
// flows around it at once and its service's table is rebuilt without it.
func TestFailingEndpointIsEjectedAndItsTableRebuilt(t *testing.T) {
	e := newEnv(t)
	s := web(80, 3, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.wantReachable(s, be...)

	e.refused(svc, be[2], false)
	e.refused(svc, be[2], false)
	e.wantState(be[2], "ready")
	e.wantReachable(s, be...)
	// A success in between resets the count.
	e.served(svc, be[2], false)
	e.refused(svc, be[2], false)
	e.refused(svc, be[2], false)
	e.wantState(be[2], "ready")
	e.refused(svc, be[2], false)
	e.wantState(be[2], "ejected")
	if st, _ := e.kernel(be[2]); st != pbmaps.BackendEjected {
		t.Fatalf("kernel entry %s, want ejected", st)
	}
	e.wantReachable(s, be[0], be[1])
	writes := e.f.TableWrites[svc]
	if last := writes[len(writes)-1]; slices.Contains(last, be[2]) {
		t.Fatal("the live table still holds the ejected endpoint")
	}
	ep := e.endpoint(be[2])
	if ep.Penalty != "1s" || ep.LastFailureKind != "refused" {
		t.Fatalf("penalty %q, last failure %q; want 1s, refused", ep.Penalty, ep.LastFailureKind)
	}
	if got := testutil.ToFloat64(e.a.Metrics().Transitions.WithLabelValues("web", string(accrual.ReasonConsecutiveFailures))); got != 1 {
		t.Fatalf("transitions{consecutive-failures} = %v, want 1", got)
	}
	// The decision is persisted for a restart.
	if h, ok := e.f.PbHealth[be[2]]; !ok || accrual.State(h.State) != accrual.Ejected {
		t.Fatalf("pb_health[%d] = %+v, %v; want ejected", be[2], h, ok)
	}
}

// A connection the backend never answers is a timeout failure when the
// connect deadline passes.
func TestUnansweredConnectsTimeOut(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	for range 3 {
		e.unanswered(svc, be[1])
	}
	e.wantState(be[1], "ready")
	if next := e.a.NextDeadline(); !next.Equal(e.clk.Now().Add(time.Second)) {
		t.Fatalf("next deadline %v, want the connect timeout from now", next.Sub(e.clk.Now()))
	}
	e.clk.Step(time.Second)
	e.a.Advance()
	e.wantState(be[1], "ejected")
	if got := e.endpoint(be[1]).LastFailureKind; got != "timeout" {
		t.Fatalf("last failure %q, want timeout", got)
	}
	e.wantReachable(s, be[0])
}

// At the end of its penalty an endpoint goes into probation: the kernel
// admits exactly one new flow to it. A successful probe makes it ready.
func TestProbationAdmitsOneProbeThatSucceeds(t *testing.T) {
	e := newEnv(t)
	s := web(80, 3, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.eject(svc, be[0], 3)
	e.clk.Step(999 * time.Millisecond)
	e.a.Advance()
	e.wantState(be[0], "ejected")
	e.endPenalty(be[0])
	e.wantState(be[0], "probation")
	st, grants := e.kernel(be[0])
	if st != pbmaps.BackendProbation || grants != 1 {
		t.Fatalf("kernel entry %s with %d grants, want probation with 1", st, grants)
	}
	e.wantReachable(s, be...)
	// The probe is admitted (the kernel spends the grant) and succeeds.
	e.f.PbBackends[be[0]] = pbmaps.NewBackend(e.addr(be[0]), svc, pbmaps.BackendProbation, 0)
	e.served(svc, be[0], true)
	e.wantState(be[0], "ready")
	if st, _ := e.kernel(be[0]); st != pbmaps.BackendActive {
		t.Fatalf("kernel entry %s after the probe succeeded, want active", st)
	}
	if ep := e.endpoint(be[0]); ep.ConsecutiveFailures != 0 || ep.Penalty != "" {
		t.Fatalf("after recovery: %d failures, penalty %q; want 0 and none", ep.ConsecutiveFailures, ep.Penalty)
	}
	e.wantReachable(s, be...)
}

// A failed probe ejects the endpoint again with twice the penalty, up to
// maxPenalty; recovery resets the penalty.
func TestPenaltyDoublesUpToMaxAndResets(t *testing.T) {
	e := newEnv(t)
	s := web(80, 3, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.eject(svc, be[1], 3)
	var got []string
	for range 4 {
		got = append(got, e.endpoint(be[1]).Penalty)
		e.endPenalty(be[1])
		e.wantState(be[1], "probation")
		e.refused(svc, be[1], true)
		e.wantState(be[1], "ejected")
		e.wantReachable(s, be[0], be[2])
	}
	got = append(got, e.endpoint(be[1]).Penalty)
	if want := []string{"1s", "2s", "4s", "4s", "4s"}; !slices.Equal(got, want) {
		t.Fatalf("penalties %v, want %v", got, want)
	}
	e.endPenalty(be[1])
	e.served(svc, be[1], true)
	e.wantState(be[1], "ready")
	e.eject(svc, be[1], 3)
	if p := e.endpoint(be[1]).Penalty; p != "1s" {
		t.Fatalf("penalty after a recovery %q, want 1s", p)
	}
}

// maxEjectionPercent caps how many endpoints are out at once: a failing
// endpoint over the cap stays in its table and the suppression is counted.
func TestMaxEjectionPercent(t *testing.T) {
	e := newEnv(t)
	s := web(80, 4, settings(func(s *accrual.Settings) { s.MaxEjectionPercent = 50 }))
	e.start(state(s))
	svc, be := e.ids(s)
	e.eject(svc, be[0], 3)
	e.eject(svc, be[1], 3)
	for range 3 {
		e.refused(svc, be[2], false)
	}
	e.wantState(be[2], "ready")
	e.wantReachable(s, be[2], be[3])
	if got := testutil.ToFloat64(e.a.Metrics().Transitions.WithLabelValues("web", string(accrual.ReasonEjectionSuppressed))); got == 0 {
		t.Fatal("the suppressed ejection was not counted")
	}
}

// With every endpoint ejected the service fails open: new flows go to all
// of them rather than nowhere. One endpoint recovering ends it.
func TestFailOpenAndItsEnd(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.eject(svc, be[0], 3)
	e.wantReachable(s, be[1])
	for range 3 {
		e.refused(svc, be[1], false)
	}
	v := e.a.EndpointsView().Services[0]
	if !v.FailOpen || v.FailOpenSince == nil {
		t.Fatalf("service not failing open with every endpoint ejected: %+v", v)
	}
	e.wantReachable(s, be...)
	if !e.a.ServicesView().Services[0].FailOpen {
		t.Fatal("/admin/services does not show the datapath failing open")
	}
	// A success while failing open brings that endpoint back, which ends
	// fail-open; the other stays out.
	e.served(svc, be[1], false)
	v = e.a.EndpointsView().Services[0]
	if v.FailOpen {
		t.Fatal("still failing open after an endpoint recovered")
	}
	e.wantState(be[1], "ready")
	e.wantReachable(s, be[1])
}

// A restarted agent adopts the accrual state its predecessor persisted:
// the ejected endpoint stays out until its penalty ends.
func TestRestartAdoptsPersistedAccrualState(t *testing.T) {
	e := newEnv(t)
	s := web(80, 3, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.eject(svc, be[1], 3)
	e.refused(svc, be[2], false)
	probationAt := *e.endpoint(be[1]).ProbationAt

	e.clk.Step(300 * time.Millisecond)
	e.restart()
	e.start(state(s))
	svc2, be2 := e.ids(s)
	if svc2 != svc || !slices.Equal(be2, be) {
		t.Fatalf("ids changed across the restart: %d %v, want %d %v", svc2, be2, svc, be)
	}
	e.wantState(be[1], "ejected")
	if at := e.endpoint(be[1]).ProbationAt; at == nil || !at.Equal(probationAt) {
		t.Fatalf("probation at %v after the restart, want %v", at, probationAt)
	}
	e.wantReachable(s, be[0], be[2])
	// The penalty keeps running from where it was.
	e.endPenalty(be[1])
	e.wantState(be[1], "probation")
}

// Across a restart, no new flow can reach an endpoint that was ejected when
// the agent died: the restarted agent's first table already leaves it out
// and its kernel entry is never set back to active. A restored ejection is
// not an ejection's reaction time.
func TestRestartNeverReadmitsAnEjectedEndpoint(t *testing.T) {
	e := newEnv(t)
	s := web(80, 3, settings(func(s *accrual.Settings) { s.MinPenalty, s.MaxPenalty = 30*time.Second, time.Minute }))
	e.start(state(s))
	svc, be := e.ids(s)
	e.eject(svc, be[1], 3)
	e.f.TableWrites, e.f.StateWrites = map[uint32][][]uint32{}, map[uint32][]pbmaps.BackendState{}

	e.restart()
	e.start(state(s))
	e.wantState(be[1], "ejected")
	for i, tbl := range e.f.TableWrites[svc] {
		if slices.Contains(tbl, be[1]) {
			t.Fatalf("table %d written after the restart admits the ejected endpoint", i)
		}
	}
	for _, st := range e.f.StateWrites[be[1]] {
		if st != pbmaps.BackendEjected {
			t.Fatalf("the ejected endpoint's kernel entry was set %s after the restart (writes %v)", st, e.f.StateWrites[be[1]])
		}
	}
	e.wantReachable(s, be[0], be[2])
	var m dto.Metric
	if err := e.a.Metrics().Reaction.Write(&m); err != nil {
		t.Fatal(err)
	}
	if c := m.GetHistogram().GetSampleCount(); c != 0 {
		t.Fatalf("the restored ejection was observed as a reaction time (%d samples)", c)
	}
}

// A service no longer served (still there, kube-proxy's now) leaves
// accrual with its endpoints, but the kernel keeps what its established
// flows need (backend entries, VIP port) until no flow uses them, and the
// service's entry, handed back (new flows to kube-proxy), for handBack
// after its last flow.
func TestServiceNoLongerServedKeepsItsFlows(t *testing.T) {
	e := newEnv(t)
	s, other := web(80, 2, settings()), web(443, 1, settings())
	e.start(state(s, other))
	svc, be := e.ids(s)
	st := state(other)
	st.HandBack = []desired.Key{s.Key}
	e.a.Apply(st)
	if v, ok := e.f.PbServices[kernelKey(s)]; ok && v.Flags&pbmaps.ServiceHandedBack == 0 {
		t.Fatal("the removed service still takes new flows")
	}
	for _, id := range be {
		if st, _ := e.kernel(id); st != pbmaps.BackendRemoved {
			t.Fatalf("backend %d is %s, want removed (kept for its flows)", id, st)
		}
	}
	if e.f.PbPorts[80]&pbmaps.PortVIP == 0 {
		t.Fatal("the removed service's VIP port is no longer marked: its flows lose their NAT")
	}
	if n := len(e.a.EndpointsView().Services); n != 1 {
		t.Fatalf("accrual still judges %d services, want 1", n)
	}
	// A sweep that finds a flow on it keeps everything; once the flows are
	// gone and the cooldown passed, the entries go.
	e.clk.Step(2 * time.Minute)
	e.sweepDone(conntrack.InUse{Services: map[uint32]bool{svc: true}, Backends: map[uint32]bool{be[0]: true}})
	e.sweepDone(e.sweep.inUse)
	if _, ok := e.f.PbBackends[be[0]]; !ok {
		t.Fatal("a backend a live flow used one sweep ago was cleared (one miss is not enough)")
	}
	e.sweepDone(e.sweep.inUse)
	if _, ok := e.f.PbBackends[be[0]]; ok {
		t.Fatal("an unused backend entry survived two sweeps after its cooldown")
	}
	if _, ok := e.f.PbServices[kernelKey(s)]; !ok {
		t.Fatal("the service's entry went before its hand-back time")
	}
	e.clk.Step(handBack)
	e.sweepDone(e.sweep.inUse)
	if _, ok := e.f.PbServices[kernelKey(s)]; ok {
		t.Fatal("the service's entry outlived its hand-back time")
	}
	e.clk.Step(2 * time.Minute)
	e.sweepDone(e.sweep.inUse)
	e.sweepDone(e.sweep.inUse)
	if e.f.PbPorts[80]&pbmaps.PortVIP != 0 {
		t.Fatal("the VIP port is still marked after its flows ended")
	}
}

// A map write that fails is counted, shown on /readyz, and retried by
// Maintain until it goes through. The ejected endpoint is out of the
// kernel's reach meanwhile (its entry is written first).
func TestFailedWriteIsRetriedAndCounted(t *testing.T) {
	e := newEnv(t)
	s := web(80, 3, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.f.Fail["FillTable"] = 1
	e.eject(svc, be[0], 3)
	if got := testutil.ToFloat64(e.a.Metrics().ProgramErrors); got != 1 {
		t.Fatalf("program errors %v, want 1", got)
	}
	if err := e.a.Ready(); err == nil || !strings.Contains(err.Error(), "could not be programmed") {
		t.Fatalf("ready = %v, want the failing service named", err)
	}
	e.wantReachable(s, be[1], be[2])
	v := e.f.PbServices[kernelKey(s)]
	if live := e.f.PbMaglev[pbmaps.TableKey(svc, v.Table)]; !slices.Contains(live, be[0]) {
		t.Fatal("the live table changed although its write failed")
	}
	e.a.Maintain()
	if err := e.a.Ready(); err != nil {
		t.Fatalf("still not ready after the retry: %v", err)
	}
	v = e.f.PbServices[kernelKey(s)]
	if live := e.f.PbMaglev[pbmaps.TableKey(svc, v.Table)]; slices.Contains(live, be[0]) {
		t.Fatal("the retry did not rebuild the table without the ejected endpoint")
	}
}

// A probe the kernel admitted whose verdict never came (its events were
// lost) gets a fresh grant, so a healed endpoint is not kept out for good.
func TestStalledProbeIsRegranted(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.eject(svc, be[0], 3)
	e.endPenalty(be[0])
	e.f.PbBackends[be[0]] = pbmaps.NewBackend(e.addr(be[0]), svc, pbmaps.BackendProbation, 0)
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[0], e.nextPort(), outcomes.FlagProbe)})
	// The tracker's own deadline would judge a lost probe a timeout; here
	// the flow's NewFlow event was lost too, so nothing is pending.
	e.a.tracker.Forget(map[uint32]bool{be[0]: true})
	e.clk.Step(2 * time.Second)
	e.a.Maintain()
	if _, grants := e.kernel(be[0]); grants != 0 {
		t.Fatal("regranted before the verdict could have come")
	}
	e.clk.Step(2 * time.Second)
	e.a.Maintain()
	if st, grants := e.kernel(be[0]); st != pbmaps.BackendProbation || grants != 1 {
		t.Fatalf("kernel entry %s with %d grants, want a fresh probe", st, grants)
	}
	if got := testutil.ToFloat64(e.a.Metrics().ProbeRegrants.WithLabelValues("web", "no_verdict")); got != 1 {
		t.Fatalf("probe regrants{no_verdict} = %v, want 1", got)
	}
	e.served(svc, be[0], true)
	e.wantState(be[0], "ready")
}

// A config naming an interface that does not exist changes nothing and
// names the field; a good one attaches XDP and tells the datapath which
// interfaces are veths and which take redirects.
func TestApplyConfig(t *testing.T) {
	e := newEnv(t)
	e.links = map[string]int{"cl0": 4, "b1": 5, "eth9": 6}
	e.veths = map[string]bool{"b1": true}
	node := &desired.Node{Interfaces: []string{"cl0", "nope0"}, TableSize: 31}
	cfg := nodeConfig(node)
	err := e.a.Apply(cfg)
	if err == nil || !strings.Contains(err.Error(), `interfaces[1]: "nope0"`) {
		t.Fatalf("err = %v, want interfaces[1] named", err)
	}
	if len(e.f.PbServices) != 0 || len(e.hooks.attached) != 0 {
		t.Fatal("a config that cannot be applied changed the datapath")
	}
	if got := testutil.ToFloat64(e.a.Metrics().ConfigReloads.WithLabelValues("error")); got != 1 {
		t.Fatalf("config errors %v, want 1", got)
	}
	node.Interfaces = []string{"cl0", "b1"}
	node.RedirectInterfaces = []string{"eth9"}
	if err := e.a.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(e.hooks.Attached(), []string{"b1", "cl0"}) || !slices.Equal(e.f.Partial, []uint32{5}) ||
		!slices.Equal(e.f.PbRedirect, []uint32{6}) || !e.f.PbConfig.Redirect {
		t.Fatalf("attached %v, partial %v, redirect %v, config %+v", e.hooks.Attached(), e.f.Partial, e.f.PbRedirect, e.f.PbConfig)
	}
	if got := e.a.ServicesView().Interfaces; !slices.Equal(got, node.Interfaces) {
		t.Fatalf("/admin/services interfaces %v", got)
	}
	// Dropping an interface detaches it.
	node.Interfaces, node.RedirectInterfaces = []string{"cl0"}, nil
	if err := e.a.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(e.hooks.Attached(), []string{"cl0"}) || len(e.f.PbRedirect) != 0 || e.f.PbConfig.Redirect {
		t.Fatalf("attached %v, redirect %v, config %+v", e.hooks.Attached(), e.f.PbRedirect, e.f.PbConfig)
	}
}

// A probe whose flow the client resets before the backend answered with a
// SYN-ACK or a RST (the backend answered its SYN with the bare ACK of an
// old TIME_WAIT socket on the same ports) is inconclusive at once: a new
// probe is granted without waiting for the watchdog.
func TestProbeResetByItsClientIsInconclusive(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.eject(svc, be[0], 3)
	e.endPenalty(be[0])
	e.f.PbBackends[be[0]] = pbmaps.NewBackend(e.addr(be[0]), svc, pbmaps.BackendProbation, 0) // spent
	p := e.nextPort()
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[0], p, outcomes.FlagProbe),
		e.event(outcomes.FlowEnd, svc, be[0], p, outcomes.FlagClient)})
	if st, grants := e.kernel(be[0]); st != pbmaps.BackendProbation || grants != 1 {
		t.Fatalf("kernel entry %s with %d grants, want a fresh probe at once", st, grants)
	}
	ep := e.endpoint(be[0])
	if ep.State != "probation" || ep.Counters.ProbeInconclusive != 1 || ep.Counters.Failures.Refused != 3 {
		t.Fatalf("%s, %d inconclusive, %d refusals; want probation, 1, 3", ep.State, ep.Counters.ProbeInconclusive, ep.Counters.Failures.Refused)
	}
	// The next probe is refused: a failed probe, as always.
	e.refused(svc, be[0], true)
	e.wantState(be[0], "ejected")
}

// The heartbeat carries the agent's time on the kernel's monotonic
// clock, each beat later than the last; Drain hands new flows to
// kube-proxy and keeps every other setting.
func TestHeartbeatAndDrain(t *testing.T) {
	e := newEnv(t)
	if err := e.a.SetDatapathConfig(pbmaps.Config{ReversePath: true, HashSeed: 9, DeadMan: 30 * time.Second}); err != nil {
		t.Fatal(err)
	}
	e.a.Heartbeat()
	first := e.f.PbConfig.Heartbeat
	if first == 0 {
		t.Fatal("no heartbeat written")
	}
	e.clk.Step(time.Second)
	e.a.Heartbeat()
	if got := e.f.PbConfig.Heartbeat; got != first+uint64(time.Second) {
		t.Fatalf("heartbeat %d a second later, want %d", got, first+uint64(time.Second))
	}
	if err := e.a.Drain(); err != nil {
		t.Fatal(err)
	}
	want := pbmaps.Config{ReversePath: true, HashSeed: 9, DeadMan: 30 * time.Second, Heartbeat: first + uint64(time.Second), Drain: true}
	if e.f.PbConfig != want {
		t.Fatalf("config %+v after Drain, want %+v", e.f.PbConfig, want)
	}
}

// The first state's spare tables wait until the datapath is live
// (PrepareTables; the maintenance would install them too): it goes live
// without waiting for a second table per service. A change before then
// installs its own table.
func TestFirstStateSparesOnceLive(t *testing.T) {
	a, b := web(80, 3, settings()), web(81, 3, settings())
	b.Name = "web2"
	e := newEnv(t)
	e.start(state(a, b))
	if got := len(e.f.PbMaglev); got != 2 {
		t.Fatalf("after the first state: %d tables, want 2 (the live ones, no spare)", got)
	}
	e.a.PrepareTables()
	if got := len(e.f.PbMaglev); got != 4 {
		t.Errorf("after PrepareTables: %d tables, want 4 (a spare per service)", got)
	}

	e = newEnv(t)
	e.start(state(a, b))
	_, bes := e.ids(a)
	changed := a
	changed.Endpoints = a.Endpoints[:2]
	e.a.Apply(state(changed, b))
	e.wantReachable(changed, bes[:2]...)
}

// A pod's veth is written into pb_ifaces with the master the link watch
// reported, and written again when the watch reports a master set later
// (a CNI makes the bridge the veth's master after it creates the veth):
// the datapath takes a bridged pod's replies only through its bridge.
func TestSyncLinksFollowsMasters(t *testing.T) {
	e := newEnv(t)
	veth := nodelinks.Link{Name: "veth1", Index: 7, Pod: true}
	e.a.SyncLinks([]nodelinks.Link{veth}, true)
	if m, ok := e.f.Masters[7]; ok {
		t.Fatalf("pb_ifaces[7] has master %d before the veth has one", m)
	}
	veth.Master = 3
	e.a.SyncLinks([]nodelinks.Link{veth}, false)
	if m := e.f.Masters[7]; m != 3 {
		t.Fatalf("pb_ifaces[7] master %d after the watch reported 3", m)
	}
	if !slices.Equal(e.hooks.Attached(), []string{"veth1"}) {
		t.Fatalf("attached %v: a master's change detaches nothing", e.hooks.Attached())
	}
}

// An ejection's log line splits its reaction time at the reader's
// hand-over and at accrual's decision, each measured from the deciding
// failure's kernel timestamp: the decision comes before the table is
// written, the maps last.
func TestEjectionLogSplitsItsReaction(t *testing.T) {
	e := newEnv(t)
	var logged bytes.Buffer
	e.logTo = &logged
	e.restart()
	s := web(80, 3, settings(func(s *accrual.Settings) { s.MaxFailures = 1 }))
	e.start(state(s))
	svc, be := e.ids(s)
	// The failure is stamped as the agent began (the fake events' clock
	// starts a millisecond early), so its reaction is measurable.
	e.clk.SetTime(e.clk.Now().Add(-time.Millisecond))
	// failed: the kernel timestamp the failure stands for; filled: when
	// the table was written, in µs after it (-1: not yet).
	failed := e.clk.Now().UnixNano() - e.a.trans.monoOffset
	filled := int64(-1)
	check := e.f.Check
	e.f.Check = func(f *mapsfake.Maps, after mapsfake.Op) {
		if after.Kind == mapsfake.OpFillTable && filled < 0 {
			filled = (outcomes.MonoNow() - failed) / 1e3
		}
		check(f, after)
	}
	e.refused(svc, be[2], false)
	e.wantState(be[2], "ejected")

	split, ok := reactionFields(logged.String())
	if !ok || len(split) != 3 {
		t.Fatalf("no ejection line with reaction_us, reaction_read_us and reaction_decided_us in:\n%s", logged.String())
	}
	if filled < 0 {
		t.Fatal("the ejection wrote no table")
	}
	read, decided, reaction := split["reaction_read_us"], split["reaction_decided_us"], split["reaction_us"]
	if read > decided || decided > filled || filled > reaction {
		t.Fatalf("read %d µs, decided %d µs, table written %d µs, reaction %d µs: want read <= decided <= table written <= reaction",
			read, decided, filled, reaction)
	}
}

// An ejection no batch of the reader's held (a connect deadline's, a fleet
// verdict's) has a reaction time, and no split: nothing was handed over.
func TestEjectionOutsideABatchHasNoSplit(t *testing.T) {
	e := newEnv(t)
	var logged bytes.Buffer
	e.logTo = &logged
	e.restart()
	s := web(80, 3, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.a.mu.Lock()
	failed := time.Unix(0, outcomes.MonoNow()+e.a.trans.monoOffset)
	e.a.trans.handle([]accrual.Transition{{Service: svc, Endpoint: be[2], From: accrual.Ready,
		To: accrual.Ejected, Reason: accrual.ReasonConsecutiveFailures, FailureAt: failed}})
	e.a.mu.Unlock()
	split, ok := reactionFields(logged.String())
	if !ok {
		t.Fatalf("no ejection line in:\n%s", logged.String())
	}
	if _, ok := split["reaction_us"]; !ok || len(split) != 1 {
		t.Fatalf("reaction fields %v, want reaction_us alone", split)
	}
}

// reactionFields reads the reaction fields (reaction_us,
// reaction_read_us, reaction_decided_us) of the last "endpoint ejected"
// line of a JSON log; ok is false when there is none.
func reactionFields(log string) (fields map[string]int64, ok bool) {
	for l := range strings.Lines(log) {
		var rec map[string]any
		if err := json.Unmarshal([]byte(l), &rec); err != nil || rec["msg"] != "endpoint ejected" {
			continue
		}
		fields, ok = map[string]int64{}, true
		for _, k := range []string{"reaction_us", "reaction_read_us", "reaction_decided_us"} {
			if v, found := rec[k].(float64); found {
				fields[k] = int64(v)
			}
		}
	}
	return fields, ok
}

// conntrack_sweeps_total says how each sweep ran: in the kernel, on a copy
// (no program, or one that failed), or on a copy after a kernel sweep that
// could not fill its in-use sets.
func TestConntrackSweepsCountedByWay(t *testing.T) {
	e := newEnv(t)
	sweeps := e.a.Metrics().ConntrackSweeps
	for _, c := range []struct {
		kernel bool
		err    error
		way    string
	}{
		{true, nil, "kernel"},
		{false, nil, "copy"},
		{false, errors.New("pb_ct_sweep_run: walk 2 returned 1"), "copy"},
		{false, pbmaps.ErrSweepIncomplete{Failed: pbmaps.SweepFailVIPs}, "fallback"},
	} {
		e.sweep.kernel, e.sweep.kernelErr = c.kernel, c.err
		before := testutil.ToFloat64(sweeps.WithLabelValues(c.way))
		e.a.SweepConntrack()
		if got := testutil.ToFloat64(sweeps.WithLabelValues(c.way)) - before; got != 1 {
			t.Errorf("kernel %v, err %v: %s sweeps went up by %v, want 1", c.kernel, c.err, c.way, got)
		}
	}
	for _, way := range []string{"kernel", "copy", "fallback"} {
		want := map[string]float64{"kernel": 1, "copy": 2, "fallback": 1}[way]
		if got := testutil.ToFloat64(sweeps.WithLabelValues(way)); got != want {
			t.Errorf("%s sweeps: %v, want %v", way, got, want)
		}
	}
}

// events_total counts every event read by its type, a batch's in
// Prometheus once the batch is handled.
func TestEventsCountedByType(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	a, b := e.nextPort(), e.nextPort()
	e.a.HandleEvents([]outcomes.Event{
		e.event(outcomes.NewFlow, svc, be[0], a, 0),
		e.event(outcomes.NewFlow, svc, be[1], b, 0),
		e.event(outcomes.Established, svc, be[0], a, 0),
	})
	count := func(typ outcomes.Type) float64 {
		return testutil.ToFloat64(e.a.Metrics().Events.WithLabelValues(typ.String()))
	}
	if n, est := count(outcomes.NewFlow), count(outcomes.Established); n != 2 || est != 1 {
		t.Fatalf("events_total: new_flow %v, established %v; want 2 and 1", n, est)
	}
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.FirstData, svc, be[0], a, 0)})
	if n, fd := count(outcomes.NewFlow), count(outcomes.FirstData); n != 2 || fd != 1 {
		t.Fatalf("events_total after a second batch: new_flow %v, first_data %v; want 2 and 1", n, fd)
	}
}
