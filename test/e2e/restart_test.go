// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/admin"
)

// loadAround runs rate new connections per second for d in the background
// while during runs; it returns the results once both are done.
func (e *env) loadAround(rate float64, d time.Duration, during func()) testnet.Results {
	e.t.Helper()
	var rs testnet.Results
	var err error
	var wg sync.WaitGroup
	wg.Go(func() {
		rs, err = testnet.Load(e.ctx, e.topo.Client, testnet.LoadSpec{
			Target: testnet.VIP + ":80", Rate: rate, Duration: d,
			ConnectTimeout: time.Second, RequestTimeout: 3 * time.Second,
		})
	})
	during()
	wg.Wait()
	if err != nil {
		e.t.Fatal(err)
	}
	return rs
}

// longLived opens n keep-alive connections through the VIP and returns
// them with the backend each first reached.
func (e *env) longLived(n int) (long []*conn, first []string) {
	e.t.Helper()
	for range n {
		c := e.dialVIP()
		long = append(long, c)
		first = append(first, c.mustGet("when opened"))
	}
	return long, first
}

// checkLongLived fails the test for every long-lived connection that
// broke or moved off the backend it first reached.
func (e *env) checkLongLived(long []*conn, first []string) {
	e.t.Helper()
	for i, c := range long {
		if got, err := c.get(); err != nil || got != first[i] {
			e.t.Errorf("long-lived connection %d: %q, %v (was on %s)", i, got, err, first[i])
		}
	}
}

// An agent killed outright leaves the datapath serving, wherever its pins
// are and whatever mount namespace it runs in: here through `ip netns
// exec`, which gives it a mount namespace of its own (a container has one
// too), with the pin root at a bpffs mount point and, as by default, in a
// directory under one. Long-lived connections and new ones keep working
// through the SIGKILL, the 3 s without an agent and the restart.
func TestKilledAgentInItsOwnMountNamespaceLeavesTheDatapath(t *testing.T) {
	for _, tc := range []struct {
		name    string
		atMount bool
	}{{"root at the mount point", true}, {"root under the mount point", false}} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 3)
			a := e.startAgentWith(config(e.topo, all(3), ""), func(a *agentrun.Agent) {
				a.OwnMountNS = true
				if tc.atMount {
					a.PinAtMount()
				}
			})
			long, first := e.longLived(6)
			rs := e.loadAround(100, 5*time.Second, func() {
				time.Sleep(time.Second)
				if err := a.Kill(); err != nil {
					t.Error(err)
					return
				}
				time.Sleep(3 * time.Second)
				if err := a.Start(e.ctx); err != nil {
					t.Error(err)
				}
			})
			if t.Failed() {
				return
			}
			if rs.Failures() != 0 {
				t.Fatalf("new connections across the kill and restart: %v", rs.Counts())
			}
			e.checkLongLived(long, first)
			if t.Failed() {
				return
			}
			if !a.LogContains("pins outlive the agent", a.Mount) {
				t.Fatalf("the agent did not say where its pins live:\n%s", a.LogTail(20))
			}
			if !a.LogContains("adopted XDP link") {
				t.Fatalf("the restarted agent did not adopt the pinned links:\n%s", a.LogTail(20))
			}
		})
	}
}

// Where a bpffs the agent would have to mount itself would not outlive it
// (its own mount namespace, no bpffs at the root), it refuses to start and
// names the flag, rather than run a datapath that dies with it.
func TestPinsThatWouldNotOutliveTheAgentAreRefused(t *testing.T) {
	e := newEnv(t, 1)
	a, err := agentrun.New(agentBin, e.topo.Node, t.TempDir(), config(e.topo, all(1), ""))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	a.OwnMountNS = true
	a.BPFFSRoot = t.TempDir() // not on a bpffs
	if err := a.StartNoWait(); err != nil {
		t.Fatal(err)
	}
	exited, err := a.Exited(30 * time.Second)
	if !exited || err == nil {
		t.Fatalf("the agent did not refuse to start (exited %v, %v):\n%s", exited, err, a.LogTail(20))
	}
	out := a.LogTail(5)
	if !strings.Contains(out, "--bpffs-root "+a.BPFFSRoot) || !strings.Contains(out, "would vanish") {
		t.Fatalf("the refusal does not name the flag and the reason:\n%s", out)
	}
}

// A restarted agent's first table already leaves out an endpoint that was
// ejected when its predecessor died: no new flow reaches it across a
// SIGKILL and a restart under load.
func TestRestartAdmitsNoFlowToAnEjectedEndpoint(t *testing.T) {
	e := newEnv(t, 3)
	e.topo.Backend(3).SetMode(testnet.Refuse)
	a := e.startAgent(config(e.topo, all(3), `    failureAccrual:
      maxFailures: 5
      minPenalty: 30s
      maxPenalty: 1m
      jitterRatio: 0
`))
	e.load(100, 2*time.Second, time.Second)
	if st, _ := e.state(b3); st != "ejected" {
		t.Fatalf("b3 is %s, want ejected", st)
	}
	before := e.backendFlows(b3)
	rs := e.loadAround(100, 4*time.Second, func() {
		time.Sleep(500 * time.Millisecond)
		if err := a.Kill(); err != nil {
			t.Error(err)
			return
		}
		time.Sleep(time.Second)
		if err := a.Start(e.ctx); err != nil {
			t.Error(err)
		}
	})
	if t.Failed() {
		return
	}
	if n := rs.Count(testnet.Refused); n != 0 {
		t.Fatalf("%d connections refused across the restart (%v)", n, rs.Counts())
	}
	if after := e.backendFlows(b3); after != before {
		t.Fatalf("the kernel sent %d new flows to the ejected b3 across the restart", after-before)
	}
	if st, _ := e.state(b3); st != "ejected" {
		t.Fatalf("b3 is %s after the restart, want ejected", st)
	}
}

// servicesView is GET /admin/services.
type servicesView admin.ServicesView

// backendFlows is the datapath's count of new flows sent to the endpoint
// (pb_be_stats_v2's flows, through /admin/services).
func (e *env) backendFlows(ep string) uint64 {
	e.t.Helper()
	var v servicesView
	if err := e.agent.JSON(e.ctx, "/admin/services", &v); err != nil {
		e.t.Fatal(err)
	}
	for _, s := range v.Services {
		for _, b := range s.Backends {
			if b.Endpoint == ep && b.Counters != nil {
				return b.Counters.Flows
			}
		}
	}
	e.t.Fatalf("endpoint %s not in /admin/services", ep)
	return 0
}
