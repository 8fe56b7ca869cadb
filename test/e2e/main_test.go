// SPDX-License-Identifier: Apache-2.0

// Package e2e runs the agent binary in network namespaces against real
// servers: the datapath, failure accrual and circuit breaking as a client
// sees them. Every test builds its own topology (internal/testnet) and its
// own bpffs, and removes both.
package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

var agentBin string

func TestMain(m *testing.M) {
	if os.Geteuid() != 0 {
		fmt.Println("e2e: not root; these tests need network namespaces and BPF (CI runs as root)")
		os.Exit(m.Run())
	}
	// PB_E2E_AGENT runs the suite against another build of the agent (an
	// A/B against an earlier version: which tests it fails).
	if agentBin = os.Getenv("PB_E2E_AGENT"); agentBin != "" {
		os.Exit(m.Run())
	}
	var err error
	agentBin, err = agentrun.Build("pb-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(filepath.Dir(agentBin))
	os.Exit(code)
}

// env is one test's world: a topology with HTTP backends and an agent.
type env struct {
	t     *testing.T
	topo  *testnet.Topology
	agent *agentrun.Agent
	ctx   context.Context
}

// config renders a standalone config for the topology's backends
// (1-based indexes) with extra service-level YAML.
func config(topo *testnet.Topology, backends []int, serviceExtra string) string {
	var bs []string
	for _, i := range backends {
		bs = append(bs, fmt.Sprintf("%q", fmt.Sprintf("198.18.%d.2:8080", i)))
	}
	return fmt.Sprintf(`interfaces: [%s]
services:
  - name: web
    vip: %s
    port: 80
    protocol: tcp
    backends: [%s]
%s`, strings.Join(topo.NodeIfaces(), ", "), testnet.VIP, strings.Join(bs, ", "), serviceExtra)
}

func newEnv(t *testing.T, backends int, opts ...func(*testnet.Options)) *env {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for network namespaces and BPF (CI runs as root)")
	}
	o := testnet.Options{Backends: backends}
	for _, f := range opts {
		f(&o)
	}
	topo := testnet.New(t, o)
	for i := 1; i <= backends; i++ {
		if err := topo.Backend(i).ServeHTTP(8080); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return &env{t: t, topo: topo, ctx: ctx}
}

func all(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i + 1
	}
	return out
}

// startAgent starts the agent with cfg and registers its teardown.
func (e *env) startAgent(cfg string, args ...string) *agentrun.Agent {
	e.t.Helper()
	return e.startAgentWith(cfg, nil, args...)
}

// startAgentWith is startAgent with a change to the agent's settings
// before it starts.
func (e *env) startAgentWith(cfg string, prepare func(*agentrun.Agent), args ...string) *agentrun.Agent {
	e.t.Helper()
	a, err := agentrun.New(agentBin, e.topo.Node, e.t.TempDir(), cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	a.Args = args
	if prepare != nil {
		prepare(a)
	}
	e.t.Cleanup(func() {
		if e.t.Failed() {
			e.t.Logf("agent log tail:\n%s", a.LogTail(40))
		}
		if err := a.Close(); err != nil {
			e.t.Logf("agent close: %v", err)
		}
	})
	if err := a.Start(e.ctx); err != nil {
		e.t.Fatal(err)
	}
	e.agent = a
	return a
}

// load runs new connections (one HTTP request each) at rate through the VIP.
func (e *env) load(rate float64, d time.Duration, connectTimeout time.Duration) testnet.Results {
	e.t.Helper()
	rs, err := testnet.Load(e.ctx, e.topo.Client, testnet.LoadSpec{
		Target: testnet.VIP + ":80", Rate: rate, Duration: d,
		ConnectTimeout: connectTimeout, RequestTimeout: 3 * time.Second,
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return rs
}

func (e *env) metrics() agentrun.Metrics {
	e.t.Helper()
	m, err := e.agent.Metrics(e.ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	return m
}

// eventually polls cond every 50ms for up to d.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
