// Package agentrun runs the agent binary inside a testnet node namespace
// for end-to-end tests, the demo and benchmarks: a private bpffs for its
// pins, a config file it can reload, and clients for its HTTP surface.
package agentrun

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// MetricsPort is where the agent serves /metrics and the probes inside the
// node namespace, AdminPort the /admin views (both on its 127.0.0.1).
const (
	MetricsPort = 9464
	AdminPort   = 9465
)

// Build compiles the agent into a new temporary directory named after
// prefix and returns the binary's path; remove filepath.Dir of it when
// done.
func Build(prefix string) (string, error) {
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, "agent")
	root, err := ModuleRoot()
	if err != nil {
		os.RemoveAll(dir)
		return "", err
	}
	cmd := exec.Command("go", "build", "-o", out, "./cmd/agent")
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", fmt.Errorf("build agent: %v\n%s", err, b)
	}
	return out, nil
}

// ModuleRoot is the repository's root: the first directory with a go.mod
// above the working directory.
func ModuleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for range 10 {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		dir = filepath.Dir(dir)
	}
	return "", errors.New("agentrun: go.mod not found above the working directory")
}

// Agent is one agent process in a node namespace.
type Agent struct {
	Binary     string
	Node       *testnet.NS
	Dir        string // holds the config file, the log and the bpffs mount
	BPFFSRoot  string
	ConfigPath string
	Args       []string // extra flags
	// OwnMountNS runs the agent through `ip netns exec`, which gives it a
	// mount namespace of its own with a fresh /sys (as a container has its
	// own), instead of only switching its network namespace.
	OwnMountNS bool
	// Mount is the private bpffs New mounted; BPFFSRoot is under it, or it
	// (PinAtMount).
	Mount string

	mu     sync.Mutex
	closed bool
	cmd    *exec.Cmd
	done   chan error
	log    *os.File
	http   *http.Client
}

// New prepares an agent: a private bpffs mounted under dir (so tests
// never touch /sys/fs/bpf), and the config written. Call Start. An empty
// config means no config file and no --config flag (Kubernetes mode: the
// caller's Args say where the API server is).
func New(binary string, node *testnet.NS, dir, config string) (*Agent, error) {
	mnt := filepath.Join(dir, "bpffs")
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return nil, err
	}
	if err := unix.Mount("bpf", mnt, "bpf", 0, "mode=0700"); err != nil {
		return nil, fmt.Errorf("mount bpffs: %w", err)
	}
	a := &Agent{
		Binary:     binary,
		Node:       node,
		Dir:        dir,
		BPFFSRoot:  filepath.Join(mnt, "penaltybox"),
		Mount:      mnt,
		ConfigPath: filepath.Join(dir, "config.yaml"),
		http:       node.HTTPClient(time.Second),
	}
	if config == "" {
		a.ConfigPath = ""
		return a, nil
	}
	if err := a.WriteConfig(config); err != nil {
		return nil, err
	}
	return a, nil
}

// WriteConfig replaces the config file (atomically, as an operator's
// editor or a ConfigMap update would).
func (a *Agent) WriteConfig(config string) error {
	tmp := a.ConfigPath + ".tmp"
	if err := os.WriteFile(tmp, []byte(config), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, a.ConfigPath)
}

// LogPath is the agent's combined output.
func (a *Agent) LogPath() string { return filepath.Join(a.Dir, "agent.log") }

// Start runs the agent and returns once /readyz answers 200, or with the
// agent's exit error and log tail if it stops first.
func (a *Agent) Start(ctx context.Context) error {
	if err := a.StartNoWait(); err != nil {
		return err
	}
	return a.WaitReady(ctx)
}

// StartNoWait starts the agent process.
func (a *Agent) StartNoWait() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cmd != nil {
		return errors.New("agentrun: already running")
	}
	f, err := os.OpenFile(a.LogPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	args := []string{"--bpffs-root", a.BPFFSRoot, "--metrics-addr", fmt.Sprintf("127.0.0.1:%d", MetricsPort),
		"--admin-addr", fmt.Sprintf("127.0.0.1:%d", AdminPort)}
	if a.ConfigPath != "" {
		args = append(args, "--config", a.ConfigPath)
	}
	args = append(args, a.Args...)
	var cmd *exec.Cmd
	if a.OwnMountNS {
		// ip netns exec execs the agent: the process is the agent's.
		cmd = a.Node.Command(a.Binary, args...)
		cmd.Stdout, cmd.Stderr = f, f
		err = cmd.Start()
	} else {
		cmd = exec.Command(a.Binary, args...)
		cmd.Stdout, cmd.Stderr = f, f
		err = a.Node.Start(cmd)
	}
	if err != nil {
		f.Close()
		return err
	}
	a.cmd, a.log = cmd, f
	a.done = make(chan error, 1)
	go func() { a.done <- cmd.Wait() }()
	return nil
}

// Exited reports the exit of a process started with StartNoWait: the
// error from Wait, after at most timeout.
func (a *Agent) Exited(timeout time.Duration) (exited bool, err error) {
	a.mu.Lock()
	done := a.done
	a.mu.Unlock()
	if done == nil {
		return true, nil
	}
	select {
	case err := <-done:
		a.reap()
		return true, err
	case <-time.After(timeout):
		return false, nil
	}
}

func (a *Agent) reap() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.log != nil {
		a.log.Close()
	}
	a.cmd, a.done, a.log = nil, nil, nil
}

// WaitReady polls /readyz every 50 ms, for at most 30 s.
func (a *Agent) WaitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return a.PollReady(ctx, 50*time.Millisecond)
}

// PollReady polls /readyz every interval until it answers 200, the agent
// exits, or ctx ends.
func (a *Agent) PollReady(ctx context.Context, every time.Duration) error {
	for {
		if code, _, err := a.Get(ctx, "/readyz"); err == nil && code == 200 {
			return nil
		}
		if exited, err := a.Exited(0); exited {
			return fmt.Errorf("agent exited (%v) before ready:\n%s", err, a.LogTail(30))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("agent not ready: %w\n%s", ctx.Err(), a.LogTail(30))
		case <-time.After(every):
		}
	}
}

// Signal sends sig to the agent.
func (a *Agent) Signal(sig os.Signal) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cmd == nil {
		return errors.New("agentrun: not running")
	}
	return a.cmd.Process.Signal(sig)
}

// Stop sends SIGTERM and waits for the exit.
func (a *Agent) Stop() error {
	if err := a.Signal(syscall.SIGTERM); err != nil {
		return nil
	}
	exited, err := a.Exited(15 * time.Second)
	if !exited {
		a.Signal(syscall.SIGKILL)
		a.Exited(5 * time.Second)
		return fmt.Errorf("agent did not stop on SIGTERM within 15s")
	}
	return err
}

// Kill sends SIGKILL, as a crash or an OOM kill would end the agent, and
// waits for the exit.
func (a *Agent) Kill() error {
	if err := a.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	if exited, _ := a.Exited(5 * time.Second); !exited {
		return errors.New("agent did not exit on SIGKILL within 5s")
	}
	return nil
}

// PinAtMount makes the agent pin at the bpffs mount point itself, not in a
// directory under it.
func (a *Agent) PinAtMount() { a.BPFFSRoot = a.Mount }

// Reload writes config and sends SIGHUP.
func (a *Agent) Reload(config string) error {
	if err := a.WriteConfig(config); err != nil {
		return err
	}
	return a.Signal(syscall.SIGHUP)
}

// Close stops the agent, detaches and unpins everything, unmounts the
// private bpffs.
func (a *Agent) Close() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil
	}
	a.closed = true
	a.mu.Unlock()
	errs := []error{a.Stop()}
	cmd := exec.Command(a.Binary, "teardown", "--bpffs-root", a.BPFFSRoot)
	if out, err := cmd.CombinedOutput(); err != nil {
		errs = append(errs, fmt.Errorf("teardown: %v: %s", err, out))
	}
	errs = append(errs, unix.Unmount(a.Mount, unix.MNT_DETACH))
	return errors.Join(errs...)
}

// Get fetches path from the agent's metrics listener (/metrics, /healthz,
// /readyz).
func (a *Agent) Get(ctx context.Context, path string) (int, []byte, error) {
	return a.get(ctx, MetricsPort, path)
}

// GetAdmin fetches path from the agent's admin listener (/admin/*).
func (a *Agent) GetAdmin(ctx context.Context, path string) (int, []byte, error) {
	return a.get(ctx, AdminPort, path)
}

func (a *Agent) get(ctx context.Context, port int, path string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet,
		fmt.Sprintf("http://127.0.0.1:%d%s", port, path), nil)
	if err != nil {
		return 0, nil, err
	}
	resp, err := a.http.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// JSON decodes an /admin/ view into v.
func (a *Agent) JSON(ctx context.Context, path string, v any) error {
	code, b, err := a.GetAdmin(ctx, path)
	if err != nil {
		return err
	}
	if code != 200 {
		return fmt.Errorf("%s: HTTP %d: %s", path, code, b)
	}
	return json.Unmarshal(b, v)
}

// Metrics scrapes /metrics.
func (a *Agent) Metrics(ctx context.Context) (Metrics, error) {
	code, b, err := a.Get(ctx, "/metrics")
	if err != nil {
		return nil, err
	}
	if code != 200 {
		return nil, fmt.Errorf("/metrics: HTTP %d", code)
	}
	return ParseMetrics(string(b))
}

// ParseMetrics reads a Prometheus text exposition.
func ParseMetrics(text string) (Metrics, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		return nil, err
	}
	return Metrics(fams), nil
}

// LogTail returns the last n lines of the agent's log.
func (a *Agent) LogTail(n int) string {
	f, err := os.Open(a.LogPath())
	if err != nil {
		return ""
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	return strings.Join(lines, "\n")
}

// LogContains reports whether some log line contains every one of subs.
func (a *Agent) LogContains(subs ...string) bool {
	b, err := os.ReadFile(a.LogPath())
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		all := true
		for _, s := range subs {
			if !strings.Contains(line, s) {
				all = false
				break
			}
		}
		if all {
			return true
		}
	}
	return false
}
