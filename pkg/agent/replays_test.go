// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"net/netip"
	"testing"

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
