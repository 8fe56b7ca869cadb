// SPDX-License-Identifier: Apache-2.0

// Package k8s runs the agent in Kubernetes mode against a real
// kube-apiserver backed by a real etcd, both started by the test inside the
// node's network namespace: Services and EndpointSlices created through the
// API become load-balanced ClusterIPs in front of real servers, failing
// endpoints are ejected with an Event on the Service, annotations retune
// failure accrual live. The deploy/ manifests are checked against the same
// API server with kubectl apply --dry-run=server.
//
// The servers and kubectl are built from source by scripts/k8s-tools.sh
// and cached outside the clone, keyed by version: 10-20 minutes the first
// time, under a second after that. `make test` builds them before go test
// runs, so the test's own timeout never includes that build.
package k8s

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/kubeapi"
)

var (
	agentBin string
	toolsDir string // kube-apiserver, etcd, kubectl
	repoRoot string
)

func TestMain(m *testing.M) {
	var err error
	if repoRoot, err = agentrun.ModuleRoot(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if os.Geteuid() != 0 {
		fmt.Println("e2e/k8s: not root; the cluster tests need network namespaces and BPF (CI runs as root)")
		os.Exit(m.Run())
	}
	start := time.Now()
	if toolsDir, err = buildTools("k8s-tools.sh"); err != nil {
		fmt.Fprintln(os.Stderr, "e2e/k8s:", err)
		os.Exit(1)
	}
	fmt.Printf("e2e/k8s: kube-apiserver, etcd and kubectl in %s (%v)\n", toolsDir, time.Since(start).Round(time.Millisecond))
	agentBin, err = agentrun.Build("pb-e2e-k8s-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(filepath.Dir(agentBin))
	os.Exit(code)
}

// buildTools runs scripts/<script> (kubeapi.Tools): the binaries from its
// cache, built the first time.
func buildTools(script string) (string, error) { return kubeapi.Tools(repoRoot, script) }
