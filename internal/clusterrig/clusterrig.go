// Package clusterrig drives scripts/cluster.sh, the one-node Kubernetes
// cluster made of real components (etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler, kube-proxy, a kubelet, containerd
// and the CNI bridge plugin) in network namespaces of its own, and the
// images it runs (scripts/cluster-images.sh). The cluster test and `make
// cluster-demo` share it.
package clusterrig

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/penaltybox/penaltybox/internal/clientlog"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

// Addresses scripts/cluster.sh gives the node (its uplink interface, where
// the API server, the kubelet and hostNetwork pods listen).
const NodeIP = "198.18.210.2"

// Rig is a running cluster.
type Rig struct {
	Root   string // the repository
	Dir    string // the cluster's state (CLUSTER_DIR)
	Netns  string // the node's network namespace (CLUSTER_NETNS)
	Images string // the docker-archives built for it
	// Node is the node's network namespace, for HTTP to pods and
	// hostNetwork ports.
	Node *testnet.NS
	// Log receives the scripts' progress.
	Log func(format string, args ...any)
}

// Up builds the images, starts the cluster whose node is network
// namespace netns, with its state in /tmp/<netns> (short: containerd's shim
// sockets live under it), and loads the images into its containerd. A
// cluster of that name left running by an interrupted run is stopped
// first. On error, what was started is stopped again.
func Up(ctx context.Context, root, netns string, logf func(string, ...any)) (*Rig, error) {
	dir := filepath.Join("/tmp", netns)
	r := &Rig{Root: root, Dir: dir, Netns: netns, Images: dir + "-images", Log: logf}
	if _, err := os.Stat(filepath.Join("/run/netns", netns)); err == nil {
		logf("a cluster %s is still up (an interrupted run?): stopping it", netns)
		if _, err := r.script(ctx, "scripts/cluster.sh", "down"); err != nil {
			return nil, err
		}
	}
	if _, err := r.script(ctx, "scripts/cluster-images.sh", r.Images); err != nil {
		os.RemoveAll(r.Images)
		return nil, fmt.Errorf("images: %w", err)
	}
	fail := func(err error) (*Rig, error) {
		r.Down()
		return nil, err
	}
	if _, err := r.script(ctx, "scripts/cluster.sh", "up"); err != nil {
		return fail(err)
	}
	tars, _ := filepath.Glob(filepath.Join(r.Images, "*.tar"))
	if len(tars) == 0 {
		return fail(fmt.Errorf("no images in %s", r.Images))
	}
	if _, err := r.script(ctx, "scripts/cluster.sh", append([]string{"import"}, tars...)...); err != nil {
		return fail(err)
	}
	ns, err := testnet.Open(netns)
	if err != nil {
		return fail(err)
	}
	r.Node = ns
	return r, nil
}

// AgentBinary is the agent's binary, as in its image, for the test to run
// on the node (`agent inspect` while no agent runs).
func (r *Rig) AgentBinary() string { return filepath.Join(r.Images, "agent") }

// Down stops the cluster and removes what it made, images included. It
// does not take a context: it must run to the end (about 15 s, at most a
// few minutes) even when the caller gave up.
func (r *Rig) Down() {
	if r.Node != nil {
		r.Node.Close()
		r.Node = nil
	}
	if _, err := r.script(context.Background(), "scripts/cluster.sh", "down"); err != nil {
		r.Log("cluster down: %v", err)
	}
	os.RemoveAll(r.Images)
}

func (r *Rig) env() []string {
	return append(os.Environ(), "CLUSTER_DIR="+r.Dir, "CLUSTER_NETNS="+r.Netns)
}

// script runs one of the repository's scripts, passing its progress on.
func (r *Rig) script(ctx context.Context, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(r.Root, name), args...)
	cmd.Env = r.env()
	cmd.WaitDelay = 5 * time.Second
	var out bytes.Buffer
	cmd.Stdout = &out
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return "", err
	}
	if err := cmd.Start(); err != nil {
		return "", err
	}
	var last []string
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		r.Log("%s", sc.Text())
		last = append(last[max(0, len(last)-19):], sc.Text())
	}
	if err := cmd.Wait(); err != nil {
		return out.String(), fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, strings.Join(last, "\n"))
	}
	return out.String(), nil
}

// Kubectl runs kubectl as cluster-admin on the node and returns its stdout.
func (r *Rig) Kubectl(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(r.Root, "scripts/cluster.sh"), append([]string{"kubectl"}, args...)...)
	cmd.Env = r.env()
	cmd.WaitDelay = 5 * time.Second
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

// KubectlJSON runs kubectl with -o json and decodes its output into v.
func (r *Rig) KubectlJSON(ctx context.Context, v any, args ...string) error {
	out, err := r.Kubectl(ctx, append(args, "-o", "json")...)
	if err != nil {
		return err
	}
	return json.Unmarshal([]byte(out), v)
}

// Command is a command that runs on the node (its network and mount
// namespaces), as the cluster's own components do.
func (r *Rig) Command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(r.Root, "scripts/cluster.sh"), append([]string{"exec", name}, args...)...)
	cmd.Env = r.env()
	return cmd
}

// Wait polls ok every 200 ms until it returns true or ctx ends.
func Wait(ctx context.Context, ok func() bool) error {
	for {
		if ok() {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// HTTPClient dials from the node, with a 2 s connect timeout and 10 s for
// the whole request.
func (r *Rig) HTTPClient() *http.Client {
	c := r.Node.HTTPClient(2 * time.Second)
	c.Timeout = 10 * time.Second
	return c
}

// AdminKubeconfig is the kubeconfig of the cluster's admin user.
func (r *Rig) AdminKubeconfig() string { return filepath.Join(r.Dir, "etc", "admin.kubeconfig") }

// The agent's image as scripts/cluster-images.sh tags it, and where
// deploy/ runs it.
const (
	AgentImage     = "localhost/penaltybox/agent"
	AgentTag       = "test"
	AgentNamespace = "penaltybox-system"
	AgentDaemonSet = "ds/penaltybox-agent"
)

// InstallAgent applies deploy/ as a user would, `kubectl apply -k` with
// only the image reference overridden (a kustomization of its own that
// names deploy/ as its base), and waits for the agent's pod to be Ready.
func (r *Rig) InstallAgent(ctx context.Context) error {
	if err := r.kustomize(ctx, "apply"); err != nil {
		return err
	}
	_, err := r.Kubectl(ctx, "-n", AgentNamespace, "rollout", "status", AgentDaemonSet, "--timeout=180s")
	return err
}

// UninstallAgent deletes what InstallAgent applied, `kubectl delete -k`,
// as a user removes the install, and waits for it to be gone.
func (r *Rig) UninstallAgent(ctx context.Context) error {
	return r.kustomize(ctx, "delete", "--wait=true", "--timeout=120s")
}

// kustomize runs kubectl verb -k on deploy/ with the test's image.
func (r *Rig) kustomize(ctx context.Context, verb string, args ...string) error {
	overlay, err := os.MkdirTemp("", "penaltybox-overlay")
	if err != nil {
		return err
	}
	defer os.RemoveAll(overlay)
	base, err := filepath.Rel(overlay, filepath.Join(r.Root, "deploy"))
	if err != nil {
		return err
	}
	kust := fmt.Sprintf("resources:\n  - %s\nimages:\n  - name: penaltybox/agent\n    newName: %s\n    newTag: %s\n",
		base, AgentImage, AgentTag)
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), []byte(kust), 0o644); err != nil {
		return err
	}
	_, err = r.Kubectl(ctx, append([]string{verb, "-k", overlay}, args...)...)
	return err
}

// Workloads is the seed story's manifest: the good and bad backends, the
// Service with Linkerd's annotations, the client.
const Workloads = "examples/cluster-demo/workloads.yaml"

// StartWorkloads applies Workloads and waits for every Deployment in it.
func (r *Rig) StartWorkloads(ctx context.Context) error {
	if _, err := r.Kubectl(ctx, "apply", "-f", filepath.Join(r.Root, Workloads)); err != nil {
		return err
	}
	for _, d := range []string{"deploy/good", "deploy/bad", "deploy/client"} {
		if _, err := r.Kubectl(ctx, "rollout", "status", d, "--timeout=120s"); err != nil {
			return err
		}
	}
	return nil
}

// SetMode tells the test server at ip what to do with connections on its
// service port: serve, refuse or reset.
func (r *Rig) SetMode(ip, mode string) error {
	resp, err := r.HTTPClient().Post(fmt.Sprintf("http://%s:8081/mode?m=%s", ip, mode), "", nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("pod %s, mode %s: %s %s", ip, mode, resp.Status, bytes.TrimSpace(b))
	}
	return nil
}

// ClientSeconds is the output so far of the client pod in namespace ns.
func (r *Rig) ClientSeconds(ctx context.Context, ns string) ([]clientlog.Second, error) {
	out, err := r.Kubectl(ctx, "-n", ns, "logs", "deploy/client")
	if err != nil {
		return nil, err
	}
	return clientlog.Parse(out), nil
}
