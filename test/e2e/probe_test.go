// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// Every probe the kernel admits gets a verdict: a refusing endpoint goes
// through dozens of short penalties, and each probe it refuses is a failed
// probe (counted as a refusal, its penalty doubling), never one the agent
// has to regrant because no verdict came.
func TestEveryRefusedProbeIsJudged(t *testing.T) {
	e := newEnv(t, 3)
	e.topo.Backend(3).SetMode(testnet.Refuse)
	a := e.startAgent(config(e.topo, all(3), `    failureAccrual:
      maxFailures: 3
      minPenalty: 50ms
      maxPenalty: 100ms
      jitterRatio: 0
      connectTimeout: 300ms
`))
	e.load(200, 15*time.Second, 3*time.Second)
	m := e.metrics()
	probes := m.Get("penaltybox_datapath_probe_flows_total")
	failed := m.Get("penaltybox_accrual_transitions_total", "svc_name", "web", "reason", "probe-failed")
	inconclusive := m.Get("penaltybox_accrual_transitions_total", "svc_name", "web", "reason", "probe-inconclusive")
	refused := m.Get("penaltybox_endpoint_failures_by_kind_total", "svc_name", "web", "backend", b3, "kind", "refused")
	t.Logf("probes admitted %v, failed %v, inconclusive %v, refusals of b3 %v", probes, failed, inconclusive, refused)
	if probes < 20 {
		t.Fatalf("only %v probes in 15 s: the test did not exercise probation", probes)
	}
	if a.LogContains("probation stalled") {
		t.Errorf("a probe went without a verdict:\n%s", a.LogTail(30))
	}
	// The last probe may still be on its way when the load stops.
	if failed < probes-1 || inconclusive != 0 {
		t.Fatalf("%v probes admitted, %v judged failed, %v inconclusive: want every one failed", probes, failed, inconclusive)
	}
	if refused < 3+failed {
		t.Fatalf("refusals of b3 %v, want the 3 that ejected it plus one per failed probe (%v)", refused, failed)
	}
}
