// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"fmt"
	"testing"
	"time"
)

// An endpoint that refuses 30% of its connections at random, the way pods
// usually degrade: consecutive accrual (Linkerd's default of 7 in a row)
// leaves it in and the service keeps losing about a tenth of its
// connections; the failure-rate rule ejects it within its window, ejects
// it again each time a probe returns it and it relapses, and after that
// window the service loses well under 1% of its connections (the bench's
// target is 99.9%). What a readmission costs is chance: the window judges
// a returned endpoint once it holds minCalls connections, and a 30% refuser
// can hover near the 20% threshold for a while. Six runs on 2026-12-03
// (this build and the one before) lost 1 to 17 of 4,000 after the window,
// 99.575% to 99.975%, one readmission costing up to 15 (73 calls judged at
// 20.5%); a margin at 99.8% failed two of them, so the test keeps 99%,
// still far from consecutive accrual's ~90%.
func TestPartlyRefusingEndpoint(t *testing.T) {
	const rate = 200
	for _, tc := range []struct {
		mode       string
		d          time.Duration
		maxPenalty string
	}{
		// A chance run of 7 refusals ejects b3 in consecutive mode too, and
		// each of its probes fails 30% of the time, doubling the penalty: a
		// cap of 2 s keeps what one such run takes out of a 12 s run small
		// (with 1m, two failed probes kept b3 out for most of a 6 s run).
		{"consecutive", 12 * time.Second, "2s"},
		{"failure-rate", 30 * time.Second, "1m"},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			e := newEnv(t, 3)
			if err := e.topo.Backend(3).RefuseShare(0.3); err != nil {
				t.Fatal(err)
			}
			// Refusals reach the clients (no replay): the test is about
			// what accrual alone protects.
			e.startAgent(config(e.topo, all(3), fmt.Sprintf(`    retryRefused: false
    failureAccrual:
      mode: %s
      minPenalty: 1s
      maxPenalty: %s
      window: 10s
`, tc.mode, tc.maxPenalty)))
			start := time.Now()
			rs := e.load(rate, tc.d, time.Second)
			m := e.metrics()
			byRate := m.Get("penaltybox_endpoint_ejections_by_reason_total", "backend", b3, "reason", "failure-rate")
			t.Logf("%v; b3 ejections for failure-rate: %v", rs, byRate)
			if tc.mode == "consecutive" {
				// About 1/3 × 30% = 10% of all connections fail; a rare run
				// of 7 buys a second or a few, which changes that little.
				if f := rs.Failures(); f < len(rs)/20 {
					t.Fatalf("%d failures of %d: consecutive accrual protected more than it can", f, len(rs))
				}
				return
			}
			// Runs measured 3 to 5: the first ejection and its relapses (one
			// needs every probe after the first ejection to fail: 0.3^5).
			if byRate < 2 {
				t.Fatalf("b3 ejected %v times for its failure rate, want its relapses too (>= 2)", byRate)
			}
			if !e.agent.LogContains(`"msg":"endpoint ejected"`, b3, `"reason":"failure-rate"`, "window_calls", "threshold") {
				t.Errorf("no log line naming the rule and the window:\n%s", e.agent.LogTail(10))
			}
			// Within the window: the first ejection comes after minCalls
			// connections to b3, a few hundred milliseconds in.
			first := rs.Since(start).Failures()
			after := rs.Since(start.Add(10 * time.Second))
			t.Logf("after the first window: %d connections, %.3f%% succeeded (%d failures of %d overall)",
				len(after), 100*after.SuccessRate(), first, len(rs))
			if len(after) < 3000 {
				t.Fatalf("only %d connections after the window", len(after))
			}
			if r := after.SuccessRate(); r < 0.99 {
				t.Fatalf("success rate after the window %.3f%%, want >= 99%%", 100*r)
			}
		})
	}
}

// An endpoint whose handshakes take 50 ms among peers answering in about
// a millisecond is ejected by the slow-connect rule, and by nothing else:
// none of its connections fails, and its peers stay in.
func TestSlowHandshakesAreEjected(t *testing.T) {
	e := newEnv(t, 3)
	if err := e.topo.Backend(3).DelayHandshakes(50 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	e.startAgent(config(e.topo, all(3), `    failureAccrual:
      slowConnectThreshold: 25ms
`))
	rs := e.load(100, 4*time.Second, time.Second)
	m := e.metrics()
	slow := m.Get("penaltybox_endpoint_ejections_by_reason_total", "backend", b3, "reason", "slow-connects")
	t.Logf("%v; b3: %v ejections for slow connects, %v slow connects", rs, slow,
		m.Get("penaltybox_endpoint_slow_connects_total", "backend", b3))
	if slow < 1 {
		t.Fatalf("b3 not ejected for its slow handshakes")
	}
	if f := rs.Failures(); f != 0 {
		t.Errorf("%d connections failed: a slow endpoint is slow, not failing", f)
	}
	for _, ep := range []string{"198.18.1.2:8080", "198.18.2.2:8080", b3} {
		for _, r := range []string{"consecutive-failures", "probe-failed", "failure-rate", "success-rate-outlier"} {
			if n := m.Get("penaltybox_endpoint_ejections_by_reason_total", "backend", ep, "reason", r); n != 0 {
				t.Errorf("%s ejected %v times for %s", ep, n, r)
			}
		}
		if ep != b3 {
			if n := m.Get("penaltybox_endpoint_ejections_total", "backend", ep); n != 0 {
				t.Errorf("%s (fast) ejected %v times", ep, n)
			}
		}
	}
	if !e.agent.LogContains(`"msg":"endpoint ejected"`, b3, `"reason":"slow-connects"`, "slow_rate") {
		t.Errorf("no log line naming the rule:\n%s", e.agent.LogTail(10))
	}
}
