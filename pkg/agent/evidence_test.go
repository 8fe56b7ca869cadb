package agent

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

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
	if next := e.a.NextDeadline(); next.After(e.clk.Now().Add(10 * time.Millisecond)) {
		t.Fatalf("the unjudged deadlines are looked at again only in %v", next.Sub(e.clk.Now()))
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
	e.f.lost += 1000 // the ring overflowed meanwhile
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
	// After the loss, a silent backend is still caught.
	for range 3 {
		e.unanswered(svc, be[1])
	}
	e.clk.Step(time.Second)
	e.a.Advance()
	e.wantState(be[1], "ejected")

	// Flood mode ends after a quiet spell.
	e.clk.Step(floodQuiet + time.Second)
	e.a.Maintain()
	if testutil.ToFloat64(e.a.Metrics().FloodMode) != 0 {
		t.Fatal("flood mode did not end")
	}
}

// A restarted agent does not take the losses of the datapath's past for
// news.
func TestOldLossesAreNoNews(t *testing.T) {
	e := newEnv(t)
	e.f.lost = 5000
	s := web(80, 2, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	for range 3 {
		e.unanswered(svc, be[0])
	}
	e.clk.Step(time.Second)
	e.a.Advance()
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
