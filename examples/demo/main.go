// SPDX-License-Identifier: Apache-2.0

// Command demo is `make demo`: penaltybox's main story, told on this machine
// in network namespaces with real servers, in well under a minute.
//
//	go run ./examples/demo --agent bin/agent [--rate 100] [--keep]
//
// It builds a client, a "node" and three backend namespaces
// (internal/testnet), runs the agent in the node namespace with XDP on its
// interfaces and the service VIP 198.18.100.1:80 → 198.18.{1,2,3}.2:8080,
// and then:
//
//   - Part 1 (spread): a few hundred new connections through the VIP, how
//     Maglev spread them over the backends, and what the agent's metrics say.
//   - Part 2 (a failing backend, after Linkerd's circuit-breaking
//     walkthrough): steady load while backend 3 first serves, then refuses
//     every connection, then is healed. Per second: what the clients saw and
//     the accrual state of b3 (polled from /admin/endpoints); then the
//     ejection and rejoin in numbers, metrics and the agent's log lines.
//
// Everything it creates (namespaces, veths, XDP links, pins, the private
// bpffs mount, the temporary directory) is removed at the end, on Ctrl-C
// and on any failure. It needs root. Only addresses in 198.18.0.0/15 are
// used, and nothing in the host's own network namespace is touched.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

const usageText = `Usage: demo --agent PATH [--rate N] [--part1-connections N] [--keep]

The penaltybox demo (what 'make demo' runs; needs root). It builds a test
network of Linux network namespaces, runs the agent binary in it with XDP on
the node's interfaces, and shows:

  Part 1  new connections through the VIP 198.18.100.1:80 spread over three
          backends by Maglev, and the agent's metrics;
  Part 2  a backend that starts refusing every connection is ejected after
          5 consecutive failures, and rejoins after its penalty and one
          successful probe once it is healed.

Everything it creates is removed at the end, on Ctrl-C and on failure.
Takes about 25 seconds.

Flags:
`

type options struct {
	agent     string
	rate      float64
	part1N    int
	part1Rate float64
	keep      bool
}

func main() {
	os.Exit(mainCode())
}

func mainCode() int {
	var o options
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usageText)
		fs.PrintDefaults()
	}
	fs.StringVar(&o.agent, "agent", "bin/agent", "the agent binary to run: `PATH` (make build makes bin/agent)")
	fs.Float64Var(&o.rate, "rate", 100, "new connections per second during part 2")
	fs.IntVar(&o.part1N, "part1-connections", 300, "new connections in part 1 (sent at 150/s)")
	fs.BoolVar(&o.keep, "keep", false, "after the demo, leave the network and the agent running for a look around\n(bpftool, curl, ip netns exec ...) until Ctrl-C, then clean up")
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "demo: unexpected argument %q (see --help)\n", fs.Arg(0))
		return 2
	}
	if o.rate < 10 || o.rate > 2000 {
		fmt.Fprintln(os.Stderr, "demo: --rate must be between 10 and 2000 connections per second")
		return 2
	}
	if o.part1N < 30 {
		fmt.Fprintln(os.Stderr, "demo: --part1-connections must be at least 30")
		return 2
	}
	o.part1Rate = 150

	if err := preflight(&o); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		return 1
	}

	// The first SIGINT/SIGTERM cancels ctx: whatever runs stops, and the
	// deferred cleanup removes everything. Later signals are caught too, so
	// an impatient second Ctrl-C cannot leave half a topology behind.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	interrupted := make(chan os.Signal, 1)
	go func() {
		first := true
		for s := range sigs {
			if first {
				first = false
				interrupted <- s
				fmt.Fprintf(os.Stderr, "\ndemo: %s: stopping and cleaning up ...\n", sigName(s))
				cancel()
				continue
			}
			fmt.Fprintln(os.Stderr, "demo: still cleaning up, please wait ...")
		}
	}()

	var cleanupErr error
	err := run(ctx, o, os.Stdout, &cleanupErr)
	var sig os.Signal
	select {
	case sig = <-interrupted:
	default:
	}
	code := 0
	switch {
	case sig != nil && o.keep && err == nil:
		// --keep ends with Ctrl-C by design.
	case sig != nil:
		fmt.Fprintf(os.Stderr, "demo: interrupted by %s\n", sigName(sig))
		code = 130
	case err != nil:
		fmt.Fprintln(os.Stderr, "\ndemo FAILED:", err)
		code = 1
	}
	if cleanupErr != nil {
		fmt.Fprintf(os.Stderr, "demo: cleanup incomplete (check `ip netns list | grep pbt` and `mount | grep bpf`): %v\n", cleanupErr)
		return 1
	}
	if code != 0 {
		fmt.Fprintln(os.Stderr, "demo: everything it created has been removed")
	}
	return code
}

func sigName(s os.Signal) string {
	switch s {
	case syscall.SIGINT:
		return "SIGINT (Ctrl-C)"
	case syscall.SIGTERM:
		return "SIGTERM"
	}
	return s.String()
}

// preflight checks what the demo needs before it creates anything, so a
// newcomer gets one clear sentence instead of a netlink error.
func preflight(o *options) error {
	if os.Geteuid() != 0 {
		return errors.New("needs root: it creates network namespaces and loads XDP programs.\n" +
			"Run it as root, e.g. `sudo make demo`")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		if _, err2 := os.Stat("/usr/sbin/ip"); err2 != nil {
			return errors.New("`ip` is not installed (`make deps` installs iproute2)")
		}
	}
	abs, err := filepath.Abs(o.agent)
	if err != nil {
		return err
	}
	st, err := os.Stat(abs)
	if err != nil {
		return fmt.Errorf("agent binary: %w (build it with `make build`, or pass --agent PATH)", err)
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return fmt.Errorf("agent binary %s is not an executable file", abs)
	}
	o.agent = abs
	return nil
}

// run is the whole demo. Its defers tear down, in order: the agent (stop,
// detach XDP, unpin, unmount its bpffs), the topology (servers,
// namespaces, veths), the temporary directory; their errors go to
// *cleanupErr.
func run(ctx context.Context, o options, out io.Writer, cleanupErr *error) (err error) {
	start := time.Now()
	p := &printer{w: out}
	p.title("penaltybox demo: an XDP load balancer that takes failing backends out, in the kernel")

	dir, err := os.MkdirTemp("", "penaltybox-demo-")
	if err != nil {
		return err
	}
	defer func() {
		// Never RemoveAll through a bpffs that is still mounted: it would
		// unlink the pins of whoever mounted it.
		if mounted(filepath.Join(dir, "bpffs")) {
			*cleanupErr = errors.Join(*cleanupErr, fmt.Errorf("bpffs %s is still mounted; left %s in place", filepath.Join(dir, "bpffs"), dir))
			return
		}
		if rerr := os.RemoveAll(dir); rerr != nil {
			*cleanupErr = errors.Join(*cleanupErr, rerr)
		}
	}()

	topo, err := testnet.Build(testnet.Options{Backends: 3})
	if err != nil {
		return fmt.Errorf("build the test network: %w", err)
	}
	defer func() {
		if cerr := topo.Close(); cerr != nil {
			*cleanupErr = errors.Join(*cleanupErr, fmt.Errorf("remove the test network: %w", cerr))
		}
	}()
	for _, b := range topo.Backends {
		if err := b.ServeHTTP(backendPort); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil { // interrupted while building
		return err
	}

	cfg := configYAML(topo)
	agent, err := agentrun.New(o.agent, topo.Node, dir, cfg)
	if err != nil {
		// New may have mounted the bpffs before failing.
		_ = syscall.Unmount(filepath.Join(dir, "bpffs"), syscall.MNT_DETACH)
		return fmt.Errorf("prepare the agent: %w", err)
	}
	started := false // Start's own error already carries the log's tail
	defer func() {
		if started && err != nil && ctx.Err() == nil {
			fmt.Fprintf(os.Stderr, "\nlast lines of the agent's log (%s):\n%s\n", agent.LogPath(), agent.LogTail(25))
		}
		if cerr := agent.Close(); cerr != nil {
			*cleanupErr = errors.Join(*cleanupErr, fmt.Errorf("stop the agent and remove its datapath: %w", cerr))
		}
	}()
	if err := agent.Start(ctx); err != nil {
		return fmt.Errorf("start the agent: %w", err)
	}
	started = true
	d := &demo{o: o, p: p, topo: topo, agent: agent, dir: dir}
	d.printSetup(time.Since(start))

	if err := d.part1(ctx); err != nil {
		return err
	}
	if err := d.part2(ctx); err != nil {
		return err
	}
	if o.keep {
		d.printKeep()
		<-ctx.Done()
	}
	fmt.Fprintf(out, "\nDone in %.1fs. Removing the agent's datapath, the namespaces and %s.\n",
		time.Since(start).Seconds(), dir)
	if len(d.problems) > 0 {
		return fmt.Errorf("the story did not go as expected:\n  - %s", strings.Join(d.problems, "\n  - "))
	}
	return nil
}

// mounted reports whether path is a mount point (its device differs from
// its parent's).
func mounted(path string) bool {
	var st, parent syscall.Stat_t
	if syscall.Stat(path, &st) != nil || syscall.Stat(filepath.Dir(path), &parent) != nil {
		return false
	}
	return st.Dev != parent.Dev
}

const (
	backendPort = 8080
	vipPort     = 80
	service     = "web"
	tableSize   = 16381

	// The failureAccrual block: short penalties so the story fits in a
	// few seconds.
	maxFailures    = 5
	minPenalty     = 3 * time.Second
	maxPenalty     = 30 * time.Second
	jitterRatio    = 0.2
	connectTimeout = 300 * time.Millisecond
)

func endpoint(i int) string { return fmt.Sprintf("198.18.%d.2:%d", i, backendPort) }

// configYAML is examples/standalone.yaml for this topology, with a
// failureAccrual block fit for a short demo.
func configYAML(topo *testnet.Topology) string {
	var bs []string
	for i := range topo.Backends {
		bs = append(bs, fmt.Sprintf("%q", endpoint(i+1)))
	}
	return fmt.Sprintf(`# penaltybox demo config (see examples/standalone.yaml)
interfaces: [%s]
redirectInterfaces: []
maglev:
  tableSize: %d
services:
  - name: %s
    vip: %s
    port: %d
    protocol: tcp
    backends: [%s]
    failureAccrual:
      mode: consecutive
      maxFailures: %d
      minPenalty: %v
      maxPenalty: %v
      jitterRatio: %v
      connectTimeout: %v
      failureKinds: [refused, timeout, reset]
`, strings.Join(topo.NodeIfaces(), ", "), tableSize, service, testnet.VIP, vipPort, strings.Join(bs, ", "),
		maxFailures, minPenalty, maxPenalty, jitterRatio, connectTimeout)
}

type demo struct {
	o        options
	p        *printer
	topo     *testnet.Topology
	agent    *agentrun.Agent
	dir      string
	problems []string // expectations the story did not meet
}

func (d *demo) problem(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	d.problems = append(d.problems, msg)
	d.p.line("  !! %s", msg)
}

func (d *demo) printSetup(took time.Duration) {
	t := d.topo
	p := d.p
	p.section(fmt.Sprintf("Setup (%.1fs)", took.Seconds()))
	names := []string{t.Node.Name + " (node: the agent, XDP on " + strings.Join(t.NodeIfaces(), " ") + ")",
		t.Client.Name + " (client)"}
	var bn []string
	for _, b := range t.Backends {
		bn = append(bn, b.NS.Name)
	}
	p.line("  namespaces  %s", names[0])
	p.line("              %s", names[1])
	p.line("              %s (backends)", strings.Join(bn, ", "))
	l := t.Links[0]
	p.line("  client      %s on eth0  ──  %s %s (node)", l.PeerAddr.Addr(), l.Name, l.Addr.Addr())
	for _, b := range t.Backends {
		p.line("  backend %s  %s on eth0  ──  %s %s (node)   HTTP on :%d answers %q",
			b.Name, b.Addr, b.Link.Name, b.Link.Addr.Addr(), backendPort, b.Name)
	}
	p.line("  VIP         %s:%d/tcp  (on no interface: XDP rewrites it to a backend)", testnet.VIP, vipPort)
	p.line("  service     %s → %s, %s, %s  (Maglev table of %d slots)", service,
		endpoint(1), endpoint(2), endpoint(3), tableSize)
	p.line("  accrual     maxFailures %d, minPenalty %v, maxPenalty %v, jitterRatio %v, connectTimeout %v",
		maxFailures, minPenalty, maxPenalty, jitterRatio, connectTimeout)
	p.line("  agent       %s --config %s", d.agent.Binary, d.agent.ConfigPath)
	p.line("              pins in %s, log %s", d.agent.BPFFSRoot, d.agent.LogPath())
	p.line("              /metrics on 127.0.0.1:%d, /admin/* on 127.0.0.1:%d inside the node namespace", agentrun.MetricsPort, agentrun.AdminPort)
}

func (d *demo) printKeep() {
	t := d.topo
	p := d.p
	p.section("Still running (--keep): have a look, then press Ctrl-C to remove everything")
	p.line("  ip netns exec %s curl -s http://%s/", t.Client.Name, testnet.VIP)
	p.line("  ip netns exec %s curl -s http://127.0.0.1:%d/admin/endpoints", t.Node.Name, agentrun.AdminPort)
	p.line("  ip netns exec %s curl -s http://127.0.0.1:%d/metrics | grep ^penaltybox_", t.Node.Name, agentrun.MetricsPort)
	p.line("  ip netns exec %s bpftool net show", t.Node.Name)
	p.line("  ls %s; bpftool map dump pinned %s/pb_backends", d.agent.BPFFSRoot, d.agent.BPFFSRoot)
	p.line("  tail -f %s", d.agent.LogPath())
}
