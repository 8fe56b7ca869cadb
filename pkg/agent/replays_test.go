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

// The reader runs the replay deadlines as it reads (caughtUp), so the
// loop's timer does not wake for them (under load each cost a wake-up of
// the loop, a kick of the reader and another wake-up): it asks to read
// again by the next replay deadline, and a SYN still unanswered when it
// has read up to that deadline is replayed, once; one answered before is
// not.
func TestReaderRunsReplayDeadlines(t *testing.T) {
	e := newEnv(t)
	rp := &fakeReplayer{}
	e.a.replays.replayer = rp
	s := web(80, 2, settings())
	s.RetryRefused = true
	e.start(state(s))
	svc, be := e.ids(s)
	after := e.a.policyOf(be[0]).Replay
	if after <= 0 || after >= time.Second {
		t.Fatalf("replay deadline %v, want one before the 1s connect timeout", after)
	}
	if e.ev.onCaught == nil {
		t.Fatal("the agent gave the reader no hook")
	}
	start := e.clk.Now()
	answered, silent := e.nextPort(), e.nextPort()
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, be[0], answered, 0), e.event(outcomes.NewFlow, svc, be[1], silent, 0)})
	if next := e.a.NextDeadline(); !next.Equal(start.Add(time.Second)) {
		t.Errorf("the loop's next deadline in %v, want the connect timeout's 1s (not the replay's %v)", next.Sub(start), after)
	}
	if by := e.ev.onCaught(start); !by.Equal(start.Add(after)) {
		t.Fatalf("read asked by %v, want the replay deadline %v", by.Sub(start), after)
	}
	e.clk.Step(after / 2)
	e.a.HandleEvents([]outcomes.Event{e.event(outcomes.Established, svc, be[0], answered, 0)})
	if by := e.ev.onCaught(e.clk.Now()); !by.Equal(start.Add(after)) {
		t.Fatalf("read asked by %v, want the silent flow's replay deadline %v", by.Sub(start), after)
	}
	if len(rp.unanswered) != 0 {
		t.Fatalf("replayed before the deadline: %v", rp.unanswered)
	}
	e.clk.Step(after - after/2)
	if by := e.ev.onCaught(e.clk.Now()); !by.IsZero() {
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
	if e.ev.kicks != 0 {
		t.Errorf("%d kicks: the replay deadlines need none", e.ev.kicks)
	}
}
