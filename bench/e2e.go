// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

type e2eOpts struct {
	Rounds           int
	Duration, Warmup time.Duration
	Workers          int // closed-loop clients, each one connection at a time
}

const (
	vipPort    = 80
	backendPrt = 8080
)

var vipTarget = fmt.Sprintf("%s:%d", testnet.VIP, vipPort)

var (
	agentOnce sync.Once
	agentPath string
	agentErr  error
)

// agentBinary builds ./cmd/agent once per process (or uses --agent).
func agentBinary(given string) (string, error) {
	if given != "" {
		return given, nil
	}
	agentOnce.Do(func() { agentPath, agentErr = agentrun.Build("pb-bench-bin-") })
	return agentPath, agentErr
}

// rig is a topology with HTTP backends, where one load balancer at a
// time is set up in the node namespace.
type rig struct {
	topo  *testnet.Topology
	agent string // binary
	dir   string
	// Interrupt cleanups: the rig's own and its agents' (Agent.Close is
	// idempotent, so an agent closed earlier may stay registered).
	unregister func()
	agents     []func()
}

func newRig(agentBin string, backends int) (*rig, error) {
	bin, err := agentBinary(agentBin)
	if err != nil {
		return nil, err
	}
	topo, err := testnet.Build(testnet.XDPOptions(backends))
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pb-bench-")
	if err != nil {
		topo.Close()
		return nil, err
	}
	for i := 1; i <= backends; i++ {
		if err := topo.Backend(i).ServeHTTP(backendPrt); err != nil {
			topo.Close()
			return nil, err
		}
	}
	r := &rig{topo: topo, agent: bin, dir: dir}
	r.unregister = atInterrupt(r.closeNow)
	return r, nil
}

func (r *rig) close() {
	for _, u := range r.agents {
		u()
	}
	r.unregister()
	r.closeNow()
}

func (r *rig) closeNow() {
	r.topo.Close()
	os.RemoveAll(r.dir)
}

func (r *rig) backendList() string {
	var bs []string
	for i := range r.topo.Backends {
		bs = append(bs, fmt.Sprintf("%q", fmt.Sprintf("198.18.%d.2:%d", i+1, backendPrt)))
	}
	return strings.Join(bs, ", ")
}

// lb is one load balancer set up in the node namespace.
type lb interface {
	stop() error
	// pid is the load balancer's own process (0: none, the work is in
	// the kernel).
	pid() int
}

// --- penaltybox ---

type pbLB struct {
	a        *agentrun.Agent
	redirect bool
}

// stop checks the agent forwarded the way the variant says (every
// rewritten packet redirected, or every one passed to the stack), then
// stops it.
func (p *pbLB) stop() error {
	m, err := p.a.Metrics(context.Background())
	var check error
	if err == nil {
		red := m.Get("penaltybox_datapath_forwarded_packets_total", "method", "redirect")
		pass := m.Get("penaltybox_datapath_forwarded_packets_total", "method", "pass")
		if (p.redirect && (red == 0 || pass > red/100)) || (!p.redirect && red != 0) {
			check = fmt.Errorf("penaltybox (redirect=%v) forwarded %v packets by redirect and %v by the stack", p.redirect, red, pass)
		}
	}
	return errors.Join(check, p.a.Close())
}

func (p *pbLB) pid() int {
	pid, _ := agentPID(p.a)
	return pid
}

// pbConfig is the agent's config for the e2e and flood parts: service
// web, the VIP's vipPort to every backend.
func (r *rig) pbConfig(redirect bool, serviceExtra string) string {
	return r.serviceConfig(redirect, "web", vipPort, r.backendList(), serviceExtra)
}

// serviceConfig is an agent config of one TCP service on testnet.VIP:
// XDP on the node's interfaces (redirecting between them when redirect
// is set), the service name on port, backends a YAML list's items, and
// serviceExtra appended to the service.
func (r *rig) serviceConfig(redirect bool, name string, port int, backends, serviceExtra string) string {
	ifs := strings.Join(r.topo.NodeIfaces(), ", ")
	red := ""
	if redirect {
		red = ifs
	}
	return fmt.Sprintf(`interfaces: [%s]
redirectInterfaces: [%s]
services:
  - name: %s
    vip: %s
    port: %d
    protocol: tcp
    backends: [%s]
%s`, ifs, red, name, testnet.VIP, port, backends, serviceExtra)
}

func (r *rig) startAgent(cfg string, args ...string) (*agentrun.Agent, error) {
	dir, err := os.MkdirTemp(r.dir, "agent-")
	if err != nil {
		return nil, err
	}
	a, err := agentrun.New(r.agent, r.topo.Node, dir, cfg)
	if err != nil {
		return nil, err
	}
	a.Args = args
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	unregister := atInterrupt(func() { a.Close() })
	if err := a.Start(ctx); err != nil {
		unregister()
		a.Close()
		return nil, err
	}
	r.agents = append(r.agents, unregister)
	return a, nil
}

func (r *rig) penaltybox(redirect bool, serviceExtra string, args ...string) (lb, error) {
	a, err := r.startAgent(r.pbConfig(redirect, serviceExtra), args...)
	if err != nil {
		return nil, err
	}
	return &pbLB{a: a, redirect: redirect}, nil
}

// --- nftables DNAT, as kube-proxy's nftables mode writes it ---

type nftLB struct{ r *rig }

const nftTable = "pbbench"

func (r *rig) nftables() (lb, error) {
	n := len(r.topo.Backends)
	var sb strings.Builder
	fmt.Fprintf(&sb, "table ip %s {\n", nftTable)
	fmt.Fprintf(&sb, "\tmap service-ips {\n\t\ttype ipv4_addr . inet_proto . inet_service : verdict\n\t\telements = { %s . tcp . %d : goto svc-web }\n\t}\n", testnet.VIP, vipPort)
	fmt.Fprintf(&sb, "\tchain nat-prerouting {\n\t\ttype nat hook prerouting priority dstnat; policy accept;\n\t\tjump services\n\t}\n")
	fmt.Fprintf(&sb, "\tchain services {\n\t\tip daddr . meta l4proto . th dport vmap @service-ips\n\t}\n")
	var arms []string
	for i := range n {
		arms = append(arms, fmt.Sprintf("%d : goto ep-%d", i, i+1))
	}
	fmt.Fprintf(&sb, "\tchain svc-web {\n\t\tnumgen random mod %d vmap { %s }\n\t}\n", n, strings.Join(arms, ", "))
	for i := 1; i <= n; i++ {
		fmt.Fprintf(&sb, "\tchain ep-%d {\n\t\tmeta l4proto tcp dnat to 198.18.%d.2:%d\n\t}\n", i, i, backendPrt)
	}
	sb.WriteString("}\n")
	path := filepath.Join(r.dir, "nft.conf")
	if err := os.WriteFile(path, []byte(sb.String()), 0o600); err != nil {
		return nil, err
	}
	if _, err := r.topo.Node.Run("nft", "-f", path); err != nil {
		return nil, err
	}
	return &nftLB{r}, nil
}

func (n *nftLB) pid() int { return 0 }

func (n *nftLB) stop() error {
	_, err := n.r.topo.Node.Run("nft", "delete", "table", "ip", nftTable)
	return err
}

// nftRules returns the kube-proxy style rules, for RESULTS.md.
func nftRulesSummary() string {
	return "`ip daddr . meta l4proto . th dport vmap @service-ips` → service chain `numgen random mod 3 vmap { 0 : goto ep-1, … }` → endpoint chain `meta l4proto tcp dnat to 198.18.i.2:8080` (the DNAT part of kube-proxy's nftables mode; no masquerade or firewall chains)"
}

// --- HAProxy in TCP mode ---

type haproxyLB struct {
	r          *rig
	cmd        *exec.Cmd
	done       chan error
	log        string
	unregister func()
}

// haproxyConfig returns the configuration; passive adds passive layer-4
// checks: `observe layer4 error-limit N on-error mark-down`. HAProxy 2.6
// parses `observe` without `check` too (haproxyCheck records what
// `haproxy -c` says), but its documentation says observing needs health
// checks enabled, so `check` is on, with inter 60s to keep the active
// checks out of a run.
// hapOpts are the HAProxy settings a benchmark varies.
type hapOpts struct {
	passive    bool // observe layer4 with error-limit errorLimit, on-error mark-down
	errorLimit int
	redispatch bool // option redispatch 1: every connect retry may go to another server
}

func (r *rig) haproxyConfig(o hapOpts) string {
	var sb strings.Builder
	sb.WriteString(`global
	maxconn 9000
	nbthread 2
defaults
	mode tcp
	timeout connect 300ms
	timeout client 10s
	timeout server 10s
	retries 3
frontend web
	bind ` + vipTarget + `
	default_backend web
backend web
	balance roundrobin
`)
	if o.redispatch {
		sb.WriteString("	option redispatch 1\n")
	}
	for i := range r.topo.Backends {
		fmt.Fprintf(&sb, "\tserver b%d 198.18.%d.2:%d", i+1, i+1, backendPrt)
		if o.passive {
			fmt.Fprintf(&sb, " check inter 60s observe layer4 error-limit %d on-error mark-down", o.errorLimit)
		}
		sb.WriteString("\n")
	}
	return sb.String()
}

func (r *rig) haproxy(o hapOpts) (lb, error) {
	if _, err := r.topo.Node.Run("ip", "addr", "replace", testnet.VIP+"/32", "dev", "lo"); err != nil {
		return nil, err
	}
	// HAProxy is the only variant that opens connections from the node
	// (to the backends) and, closing them first, keeps their TIME_WAIT
	// there. With the default port range the connect() port search grows
	// with every round until a round collapses (~600 conn/s, seen in the
	// third round); production HAProxy hosts are tuned like this.
	for _, kv := range [][2]string{{"net/ipv4/ip_local_port_range", "1024 65535"}, {"net/ipv4/tcp_tw_reuse", "1"}} {
		if err := r.topo.Node.Sysctl(kv[0], kv[1]); err != nil {
			return nil, err
		}
	}
	path := filepath.Join(r.dir, "haproxy.cfg")
	if err := os.WriteFile(path, []byte(r.haproxyConfig(o)), 0o600); err != nil {
		return nil, err
	}
	logPath := filepath.Join(r.dir, "haproxy.log")
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("haproxy", "-db", "-f", path)
	cmd.Stdout, cmd.Stderr = f, f
	if err := r.topo.Node.Start(cmd); err != nil {
		f.Close()
		return nil, err
	}
	h := &haproxyLB{r: r, cmd: cmd, done: make(chan error, 1), log: logPath}
	go func() { h.done <- cmd.Wait(); f.Close() }()
	h.unregister = atInterrupt(func() { cmd.Process.Kill() })
	// Ready when the VIP accepts from the client namespace.
	d := r.topo.Client.Dialer(200 * time.Millisecond)
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := d.DialContext(context.Background(), "tcp", vipTarget)
		if err == nil {
			c.Close()
			return h, nil
		}
		select {
		case err := <-h.done:
			b, _ := os.ReadFile(logPath)
			return nil, fmt.Errorf("haproxy exited (%v): %s", err, b)
		default:
		}
		if time.Now().After(deadline) {
			h.stop()
			return nil, fmt.Errorf("haproxy not accepting on %s: %v", vipTarget, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (h *haproxyLB) pid() int { return h.cmd.Process.Pid }

func (h *haproxyLB) stop() error {
	h.unregister()
	h.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-h.done:
	case <-time.After(5 * time.Second):
		h.cmd.Process.Kill()
		<-h.done
	}
	_, err := h.r.topo.Node.Run("ip", "addr", "del", testnet.VIP+"/32", "dev", "lo")
	return err
}

// haproxyCheck validates the passive-check configuration with the
// installed haproxy and returns its version and what it said.
func haproxyCheck(dir string) (version, said string) {
	out, _ := exec.Command("haproxy", "-v").Output()
	version = strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
	r := &rig{topo: &testnet.Topology{Backends: make([]*testnet.Backend, 3)}}
	for _, variant := range []struct {
		name string
		cfg  string
	}{
		{"observe without check", strings.ReplaceAll(r.haproxyConfig(hapOpts{passive: true, errorLimit: 5}), "check inter 60s ", "")},
		{"observe with check", r.haproxyConfig(hapOpts{passive: true, errorLimit: 5, redispatch: true})},
	} {
		path := filepath.Join(dir, "check.cfg")
		os.WriteFile(path, []byte(variant.cfg), 0o600)
		out, err := exec.Command("haproxy", "-c", "-f", path).CombinedOutput()
		msg := strings.Join(strings.Fields(string(out)), " ")
		if err != nil {
			msg = "rejected: " + msg
		}
		said += fmt.Sprintf("%s: `%s`; ", variant.name, msg)
	}
	return version, said
}

// flushConntrack empties the node namespace's netfilter conntrack table,
// so every variant of every round starts from the same state (penaltybox's
// own conntrack goes with its agent's teardown). Without it, nftables
// rounds inherit the previous rounds' TIME_WAIT entries (120 s): a client
// port reused within that time meets its old entry and the SYN takes
// conntrack's "reopen" path (kill, look up again, or drop).
// fresh starts a load balancer on a node whose netfilter conntrack is
// flushed, so no run inherits another's entries.
func (r *rig) fresh(name string, start func() (lb, error)) (lb, error) {
	if err := r.flushConntrack(); err != nil {
		return nil, err
	}
	l, err := start()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return l, nil
}

func (r *rig) flushConntrack() error {
	return r.topo.Node.Do(func() error {
		err := netlink.ConntrackTableFlush(netlink.ConntrackTable)
		if err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("flush conntrack: %w", err)
		}
		return nil
	})
}

// --- no load balancer: plain routing to the backends ---

type direct struct{}

func (direct) stop() error { return nil }
func (direct) pid() int    { return 0 }

// ownRow names the rows of a load balancer's own process CPU.
const ownRow = "of which its own process (agent / haproxy)"

// procCPU is a process's user+system CPU time so far (all threads).
func procCPU(pid int) time.Duration {
	if pid <= 0 {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseUint(f[11], 10, 64)
	st, _ := strconv.ParseUint(f[12], 10, 64)
	return time.Duration(u+st) * time.Second / userHZ
}

// --- load and CPU ---

// cpuTimes reads the machine's busy and total CPU time (USER_HZ ticks)
// from /proc/stat: busy = total − idle − iowait.
func cpuTimes() (busy, total uint64, err error) {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 8 || fs[0] != "cpu" {
			continue
		}
		var v []uint64
		for _, s := range fs[1:] {
			n, _ := strconv.ParseUint(s, 10, 64)
			v = append(v, n)
		}
		// user nice system idle iowait irq softirq steal (guest is in user)
		for i, n := range v {
			if i >= 8 {
				break
			}
			total += n
			if i != 3 && i != 4 {
				busy += n
			}
		}
		return busy, total, nil
	}
	return 0, 0, errors.New("/proc/stat: no cpu line")
}

const userHZ = 100 // USER_HZ, the unit of /proc/stat on Linux

type loadResult struct {
	ok, failed int
	elapsed    time.Duration
	cpu        time.Duration // machine busy CPU time during the run
	firstErr   error
}

// closedLoop runs workers clients for d: each opens a new connection,
// sends one HTTP request, reads the response and closes, again and again.
// targets are spread over the workers.
func closedLoop(ns *testnet.NS, targets []string, workers int, d time.Duration) (loadResult, error) {
	// No "Connection: close": the client closes first once it has the
	// response, so TIME_WAIT stays on the client (which reuses its ports
	// safely, tcp_tw_reuse) instead of piling up on the backends, where a
	// reused client port from another variant (another TCP timestamp
	// offset: direct connections and DNATed ones differ) would meet it.
	req := []byte("GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
	dialer := ns.Dialer(2 * time.Second)
	var ok, failed atomic.Int64
	var firstErr atomic.Value
	b0, _, err := cpuTimes()
	if err != nil {
		return loadResult{}, err
	}
	start := time.Now()
	deadline := start.Add(d)
	var wg sync.WaitGroup
	for w := range workers {
		target := targets[w%len(targets)]
		wg.Go(func() {
			br := bufio.NewReaderSize(nil, 1024)
			for time.Now().Before(deadline) {
				if err := oneRequest(dialer, target, req, br); err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err)
					continue
				}
				ok.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	b1, _, err := cpuTimes()
	if err != nil {
		return loadResult{}, err
	}
	res := loadResult{ok: int(ok.Load()), failed: int(failed.Load()), elapsed: elapsed,
		cpu: time.Duration(b1-b0) * time.Second / userHZ}
	// A rare connect timeout is the test network's, not the load
	// balancer's (a reused client port meeting the backend's TIME_WAIT);
	// more than 1% is a broken variant. Failures are reported.
	if res.failed*100 > res.ok+res.failed {
		err, _ := firstErr.Load().(error)
		return res, fmt.Errorf("%d of %d requests failed, first: %v", res.failed, res.ok+res.failed, err)
	}
	if err, _ := firstErr.Load().(error); err != nil {
		res.firstErr = err
	}
	return res, nil
}

func oneRequest(d *testnet.Dialer, target string, req []byte, br *bufio.Reader) error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	c, err := d.DialContext(ctx, "tcp", target)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write(req); err != nil {
		return err
	}
	br.Reset(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("HTTP %s", resp.Status)
	}
	return nil
}

// runE2E is part 2.
func runE2E(res *Results, o e2eOpts, agentBin string, logf func(string, ...any)) error {
	r, err := newRig(agentBin, 3)
	if err != nil {
		return err
	}
	defer r.close()
	directTargets := []string{}
	for i := range r.topo.Backends {
		directTargets = append(directTargets, fmt.Sprintf("198.18.%d.2:%d", i+1, backendPrt))
	}
	type variant struct {
		name    string
		start   func() (lb, error)
		targets []string
	}
	const (
		vNft    = "nftables DNAT (kube-proxy nftables mode)"
		vDirect = "no load balancer (client → backend, routed)"
		vPB     = "penaltybox, XDP_PASS after NAT"
		vPBRed  = "penaltybox, XDP redirect"
		vPBNat  = "penaltybox, native XDP on the veths, XDP_PASS after NAT"
		vHAP    = "HAProxy 2.6, TCP mode"
	)
	variants := []variant{
		{vDirect, func() (lb, error) { return direct{}, nil }, directTargets},
		{vNft, r.nftables, []string{vipTarget}},
		{vPB, func() (lb, error) { return r.penaltybox(false, "") }, []string{vipTarget}},
		{vPBRed, func() (lb, error) { return r.penaltybox(true, "") }, []string{vipTarget}},
		{vPBNat, func() (lb, error) { return r.penaltybox(false, "", "--xdp-mode", "native") }, []string{vipTarget}},
		{vHAP, func() (lb, error) { return r.haproxy(hapOpts{}) }, []string{vipTarget}},
	}
	failures, total, firstErrs := map[string]int{}, map[string]int{}, map[string]error{}
	for round := range o.Rounds {
		for _, v := range variants {
			l, err := r.fresh(v.name, v.start)
			if err != nil {
				return err
			}
			closedLoop(r.topo.Client, v.targets, o.Workers, o.Warmup) // failures in the warm-up do not count
			pid := l.pid()
			p0 := procCPU(pid)
			lr, err := closedLoop(r.topo.Client, v.targets, o.Workers, o.Duration)
			pcpu := procCPU(pid) - p0
			if serr := l.stop(); serr != nil && err == nil {
				err = serr
			}
			if err != nil {
				return fmt.Errorf("%s: %w", v.name, err)
			}
			failures[v.name] += lr.failed
			total[v.name] += lr.ok + lr.failed
			if lr.firstErr != nil && firstErrs[v.name] == nil {
				firstErrs[v.name] = lr.firstErr
			}
			cps := float64(lr.ok) / lr.elapsed.Seconds()
			cpu := float64(lr.cpu.Microseconds()) / float64(lr.ok)
			f := res.figure("e2e", v.name+": connections/s", "conn/s")
			f.Samples = append(f.Samples, cps)
			if v.name != vNft {
				f.Baseline = vNft + ": connections/s"
			}
			g := res.figure("e2e", v.name+": machine CPU per connection", "µs/conn")
			g.Samples = append(g.Samples, cpu)
			g.Digits = 1
			if v.name != vNft {
				g.Baseline = vNft + ": machine CPU per connection"
			}
			if pid > 0 {
				h := res.figure("e2e", v.name+": "+ownRow, "µs/conn")
				h.Samples = append(h.Samples, float64(pcpu.Microseconds())/float64(lr.ok))
				h.Digits = 1
			}
			logf("e2e: round %d/%d: %-45s %7.0f conn/s  %6.1f µs CPU/conn (own process %v)", round+1, o.Rounds, v.name, cps, cpu, pcpu)
		}
	}
	// Order rows: connections/s first, then CPU.
	var cps, cpu, other []*Figure
	for _, f := range res.Figures {
		switch {
		case f.Part == "e2e" && strings.HasSuffix(f.Name, "connections/s"):
			cps = append(cps, f)
		case f.Part == "e2e":
			cpu = append(cpu, f)
		default:
			other = append(other, f)
		}
	}
	res.Figures = append(append(other, cps...), cpu...)

	res.note("e2e", "Topology: internal/testnet (client, node, 3 backends in network namespaces, veth pairs with GRO and full checksums on the peers), real HTTP servers (Go net/http, `testnet.Backend.ServeHTTP`) on 198.18.{1,2,3}.2:8080. Closed loop: %d client workers, each opening a new TCP connection per request (GET), reading the 200 response and closing it (the client closes first, so TIME_WAIT stays on the client side); %v warm-up, then %v measured, per variant per round; variants interleaved in every round. Every request must succeed.", o.Workers, o.Warmup, o.Duration)
	res.note("e2e", "Machine CPU per connection = busy CPU time of the whole machine (/proc/stat, all CPUs, total − idle − iowait) during the measured window ÷ completed connections. It includes the client, the servers and the Go runtime (identical in every variant) and, for HAProxy, its own user time; the load balancers' kernel work has no process of its own, so whole-machine time is the honest denominator. Lower is better; the difference between variants is the load balancer's share.")
	res.note("e2e", "nftables: %s, in the node namespace. HAProxy: `mode tcp`, `balance roundrobin`, `nbthread 2`, bound to the VIP on the node's lo (added for this variant only); the node gets `net.ipv4.ip_local_port_range = 1024 65535` and `net.ipv4.tcp_tw_reuse = 1`, as HAProxy hosts are tuned, because HAProxy alone opens (and closes first) the node → backend connections, whose TIME_WAIT otherwise exhausts the default port range within three rounds. penaltybox: the agent binary with the config file, XDP on cl0, b1..b3, attached as `--xdp-mode auto` does (generic XDP on veths) unless the row says native (`--xdp-mode native`: each veth then hands its peer's packets to NAPI through a 256-entry ring); \"XDP redirect\" adds `redirectInterfaces: [cl0, b1, b2, b3]` (bpf_fib_lookup + bpf_redirect_map), the other rewrites and hands the packet to the node's stack. The \"no load balancer\" row connects to the backends' own addresses through the node's routing: the floor.", nftRulesSummary())
	var fl []string
	for _, v := range variants {
		s := fmt.Sprintf("%s: %d of %d", v.name, failures[v.name], total[v.name])
		if e := firstErrs[v.name]; e != nil {
			s += fmt.Sprintf(" (first: %v)", e)
		}
		fl = append(fl, s)
	}
	res.note("e2e", "Failed requests (not counted in connections/s; a run fails above 1%%): %s.", strings.Join(fl, "; "))
	res.note("e2e", "On 2 cores the client and the servers take most of the CPU, so connections/s is bounded by them for every variant; the CPU per connection shows what the load balancer adds.")
	// Best mode: the best of penaltybox's variants, figure by figure.
	pb, cpuRatio, own := 0.0, math.Inf(1), math.Inf(1)
	for _, v := range []string{vPB, vPBRed, vPBNat} {
		pb = max(pb, res.median("e2e", v+": connections/s"))
		cpuRatio = min(cpuRatio, res.ratio("e2e", v+": machine CPU per connection"))
		own = min(own, res.median("e2e", v+": "+ownRow))
	}
	res.target("e2e", "penaltybox connections/s ≥ nftables DNAT's (best mode, ratio)", pb/res.median("e2e", vNft+": connections/s"), 1, false, "%.2f×")
	res.target("e2e", "penaltybox machine CPU per connection ≤ 0.95× nftables DNAT's (best mode, ratio)", cpuRatio, 0.95, true, "%.2f×")
	res.target("e2e", "agent CPU per healthy connection ≤ 3 µs (best mode)", own, 3, true, "%.1f µs")
	return nil
}
