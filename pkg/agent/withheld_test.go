// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// A SYN-ACK the reader has not read yet when the connect deadline passes
// (a busy ring, a starved reader) is not a timeout: the deadline waits for
// the reader to catch up, and the late SYN-ACK decides.
func TestLateEventsAreNotTimeouts(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	var ports []uint16
	for range 3 {
		p := e.nextPort()
		ports = append(ports, p)
		e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[1], p, 0)})
	}
	// The backend answered at once, but the reader is 2 s behind.
	behind := e.clk.Now()
	e.ev.caught = &behind
	e.clk.Step(2 * time.Second)
	e.a.Advance()
	if ep := e.endpoint(be[1]); ep.State != "ready" || ep.Counters.Failures.Timeout != 0 {
		t.Fatalf("endpoint %s with %d timeouts while its events were unread", ep.State, ep.Counters.Failures.Timeout)
	}
	// Looked at again later (not in a busy loop), within a second.
	if next := e.a.NextDeadline(); !next.After(e.clk.Now()) || next.After(e.clk.Now().Add(lagLimit)) {
		t.Fatalf("the unjudged deadlines are looked at again in %v", next.Sub(e.clk.Now()))
	}
	// The reader catches up: the SYN-ACKs and data were there.
	for _, p := range ports {
		e.a.HandleEvents([]outcomes.Event{e.event(outcomes.Established, svc, be[1], p, 0), e.event(outcomes.FirstData, svc, be[1], p, 0)})
	}
	now := e.clk.Now()
	e.ev.caught = &now
	e.a.Advance()
	if ep := e.endpoint(be[1]); ep.State != "ready" || ep.Counters.Failures.Timeout != 0 || ep.Counters.Successes != 3 {
		t.Fatalf("endpoint %s, %d timeouts, %d successes; want ready, 0, 3", ep.State, ep.Counters.Failures.Timeout, ep.Counters.Successes)
	}
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 1 {
		t.Fatal("a reader 2 s behind did not put the agent in flood mode")
	}
}

// Connections that waited while the datapath dropped events get no
// timeout from their deadline (their SYN-ACK may be among the lost), and
// the withheld verdicts are counted; connections after the loss are
// judged as usual.
func TestLostEventsWithholdTimeouts(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	for range 3 {
		e.unanswered(svc, be[1])
	}
	e.f.Global.EventsLost += 1000 // the ring overflowed meanwhile
	e.clk.Step(time.Second)
	e.a.Advance()
	if ep := e.endpoint(be[1]); ep.State != "ready" || ep.Counters.Failures.Timeout != 0 {
		t.Fatalf("endpoint %s with %d timeouts judged across lost events", ep.State, ep.Counters.Failures.Timeout)
	}
	if got := testutil.ToFloat64(e.a.Metrics().Withheld.WithLabelValues("events_lost")); got != 3 {
		t.Fatalf("withheld %v, want 3", got)
	}
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 1 {
		t.Fatal("lost events did not put the agent in flood mode")
	}
	// In flood mode no timeout counts, the deadline's or the kernel's
	// (a SYN again on a half-open tuple), but a refusal does.
	for range 3 {
		e.unanswered(svc, be[1])
	}
	for range 3 {
		p := e.nextPort()
		e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[1], p, 0), e.event(outcomes.SynRetrans, svc, be[1], p, 0)})
	}
	e.clk.Step(time.Second)
	e.a.Advance()
	e.wantState(be[1], "ready")
	if got := testutil.ToFloat64(e.a.Metrics().Withheld.WithLabelValues("flood")); got != 6 {
		t.Fatalf("withheld{flood} %v, want 6", got)
	}
	e.eject(svc, be[1], 3)

	// Flood mode ends after a quiet spell; deadlines judge again.
	e.clk.Step(floodQuiet + time.Second)
	e.a.Maintain()
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 0 {
		t.Fatal("flood mode did not end")
	}
	e.timeOut(svc, be[0], 3)
	if ep := e.endpoint(be[0]); ep.Counters.Failures.Timeout != 3 {
		t.Fatalf("%d deadline timeouts after flood mode ended, want 3", ep.Counters.Failures.Timeout)
	}
}

// A restarted agent does not take the losses of the datapath's past for
// news.
func TestOldLossesAreNoNews(t *testing.T) {
	e := newEnv(t)
	e.f.Global.EventsLost = 5000
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.timeOut(svc, be[0], 3)
	e.wantState(be[0], "ejected")
	if got := testutil.ToFloat64(e.a.Metrics().Withheld.WithLabelValues("events_lost")); got != 0 {
		t.Fatalf("withheld %v, want 0", got)
	}
}

// When most endpoints of a service time out together (a node dropping
// packets under a flood, a shared dependency down), no endpoint is
// ejected for it: the timeouts are withheld. One endpoint timing out alone
// among healthy peers is still ejected.
func TestServiceWideTimeoutsEjectNobody(t *testing.T) {
	e := newEnv(t)
	s := web(80, 3, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	for range 10 {
		for _, id := range be {
			e.unanswered(svc, id)
		}
	}
	e.clk.Step(time.Second)
	e.a.Advance()
	for _, id := range be {
		e.wantState(id, "ready")
	}
	if got := testutil.ToFloat64(e.a.Metrics().Withheld.WithLabelValues("service_wide")); got < 20 {
		t.Fatalf("service-wide withheld %v, want most of the 30 timeouts", got)
	}
	// Later, one endpoint alone goes silent: it is ejected.
	e.clk.Step(3 * time.Second)
	for range 3 {
		e.unanswered(svc, be[2])
		e.served(svc, be[0], false)
		e.served(svc, be[1], false)
	}
	e.clk.Step(time.Second)
	e.a.Advance()
	e.wantState(be[2], "ejected")
}

// A dead endpoint among healthy peers is ejected even when a peer has an
// occasional timeout of its own: a peer counts as degraded only when a
// real share of its connects time out.
func TestOccasionalPeerTimeoutsWithholdNothing(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	// A healthy endpoint's two slow connects among 60 that went well.
	e.unanswered(svc, be[1])
	e.unanswered(svc, be[1])
	for range 60 {
		e.served(svc, be[1], false)
	}
	e.timeOut(svc, be[0], 3)
	e.wantState(be[0], "ejected")
	e.wantState(be[1], "ready")
}

// An endpoint out of the table is nobody's peer: after one endpoint was
// ejected for its timeouts, the next one that goes silent is ejected too.
func TestEjectedEndpointsAreNoPeers(t *testing.T) {
	e := newEnv(t)
	s := web(80, 4, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.timeOut(svc, be[0], 3)
	e.wantState(be[0], "ejected")
	e.timeOut(svc, be[1], 3)
	e.wantState(be[1], "ejected")
}

// A service of one endpoint has no peers to compare with: its timeouts
// count.
func TestLoneEndpointTimeoutsCount(t *testing.T) {
	e := newEnv(t)
	s := web(80, 1, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	e.timeOut(svc, be[0], 3)
	if ep := e.endpoint(be[0]); ep.Counters.Failures.Timeout != 3 {
		t.Fatalf("%d timeouts counted, want 3", ep.Counters.Failures.Timeout)
	}
}

// A pinned ring can hold events from while no agent ran: until the reader
// has read it to its end once nothing is judged, and connects that started
// before the agent did get no timeout from their deadline (their answers
// may have been lost unseen).
func TestBacklogFromBeforeStartIsNoTimeout(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	zero := time.Time{}
	e.ev.caught = &zero
	old := e.clk.Now().Add(-5 * time.Second)
	for range 3 {
		ev := e.event(outcomes.NewFlow, svc, be[1], e.nextPort(), 0)
		ev.At = old
		e.a.HandleEvents([]outcomes.Event{ev})
	}
	e.a.Advance()
	if ep := e.endpoint(be[1]); ep.Counters.Failures.Timeout != 0 {
		t.Fatal("deadlines judged before the reader read the ring once")
	}
	e.ev.caught = nil
	e.a.Advance()
	if ep := e.endpoint(be[1]); ep.State != "ready" || ep.Counters.Failures.Timeout != 0 {
		t.Fatalf("endpoint %s with %d timeouts from connects older than the agent", ep.State, ep.Counters.Failures.Timeout)
	}
	if got := testutil.ToFloat64(e.a.Metrics().Withheld.WithLabelValues("before_start")); got != 3 {
		t.Fatalf("withheld{before_start} %v, want 3", got)
	}
}

// More connects awaiting a verdict than a busy node ever has, spread over
// services as a real flood's are, put the agent in flood mode before the
// first of their deadlines passes; the deadlines then judge nothing.
func TestManyPendingConnectsAreAFlood(t *testing.T) {
	e := newEnv(t)
	var svcs []desired.Service
	for i := range 5 {
		s := web(uint16(80+i), 2, settings())
		s.Name = fmt.Sprintf("web%d", i)
		svcs = append(svcs, s)
	}
	e.start(state(svcs...))
	per := floodPending/5 + 1 // under each service's share: together, over the threshold
	for i, s := range svcs {
		svc, be := e.ids(s)
		batch := make([]outcomes.Event, 0, per)
		for range per {
			batch = append(batch, e.event(outcomes.NewFlow, svc, be[0], e.nextPort(), 0))
		}
		e.a.HandleEvents(batch)
		if on := testutil.ToFloat64(e.a.Metrics().FloodMode) == 1; on != (i == len(svcs)-1) {
			t.Fatalf("flood mode %v after %d services' %d connects each", on, i+1, per)
		}
	}
	e.clk.Step(time.Second)
	e.a.Advance()
	for _, s := range svcs {
		_, be := e.ids(s)
		if ep := e.endpoint(be[0]); ep.State != "ready" || ep.Counters.Failures.Timeout != 0 {
			t.Fatalf("endpoint %s with %d timeouts judged by deadlines in flood mode", ep.State, ep.Counters.Failures.Timeout)
		}
	}
}

// One tenant cannot hold the node in flood mode: a service's 10,000 idle
// connections (established, settling under a 30 s connect timeout) and
// 10,000 half-open ones (no SYN-ACK) leave flood mode off, its endpoints'
// deadlines judge as ever, and another service's connections are tracked
// and judged as ever. What the tenant's service has beyond its cap is not
// tracked, and counted.
func TestOneServiceCannotHoldFloodMode(t *testing.T) {
	e := newEnv(t)
	idle := web(80, 2, settings(func(s *accrual.Settings) { s.ConnectTimeout = 30 * time.Second }))
	other := web(81, 2, settings())
	other.Name = "api"
	e.start(state(idle, other))
	svc, be := e.ids(idle)
	osvc, obe := e.ids(other)
	capacity := e.a.tracker.MaxPendingPerService
	if capacity <= 0 || capacity >= 10000 {
		t.Fatalf("per-service cap %d: the test wants one below 10,000", capacity)
	}
	batch := make([]outcomes.Event, 0, 3*10000)
	for range 10000 {
		p := e.nextPort()
		batch = append(batch, e.event(outcomes.NewFlow, svc, be[0], p, 0), e.event(outcomes.Established, svc, be[0], p, 0))
	}
	e.a.HandleEvents(batch)
	batch = batch[:0]
	for range 10000 {
		batch = append(batch, e.event(outcomes.NewFlow, svc, be[1], e.nextPort(), 0))
	}
	e.a.HandleEvents(batch)
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 0 {
		t.Fatal("one service's idle and half-open connections put the node in flood mode")
	}
	// The cap was full with the idle ones: the half-open were all shed.
	shed := testutil.ToFloat64(e.a.Metrics().UntrackedFlows.WithLabelValues("web", "service_cap"))
	if want := float64(20000 - capacity); shed != want {
		t.Fatalf("untracked{service_cap} %v, want %v", shed, want)
	}
	if got := e.a.tracker.Pending(); got != capacity {
		t.Fatalf("tracker holds %d flows, want the cap %d", got, capacity)
	}
	// Another service is tracked and judged as ever: its silent endpoint
	// times out and is ejected.
	e.timeOut(osvc, obe[1], 3)
	e.wantState(obe[1], "ejected")
	e.served(osvc, obe[0], false)
	if ep := e.endpoint(obe[0]); ep.Counters.Successes != 1 {
		t.Fatalf("the other service's served connection: %d successes, want 1", ep.Counters.Successes)
	}
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 0 {
		t.Fatal("flood mode on")
	}
	// The spell of shedding is logged when it starts and when it ends, a
	// quiet spell later.
	if len(e.a.shed.spells) != 1 {
		t.Fatalf("shedding spells %v, want the idle service's", e.a.shed.spells)
	}
	e.clk.Step(floodQuiet + time.Second)
	e.a.Maintain()
	if len(e.a.shed.spells) != 0 {
		t.Fatalf("shedding spells %v after a quiet spell, want none", e.a.shed.spells)
	}
}

// Timeouts are decided a connect timeout after their SYN, after the
// successes of connections that began later: those failures are no streak
// (the endpoint has served since they began), however many arrive at once.
func TestTimeoutsOvertakenBySuccessAreNoStreak(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	for range 5 {
		e.unanswered(svc, be[0])
	}
	e.clk.Step(500 * time.Millisecond)
	e.served(svc, be[0], false)
	e.clk.Step(500 * time.Millisecond)
	e.a.Advance()
	ep := e.endpoint(be[0])
	if ep.State != "ready" || ep.ConsecutiveFailures != 0 || ep.Counters.Failures.Timeout != 5 || ep.Counters.Overtaken != 5 {
		t.Fatalf("%s, %d consecutive, %d timeouts, %d overtaken; want ready, 0, 5, 5",
			ep.State, ep.ConsecutiveFailures, ep.Counters.Failures.Timeout, ep.Counters.Overtaken)
	}
	// Connections that began after the success and failed are a streak.
	e.timeOut(svc, be[0], 3)
	e.wantState(be[0], "ejected")
}

// A deadline that falls due while the reader has not read up to it kicks
// the reader (which polls seldom) and is looked at again shortly; one the
// reader has caught up with kicks nobody.
func TestDueDeadlineKicksTheReader(t *testing.T) {
	e := newEnv(t)
	s := web(80, 2, settings(func(s *accrual.Settings) { s.ConnectTimeout = 300 * time.Millisecond }))
	e.start(state(s))
	svc, be := e.ids(s)
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[0], e.nextPort(), 0)})
	if e.ev.kicks != 0 {
		t.Fatalf("%d kicks with nothing due", e.ev.kicks)
	}
	behind := e.clk.Now()
	e.ev.caught = &behind
	e.clk.Step(400 * time.Millisecond) // due, and the reader less than lagLimit behind
	e.a.Advance()
	if next := e.a.NextDeadline(); next.After(e.clk.Now().Add(outcomes.Poll)) {
		t.Fatalf("the due deadline is looked at again in %v, want within %v", next.Sub(e.clk.Now()), outcomes.Poll)
	}
	if e.ev.kicks == 0 {
		t.Fatal("a due deadline behind the reader did not kick it")
	}
	now := e.clk.Now()
	e.ev.caught = &now
	kicks := e.ev.kicks
	e.a.Advance()
	e.a.NextDeadline()
	if e.ev.kicks != kicks {
		t.Fatal("the reader was kicked while caught up")
	}
}
