// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/penaltybox/penaltybox/pkg/outcomes"
	"github.com/penaltybox/penaltybox/pkg/replay"
)

// Every rescued refusal the agent reads shows in a replay result, so that
// the results can be held against the datapath's rescues: one the
// datapath did not move is "dropped", not "sent", and one whose service or
// backend left the desired state is "stale", not silently skipped.
func TestReplayResultsAccountForEveryRescue(t *testing.T) {
	e := newEnv(t)
	rp := &fakeReplayer{err: replay.ErrDropped}
	e.a.replays.replayer = rp
	v6 := web6(80, 2)
	e.start(state(v6))
	s6, be6 := e.ids(v6)
	result := func(r string) float64 { return testutil.ToFloat64(e.a.metrics.Replays.WithLabelValues("refused", r)) }

	c := netip.AddrPortFrom(client6, e.nextPort())
	e.a.HandleEvents([]outcomes.Event{{Type: outcomes.Refused, Flags: outcomes.FlagRescued, Service: s6, Backend: be6[0],
		Client: c, At: e.clk.Now()}})
	if len(rp.refused) != 1 {
		t.Fatalf("replays asked %v, want one", rp.refused)
	}
	if got, sent := result("dropped"), result("sent"); got != 1 || sent != 0 {
		t.Errorf("replays_total{refused}: dropped %v sent %v, want 1 and 0", got, sent)
	}

	// A backend id the agent no longer has.
	c2 := netip.AddrPortFrom(client6, e.nextPort())
	e.a.HandleEvents([]outcomes.Event{{Type: outcomes.Refused, Flags: outcomes.FlagRescued, Service: s6, Backend: 9999,
		Client: c2, At: e.clk.Now()}})
	if len(rp.refused) != 1 {
		t.Errorf("replays asked %v: none wanted for an unknown backend", rp.refused)
	}
	if got := result("stale"); got != 1 {
		t.Errorf("replays_total{refused,stale} = %v, want 1", got)
	}
}

// replayEnv is an agent with a replayer, serving a web service with
// retryRefused: its endpoints' ids, and their replay deadline.
func replayEnv(t *testing.T) (e *env, rp *fakeReplayer, svc uint32, be []uint32, after time.Duration) {
	t.Helper()
	e = newEnv(t)
	rp = &fakeReplayer{}
	e.a.replays.replayer = rp
	s := web(80, 2, settings())
	s.RetryRefused = true
	e.start(state(s))
	svc, be = e.ids(s)
	return e, rp, svc, be, e.a.policyOf(be[0]).Replay
}

// The reader runs the replay deadlines as it reads (caughtUp), so the
// loop's timer does not wake for them (under load each cost a wake-up of
// the loop, a kick of the reader and another wake-up): it asks to read
// again by the next replay deadline, and a SYN still unanswered when it
// has read up to that deadline is replayed, once; one answered before is
// not, and nothing is replayed before the reader has read up to it.
func TestReaderRunsReplayDeadlines(t *testing.T) {
	e, rp, svc, be, after := replayEnv(t)
	if after < 16*time.Millisecond || after >= time.Second {
		t.Fatalf("replay deadline %v, want one of 16ms or more before the 1s connect timeout", after)
	}
	if e.ev.onCaught == nil {
		t.Fatal("the agent gave the reader no hook")
	}
	// The reader has read up to start only.
	start := e.clk.Now()
	e.ev.caught = &start
	answered, silent := e.nextPort(), e.nextPort()
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[0], answered, 0)})
	e.clk.Step(after / 4)
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[1], silent, 0)})
	if next := e.a.NextDeadline(); !next.Equal(start.Add(time.Second)) {
		t.Errorf("the loop's next deadline in %v, want the first connect timeout's 1s (not a replay's %v)", next.Sub(start), after)
	}
	if by := e.ev.onCaught(e.clk.Now()); !by.Equal(start.Add(after)) {
		t.Fatalf("read asked by %v, want the first flow's replay deadline %v", by.Sub(start), after)
	}
	e.clk.Step(after / 4)
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.Established, svc, be[0], answered, 0)})
	silentDue := start.Add(after / 4).Add(after)
	if by := e.ev.onCaught(e.clk.Now()); !by.Equal(silentDue) {
		t.Fatalf("read asked by %v, want the silent flow's replay deadline %v", by.Sub(start), silentDue.Sub(start))
	}
	e.clk.Step(silentDue.Sub(e.clk.Now()))
	// The loop, woken for something else, leaves the deadline to the
	// reader: it neither kicks it nor replays what the reader has not
	// read up to.
	e.a.NextDeadline()
	e.a.Advance()
	if e.ev.kicks != 0 {
		t.Errorf("%d kicks: the replay deadlines need none", e.ev.kicks)
	}
	// Read up to a moment before the deadline: not yet.
	e.ev.onCaught(silentDue.Add(-time.Microsecond))
	if len(rp.unanswered) != 0 {
		t.Fatalf("replayed before the reader read up to the deadline: %v", rp.unanswered)
	}
	if by := e.ev.onCaught(silentDue); !by.IsZero() {
		t.Errorf("read asked by %v with no replay deadline left", by.Sub(start))
	}
	if len(rp.unanswered) != 1 || rp.unanswered[0].Port() != silent {
		t.Fatalf("replayed %v, want the silent flow's client (port %d) once", rp.unanswered, silent)
	}
	e.a.Advance()
	e.ev.onCaught(e.clk.Now())
	if len(rp.unanswered) != 1 {
		t.Errorf("replayed %v, want no second replay", rp.unanswered)
	}
}

// Replay deadlines a moment apart are read together: the reader is asked
// to read no sooner than replaySlack after it caught up, not once a SYN.
// In flood mode, where no replay is sent, it is asked for no early read.
func TestReplayDeadlinesAreReadTogether(t *testing.T) {
	e, _, svc, be, after := replayEnv(t)
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[0], e.nextPort(), 0)})
	due := e.clk.Now().Add(after)
	at := due.Add(-replaySlack / 4)
	if by := e.ev.onCaught(at); !by.Equal(at.Add(replaySlack)) {
		t.Errorf("read asked by %v after the read, want %v", by.Sub(at), replaySlack)
	}
	e.a.mu.Lock()
	e.a.flood.sign(e.clk.Now(), "test")
	e.a.mu.Unlock()
	if by := e.ev.onCaught(e.clk.Now()); !by.IsZero() {
		t.Errorf("in flood mode, read asked by %v; want no early read", by.Sub(e.clk.Now()))
	}
}

// A replay waits for the events it depends on: with events lost since the
// last look (a lost SYN-ACK leaves its flow looking unanswered) the agent
// is in flood mode and sends none; and a deadline read long after it
// passed (a reader that lagged) is not replayed either, but counted stale.
func TestReplaysAfterLossOrLag(t *testing.T) {
	e, rp, svc, be, after := replayEnv(t)
	result := func(r string) float64 {
		return testutil.ToFloat64(e.a.metrics.Replays.WithLabelValues("unanswered", r))
	}

	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[0], e.nextPort(), 0)})
	e.f.Global.EventsLost += 1000
	e.clk.Step(after)
	e.ev.onCaught(e.clk.Now())
	if len(rp.unanswered) != 0 || result("flood") != 1 {
		t.Errorf("with events lost: replayed %v, replays_total{unanswered,flood} = %v; want none sent, 1 counted in flood", rp.unanswered, result("flood"))
	}
	if !e.a.flood.on {
		t.Error("events lost, and no flood mode")
	}

	e2, rp2, svc, be, _ := replayEnv(t)
	e2.a.HandleEvents([]outcomes.Event{e2.event(outcomes.NewFlow, svc, be[0], e2.nextPort(), 0)})
	e2.clk.Step(after + maxReplayAge + time.Millisecond)
	e2.ev.onCaught(e2.clk.Now())
	if got := testutil.ToFloat64(e2.a.metrics.Replays.WithLabelValues("unanswered", "stale")); len(rp2.unanswered) != 0 || got != 1 {
		t.Errorf("read %v after its deadline: replayed %v, replays_total{unanswered,stale} = %v; want none sent, 1 stale", maxReplayAge+time.Millisecond, rp2.unanswered, got)
	}
}

// A replay whose SYN the raw socket could not send (replay.NotSentError)
// moved its flow to another backend, which never saw the SYN: the flow's
// NEW_FLOW and the time until the client's own retransmission are no
// evidence against that backend. The retransmission (SYN_RETRANS) is when
// the backend gets the SYN: from there its answer is a verdict, and its
// silence a timeout at the connect deadline. After a replay that was
// sent, the same SYN_RETRANS is the timeout.
func TestUnsentReplayDecidesNothing(t *testing.T) {
	for _, tc := range []struct {
		name     string
		sent     bool
		answered bool // the backend answers the client's retransmission
		failures uint32
	}{
		{"unsent, then answered", false, true, 0},
		{"unsent, then silent", false, false, 1},
		{"sent", true, true, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, rp, svc, be, _ := replayEnv(t)
			if !tc.sent {
				rp.err = &replay.NotSentError{Backend: be[1], Err: replay.ErrNotSent}
			}
			p := e.nextPort()
			e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[0], p, 0),
				e.event(outcomes.Refused, svc, be[0], p, outcomes.FlagRescued)})
			if len(rp.refused) != 1 {
				t.Fatalf("replays asked %v, want one", rp.refused)
			}
			result := "sent"
			if !tc.sent {
				result = "not_sent"
			}
			if got := testutil.ToFloat64(e.a.metrics.Replays.WithLabelValues("refused", result)); got != 1 {
				t.Errorf("replays_total{refused,%s} = %v, want 1", result, got)
			}
			// The refusal counts against the backend that refused.
			if got := e.endpoint(be[0]); got.ConsecutiveFailures != 1 || got.LastFailureKind != "refused" {
				t.Errorf("backend %d: %d failures (last %q), want its refusal", be[0], got.ConsecutiveFailures, got.LastFailureKind)
			}
			// The datapath's report of the move, read after the replay; the
			// client retransmits a second later (past the settings' 1 s
			// connect timeout).
			e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[1], p, outcomes.FlagRepick)})
			e.clk.Step(time.Second)
			e.a.Advance()
			e.a.HandleEvents([]outcomes.Event{e.event(outcomes.SynRetrans, svc, be[1], p, 0)})
			if tc.answered {
				e.a.HandleEvents([]outcomes.Event{e.event(outcomes.Established, svc, be[1], p, 0),
					e.event(outcomes.FirstData, svc, be[1], p, 0)})
			}
			e.clk.Step(time.Second)
			e.a.Advance()
			got := e.endpoint(be[1])
			want := ""
			if tc.failures > 0 {
				want = "timeout"
			}
			if got.ConsecutiveFailures != tc.failures || got.LastFailureKind != want {
				t.Errorf("backend %d: %d failures (last %q), want %d (%q)", be[1], got.ConsecutiveFailures, got.LastFailureKind, tc.failures, want)
			}
		})
	}
}

// An unsent replay whose flow moved back to the backend that refused it
// (no other backend active) leaves that refusal a verdict, a probe's too:
// the flow is voided only after the refusal was classified.
func TestUnsentReplayKeepsTheRefusal(t *testing.T) {
	e, rp, svc, be, _ := replayEnv(t)
	rp.err = &replay.NotSentError{Backend: be[0], Err: replay.ErrNotSent}
	p := e.nextPort()
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[0], p, 0),
		e.event(outcomes.Refused, svc, be[0], p, outcomes.FlagRescued)})
	if got := e.endpoint(be[0]); got.ConsecutiveFailures != 1 || got.LastFailureKind != "refused" {
		t.Errorf("backend %d: %d failures (last %q), want its refusal", be[0], got.ConsecutiveFailures, got.LastFailureKind)
	}
}

// A service's replay deadline is set from its first 8 handshakes: until
// then each unanswered SYN waits the cautious half of the connect timeout.
func TestReplayDeadlineFromTheFirstHandshakes(t *testing.T) {
	e, _, svc, be, after := replayEnv(t)
	if after != 500*time.Millisecond {
		t.Fatalf("replay deadline before any handshake %v, want 500ms (half the connect timeout)", after)
	}
	for i := range replayFirst {
		p := e.nextPort()
		e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[0], p, 0)})
		e.clk.Step(300 * time.Microsecond)
		e.a.HandleEvents([]outcomes.Event{e.event(outcomes.Established, svc, be[0], p, 0),
			e.event(outcomes.FirstData, svc, be[0], p, 0)})
		want := 500 * time.Millisecond
		if i+1 == replayFirst {
			want = replayFloor
		}
		if got := e.a.policyOf(be[0]).Replay; got != want {
			t.Fatalf("after %d handshakes of 300µs the replay deadline is %v, want %v", i+1, got, want)
		}
	}
}
