// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// An endpoint that refuses 30% of its connections, never twice in a row,
// stays in under consecutive accrual and is ejected by the failure-rate
// rule, with its window on /admin/endpoints beforehand and the rule named
// in the metric.
func TestFailureRateEjectsAPartlyFailingEndpoint(t *testing.T) {
	for _, mode := range []accrual.Mode{accrual.ModeConsecutive, accrual.ModeFailureRate} {
		t.Run(string(mode), func(t *testing.T) {
			e := newEnv(t)
			s := web(80, 3, settings(func(s *accrual.Settings) { s.Mode, s.MinCalls = mode, 10 }))
			e.start(state(s))
			svc, be := e.ids(s)
			for _, c := range "rssrsssrs" { // 3 of 9: below minCalls
				if c == 'r' {
					e.refused(svc, be[2], false)
				} else {
					e.served(svc, be[2], false)
				}
			}
			e.wantState(be[2], "ready")
			if mode == accrual.ModeFailureRate {
				if w := e.endpoint(be[2]).Window; w == nil || w.Calls != 9 || w.Failures != 3 {
					t.Fatalf("window %+v, want 9 calls, 3 failures", w)
				}
			} else if w := e.endpoint(be[2]).Window; w != nil {
				t.Fatalf("consecutive mode shows a window: %+v", w)
			}
			e.served(svc, be[2], false) // 3 of 10 = 0.3 > 0.2
			if mode == accrual.ModeConsecutive {
				e.wantState(be[2], "ready")
				return
			}
			e.wantState(be[2], "ejected")
			if st, _ := e.kernel(be[2]); st != pbmaps.BackendEjected {
				t.Fatalf("kernel entry %s, want ejected", st)
			}
			e.wantReachable(s, be[0], be[1])
			if got := testutil.ToFloat64(e.a.Metrics().Transitions.WithLabelValues("web", string(accrual.ReasonFailureRate))); got != 1 {
				t.Fatalf("transitions{failure-rate} = %v, want 1", got)
			}
			if c := e.endpoint(be[2]).Counters; c.EjectionsBy.FailureRate != 1 {
				t.Fatalf("counters %+v", c)
			}
		})
	}
}

// Handshake times come from the events' own timestamps: an endpoint whose
// SYN-ACKs come 60 ms after the SYNs is ejected by the slow-connect rule,
// one answering within 5 ms is not.
func TestSlowHandshakesEject(t *testing.T) {
	e := newEnv(t)
	s := web(80, 3, settings(func(s *accrual.Settings) { s.SlowConnectThreshold = 50 * time.Millisecond }))
	e.start(state(s))
	svc, be := e.ids(s)
	handshake := func(b uint32, d time.Duration) {
		p := e.nextPort()
		e.a.HandleEvents([]outcomes.Event{e.event(outcomes.NewFlow, svc, b, p, 0)})
		e.clk.Step(d)
		e.a.HandleEvents([]outcomes.Event{e.event(outcomes.Established, svc, b, p, 0), e.event(outcomes.FirstData, svc, b, p, 0)})
	}
	for range 5 {
		handshake(be[0], 5*time.Millisecond)
		handshake(be[1], 60*time.Millisecond)
	}
	e.wantState(be[0], "ready")
	e.wantState(be[1], "ejected")
	if got := testutil.ToFloat64(e.a.Metrics().Transitions.WithLabelValues("web", string(accrual.ReasonSlowConnects))); got != 1 {
		t.Fatalf("transitions{slow-connects} = %v, want 1", got)
	}
	if c := e.endpoint(be[1]).Counters; c.SlowConnects != 5 || c.Successes != 5 {
		t.Fatalf("counters %+v, want 5 slow successes", c)
	}
}
