// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

// Every new connection through the VIP reaches a real server, and Maglev
// spreads them over the three backends: with generic XDP on the veths
// (--xdp-mode auto, the default) and with native XDP on them.
func TestConnectionsThroughVIPSpreadEvenly(t *testing.T) {
	for _, tc := range []struct{ mode, ipLink string }{
		{"auto", " xdpgeneric "}, // how `ip link` names each attach mode
		{"native", " xdp "},
	} {
		t.Run(tc.mode, func(t *testing.T) { connectionsSpreadEvenly(t, tc.mode, tc.ipLink) })
	}
}

func connectionsSpreadEvenly(t *testing.T, mode, ipLink string) {
	e := newEnv(t, 3)
	e.startAgent(config(e.topo, all(3), ""), "--xdp-mode", mode)
	for _, ifname := range e.topo.NodeIfaces() {
		if link, err := e.topo.Node.Run("ip", "link", "show", ifname); err != nil || !strings.Contains(link, ipLink) {
			t.Fatalf("--xdp-mode %s: %s is not attached as %q: %v\n%s", mode, ifname, ipLink, err, link)
		}
	}

	// A 3 s connect timeout survives one lost SYN (retransmitted at 1 s):
	// on a busy 2-core machine a veth can drop one, which is no fault of
	// the load balancer's, and the claim is that it loses nothing.
	rs := e.load(250, 4*time.Second, 3*time.Second)
	if started := len(rs) - rs.Count(testnet.NotStarted); started < 1000 {
		t.Fatalf("only %d attempts started: the load did not happen", started)
	}
	if f := rs.Failures(); f != 0 {
		t.Fatalf("%d of %d connections failed: %v", f, len(rs), rs.Counts())
	}
	by := rs.ByBackend()
	t.Logf("%d connections: %v", len(rs), by)
	for _, b := range []string{"b1", "b2", "b3"} {
		// Client ports are random, so each backend's share is binomial
		// around 1/3; at n=1000 its standard deviation is 1.5%.
		share := float64(by[b]) / float64(len(rs))
		if share < 0.25 || share > 0.42 {
			t.Errorf("%s got %.1f%% of the connections, want about a third", b, 100*share)
		}
	}
	m := e.metrics()
	if got := m.Get("penaltybox_service_flows_total", "svc_name", "web"); got < float64(len(rs)) {
		t.Errorf("penaltybox_service_flows_total = %v, want at least %d", got, len(rs))
	}
	// Successes reach the agent in batches (the datapath wakes it only for
	// failures; it polls for the rest every few milliseconds).
	eventually(t, 2*time.Second, "every new flow's event read", func() bool {
		m = e.metrics()
		return m.Get("penaltybox_events_total", "type", "new_flow") >= float64(len(rs))
	})
	if got := m.Get("penaltybox_datapath_events_lost_total"); got != 0 {
		t.Errorf("lost events: %v", got)
	}
}

// conn is a keep-alive HTTP/1.1 connection through the VIP.
type conn struct {
	t  *testing.T
	c  net.Conn
	br *bufio.Reader
}

func (e *env) dialVIP() *conn {
	e.t.Helper()
	c, err := e.topo.Client.Dialer(time.Second).DialContext(e.ctx, "tcp", testnet.VIP+":80")
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close() })
	return &conn{t: e.t, c: c, br: bufio.NewReader(c)}
}

// get sends one request on the connection and returns the backend's name.
func (c *conn) get() (string, error) {
	c.c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := fmt.Fprintf(c.c, "GET / HTTP/1.1\r\nHost: vip\r\n\r\n"); err != nil {
		return "", err
	}
	req, _ := http.NewRequest("GET", "/", nil)
	resp, err := http.ReadResponse(c.br, req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b := make([]byte, 64)
	n, _ := resp.Body.Read(b)
	return strings.TrimSpace(string(b[:n])), nil
}

func (c *conn) mustGet(when string) string {
	c.t.Helper()
	b, err := c.get()
	if err != nil {
		c.t.Fatalf("%s: request on the long-lived connection: %v", when, err)
	}
	return b
}

// The datapath outlives the agent: a long-lived connection and new ones
// keep working while it is down, and a restarted agent adopts the pinned
// maps without breaking the connection.
func TestAgentRestartKeepsConnections(t *testing.T) {
	e := newEnv(t, 3)
	a := e.startAgent(config(e.topo, all(3), ""))
	c := e.dialVIP()
	first := c.mustGet("before restart")

	if err := a.Stop(); err != nil {
		t.Fatal(err)
	}
	if got := c.mustGet("agent stopped"); got != first {
		t.Fatalf("connection moved from %s to %s while the agent was down", first, got)
	}
	if rs := e.load(50, time.Second, time.Second); rs.Failures() != 0 {
		t.Fatalf("new connections while the agent is down: %v", rs.Counts())
	}

	if err := a.Start(e.ctx); err != nil {
		t.Fatal(err)
	}
	if got := c.mustGet("after restart"); got != first {
		t.Fatalf("connection moved from %s to %s across the restart", first, got)
	}
	if !a.LogContains("adopted XDP link") || !a.LogContains("adopted pinned state") {
		t.Errorf("restarted agent did not adopt the pinned datapath:\n%s", a.LogTail(20))
	}
	if rs := e.load(100, 2*time.Second, time.Second); rs.Failures() != 0 || len(rs.ByBackend()) != 3 {
		t.Fatalf("after restart: %v over %v", rs.Counts(), rs.ByBackend())
	}
}

// A new --conntrack-size keeps the established flows: the restarted agent
// copies the pinned table's entries into the resized one when it loads the
// maps, and brings it up to date when it switches the interface to its
// program (without the copy, the connection's next packet would find no
// entry and be picked up midstream, deciding nothing).
// Nothing but the held connection runs, and it sends nothing between the
// restart and the first sweep.
func TestConntrackResizeKeepsConnections(t *testing.T) {
	e := newEnv(t, 3)
	a := e.startAgent(config(e.topo, all(3), ""), "--conntrack-size=8192")
	c := e.dialVIP()
	first := c.mustGet("before the restart")

	if err := a.Stop(); err != nil {
		t.Fatal(err)
	}
	// Restarted with the DaemonSet's capabilities alone, as in a cluster
	// (no CAP_SYS_ADMIN: no program or map can be opened by its id).
	wrap := filepath.Join(t.TempDir(), "agent")
	script := fmt.Sprintf("#!/bin/sh\nexec setpriv --bounding-set=-all,%s --inh-caps=-all %s \"$@\"\n", daemonSetCaps(t), agentBin)
	if err := os.WriteFile(wrap, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	a.Binary = wrap
	a.Args = []string{"--conntrack-size=16384"}
	if err := a.Start(e.ctx); err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`"copied the flows of the resized table","map":"pb_ct_v2","from_size":8192,"to_size":16384,"copied":(\d+)`).
		FindStringSubmatch(a.LogTail(200))
	if m == nil {
		t.Fatalf("no copy of the resized table logged:\n%s", a.LogTail(40))
	}
	// The held connection's two entries at least.
	if n, _ := strconv.Atoi(m[1]); n < 2 {
		t.Errorf("copied %d entries, want at least the held connection's 2", n)
	}
	// The first sweep's count, before any packet since the restart: the
	// copied entries, or none.
	var entries float64
	eventually(t, 15*time.Second, "a sweep of the resized table", func() bool {
		mm := e.metrics()
		entries = mm.Get("penaltybox_conntrack_entries")
		return mm.Get("penaltybox_conntrack_size") == 16384
	})
	if entries < 2 {
		t.Errorf("the resized table holds %v entries before any packet, want the held connection's 2", entries)
	}
	if got := c.mustGet("after the restart"); got != first {
		t.Fatalf("connection moved from %s to %s across the resize", first, got)
	}
	if !a.LogContains("brought the resized table up to date at the switch to the new program") {
		t.Errorf("the resized table was not brought up to date at the switch:\n%s", a.LogTail(40))
	}
	if _, err := os.Stat(filepath.Join(a.BPFFSRoot, "pb_ct_v2_resized")); !os.IsNotExist(err) {
		t.Errorf("the previous table is still pinned aside after the switch (%v)", err)
	}
}

// A valid reload applies without dropping established flows; an invalid
// one is refused, counted, and the last good config stays in force.
func TestReloadKeepsFlowsAndRejectsBadConfig(t *testing.T) {
	e := newEnv(t, 3)
	a := e.startAgent(config(e.topo, all(3), ""))

	// Hold one connection on each backend.
	held := map[string]*conn{}
	for range 60 {
		c := e.dialVIP()
		b := c.mustGet("before reload")
		if held[b] == nil {
			held[b] = c
		} else {
			c.c.Close()
		}
		if len(held) == 3 {
			break
		}
	}
	if len(held) != 3 {
		t.Fatalf("could not open a connection to every backend: %v", held)
	}

	// Take b3 out of the service.
	if err := a.Reload(config(e.topo, []int{1, 2}, "")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "reload applied", func() bool {
		return e.metrics().Get("penaltybox_config_reloads_total", "result", "success") >= 2
	})
	for b, c := range held {
		if got := c.mustGet("after reload"); got != b {
			t.Fatalf("established connection moved from %s to %s", b, got)
		}
	}
	rs := e.load(100, 2*time.Second, time.Second)
	if rs.Failures() != 0 || rs.ByBackend()["b3"] != 0 {
		t.Fatalf("after removing b3: %v over %v", rs.Counts(), rs.ByBackend())
	}

	// A broken file: refused, counted, logged; b1 and b2 still serve.
	if err := a.Reload("interfaces: [cl0]\nservices:\n  - name: web\n    vip: 198.18.100.1\n    port: 70000\n"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "reload error counted", func() bool {
		return e.metrics().Get("penaltybox_config_reloads_total", "result", "error") == 1
	})
	if !a.LogContains("config reload rejected", "services[0].port", "70000") {
		t.Errorf("the log does not name the bad field:\n%s", a.LogTail(10))
	}
	if got := e.metrics().Get("penaltybox_config_last_reload_successful"); got != 0 {
		t.Errorf("config_last_reload_successful = %v after a bad reload", got)
	}
	rs = e.load(100, time.Second, time.Second)
	if rs.Failures() != 0 || rs.ByBackend()["b3"] != 0 || len(rs.ByBackend()) != 2 {
		t.Fatalf("last good config not in force: %v over %v", rs.Counts(), rs.ByBackend())
	}
	for b, c := range held {
		if got := c.mustGet("after bad reload"); got != b {
			t.Fatalf("established connection moved from %s to %s", b, got)
		}
	}

	// A file that parses but names an interface the node lacks: nothing of
	// it is applied (b3 would come back if its services were).
	missing := strings.Replace(config(e.topo, all(3), ""), "interfaces: [", "interfaces: [pb-missing0, ", 1)
	if err := a.Reload(missing); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "second reload error counted", func() bool {
		return e.metrics().Get("penaltybox_config_reloads_total", "result", "error") == 2
	})
	if !a.LogContains("config reload failed to apply", "interfaces[0]", "pb-missing0") {
		t.Errorf("the log does not name the missing interface:\n%s", a.LogTail(10))
	}
	rs = e.load(100, time.Second, time.Second)
	if rs.Failures() != 0 || rs.ByBackend()["b3"] != 0 || len(rs.ByBackend()) != 2 {
		t.Fatalf("half-applied reload: %v over %v", rs.Counts(), rs.ByBackend())
	}
}

// Removing a service leaves its established flows alone, as conntrack
// does for kube-proxy: here its port (80) is no other service's, and the
// flow keeps its NAT in both directions until it ends.
func TestRemovedServiceKeepsEstablishedFlows(t *testing.T) {
	e := newEnv(t, 1)
	a := e.startAgent(config(e.topo, all(1), ""))
	c := e.dialVIP()
	defer c.c.Close()
	if got := c.mustGet("before removal"); got != "b1" {
		t.Fatalf("served by %s, want b1", got)
	}
	ifs := strings.Join(e.topo.NodeIfaces(), ", ")
	if err := a.Reload("interfaces: [" + ifs + "]\nservices: []\n"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "reload applied", func() bool {
		return e.metrics().Get("penaltybox_config_reloads_total", "result", "success") >= 2
	})
	for i := range 3 {
		if got := c.mustGet(fmt.Sprintf("request %d after removal", i)); got != "b1" {
			t.Fatalf("established flow moved to %s", got)
		}
	}
}

// A bad config at start stops the agent with an error naming the field.
func TestInvalidConfigAtStart(t *testing.T) {
	e := newEnv(t, 1)
	cfg := config(e.topo, all(1), "    failureAccrual:\n      jitterRatio: 1.5\n")
	a, err := agentrun.New(agentBin, e.topo.Node, t.TempDir(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	if err := a.StartNoWait(); err != nil {
		t.Fatal(err)
	}
	exited, err := a.Exited(20 * time.Second)
	if !exited {
		t.Fatal("agent kept running with an invalid config")
	}
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() == 0 {
		t.Fatalf("exit: %v, want a non-zero exit code", err)
	}
	if !a.LogContains("services[0].failureAccrual.jitterRatio", "1.5") {
		t.Fatalf("error does not name the field and value:\n%s", a.LogTail(5))
	}
}

// bpftool shows the pinned maps with field names, and teardown removes
// everything.
func TestBpftoolReadsPinnedMaps(t *testing.T) {
	if _, err := exec.LookPath("bpftool"); err != nil {
		t.Fatal("bpftool not installed: `make deps` installs it")
	}
	e := newEnv(t, 2)
	a := e.startAgent(config(e.topo, all(2), ""))
	for _, c := range []struct {
		args   []string
		fields []string
	}{
		{[]string{"dump", "pinned", filepath.Join(a.BPFFSRoot, "pb_services")},
			[]string{`"vip"`, `"port"`, `"proto"`, `"table_size"`}},
		// pb_backends is an array of 262144: look one entry up.
		{[]string{"lookup", "pinned", filepath.Join(a.BPFFSRoot, "pb_backends"), "key", "1", "0", "0", "0"},
			[]string{`"addr"`, `"state"`, `"probe_grants"`}},
	} {
		out, err := exec.Command("bpftool", append([]string{"map"}, c.args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("bpftool map %v: %v\n%s", c.args, err, out)
		}
		for _, f := range c.fields {
			if !strings.Contains(string(out), f) {
				t.Errorf("bpftool map %s lacks field %s:\n%s", c.args[0], f, out)
			}
		}
	}
	link, err := e.topo.Node.Run("ip", "link", "show", "cl0")
	if err != nil || !strings.Contains(link, "xdp") {
		t.Fatalf("cl0 shows no XDP program: %v\n%s", err, link)
	}

	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	link, _ = e.topo.Node.Run("ip", "link", "show", "cl0")
	if strings.Contains(link, "xdp") {
		t.Fatalf("XDP still attached after teardown:\n%s", link)
	}
	if _, err := os.Stat(a.BPFFSRoot); !os.IsNotExist(err) {
		t.Fatalf("pins left after teardown: %v", err)
	}
}

// A configured interface deleted and created again under its name (here a
// backend's veth, as a container runtime recreates one) gets the datapath
// again without a reload: the agent follows the interface, not the index
// it had. Until then the backend's replies pass un-translated and its
// connections fail.
func TestRecreatedInterfaceIsAttachedAgain(t *testing.T) {
	e := newEnv(t, 1)
	a := e.startAgent(config(e.topo, all(1), ""))
	if rs := e.load(50, time.Second, time.Second); rs.Failures() != 0 || rs.Count(testnet.OK) == 0 {
		t.Fatalf("before: %v", rs.Counts())
	}
	b1 := e.topo.Links[1]
	old := b1.Index
	if err := e.topo.RecreateLink(1); err != nil {
		t.Fatal(err)
	}
	if b1.Index == old {
		t.Fatalf("b1 recreated with its old index %d", old)
	}
	xdpOn := func() bool {
		var on bool
		if err := e.topo.Node.Do(func() error {
			l, err := netlink.LinkByName(b1.Name)
			if err != nil {
				return err
			}
			on = l.Attrs().Xdp != nil && l.Attrs().Xdp.Attached
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return on
	}
	// The log line comes once pb_ifaces is written too, after the attach.
	eventually(t, 10*time.Second, "XDP on the recreated b1", func() bool {
		return a.LogContains("a configured interface changed; interfaces applied again") && xdpOn()
	})
	if rs := e.load(50, time.Second, time.Second); rs.Failures() != 0 || rs.Count(testnet.OK) == 0 {
		t.Fatalf("after b1 was recreated: %v", rs.Counts())
	}
}
