// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// cluster is a real etcd and kube-apiserver, started by the test inside a
// network namespace (the topology's node), listening on that namespace's
// 127.0.0.1. Each test's namespace has its own loopback, so the fixed
// ports below never collide with a parallel run, and nothing listens on
// the host. There is no controller-manager, scheduler or kubelet: the
// tests create EndpointSlices themselves, as a node agent's test should.
type cluster struct {
	t   *testing.T
	ns  *testnet.NS
	dir string

	etcd, apiserver *exec.Cmd
	etcdDone        chan error
	apiDone         chan error

	// addr is where the API server listens (host:port), inside ns.
	addr string

	adminToken string
	agentToken string
	caFile     string

	// Admin is a client with system:masters rights, for the test itself.
	Admin kubernetes.Interface
	// AdminKubeconfig and AgentKubeconfig are kubeconfig files for
	// processes running in ns (kubectl, the agent). The agent's user is
	// the agent's ServiceAccount name, so what it may do is exactly what
	// deploy/rbac.yaml grants that ServiceAccount once applied.
	AdminKubeconfig, AgentKubeconfig string
}

const (
	etcdClient = "127.0.0.1:2379"
	// agentUser is the username of the ServiceAccount in deploy/: RBAC
	// bindings to a ServiceAccount subject match it.
	agentUser = "system:serviceaccount:penaltybox-system:penaltybox-agent"
)

// startCluster starts etcd and kube-apiserver in ns and waits until the
// API server is ready. Stopping (registered with t.Cleanup) takes the API
// server down first and waits, then etcd: the other order hangs the API
// server's shutdown.
func startCluster(t *testing.T, ns *testnet.NS) *cluster {
	t.Helper()
	return startClusterOn(t, ns, "127.0.0.1")
}

// startClusterOn is startCluster with the API server on ip, an address of
// ns (127.0.0.1, or one other namespaces can reach).
func startClusterOn(t *testing.T, ns *testnet.NS, ip string) *cluster {
	t.Helper()
	start := time.Now()
	c := &cluster{t: t, ns: ns, dir: t.TempDir(), addr: ip + ":6443", adminToken: randomToken(), agentToken: randomToken()}
	t.Cleanup(c.stop)
	if err := c.writeFiles(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	var err error
	c.etcd, c.etcdDone, err = c.run("etcd", filepath.Join(toolsDir, "etcd"),
		"--name", "e2e", "--data-dir", filepath.Join(c.dir, "etcd-data"),
		"--listen-client-urls", "http://"+etcdClient, "--advertise-client-urls", "http://"+etcdClient,
		"--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
		"--initial-cluster", "e2e=http://127.0.0.1:2380", "--initial-cluster-state", "new",
		"--listen-metrics-urls", "http://127.0.0.1:2381", "--unsafe-no-fsync", "--log-level", "warn")
	if err != nil {
		t.Fatal(err)
	}
	hc := ns.HTTPClient(time.Second)
	if err := c.poll(ctx, "etcd", c.etcdDone, func() bool {
		resp, err := hc.Get("http://" + etcdClient + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}); err != nil {
		t.Fatal(err)
	}

	c.apiserver, c.apiDone, err = c.run("kube-apiserver", filepath.Join(toolsDir, "kube-apiserver"),
		"--etcd-servers=http://"+etcdClient,
		"--bind-address="+ip, "--advertise-address="+ip, "--secure-port=6443",
		"--cert-dir="+filepath.Join(c.dir, "certs"), "--token-auth-file="+filepath.Join(c.dir, "tokens.csv"),
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+filepath.Join(c.dir, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(c.dir, "sa.key"),
		// ClusterIPs inside the tests' address ranges, 198.18.0.0/15 and
		// 2001:2::/48: dual-stack.
		"--service-cluster-ip-range=198.19.0.0/16,2001:2:0:200::/112",
		// No `kubernetes` Service endpoints: required with a loopback
		// advertise address, and nothing here uses them.
		"--endpoint-reconciler-type=none")
	if err != nil {
		t.Fatal(err)
	}
	c.caFile = filepath.Join(c.dir, "certs", "apiserver.crt")
	if err := c.poll(ctx, "kube-apiserver", c.apiDone, func() bool {
		if _, err := os.Stat(c.caFile); err != nil {
			return false // the serving certificate appears a moment after start
		}
		if c.Admin == nil {
			if c.Admin, err = kubernetes.NewForConfig(c.restConfig(c.adminToken)); err != nil {
				return false
			}
		}
		body, err := c.Admin.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err == nil && string(body) == "ok"
	}); err != nil {
		t.Fatal(err)
	}
	c.AdminKubeconfig = c.kubeconfig("admin", c.adminToken)
	c.AgentKubeconfig = c.kubeconfig("agent", c.agentToken)
	t.Logf("etcd and kube-apiserver ready in %v", time.Since(start).Round(10*time.Millisecond))
	return c
}

func randomToken() string {
	b := make([]byte, 16)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// writeFiles writes the static tokens and the service-account key pair.
func (c *cluster) writeFiles() error {
	tokens := fmt.Sprintf("%s,admin,admin-uid,system:masters\n%s,%s,agent-uid,system:serviceaccounts\n",
		c.adminToken, c.agentToken, agentUser)
	if err := os.WriteFile(filepath.Join(c.dir, "tokens.csv"), []byte(tokens), 0o600); err != nil {
		return err
	}
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(c.dir, "sa.key"),
		pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(c.dir, "sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o600)
}

// run starts a server in the namespace, logging to dir/name.log.
func (c *cluster) run(name, bin string, args ...string) (*exec.Cmd, chan error, error) {
	f, err := os.Create(filepath.Join(c.dir, name+".log"))
	if err != nil {
		return nil, nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	// If the test binary dies (a go test timeout), the servers die with
	// it rather than keep the namespace and 300 MB alive. The signal is
	// tied to the forking thread, which NS.Start hands back to the
	// scheduler alive; Go never ends idle threads.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := c.ns.Start(cmd); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("start %s: %w", name, err)
	}
	done := make(chan error, 1)
	go func() {
		done <- cmd.Wait()
		f.Close()
	}()
	return cmd, done, nil
}

// poll waits for ready, failing early if the process exits.
func (c *cluster) poll(ctx context.Context, name string, done chan error, ready func() bool) error {
	for !ready() {
		select {
		case err := <-done:
			done <- err // for stop
			return fmt.Errorf("%s exited (%v) before ready:\n%s", name, err, c.logTail(name, 30))
		case <-ctx.Done():
			return fmt.Errorf("%s not ready: %w\n%s", name, ctx.Err(), c.logTail(name, 30))
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

func (c *cluster) logTail(name string, n int) string {
	b, _ := os.ReadFile(filepath.Join(c.dir, name+".log"))
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// restConfig is a client config for the test process: the API server is
// on the namespace's loopback, so connections are dialed from inside it.
func (c *cluster) restConfig(token string) *rest.Config {
	return &rest.Config{
		Host:            "https://" + c.addr,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAFile: c.caFile},
		Dial:            c.ns.DialContext,
		QPS:             50,
		Burst:           100,
	}
}

func (c *cluster) kubeconfig(user, token string) string {
	path := filepath.Join(c.dir, user+".kubeconfig")
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://%s
    certificate-authority: %s
users:
- name: %s
  user:
    token: %s
contexts:
- name: e2e
  context: {cluster: e2e, user: %s}
current-context: e2e
`, c.addr, c.caFile, user, token, user)
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		c.t.Fatal(err)
	}
	return path
}

// kubectl runs the kubectl built for this API server's version, as admin,
// inside the namespace.
func (c *cluster) kubectl(args ...string) (string, error) {
	cmd := c.ns.Command(filepath.Join(toolsDir, "kubectl"), append([]string{"--kubeconfig", c.AdminKubeconfig}, args...)...)
	// Its discovery cache in the test's directory, not ~/.kube.
	cmd.Env = append(os.Environ(), "KUBECACHEDIR="+filepath.Join(c.dir, "kube-cache"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func (c *cluster) stop() {
	stop := func(name string, cmd *exec.Cmd, done chan error) {
		if cmd == nil {
			return
		}
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			c.t.Errorf("%s did not stop within 20s of SIGTERM; killing it", name)
			cmd.Process.Kill()
			<-done
		}
	}
	// The API server first: with etcd gone, its shutdown hangs.
	stop("kube-apiserver", c.apiserver, c.apiDone)
	stop("etcd", c.etcd, c.etcdDone)
	if c.t.Failed() {
		for _, n := range []string{"kube-apiserver", "etcd"} {
			if tail := c.logTail(n, 15); tail != "" {
				c.t.Logf("%s log tail:\n%s", n, tail)
			}
		}
	}
}
