// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/admin"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

// accrualYAML is the failureAccrual block these tests use: 5 failures,
// a first penalty of 4s (±20%), a connect deadline of 300ms.
const accrualYAML = `    failureAccrual:
      maxFailures: 5
      minPenalty: 4s
      maxPenalty: 30s
      jitterRatio: 0.2
      connectTimeout: 300ms
`

const maxFailures = 5

// endpointsView is GET /admin/endpoints.
type endpointsView admin.EndpointsView

// state returns the accrual state of endpoint ep of service web, and when
// its probation starts (zero unless ejected).
func (e *env) state(ep string) (string, time.Time) {
	e.t.Helper()
	var v endpointsView
	if err := e.agent.JSON(e.ctx, "/admin/endpoints", &v); err != nil {
		e.t.Fatal(err)
	}
	for _, s := range v.Services {
		for _, x := range s.Endpoints {
			if x.Endpoint == ep {
				var at time.Time
				if x.ProbationAt != nil {
					at = *x.ProbationAt
				}
				return x.State, at
			}
		}
	}
	e.t.Fatalf("endpoint %s not in /admin/endpoints", ep)
	return "", time.Time{}
}

const b3 = "198.18.3.2:8080"

// checkProtected asserts the scenario's promise: once the bad backend has
// failed maxFailures times, at least 99.9% of the connections that follow
// succeed. Probes of the still-bad backend are real connections and count
// against the budget; the penalty keeps them rare.
func checkProtected(t *testing.T, rs testnet.Results) {
	t.Helper()
	after, ok := rs.AfterFailures(maxFailures)
	if !ok {
		// Fewer client-visible failures than maxFailures: the datapath
		// rescued them (retransmitted SYNs moved off the ejected backend).
		after = rs
	}
	rate := after.SuccessRate()
	t.Logf("all: %v; after the first %d failures: %d connections, %.3f%% succeeded",
		rs, maxFailures, len(after), 100*rate)
	if len(after) < 1000 {
		t.Fatalf("only %d connections after the first failures: not enough to judge 99.9%%", len(after))
	}
	if rate < 0.999 {
		t.Fatalf("success rate after the first %d failures = %.3f%%, want >= 99.9%%", maxFailures, 100*rate)
	}
}

// A backend with nothing listening refuses every connection: it is
// ejected after maxFailures refusals and, once healed, rejoins after its
// penalty and one probe.
func TestRefusingBackendIsEjectedAndRejoins(t *testing.T) {
	e := newEnv(t, 3)
	if err := e.topo.Backend(3).SetMode(testnet.Refuse); err != nil {
		t.Fatal(err)
	}
	e.startAgent(config(e.topo, all(3), accrualYAML))

	// A 3 s connect timeout outlasts the client's SYN retransmission (1 s),
	// so the refused probe, which the datapath rescues, costs no failure:
	// with 1 s it is always one, and one straggler more would break 99.9%.
	rs := e.load(200, 7*time.Second, 3*time.Second)
	checkProtected(t, rs)
	if st, _ := e.state(b3); st != "ejected" && st != "probation" {
		t.Fatalf("b3 is %s, want ejected", st)
	}
	m := e.metrics()
	if got := m.Get("penaltybox_endpoints", "svc_name", "web", "state", "ejected"); got != 1 {
		t.Errorf("penaltybox_endpoints{state=ejected} = %v, want 1", got)
	}
	if got := m.Get("penaltybox_endpoint_failures_by_kind_total", "backend", b3, "kind", "refused"); got < maxFailures {
		t.Errorf("refused failures of b3 = %v, want >= %d", got, maxFailures)
	}
	if got := m.Get("penaltybox_ejection_reaction_seconds"); got < 1 {
		t.Errorf("reaction histogram has %v samples", got)
	}
	if !e.agent.LogContains(`"msg":"endpoint ejected"`, b3, "consecutive-failures", "penalty") {
		t.Errorf("no structured log line for the ejection:\n%s", e.agent.LogTail(10))
	}

	// Heal b3. It gets traffic again within its current penalty plus one
	// probe; the penalty has doubled at most a few times by now.
	if err := e.topo.Backend(3).SetMode(testnet.Serve); err != nil {
		t.Fatal(err)
	}
	healed := time.Now()
	st, probationAt := e.state(b3)
	limit := 3 * time.Second // probe in probation already, or a small margin
	if st == "ejected" {
		limit = time.Until(probationAt) + 3*time.Second
	}
	t.Logf("healed; b3 is %s, probation at %v, allowing %v", st, probationAt, limit)
	rs = e.load(200, limit+time.Second, time.Second)
	var first time.Time
	for _, r := range rs {
		if r.Backend == "b3" {
			first = r.Started
			break
		}
	}
	if first.IsZero() || first.Sub(healed) > limit {
		t.Fatalf("b3 did not get traffic within %v of healing: %v", limit, rs)
	}
	t.Logf("b3 served again %v after healing", first.Sub(healed).Round(time.Millisecond))
	if st, _ := e.state(b3); st != "ready" {
		t.Fatalf("b3 is %s after a successful probe, want ready", st)
	}
	if got := e.metrics().Get("penaltybox_endpoint_probes_total", "backend", b3, "result", "success"); got != 1 {
		t.Errorf("successful probes = %v, want 1", got)
	}
	// Every state change is one line with the penalty: served, then reset.
	if !e.agent.LogContains(`"msg":"endpoint probation"`, b3, `"penalty":"`) ||
		!e.agent.LogContains(`"msg":"endpoint ready"`, b3, `"reason":"probe-succeeded"`, `"penalty":"0s"`) {
		t.Errorf("no structured log lines for probation and return:\n%s", e.agent.LogTail(10))
	}
}

// A backend that never answers SYN (dropped by nftables) is ejected on the
// agent's connect deadline; the clients' retransmitted SYNs are moved to
// the healthy backends, so even the first connections get through.
func TestBlackholedBackendIsEjected(t *testing.T) {
	e := newEnv(t, 3)
	if err := e.topo.Backend(3).SetMode(testnet.Blackhole); err != nil {
		t.Fatal(err)
	}
	e.startAgent(config(e.topo, all(3), accrualYAML))

	// Clients wait 3s: long enough for one SYN retransmission (1s).
	rs := e.load(200, 7*time.Second, 3*time.Second)
	checkProtected(t, rs)
	m := e.metrics()
	if got := m.Get("penaltybox_endpoint_failures_by_kind_total", "backend", b3, "kind", "timeout"); got < maxFailures {
		t.Errorf("timeout failures of b3 = %v, want >= %d", got, maxFailures)
	}
	if got := m.Get("penaltybox_datapath_repicked_flows_total"); got < 1 {
		t.Errorf("no unanswered flow was moved off the ejected backend")
	}
	if st, _ := e.state(b3); st != "ejected" && st != "probation" {
		t.Fatalf("b3 is %s, want ejected", st)
	}
}

// A backend that accepts and resets before sending a byte is ejected too,
// with the resets counted as such.
func TestResettingBackendIsEjected(t *testing.T) {
	e := newEnv(t, 3)
	if err := e.topo.Backend(3).SetMode(testnet.ResetAfterHandshake); err != nil {
		t.Fatal(err)
	}
	e.startAgent(config(e.topo, all(3), accrualYAML))

	rs := e.load(200, 5*time.Second, time.Second)
	after, _ := rs.AfterFailures(maxFailures)
	t.Logf("all: %v; after the first %d failures: %v", rs, maxFailures, after)
	if rate := after.SuccessRate(); rate < 0.995 {
		t.Fatalf("success rate after ejection %.2f%%", 100*rate)
	}
	if got := e.metrics().Get("penaltybox_endpoint_failures_by_kind_total", "backend", b3, "kind", "reset"); got < maxFailures {
		t.Errorf("reset failures of b3 = %v, want >= %d", got, maxFailures)
	}
	if st, _ := e.state(b3); st != "ejected" && st != "probation" {
		t.Fatalf("b3 is %s, want ejected", st)
	}
}

// A flapping backend is ejected while bad and readmitted while good, again
// and again, and never gets more than a burst of failures each time.
func TestFlappingBackend(t *testing.T) {
	e := newEnv(t, 3)
	// Each phase (1.5 s) outlasts the longest penalty (1 s plus 10%
	// jitter), so every serving phase holds at least one probation and
	// its probe succeeds, whatever the phases' alignment with the
	// penalties. With shorter phases the probes could all fall into
	// refusing phases by chance.
	e.startAgent(config(e.topo, all(3), `    failureAccrual:
      maxFailures: 5
      minPenalty: 250ms
      maxPenalty: 1s
      jitterRatio: 0.1
      connectTimeout: 300ms
`))
	ctx, cancel := context.WithCancel(e.ctx)
	defer cancel()
	go func() {
		mode := testnet.Refuse
		for i := 0; i < 8; i++ {
			e.topo.Backend(3).SetMode(mode)
			if mode == testnet.Refuse {
				mode = testnet.Serve
			} else {
				mode = testnet.Refuse
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(1500 * time.Millisecond):
			}
		}
		e.topo.Backend(3).SetMode(testnet.Serve)
	}()
	rs := e.load(200, 12*time.Second, time.Second)
	cancel()
	m := e.metrics()
	ejections := m.Get("penaltybox_endpoint_ejections_total", "backend", b3)
	probesOK := m.Get("penaltybox_endpoint_probes_total", "backend", b3, "result", "success")
	served := rs.ByBackend()["b3"]
	t.Logf("%v; b3: %v ejections, %v successful probes", rs, ejections, probesOK)
	// Serving phases 1, 3 and 5 lie wholly inside the load.
	if ejections < 3 || probesOK < 3 || served == 0 {
		t.Fatalf("want b3 ejected and readmitted repeatedly: %v ejections, %v probes ok, %d served", ejections, probesOK, served)
	}
	// Four bad phases: each costs at most maxFailures plus a few failed
	// probes and in-flight stragglers.
	if f := rs.Failures(); f > 4*(maxFailures+6) {
		t.Fatalf("%d failures over four bad phases", f)
	}
}

// When every endpoint is ejected the service fails open: new flows go to
// all endpoints again, and a metric and a log line say so.
func TestFailOpenWhenNothingIsReady(t *testing.T) {
	e := newEnv(t, 2)
	for i := 1; i <= 2; i++ {
		e.topo.Backend(i).SetMode(testnet.Refuse)
	}
	e.startAgent(config(e.topo, all(2), accrualYAML))
	e.load(100, 2*time.Second, time.Second)
	m := e.metrics()
	if got := m.Get("penaltybox_service_fail_open", "svc_name", "web"); got != 1 {
		t.Fatalf("penaltybox_service_fail_open = %v, want 1", got)
	}
	if !e.agent.LogContains("service failing open") {
		t.Errorf("no log line for fail-open")
	}
	// Failing open, the table holds both endpoints: heal one and it serves
	// at once, ending fail-open.
	e.topo.Backend(1).SetMode(testnet.Serve)
	rs := e.load(100, 2*time.Second, time.Second)
	if rs.ByBackend()["b1"] == 0 {
		t.Fatalf("healed b1 got no traffic while failing open: %v", rs)
	}
	eventually(t, 3*time.Second, "fail-open to end", func() bool {
		return e.metrics().Get("penaltybox_service_fail_open", "svc_name", "web") == 0
	})
}

// A restarted agent keeps an ejected endpoint out until its penalty ends.
func TestRestartKeepsPenalty(t *testing.T) {
	e := newEnv(t, 3)
	e.topo.Backend(3).SetMode(testnet.Refuse)
	a := e.startAgent(config(e.topo, all(3), `    failureAccrual:
      maxFailures: 5
      minPenalty: 60s
      maxPenalty: 2m
      jitterRatio: 0
`))
	e.load(100, 2*time.Second, time.Second)
	st, probationAt := e.state(b3)
	if st != "ejected" {
		t.Fatalf("b3 is %s, want ejected", st)
	}
	if err := a.Stop(); err != nil {
		t.Fatal(err)
	}
	e.topo.Backend(3).SetMode(testnet.Serve) // healed, but its penalty runs on
	if err := a.Start(e.ctx); err != nil {
		t.Fatal(err)
	}
	st, at := e.state(b3)
	if st != "ejected" || !at.Equal(probationAt) {
		t.Fatalf("after restart b3 is %s with probation at %v, want ejected until %v", st, at, probationAt)
	}
	rs := e.load(100, 2*time.Second, time.Second)
	if n := rs.ByBackend()["b3"]; n != 0 || time.Until(probationAt) < 0 {
		t.Fatalf("b3 got %d connections before its penalty ended (%v)", n, probationAt)
	}
}

// With retryRefused, a refusing backend costs its clients neither a
// failure nor a wait: the datapath keeps each refusal from its client and
// the agent replays the client's SYN at once, which the datapath sends to
// another backend. No connection waits for its own SYN retransmission (1s
// on Linux), and the backend is ejected as usual.
func TestRetryRefusedHidesRefusals(t *testing.T) {
	e := newEnv(t, 3)
	e.topo.Backend(3).SetMode(testnet.Refuse)
	e.startAgent(config(e.topo, all(3), accrualYAML+"    retryRefused: true\n"))

	// Clients wait 3s to connect: room for one SYN retransmission (1s).
	before := e.synCounters()
	rs := e.load(replayLoadRate(), 5*time.Second, 3*time.Second)
	syns := e.synCounters().since(before)
	t.Logf("%v; %v; %s", rs, syns, slowConnections(rs))
	if f := rs.Failures(); f != 0 {
		t.Fatalf("%d connections failed: %v", f, rs.Counts())
	}
	if st, _ := e.state(b3); st != "ejected" && st != "probation" {
		t.Fatalf("b3 is %s, want ejected", st)
	}
	m := e.metrics()
	replayed := m.Get("penaltybox_syn_replays_total", "reason", "refused", "result", "sent")
	t.Logf("%v SYNs replayed", replayed)
	// Without replays (a kernel that refuses them) each rescued
	// connection waits for its own retransmission, which the datapath
	// moves to another backend (the retried flows below).
	if bpftest.Replays(t) {
		noneWaited(t, rs, syns, m, "refused")
		if replayed < maxFailures {
			t.Errorf("replayed SYNs = %v, want >= %d", replayed, maxFailures)
		}
	} else {
		e.replaysOff(t, m)
	}
	if got := m.Get("penaltybox_datapath_refused_retried_total", "result", "retried"); got < maxFailures {
		t.Errorf("retried flows = %v, want >= %d", got, maxFailures)
	}
	if got := m.Get("penaltybox_endpoint_failures_by_kind_total", "backend", b3, "kind", "refused"); got < maxFailures {
		t.Errorf("refusals counted against b3 = %v, want >= %d", got, maxFailures)
	}
}

// A backend that drops SYNs costs its clients neither a failure nor their
// own SYN retransmission (1 s): a SYN it leaves unanswered past the
// service's replay deadline (four times the recent p99 handshake, at
// least 16 ms, at most half the connect timeout) is replayed by the agent
// and moved by the datapath to another backend; the connect deadline
// still ejects the silent backend. On a kernel that refuses replays, a
// flow leaves the silent backend on its client's own retransmission once
// the backend is ejected: the clients wait 8 s to connect there (SYNs
// retransmitted after 1, 3 and 7 s; since Linux 6.5, with
// tcp_syn_linear_timeouts, every second), and none may fail either.
func TestUnansweredSYNsAreReplayed(t *testing.T) {
	replays := bpftest.Replays(t)
	e := newEnv(t, 3)
	e.topo.Backend(3).SetMode(testnet.Blackhole)
	e.startAgent(config(e.topo, all(3), accrualYAML))

	connect := 3 * time.Second
	if !replays {
		connect = 8 * time.Second
	}
	before := e.synCounters()
	rs := e.load(replayLoadRate(), 5*time.Second, connect)
	syns := e.synCounters().since(before)
	m := e.metrics()
	replayed := m.Get("penaltybox_syn_replays_total", "reason", "unanswered", "result", "sent")
	t.Logf("%v; %v unanswered SYNs replayed; %v; %s", rs, replayed, syns, slowConnections(rs))
	if f := rs.Failures(); f != 0 {
		t.Fatalf("%d connections failed: %v", f, rs.Counts())
	}
	if st, _ := e.state(b3); st != "ejected" && st != "probation" {
		t.Errorf("b3 is %s, want ejected by its connect timeouts", st)
	}
	if !replays {
		e.replaysOff(t, m)
		return
	}
	noneWaited(t, rs, syns, m, "unanswered")
	if replayed < 1 {
		t.Errorf("no unanswered SYN replayed")
	}
	// Learnt from the healthy backends' handshakes: natively the floor
	// (16 ms: handshakes on veths take well under 4 ms); in a VM (32 ms
	// once) below the cautious start, half the connect timeout (150 ms),
	// which stands until handshakes are known (and is the cap).
	var v servicesView
	if err := e.agent.JSON(e.ctx, "/admin/services", &v); err != nil {
		t.Fatal(err)
	}
	got := v.Services[0].ReplayAfter
	if d, err := time.ParseDuration(got); inVM() && (err != nil || d < 16*time.Millisecond || d >= 150*time.Millisecond) {
		t.Errorf("/admin/services replayAfter %q, want one learnt from the handshakes: from 16ms (the floor) to under 150ms (the start, and the cap: a p99 handshake over 32ms)", got)
	} else if !inVM() && got != "16ms" {
		t.Errorf("/admin/services replayAfter %q, want 16ms (the floor: handshakes here take well under 4ms)", got)
	}
	t.Logf("replay deadline learnt: %s", got)
}
