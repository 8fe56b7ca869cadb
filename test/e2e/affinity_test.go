// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"fmt"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// sticky opens n connections from the client, one request each, and
// returns how many reached each backend.
func (e *env) sticky(n int) map[string]int {
	e.t.Helper()
	got := map[string]int{}
	for range n {
		c := e.dialVIP()
		got[c.mustGet("a new connection")]++
		c.c.Close()
	}
	return got
}

// only returns the one backend of got, failing the test if there are
// more.
func only(t *testing.T, got map[string]int, when string) string {
	t.Helper()
	if len(got) != 1 {
		t.Fatalf("%s: the client's connections went to %v, want one backend", when, got)
	}
	for b := range got {
		return b
	}
	return ""
}

// sessionAffinity ClientIP end to end: a client's connections stay on one
// backend across an agent restart (pb_affinity is pinned like the rest);
// accrual wins over affinity: the pinned backend refusing is ejected after
// maxFailures refusals, the client moves to another backend and stays
// there when the first is healthy again. (With retryRefused, the default,
// the client moves at the first refusal: the retried SYN's backend pins
// it; here the refusals reach the client, so that accrual decides.)
func TestSessionAffinityAcrossRestartAndEjection(t *testing.T) {
	e := newEnv(t, 3)
	a := e.startAgent(config(e.topo, all(3), `    sessionAffinity: 10m
    retryRefused: false
    failureAccrual:
      maxFailures: 3
      minPenalty: 1m
      maxPenalty: 2m
      jitterRatio: 0
`))
	pinned := only(t, e.sticky(30), "pinned")

	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := a.Start(e.ctx); err != nil {
		t.Fatal(err)
	}
	if b := only(t, e.sticky(30), "after an agent restart"); b != pinned {
		t.Fatalf("after an agent restart the client went to %s, was pinned to %s", b, pinned)
	}

	idx := 0
	for i := 1; i <= 3; i++ {
		if e.topo.Backend(i).Name == pinned {
			idx = i
		}
	}
	if idx == 0 {
		t.Fatalf("no backend named %s", pinned)
	}
	e.topo.Backend(idx).SetMode(testnet.Refuse)
	rs := e.load(20, 3*time.Second, 3*time.Second)
	// The kernel trips the endpoint at its third refusal in a row: the
	// client sees those three, one more if a flow raced the trip.
	if n := rs.Failures(); n < 3 || n > 4 {
		t.Errorf("while the pinned backend refused: %v, want 3 refused (maxFailures)", rs.Counts())
	}
	ep := fmt.Sprintf("198.18.%d.2:8080", idx)
	if st, _ := e.state(ep); st != "ejected" {
		t.Fatalf("the pinned backend %s is %s, want ejected", ep, st)
	}
	moved := only(t, rs.Since(time.Now().Add(-time.Second)).ByBackend(), "last second of the ejection")
	if moved == pinned {
		t.Fatalf("the client is still sent to the ejected %s", pinned)
	}
	// The backend healthy again, the client stays where it was moved.
	e.topo.Backend(idx).SetMode(testnet.Serve)
	if b := only(t, e.sticky(30), "the first backend healthy again"); b != moved {
		t.Fatalf("the client went to %s, was moved to %s", b, moved)
	}
}
