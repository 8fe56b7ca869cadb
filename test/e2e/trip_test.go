// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/admin"
)

// A kernel trip needs no agent: with the agent frozen (SIGSTOP), a backend
// that refuses every connection gets exactly maxFailures connections, the
// datapath ejects it at the last, and every later connection goes to the
// other backends. Thawed, the agent adopts the ejection: state, penalty,
// the metric, the log line. Without kernel trips a third of the
// connections would be refused for as long as the agent is frozen.
// (retryRefused is off so that refusals reach the clients and are counted.)
func TestKernelTripWithoutTheAgent(t *testing.T) {
	e := newEnv(t, 3)
	rs := frozenAgentRun(e)
	started := len(rs) - rs.Count(testnet.NotStarted)
	t.Logf("agent frozen: %v", rs)
	if refused := rs.Count(testnet.Refused); refused != maxFailures || rs.Count(testnet.OK) != started-maxFailures || started < 100 {
		t.Fatalf("%d started, %d refused, %d OK: want exactly %d refused and the rest OK", started, refused, rs.Count(testnet.OK), maxFailures)
	}

	// The agent, thawed, reads the trip and makes it its ejection.
	deadline := time.Now().Add(5 * time.Second)
	for {
		if st, _ := e.state(b3); st == "ejected" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the thawed agent did not adopt the kernel trip")
		}
		time.Sleep(20 * time.Millisecond)
	}
	m := e.metrics()
	if got := m.Get("penaltybox_kernel_trips_total", "svc_name", "web", "result", "adopted"); got != 1 {
		t.Errorf("penaltybox_kernel_trips_total{adopted} = %v, want 1", got)
	}
	if got := m.Get("penaltybox_endpoint_ejections_total", "backend", b3); got != 1 {
		t.Errorf("ejections of b3 = %v, want 1", got)
	}
	if !e.agent.LogContains("endpoint ejected", b3, `"kernel_trip":true`) {
		t.Errorf("no ejection log line with kernel_trip:\n%s", e.agent.LogTail(20))
	}
	var v admin.ServicesView
	if err := e.agent.JSON(e.ctx, "/admin/services", &v); err != nil {
		t.Fatal(err)
	}
	kt := v.Services[0].KernelTrips
	if kt == nil || kt.Trips != 1 || kt.MaxFailures != maxFailures {
		t.Errorf("/admin/services kernelTrips %+v, want 1 trip at maxFailures %d", kt, maxFailures)
	}
	for _, b := range v.Services[0].Backends {
		if b.Endpoint == b3 && b.KernelStreak < maxFailures {
			t.Errorf("b3's kernelStreak %d, want >= %d", b.KernelStreak, maxFailures)
		}
	}
	if tail := e.agent.LogTail(40); strings.Contains(tail, "kernel trip undone") {
		t.Errorf("the trip was undone:\n%s", tail)
	}
	// Every later flow went elsewhere, and the agent, reading their events
	// in the datapath's order, saw none reach b3 once it was out.
	if got := m.Get("penaltybox_new_flows_to_ejected_total", "svc_name", "web"); got != 0 {
		t.Errorf("penaltybox_new_flows_to_ejected_total = %v, want 0", got)
	}
}

// The same with --kernel-trips=false: while the agent is frozen nothing
// takes b3 out, so a third of the connections are refused; thawed, the
// agent ejects b3 at the fifth refusal's event and counts every later flow
// the datapath gave b3 as one that reached it after its deciding failure.
func TestWithoutKernelTripsFlowsReachTheEjectedEndpoint(t *testing.T) {
	e := newEnv(t, 3)
	rs := frozenAgentRun(e, "--kernel-trips=false")
	t.Logf("agent frozen, no kernel trips: %v", rs)
	refused := rs.Count(testnet.Refused)
	// 150 sequential connections, a third of them to b3: far above 5.
	if refused < 4*maxFailures {
		t.Fatalf("%d refused with the agent frozen and no kernel trips, want well above %d", refused, maxFailures)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if st, _ := e.state(b3); st == "ejected" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the thawed agent did not eject b3")
		}
		time.Sleep(20 * time.Millisecond)
	}
	m := e.metrics()
	if got := m.Get("penaltybox_new_flows_to_ejected_total", "svc_name", "web"); got != float64(refused-maxFailures) {
		t.Errorf("penaltybox_new_flows_to_ejected_total = %v, want %d (the refusals after the fifth)", got, refused-maxFailures)
	}
	if got := m.Get("penaltybox_kernel_trips_total", "svc_name", "web", "result", "adopted"); got != 0 {
		t.Errorf("penaltybox_kernel_trips_total{adopted} = %v with kernel trips off, want 0", got)
	}
}

// frozenAgentRun starts the agent (with args) over three backends, b3
// refusing every connection, freezes it (SIGSTOP) and runs 150 sequential
// connections through the VIP, then thaws it. One connection at a time, so
// no connection can be on its way to b3 while the deciding refusal is: the
// counts are exact. Refusals reach the clients (retryRefused off): a frozen
// agent replays nothing, and the count is what the kernel lets through.
func frozenAgentRun(e *env, args ...string) testnet.Results {
	t := e.t
	t.Helper()
	if err := e.topo.Backend(3).SetMode(testnet.Refuse); err != nil {
		t.Fatal(err)
	}
	e.startAgent(config(e.topo, all(3), accrualYAML+"    retryRefused: false\n"), args...)
	if err := e.agent.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	thawed := false
	thaw := func() {
		if !thawed {
			thawed = true
			if err := e.agent.Signal(syscall.SIGCONT); err != nil {
				t.Error(err)
			}
		}
	}
	t.Cleanup(thaw)
	rs, err := testnet.Load(e.ctx, e.topo.Client, testnet.LoadSpec{Target: testnet.VIP + ":80",
		Rate: 100, Count: 150, Concurrency: 1, ConnectOnly: true, ConnectTimeout: 3 * time.Second})
	thaw()
	if err != nil {
		t.Fatal(err)
	}
	return rs
}
