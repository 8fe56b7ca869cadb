// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

// ipv6Config is an IPv6 service on [VIP6]:80 over the backends' IPv6
// addresses, with extra service-level YAML.
func ipv6Config(topo *testnet.Topology, extra string) string {
	var bs []string
	for _, b := range topo.Backends {
		bs = append(bs, fmt.Sprintf("%q", fmt.Sprintf("[%s]:8080", b.AddrV6)))
	}
	return fmt.Sprintf(`interfaces: [%s]
services:
  - name: web6
    vip: %s
    port: 80
    protocol: tcp
    backends: [%s]
%s`, strings.Join(topo.NodeIfaces(), ", "), testnet.VIP6, strings.Join(bs, ", "), extra)
}

// ejectAfterFive is the service YAML of the IPv6 and TIME_WAIT tests: an
// endpoint ejected after five failures in a row, for 1-2 s; a connect
// deadline of 300 ms.
const ejectAfterFive = `    failureAccrual:
      maxFailures: 5
      minPenalty: 1s
      maxPenalty: 2s
      jitterRatio: 0
      connectTimeout: 300ms
`

// IPv6 end to end: 1,000 new connections from an IPv6 client through an
// IPv6 VIP reach all three real servers; an endpoint that starts refusing
// is ejected after maxFailures refusals (the client sees none: each refused
// SYN's RST is kept from it and the agent replays the SYN to another
// endpoint at once), and rejoins once healed.
func TestIPv6ServiceBalancesEjectsAndRejoins(t *testing.T) {
	e := newEnv(t, 3)
	e.startAgent(ipv6Config(e.topo, ejectAfterFive))
	target := fmt.Sprintf("[%s]:80", testnet.VIP6)
	rs, err := testnet.Load(e.ctx, e.topo.Client, testnet.LoadSpec{Target: target, Rate: 200, Count: 1000,
		ConnectTimeout: 3 * time.Second, RequestTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("IPv6, all serving: %v", rs)
	if rs.Count(testnet.OK) != len(rs) || len(rs) != 1000 {
		t.Fatalf("%v: want all 1000 connections answered", rs)
	}
	for name, n := range rs.ByBackend() {
		// Maglev over three endpoints: about a third each.
		if n < 200 {
			t.Errorf("backend %s answered %d of 1000, want about a third", name, n)
		}
	}
	if len(rs.ByBackend()) != 3 {
		t.Errorf("backends answering: %v, want all three", rs.ByBackend())
	}

	b3v6 := fmt.Sprintf("[%s]:8080", e.topo.Backend(3).AddrV6)
	if err := e.topo.Backend(3).SetMode(testnet.Refuse); err != nil {
		t.Fatal(err)
	}
	before := e.synCounters()
	rs, err = testnet.Load(e.ctx, e.topo.Client, testnet.LoadSpec{Target: target, Rate: 100, Count: 200,
		ConnectTimeout: 3 * time.Second, RequestTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	syns := e.synCounters().since(before)
	t.Logf("IPv6, b3 refusing: %v; %v; %s", rs, syns, slowConnections(rs))
	if rs.Failures() != 0 {
		t.Errorf("%v: want no client-visible failure (refused SYNs are replayed elsewhere)", rs)
	}
	if st, _ := e.state(b3v6); st != "ejected" && st != "probation" {
		t.Errorf("b3 is %s, want ejected", st)
	}
	m := e.metrics()
	// Replayed at once by the agent, not on the client's retransmission
	// a second later.
	replays := bpftest.Replays(t)
	if replays {
		noneWaited(t, rs, syns, m, "refused")
	}
	if got := m.Get("penaltybox_endpoint_failures_by_kind_total", "backend", b3v6, "kind", "refused"); got < maxFailures {
		t.Errorf("refused failures of b3 = %v, want >= %d", got, maxFailures)
	}
	if got := m.Get("penaltybox_endpoint_ejections_total", "backend", b3v6); got < 1 {
		t.Errorf("ejections of b3 = %v, want >= 1", got)
	}
	if got := m.Get("penaltybox_syn_replays_total", "reason", "refused", "result", "sent"); replays && got < 1 {
		t.Errorf("refused SYNs replayed = %v, want >= 1", got)
	}

	if err := e.topo.Backend(3).SetMode(testnet.Serve); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if st, _ := e.state(b3v6); st == "ready" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("b3 did not rejoin within 10 s of healing")
		}
		if _, err := testnet.Load(e.ctx, e.topo.Client, testnet.LoadSpec{Target: target, Rate: 50, Count: 5,
			ConnectTimeout: 3 * time.Second, RequestTimeout: 3 * time.Second}); err != nil {
			t.Fatal(err)
		}
	}
}
