// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

const udpPort = 5353

// udpConfig is a UDP service on VIP:53 (VIP6 with v6) over the backends'
// echo port.
func udpConfig(topo *testnet.Topology, v6 bool, extra string) string {
	vip := testnet.VIP
	var bs []string
	for _, b := range topo.Backends {
		a := b.Addr
		if v6 {
			a = b.AddrV6
		}
		bs = append(bs, fmt.Sprintf("%q", netip.AddrPortFrom(a, udpPort).String()))
	}
	if v6 {
		vip = testnet.VIP6
	}
	return fmt.Sprintf(`interfaces: [%s]
services:
  - name: dns
    vip: %s
    port: 53
    protocol: udp
    backends: [%s]
%s`, strings.Join(topo.NodeIfaces(), ", "), vip, strings.Join(bs, ", "), extra)
}

// vipAt is the VIP (VIP6 with v6) and port as a dial target.
func vipAt(v6 bool, port uint16) string {
	a := testnet.VIPAddr
	if v6 {
		a = testnet.VIP6Addr
	}
	return netip.AddrPortFrom(a, port).String()
}

// query sends one datagram from a fresh socket (a new flow) and reads the
// answer: "ok", "refused" (ECONNREFUSED: a port unreachable that names the
// client's own flow to the VIP, so the translation reached it) or
// "timeout".
func query(e *env, v6 bool, n int) string {
	c, err := e.topo.Client.DialContext(e.ctx, "udp", vipAt(v6, 53))
	if err != nil {
		return "dial: " + err.Error()
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := fmt.Fprintf(c, "q%d", n); err != nil {
		return "write: " + err.Error()
	}
	b := make([]byte, 64)
	_, err = c.Read(b)
	var ne net.Error
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	}
	return err.Error()
}

// A UDP endpoint with nothing on its port answers every datagram with ICMP
// port unreachable. The datapath translates it (the client's socket gets
// ECONNREFUSED: it names the client's flow to the VIP), counts it as the
// flow's refusal, and at the fifth the endpoint is ejected (in the kernel,
// at once): every later query is answered. Healed, its probe is answered
// and it rejoins.
func TestUDPEndpointDownIsEjectedOnPortUnreachables(t *testing.T) {
	for _, fam := range []struct {
		name string
		v6   bool
	}{{"IPv4", false}, {"IPv6", true}} {
		t.Run(fam.name, func(t *testing.T) { udpEndpointDown(t, fam.v6) })
	}
}

func udpEndpointDown(t *testing.T, v6 bool) {
	e := newEnv(t, 3)
	for i := 1; i <= 3; i++ {
		if err := e.topo.Backend(i).ServeUDPEcho(udpPort); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.topo.Backend(3).SetMode(testnet.Refuse); err != nil {
		t.Fatal(err)
	}
	e.startAgent(udpConfig(e.topo, v6, `    failureAccrual:
      maxFailures: 5
      minPenalty: 1s
      maxPenalty: 2s
      jitterRatio: 0
      connectTimeout: 300ms
`))
	b3a := e.topo.Backend(3).Addr
	if v6 {
		b3a = e.topo.Backend(3).AddrV6
	}
	b3udp := netip.AddrPortFrom(b3a, udpPort).String()
	counts := map[string]int{}
	for i := range 150 {
		counts[query(e, v6, i)]++
	}
	t.Logf("b3 refusing: %v", counts)
	// Linux sends a burst of 6 port unreachables to one client before its
	// rate limit: the fifth ejects, so every refusal reaches the client.
	if counts["refused"] != maxFailures || counts["ok"] != 150-maxFailures {
		t.Errorf("queries %v: want exactly %d refused (ECONNREFUSED at the client) and the rest answered", counts, maxFailures)
	}
	if st, _ := e.state(b3udp); st != "ejected" && st != "probation" {
		t.Errorf("b3 is %s, want ejected", st)
	}
	m := e.metrics()
	if got := m.Get("penaltybox_endpoint_failures_by_kind_total", "backend", b3udp, "kind", "refused"); got < maxFailures {
		t.Errorf("refused failures of b3 = %v, want >= %d", got, maxFailures)
	}
	if got := m.Get("penaltybox_datapath_icmp_translated_total"); got < maxFailures {
		t.Errorf("ICMP errors translated = %v, want >= %d", got, maxFailures)
	}
	if got := m.Get("penaltybox_kernel_trips_total", "svc_name", "dns", "result", "adopted"); got != 1 {
		t.Errorf("kernel trips adopted = %v, want 1", got)
	}

	// Healed: queries go on until its probe is answered and it rejoins.
	if err := e.topo.Backend(3).SetMode(testnet.Serve); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for n := 1000; ; n++ {
		if st, _ := e.state(b3udp); st == "ready" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("b3 did not rejoin within 10 s of healing")
		}
		if r := query(e, v6, n); r != "ok" {
			t.Errorf("query after healing: %s", r)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := e.metrics().Get("penaltybox_endpoint_probes_total", "backend", b3udp, "result", "success"); got < 1 {
		t.Errorf("successful probes of b3 = %v, want >= 1", got)
	}
}

// Path MTU discovery through the NAT: the backend sits behind a router
// whose link to it has an MTU of 1280. The client's 1500-byte segments to
// the VIP are too big there, and the router's "fragmentation needed"
// quotes them as the router saw them, client -> backend. Translated to
// client -> VIP, it reaches the client's connection, which learns the
// path MTU (its route cache shows 1280 for the VIP) and the upload of
// 1 MiB completes.
func TestPathMTUThroughTheNAT(t *testing.T) {
	for _, fam := range []struct {
		name string
		v6   bool
	}{{"IPv4", false}, {"IPv6", true}} {
		t.Run(fam.name, func(t *testing.T) { pathMTU(t, fam.v6) })
	}
}

func pathMTU(t *testing.T, v6 bool) {
	e := newEnv(t, 1)
	far := addRoutedHost(t, e, 1280)
	l, err := far.Listen("tcp", ":8080")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	got := make(chan int64, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			got <- -1
			return
		}
		defer c.Close()
		n, _ := io.Copy(io.Discard, c)
		fmt.Fprintf(c, "%d", n)
		got <- n
	}()
	vip, backend := testnet.VIP, netip.AddrPortFrom(netip.MustParseAddr(farAddr), 8080)
	if v6 {
		vip, backend = testnet.VIP6, netip.AddrPortFrom(netip.MustParseAddr(farAddr6), 8080)
	}
	e.startAgent(fmt.Sprintf(`interfaces: [%s]
services:
  - name: web
    vip: %s
    port: 80
    backends: [%q]
`, strings.Join(e.topo.NodeIfaces(), ", "), vip, backend.String()))

	c, err := e.topo.Client.Dialer(3*time.Second).DialContext(e.ctx, "tcp", vipAt(v6, 80))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	const size = 1 << 20
	if _, err := c.Write(make([]byte, size)); err != nil {
		t.Fatalf("upload: %v (a black hole: the router's errors never reached the connection?)", err)
	}
	c.(*net.TCPConn).CloseWrite()
	b, err := io.ReadAll(c)
	if err != nil || string(b) != fmt.Sprint(size) {
		t.Fatalf("upload answer %q, %v: want %d bytes received", b, err, size)
	}
	if n := <-got; n != size {
		t.Fatalf("server received %d bytes", n)
	}
	route, err := e.topo.Client.Run("ip", "route", "get", vip)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(route, "mtu 1280") {
		t.Errorf("client's route to the VIP %q: want the learnt path MTU 1280", strings.TrimSpace(route))
	}
	if got := e.metrics().Get("penaltybox_datapath_icmp_translated_total"); got < 1 {
		t.Errorf("ICMP errors translated = %v, want >= 1", got)
	}
}

const (
	farAddr  = "198.18.101.2"
	farAddr6 = "2001:2:0:101::2"
)

// addRoutedHost turns backend 1's namespace into a router to a new host
// behind it (198.18.101.2, 2001:2:0:101::2) over a link whose router side
// has the given MTU, and routes the node to it, both families. The host's
// namespace goes with the test.
func addRoutedHost(t *testing.T, e *env, mtu int) *testnet.NS {
	t.Helper()
	rt := e.topo.Backend(1).NS
	far, err := e.topo.AddNS("far")
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"ip", "link", "add", "rt0", "mtu", fmt.Sprint(mtu), "type", "veth", "peer", "name", "eth0", "netns", far.Name},
		{"ip", "addr", "add", "198.18.101.1/24", "dev", "rt0"},
		{"ip", "addr", "add", "2001:2:0:101::1/64", "dev", "rt0", "nodad"},
		{"ip", "link", "set", "rt0", "up"},
		{"sysctl", "-qw", "net.ipv4.ip_forward=1"},
		{"sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"},
	} {
		if out, err := rt.Run(args...); err != nil {
			t.Fatalf("%v: %v %s", args, err, out)
		}
	}
	for _, args := range [][]string{
		{"sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=0"},
		{"ip", "addr", "add", farAddr + "/24", "dev", "eth0"},
		{"ip", "addr", "add", farAddr6 + "/64", "dev", "eth0", "nodad"},
		{"ip", "link", "set", "eth0", "up"},
		{"ip", "link", "set", "lo", "up"},
		{"ip", "route", "add", "default", "via", "198.18.101.1"},
		{"ip", "-6", "route", "add", "default", "via", "2001:2:0:101::1"},
	} {
		if out, err := far.Run(args...); err != nil {
			t.Fatalf("%v: %v %s", args, err, out)
		}
	}
	for _, args := range [][]string{
		{"ip", "route", "add", "198.18.101.0/24", "via", "198.18.1.2"},
		{"ip", "-6", "route", "add", "2001:2:0:101::/64", "via", e.topo.Backend(1).AddrV6.String()},
	} {
		if out, err := e.topo.Node.Run(args...); err != nil {
			t.Fatalf("node route %v: %v %s", args, err, out)
		}
	}
	return far
}
