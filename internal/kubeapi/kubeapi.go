// SPDX-License-Identifier: Apache-2.0

// Package kubeapi runs a real etcd and kube-apiserver inside a network
// namespace (a testnet node), listening on an address of that namespace:
// the API server of the Kubernetes end-to-end tests (test/e2e/k8s) and of
// the bench's control-plane part. The servers and kubectl are built from
// source by scripts/k8s-tools.sh and cached outside the clone (Tools).
//
// There is no controller-manager, scheduler or kubelet: whoever uses it
// creates EndpointSlices itself, as a node agent's test should.
package kubeapi

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// Tools runs scripts/<script> of the repository at root (k8s-tools.sh: the
// servers and kubectl; prometheus-tools.sh, helm-tools.sh: others), which
// finds the binaries in its cache or, the first time, builds them, and
// returns the directory it prints last. The build's progress goes to
// stderr: a cold build is long, and a CI log should say why.
func Tools(root, script string) (string, error) {
	cmd := exec.Command("bash", filepath.Join(root, "scripts", script))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("scripts/%s: %w", script, err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	return lines[len(lines)-1], nil
}

// EtcdClient is where etcd serves its clients, inside the namespace. Each
// namespace has its own loopback, so the fixed ports never collide with a
// parallel run, and nothing listens on the host.
const EtcdClient = "127.0.0.1:2379"

// Options say where and how the servers run.
type Options struct {
	// Tools is the directory with etcd, kube-apiserver and kubectl (Tools).
	Tools string
	// Dir holds the servers' state, certificates, logs and kubeconfigs.
	Dir string
	// IP is the API server's address in the namespace (default 127.0.0.1).
	IP string
	// AgentUser is the username the agent token authenticates as (in
	// group system:serviceaccounts).
	AgentUser string
	// QPS and Burst of the clients RestConfig builds (default 50, 100).
	QPS   float32
	Burst int
}

// Server is a running etcd and kube-apiserver.
type Server struct {
	NS   *testnet.NS
	Dir  string
	Addr string // where the API server listens (host:port), inside NS

	AdminToken, AgentToken string
	CAFile                 string

	// Admin is a client with system:masters rights.
	Admin kubernetes.Interface
	// AdminKubeconfig and AgentKubeconfig are kubeconfig files for
	// processes running in NS (kubectl, the agent).
	AdminKubeconfig, AgentKubeconfig string

	opts            Options
	etcd, apiserver *exec.Cmd
	etcdDone        chan error
	apiDone         chan error
}

// Start starts etcd and kube-apiserver in ns and waits until the API server
// is ready. On error, what was started is stopped. Call Stop when done.
func Start(ctx context.Context, ns *testnet.NS, o Options) (*Server, error) {
	if o.IP == "" {
		o.IP = "127.0.0.1"
	}
	if o.QPS == 0 {
		o.QPS, o.Burst = 50, 100
	}
	s := &Server{NS: ns, Dir: o.Dir, Addr: o.IP + ":6443", AdminToken: randomToken(), AgentToken: randomToken(), opts: o}
	fail := func(err error) (*Server, error) {
		s.Stop()
		return nil, err
	}
	if err := s.writeFiles(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()

	var err error
	s.etcd, s.etcdDone, err = s.run("etcd", filepath.Join(o.Tools, "etcd"),
		"--name", "e2e", "--data-dir", filepath.Join(s.Dir, "etcd-data"),
		"--listen-client-urls", "http://"+EtcdClient, "--advertise-client-urls", "http://"+EtcdClient,
		"--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
		"--initial-cluster", "e2e=http://127.0.0.1:2380", "--initial-cluster-state", "new",
		"--listen-metrics-urls", "http://127.0.0.1:2381", "--unsafe-no-fsync", "--log-level", "warn")
	if err != nil {
		return fail(err)
	}
	hc := ns.HTTPClient(time.Second)
	if err := s.poll(ctx, "etcd", s.etcdDone, func() bool {
		resp, err := hc.Get("http://" + EtcdClient + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}); err != nil {
		return fail(err)
	}

	s.apiserver, s.apiDone, err = s.run("kube-apiserver", filepath.Join(o.Tools, "kube-apiserver"),
		"--etcd-servers=http://"+EtcdClient,
		"--bind-address="+o.IP, "--advertise-address="+o.IP, "--secure-port=6443",
		"--cert-dir="+filepath.Join(s.Dir, "certs"), "--token-auth-file="+filepath.Join(s.Dir, "tokens.csv"),
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+filepath.Join(s.Dir, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(s.Dir, "sa.key"),
		// ClusterIPs inside the tests' address ranges, 198.18.0.0/15 and
		// 2001:2::/48: dual-stack.
		"--service-cluster-ip-range=198.19.0.0/16,2001:2:0:200::/112",
		// No `kubernetes` Service endpoints: required with a loopback
		// advertise address, and nothing here uses them.
		"--endpoint-reconciler-type=none")
	if err != nil {
		return fail(err)
	}
	s.CAFile = filepath.Join(s.Dir, "certs", "apiserver.crt")
	if err := s.poll(ctx, "kube-apiserver", s.apiDone, func() bool {
		if _, err := os.Stat(s.CAFile); err != nil {
			return false // the serving certificate appears a moment after start
		}
		if s.Admin == nil {
			if s.Admin, err = kubernetes.NewForConfig(s.RestConfig(s.AdminToken)); err != nil {
				return false
			}
		}
		body, err := s.Admin.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err == nil && string(body) == "ok"
	}); err != nil {
		return fail(err)
	}
	if s.AdminKubeconfig, err = s.Kubeconfig("admin", s.AdminToken); err != nil {
		return fail(err)
	}
	if s.AgentKubeconfig, err = s.Kubeconfig("agent", s.AgentToken); err != nil {
		return fail(err)
	}
	return s, nil
}

func randomToken() string {
	b := make([]byte, 16)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// writeFiles writes the static tokens and the service-account key pair.
func (s *Server) writeFiles() error {
	agent := s.opts.AgentUser
	if agent == "" {
		agent = "agent"
	}
	tokens := fmt.Sprintf("%s,admin,admin-uid,system:masters\n%s,%s,agent-uid,system:serviceaccounts\n",
		s.AdminToken, s.AgentToken, agent)
	if err := os.WriteFile(filepath.Join(s.Dir, "tokens.csv"), []byte(tokens), 0o600); err != nil {
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
	if err := os.WriteFile(filepath.Join(s.Dir, "sa.key"),
		pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(s.Dir, "sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o600)
}

// run starts a server in the namespace, logging to Dir/name.log.
func (s *Server) run(name, bin string, args ...string) (*exec.Cmd, chan error, error) {
	f, err := os.Create(filepath.Join(s.Dir, name+".log"))
	if err != nil {
		return nil, nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	// If the parent dies (a go test timeout), the servers die with it
	// rather than keep the namespace and 300 MB alive. The signal is tied
	// to the forking thread, which NS.Start hands back to the scheduler
	// alive; Go never ends idle threads.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := s.NS.Start(cmd); err != nil {
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
func (s *Server) poll(ctx context.Context, name string, done chan error, ready func() bool) error {
	for !ready() {
		select {
		case err := <-done:
			done <- err // for Stop
			return fmt.Errorf("%s exited (%v) before ready:\n%s", name, err, s.LogTail(name, 30))
		case <-ctx.Done():
			return fmt.Errorf("%s not ready: %w\n%s", name, ctx.Err(), s.LogTail(name, 30))
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// LogTail returns the last n lines of a server's log ("etcd",
// "kube-apiserver").
func (s *Server) LogTail(name string, n int) string {
	b, _ := os.ReadFile(filepath.Join(s.Dir, name+".log"))
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// PIDs are the servers' process ids (kube-apiserver, etcd), 0 when not
// running.
func (s *Server) PIDs() (apiserver, etcd int) {
	if s.apiserver != nil && s.apiserver.Process != nil {
		apiserver = s.apiserver.Process.Pid
	}
	if s.etcd != nil && s.etcd.Process != nil {
		etcd = s.etcd.Process.Pid
	}
	return apiserver, etcd
}

// RestConfig is a client config for this process: the API server is on the
// namespace's address, so connections are dialed from inside it.
func (s *Server) RestConfig(token string) *rest.Config {
	return &rest.Config{
		Host:            "https://" + s.Addr,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAFile: s.CAFile},
		Dial:            s.NS.DialContext,
		QPS:             s.opts.QPS,
		Burst:           s.opts.Burst,
	}
}

// Kubeconfig writes a kubeconfig file for user with token, for a process
// running in NS, and returns its path.
func (s *Server) Kubeconfig(user, token string) (string, error) {
	path := filepath.Join(s.Dir, user+".kubeconfig")
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
`, s.Addr, s.CAFile, user, token, user)
	return path, os.WriteFile(path, []byte(cfg), 0o600)
}

// Kubectl runs the kubectl built for this API server's version, as admin,
// inside the namespace, and returns its combined output.
func (s *Server) Kubectl(args ...string) (string, error) {
	cmd := s.NS.Command(filepath.Join(s.opts.Tools, "kubectl"), append([]string{"--kubeconfig", s.AdminKubeconfig}, args...)...)
	// Its discovery cache in the server's directory, not ~/.kube.
	cmd.Env = append(os.Environ(), "KUBECACHEDIR="+filepath.Join(s.Dir, "kube-cache"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// Stop takes the API server down first and waits, then etcd: the other
// order hangs the API server's shutdown. A server that does not stop within
// 20 s of SIGTERM is killed, and that is the error.
func (s *Server) Stop() error {
	var errs []error
	stop := func(name string, cmd *exec.Cmd, done chan error) {
		if cmd == nil {
			return
		}
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			errs = append(errs, fmt.Errorf("%s did not stop within 20s of SIGTERM; killed it", name))
			cmd.Process.Kill()
			<-done
		}
	}
	stop("kube-apiserver", s.apiserver, s.apiDone)
	stop("etcd", s.etcd, s.etcdDone)
	s.apiserver, s.etcd = nil, nil
	return errors.Join(errs...)
}
