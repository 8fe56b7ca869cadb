// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/kubeapi"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

// cluster is a real etcd and kube-apiserver (internal/kubeapi), started by
// the test inside a network namespace (the topology's node), listening on
// that namespace's 127.0.0.1. There is no controller-manager, scheduler or
// kubelet: the tests create EndpointSlices themselves, as a node agent's
// test should.
//
// Its Admin client has system:masters rights, for the test itself; its
// AgentKubeconfig's user is the agent's ServiceAccount name, so what the
// agent may do is exactly what deploy/rbac.yaml grants that ServiceAccount
// once applied.
type cluster struct {
	*kubeapi.Server
	t   *testing.T
	ns  *testnet.NS
	dir string
}

// agentUser is the username of the ServiceAccount in deploy/: RBAC
// bindings to a ServiceAccount subject match it.
const agentUser = "system:serviceaccount:penaltybox-system:penaltybox-agent"

// startCluster starts etcd and kube-apiserver in ns and waits until the
// API server is ready. Stopping is registered with t.Cleanup.
func startCluster(t *testing.T, ns *testnet.NS) *cluster {
	t.Helper()
	return startClusterOn(t, ns, "127.0.0.1")
}

// startClusterOn is startCluster with the API server on ip, an address of
// ns (127.0.0.1, or one other namespaces can reach).
func startClusterOn(t *testing.T, ns *testnet.NS, ip string) *cluster {
	t.Helper()
	start := time.Now()
	c := &cluster{t: t, ns: ns, dir: t.TempDir()}
	s, err := kubeapi.Start(context.Background(), ns, kubeapi.Options{Tools: toolsDir, Dir: c.dir, IP: ip, AgentUser: agentUser})
	if err != nil {
		t.Fatal(err)
	}
	c.Server = s
	t.Cleanup(c.stop)
	t.Logf("etcd and kube-apiserver ready in %v", time.Since(start).Round(10*time.Millisecond))
	return c
}

// kubeconfig writes a kubeconfig for user with token and returns its path.
func (c *cluster) kubeconfig(user, token string) string {
	path, err := c.Kubeconfig(user, token)
	if err != nil {
		c.t.Fatal(err)
	}
	return path
}

// kubectl runs kubectl as admin inside the namespace.
func (c *cluster) kubectl(args ...string) (string, error) { return c.Kubectl(args...) }

func (c *cluster) stop() {
	if err := c.Stop(); err != nil {
		c.t.Error(err)
	}
	if c.t.Failed() {
		for _, n := range []string{"kube-apiserver", "etcd"} {
			if tail := c.LogTail(n, 15); tail != "" {
				c.t.Logf("%s log tail:\n%s", n, tail)
			}
		}
	}
}
