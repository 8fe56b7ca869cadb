// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

const connectTimeout = 300 * time.Millisecond

// serveTimeout bounds a connection that must succeed: generous, as a load
// runs 200 of them a second and the kernel matrix's VMs emulate their CPUs
// (a 300 ms bound there missed one SYN in 60 now and then).
const serveTimeout = 3 * time.Second

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func netnsList(t *testing.T) string {
	out, err := exec.Command("ip", "netns", "list").CombinedOutput()
	if err != nil {
		t.Fatalf("ip netns list: %v: %s", err, out)
	}
	return string(out)
}

func get(t *testing.T, topo *Topology, url string) (string, Class, error) {
	t.Helper()
	body, err := topo.Client.HTTPGet(ctxT(t, 3*time.Second), url, connectTimeout)
	return body, Classify(err), err
}

// family is one IP version of the dual-stack topology, with the addresses
// the tests expect, spelled out independently of topology.go.
type family struct {
	name string
	v6   bool
}

var (
	ipv4     = family{"IPv4", false}
	ipv6     = family{"IPv6", true}
	families = []family{ipv4, ipv6}
)

// backend is backend i's address: 198.18.<i>.2 or 2001:2:0:<i>::2.
func (f family) backend(i int) netip.Addr {
	if f.v6 {
		return netip.MustParseAddr(fmt.Sprintf("2001:2:0:%d::2", i))
	}
	return netip.MustParseAddr(fmt.Sprintf("198.18.%d.2", i))
}

// client is the client's address: 198.18.0.2 or 2001:2::2.
func (f family) client() netip.Addr {
	if f.v6 {
		return netip.MustParseAddr("2001:2::2")
	}
	return netip.MustParseAddr("198.18.0.2")
}

// vip is VIP or VIP6.
func (f family) vip() netip.Addr {
	if f.v6 {
		return VIP6Addr
	}
	return VIPAddr
}

// hostPort is "198.18.<i>.2:port" or "[2001:2:0:<i>::2]:port".
func (f family) hostPort(i, port int) string {
	return netip.AddrPortFrom(f.backend(i), uint16(port)).String()
}

// url is backend i's HTTP URL on port 80 (IPv6 in brackets).
func (f family) url(i int) string { return "http://" + hostOf(f.backend(i)) + "/" }

// hostOf is a's host part of a URL: IPv6 in brackets.
func hostOf(a netip.Addr) string {
	if a.Is6() {
		return "[" + a.String() + "]"
	}
	return a.String()
}

// rawRequest connects to backend i and sends one GET, returning the
// connection (for Hold / reset checks) and the dial error.
func rawRequest(t *testing.T, topo *Topology, f family, i int) (net.Conn, error) {
	t.Helper()
	c, err := topo.Client.Dialer(connectTimeout).DialContext(ctxT(t, 2*time.Second), "tcp", f.hostPort(i, 80))
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); err != nil {
		return c, err
	}
	return c, nil
}

func TestTopology(t *testing.T) {
	topo := New(t, Options{Backends: 3})
	names := []string{topo.Node.Name, topo.Client.Name}
	for i, b := range topo.Backends {
		names = append(names, b.Name)
		if b.Name != "b"+strconv.Itoa(i+1) || b.Addr != ipv4.backend(i+1) || b.AddrV6 != ipv6.backend(i+1) {
			t.Fatalf("backend %d: name %s addr %s %s", i+1, b.Name, b.Addr, b.AddrV6)
		}
		if err := b.ServeHTTP(80); err != nil {
			t.Fatal(err)
		}
	}
	if got := strings.Join(topo.NodeIfaces(), ","); got != "cl0,b1,b2,b3" {
		t.Fatalf("node ifaces %s", got)
	}
	if topo.ClientAddr() != ipv4.client() || topo.ClientAddrV6() != ipv6.client() {
		t.Fatalf("client addrs %s %s", topo.ClientAddr(), topo.ClientAddrV6())
	}
	for i, l := range topo.Links {
		want := []netip.Prefix{
			netip.MustParsePrefix(fmt.Sprintf("198.18.%d.1/24", i)), netip.MustParsePrefix(fmt.Sprintf("2001:2:0:%d::1/64", i)),
			netip.MustParsePrefix(fmt.Sprintf("198.18.%d.2/24", i)), netip.MustParsePrefix(fmt.Sprintf("2001:2:0:%d::2/64", i)),
		}
		got := []netip.Prefix{l.Addr, l.AddrV6, l.PeerAddr, l.PeerAddrV6}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("link %s: addrs %v, want %v", l.Name, got, want)
		}
	}
	for _, c := range []struct {
		ns       *NS
		key, val string
	}{
		{topo.Node, "net/ipv6/conf/all/forwarding", "1"},
		{topo.Node, "net/ipv6/conf/b3/forwarding", "1"},
		{topo.Node, "net/ipv6/conf/cl0/disable_ipv6", "0"},
		{topo.Client, "net/ipv6/conf/eth0/disable_ipv6", "0"},
		{topo.Client, "net/ipv6/conf/eth0/accept_ra", "0"},
		{topo.Backend(2).NS, "net/ipv6/conf/eth0/forwarding", "0"},
	} {
		if v, err := c.ns.ReadSysctl(c.key); v != c.val {
			t.Errorf("%s %s = %q (%v), want %s", c.ns.Role, c.key, v, err, c.val)
		}
	}
	b1 := topo.Backend(1)
	if err := b1.ServeUDPEcho(5353); err != nil {
		t.Fatal(err)
	}

	// Everything that depends on the IP version runs once per family, IPv6
	// exactly as IPv4, with no load balancer: the client talks to the
	// backends directly, routed by the node.
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) { testFamily(t, topo, f) })
	}

	t.Run("Close", func(t *testing.T) {
		list := netnsList(t)
		for _, n := range []string{topo.Node.Name, topo.Client.Name} {
			if !strings.Contains(list, n) {
				t.Fatalf("%s missing before Close: %s", n, list)
			}
		}
		if err := topo.Close(); err != nil {
			t.Fatal(err)
		}
		if err := topo.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
		list = netnsList(t)
		for _, ns := range topo.namespaces() {
			if strings.Contains(list, ns.Name) {
				t.Errorf("%s still listed after Close", ns.Name)
			}
		}
		if _, err := os.Stat(registryPath(topo.ID)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("registry file left: %v", err)
		}
		for _, f := range families {
			if _, err := topo.Client.DialContext(context.Background(), "tcp", f.hostPort(1, 80)); err == nil {
				t.Errorf("%s dial after Close succeeded", f.name)
			}
		}
	})
}

// testFamily is TestTopology's part for one IP version. Backends 1..3 serve
// HTTP on port 80, backend 1 also UDP echo on 5353, all in mode Serve; each
// subtest leaves them so.
func testFamily(t *testing.T, topo *Topology, f family) {
	t.Run("Routing", func(t *testing.T) {
		for i := 1; i <= 3; i++ {
			body, class, err := get(t, topo, f.url(i))
			if class != OK || body != fmt.Sprintf("b%d\n", i) {
				t.Errorf("GET %s = %q, %v (%s)", f.url(i), body, err, class)
			}
		}
		// Plain routing, no NAT: the connection is client -> backend 1,
		// e.g. 198.18.0.2 -> 198.18.1.2 or 2001:2::2 -> 2001:2:0:1::2.
		c, err := topo.Client.DialContext(ctxT(t, time.Second), "tcp", f.hostPort(1, 80))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		l := c.LocalAddr().(*net.TCPAddr).AddrPort()
		if r := c.RemoteAddr().String(); l.Addr().Unmap() != f.client() || r != f.hostPort(1, 80) {
			t.Errorf("client connection %s -> %s", l, r)
		}
		// A non-canonical IPv6 literal is parsed, not compared as text.
		if f.v6 {
			if body, class, err := get(t, topo, "http://[2001:2:0:1:0::2]:80/"); class != OK || body != "b1\n" {
				t.Errorf("GET with a non-canonical IPv6 literal: %q %v", body, err)
			}
		}
	})

	t.Run("Dialer", func(t *testing.T) {
		ctx := ctxT(t, 2*time.Second)
		// Bound to the client's address of the family, or to a port only.
		for _, la := range []netip.AddrPort{
			netip.AddrPortFrom(f.client(), 0),
			netip.AddrPortFrom(netip.IPv4Unspecified(), 0),
			netip.AddrPortFrom(netip.IPv6Unspecified(), 0),
		} {
			d := &Dialer{NS: topo.Client, Timeout: connectTimeout, LocalAddr: la}
			c, err := d.DialContext(ctx, "tcp", f.hostPort(1, 80))
			if err != nil {
				t.Errorf("LocalAddr %s: %v", la, err)
				continue
			}
			if got := c.LocalAddr().(*net.TCPAddr).AddrPort().Addr().Unmap(); got != f.client() {
				t.Errorf("LocalAddr %s: bound to %s", la, got)
			}
			c.Close()
		}
		// A local address of the other family is an error, not a panic.
		other := ipv6.client()
		if f.v6 {
			other = ipv4.client()
		}
		d := &Dialer{NS: topo.Client, Timeout: connectTimeout, LocalAddr: netip.AddrPortFrom(other, 0)}
		if c, err := d.DialContext(ctx, "tcp", f.hostPort(1, 80)); err == nil {
			c.Close()
			t.Errorf("LocalAddr %s for %s: no error", other, f.hostPort(1, 80))
		}
		// The network's family suffix must match the address.
		network, wrong := "tcp4", "tcp6"
		if f.v6 {
			network, wrong = "tcp6", "tcp4"
		}
		c, err := topo.Client.DialContext(ctx, network, f.hostPort(1, 80))
		if err != nil {
			t.Errorf("%s %s: %v", network, f.hostPort(1, 80), err)
		} else {
			c.Close()
		}
		if c, err := topo.Client.DialContext(ctx, wrong, f.hostPort(1, 80)); err == nil {
			c.Close()
			t.Errorf("%s %s: no error", wrong, f.hostPort(1, 80))
		}
		if f.v6 {
			// A link-local address with its zone, by name and by index:
			// the node's on cl0, where nothing listens on port 9.
			var ll netip.Addr
			err := topo.Node.Do(func() error {
				link, err := netlink.LinkByName("cl0")
				if err != nil {
					return err
				}
				addrs, err := netlink.AddrList(link, netlink.FAMILY_V6)
				for _, a := range addrs {
					if ip, _ := netip.AddrFromSlice(a.IP); ip.IsLinkLocalUnicast() {
						ll = ip
					}
				}
				return err
			})
			if err != nil || !ll.IsValid() {
				t.Fatalf("node cl0 has no link-local address: %v", err)
			}
			idx := strconv.Itoa(topo.Links[0].PeerIndex)
			for _, zone := range []string{"eth0", idx} {
				addr := netip.AddrPortFrom(ll.WithZone(zone), 9).String()
				if _, err := topo.Client.DialContext(ctx, "tcp", addr); Classify(err) != Refused {
					t.Errorf("%s: %v, want refused", addr, err)
				}
			}
			if _, err := topo.Client.DialContext(ctx, "tcp", "[fe80::1%nosuch0]:9"); err == nil || Classify(err) == Refused {
				t.Errorf("unknown zone: %v", err)
			}
		}
	})

	t.Run("VIPUnassigned", func(t *testing.T) {
		// No load balancer: the node has no route to the VIP and says so.
		url := "http://" + hostOf(f.vip()) + "/"
		_, class, err := get(t, topo, url)
		if class != Unreachable {
			t.Errorf("GET %s: %v (%s), want unreachable", url, err, class)
		}
		// Load takes the VIP as "ip:port" or "[ipv6]:port". The node
		// rate-limits its ICMP errors (IPv4: a burst of two): should this
		// attempt's SYN go unanswered, its retransmission a second later
		// is answered, well within the connect timeout.
		target := netip.AddrPortFrom(f.vip(), 80).String()
		rs, err := Load(ctxT(t, 5*time.Second), topo.Client, LoadSpec{Target: target, Rate: 100, Count: 1, ConnectTimeout: 2500 * time.Millisecond})
		if err != nil || rs.Count(Unreachable) != 1 {
			t.Errorf("Load %s: %v %v, want unreachable", target, rs, err)
		}
	})

	t.Run("KeepAlive", func(t *testing.T) {
		b := topo.Backend(3)
		before := b.Stats()
		tr := topo.Client.httpTransport(connectTimeout, false)
		defer tr.CloseIdleConnections()
		cl := &http.Client{Transport: tr}
		for i := 0; i < 3; i++ {
			resp, err := cl.Get(f.url(3))
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if string(body) != "b3\n" {
				t.Fatalf("body %q", body)
			}
		}
		after := b.Stats()
		if d := after.Accepted - before.Accepted; d != 1 {
			t.Errorf("keep-alive: %d connections for 3 requests", d)
		}
		if d := after.Requests - before.Requests; d != 3 {
			t.Errorf("requests +%d, want 3", d)
		}
	})

	b := topo.Backend(2)
	url := f.url(2)
	t.Run("Refuse", func(t *testing.T) {
		if err := b.SetMode(Refuse); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		_, class, err := get(t, topo, url)
		if class != Refused {
			t.Errorf("refuse: %v (%s)", err, class)
		}
		if el := time.Since(start); el >= connectTimeout {
			t.Logf("note: refusal took %v", el) // the class is the assertion
		}
		if err := b.SetMode(Serve); err != nil {
			t.Fatal(err)
		}
		if body, class, err := get(t, topo, url); class != OK || body != "b2\n" {
			t.Errorf("serve after refuse: %q %v", body, err)
		}
	})

	t.Run("Blackhole", func(t *testing.T) {
		if err := b.SetMode(Blackhole); err != nil {
			t.Fatal(err)
		}
		acc := b.Accepted()
		for i := 0; i < 2; i++ {
			_, class, err := get(t, topo, url)
			if class != ConnectTimeout {
				t.Errorf("blackhole: %v (%s)", err, class)
			}
		}
		if b.Accepted() != acc {
			t.Errorf("blackhole: backend accepted %d connections", b.Accepted()-acc)
		}
		if out, _ := b.Run("nft", "list", "tables"); !strings.Contains(out, "pbtest") {
			t.Errorf("nft tables: %q", out)
		}
		if err := b.SetMode(Serve); err != nil {
			t.Fatal(err)
		}
		if out, _ := b.Run("nft", "list", "tables"); strings.Contains(out, "pbtest") {
			t.Errorf("nft table left after blackhole: %q", out)
		}
		if body, class, err := get(t, topo, url); class != OK || body != "b2\n" {
			t.Errorf("serve after blackhole: %q %v", body, err)
		}
	})

	t.Run("ResetAfterHandshake", func(t *testing.T) {
		if err := b.SetMode(ResetAfterHandshake); err != nil {
			t.Fatal(err)
		}
		before := b.Stats()
		// The kernel reports a reset's error to one syscall only, and Go's
		// transport writes the request and reads the answer in two
		// goroutines: when the write takes the ECONNRESET, the reader sees
		// end of stream and the GET fails with a bare EOF. Either way no
		// answer; the raw connection below checks the class strictly.
		body, class, err := get(t, topo, url)
		if body != "" || (class != Reset && !errors.Is(err, io.EOF)) {
			t.Errorf("HTTPGet: %q %v (%s)", body, err, class)
		}
		// The handshake itself succeeds (the backend accepted), and the RST
		// follows at once: depending on timing the dialer already sees it
		// (connect: connection reset by peer, the same as Go's own dialer),
		// or the write of the request, or the first read. Either way:
		// Reset, and no data.
		c, err := rawRequest(t, topo, f, 2)
		if err == nil {
			c.SetReadDeadline(time.Now().Add(2 * time.Second))
			var n int
			n, err = c.Read(make([]byte, 100))
			if n != 0 {
				t.Errorf("read %d bytes after handshake", n)
			}
		}
		if Classify(err) != Reset {
			t.Errorf("raw connection: %v (%s)", err, Classify(err))
		}
		if d := b.Stats().Resets - before.Resets; d != 2 {
			t.Errorf("resets +%d, want 2", d)
		}
		if err := b.SetMode(Serve); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("Hold", func(t *testing.T) {
		if err := b.SetMode(Hold); err != nil {
			t.Fatal(err)
		}
		c, err := rawRequest(t, topo, f, 2)
		if err != nil {
			t.Fatalf("connect in hold mode: %v", err)
		}
		c2, err := rawRequest(t, topo, f, 2)
		if err != nil {
			t.Fatalf("connect in hold mode: %v", err)
		}
		// The read blocks: no answer within 200ms.
		c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); Classify(err) != Timeout {
			t.Errorf("read while held: %v", err)
		}
		// Held() counts connections once the accept loop has them.
		deadline := time.Now().Add(2 * time.Second)
		for b.Stats().Held < 2 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if h := b.Stats().Held; h != 2 {
			t.Fatalf("held %d, want 2", h)
		}
		if err := b.SetMode(Serve); err != nil { // does not release
			t.Fatal(err)
		}
		if n := b.ReleaseHeld(); n != 2 {
			t.Errorf("released %d, want 2", n)
		}
		for _, c := range []net.Conn{c, c2} {
			c.SetReadDeadline(time.Now().Add(2 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatalf("after release: %v", err)
			}
			body, _ := io.ReadAll(resp.Body)
			if string(body) != "b2\n" {
				t.Errorf("after release: %q", body)
			}
		}
		// CloseHeld closes instead; the request bytes are unread, so the
		// kernel answers the close with RST.
		b.SetMode(Hold)
		c3, err := rawRequest(t, topo, f, 2)
		if err != nil {
			t.Fatal(err)
		}
		deadline = time.Now().Add(2 * time.Second)
		for b.Stats().Held < 1 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if n := b.CloseHeld(); n != 1 {
			t.Errorf("closed %d held, want 1", n)
		}
		c3.SetReadDeadline(time.Now().Add(2 * time.Second))
		if _, err := c3.Read(make([]byte, 1)); Classify(err) != Reset {
			t.Errorf("read after CloseHeld: %v", err)
		}
		b.SetMode(Serve)
	})

	t.Run("UDPEcho", func(t *testing.T) {
		b1 := topo.Backend(1)
		c, err := topo.Client.DialContext(ctxT(t, time.Second), "udp", f.hostPort(1, 5353))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		exchange := func(wait time.Duration) (string, error) {
			if _, err := c.Write([]byte("ping")); err != nil {
				return "", err
			}
			c.SetReadDeadline(time.Now().Add(wait))
			buf := make([]byte, 100)
			n, err := c.Read(buf)
			return string(buf[:n]), err
		}
		if got, err := exchange(time.Second); got != "b1\nping" {
			t.Errorf("echo: %q %v", got, err)
		}
		if l := c.LocalAddr().(*net.UDPAddr).AddrPort().Addr().Unmap(); l != f.client() {
			t.Errorf("echo from %s", l)
		}
		b1.SetMode(Refuse)
		if _, err := exchange(time.Second); Classify(err) != Refused {
			t.Errorf("udp refused: %v", err)
		}
		b1.SetMode(Serve)
		if got, err := exchange(time.Second); got != "b1\nping" {
			t.Errorf("echo after refuse: %q %v", got, err)
		}
		// Blackholed datagrams are dropped: no answer, no ICMP error.
		udp := b1.Stats().UDPPackets
		b1.SetMode(Blackhole)
		if _, err := exchange(300 * time.Millisecond); Classify(err) != Timeout {
			t.Errorf("udp blackholed: %v", err)
		}
		b1.SetMode(Serve)
		if got, err := exchange(time.Second); got != "b1\nping" {
			t.Errorf("echo after blackhole: %q %v", got, err)
		}
		if d := b1.Stats().UDPPackets - udp; d != 1 {
			t.Errorf("backend received %d datagrams, want 1 (the blackholed one dropped)", d)
		}
	})

	t.Run("Load", func(t *testing.T) {
		ctx := ctxT(t, 20*time.Second)
		rs, err := Load(ctx, topo.Client, LoadSpec{
			Target: f.hostPort(1, 80), Rate: 200, Count: 60,
			ConnectTimeout: serveTimeout, RequestTimeout: serveTimeout,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("serve: %v", rs)
		if len(rs) != 60 || rs.Count(OK) != 60 || rs.ByBackend()["b1"] != 60 {
			t.Errorf("serve: %v", rs)
		}
		for i, r := range rs {
			if r.Seq != i || r.Scheduled.IsZero() || r.Started.IsZero() {
				t.Fatalf("result %d: %+v", i, r)
			}
		}

		// Refused, then served: the first 20 fail, AfterFailures(20) is clean.
		topo.Backend(1).SetMode(Refuse)
		rs1, _ := Load(ctx, topo.Client, LoadSpec{Target: f.hostPort(1, 80), Rate: 200, Count: 20, ConnectTimeout: serveTimeout})
		topo.Backend(1).SetMode(Serve)
		rs2, _ := Load(ctx, topo.Client, LoadSpec{Target: f.hostPort(1, 80), Rate: 200, Count: 20, ConnectTimeout: serveTimeout})
		all := append(append(Results{}, rs1...), rs2...)
		if rs1.Count(Refused) != 20 || rs2.Count(OK) != 20 {
			t.Errorf("refuse/serve: %v / %v", rs1, rs2)
		}
		if after, ok := all.AfterFailures(20); !ok || after.Count(OK) != 20 || after.Failures() != 0 {
			t.Errorf("AfterFailures(20): %v %v", ok, after)
		}
		if _, ok := all.AfterFailures(21); ok {
			t.Errorf("AfterFailures(21) ok with 20 failures")
		}
		bk := all.Buckets(50 * time.Millisecond)
		total := 0
		for _, b := range bk {
			total += b.Total
		}
		if total != 40 {
			t.Errorf("buckets hold %d results, want 40", total)
		}

		// From several addresses of the client's, in turn: an address the
		// namespace lacks cannot be bound, so every other attempt fails.
		srcs := []netip.Addr{netip.MustParseAddr("198.18.0.30"), netip.MustParseAddr("198.18.0.31")}
		if f.v6 {
			srcs = []netip.Addr{netip.MustParseAddr("2001:2::30"), netip.MustParseAddr("2001:2::31")}
		}
		if err := topo.Client.AddAddrs(srcs...); err != nil {
			t.Fatal(err)
		}
		rsSrc, _ := Load(ctx, topo.Client, LoadSpec{Target: f.hostPort(1, 80), Rate: 200, Count: 10, ConnectTimeout: serveTimeout,
			Sources: srcs})
		if rsSrc.Count(OK) != 10 {
			t.Errorf("from %v: %v", srcs, rsSrc)
		}
		rsSrc, _ = Load(ctx, topo.Client, LoadSpec{Target: f.hostPort(1, 80), Rate: 200, Count: 10, ConnectTimeout: serveTimeout,
			Sources: []netip.Addr{srcs[0], srcs[0].Next().Next().Next()}})
		if rsSrc.Count(OK) != 5 {
			t.Errorf("from %s and an address the client lacks: %v, want 5 ok", srcs[0], rsSrc)
		}

		// Connect-only attempts: L4 outcome without HTTP.
		acc := topo.Backend(2).Accepted()
		rs4, _ := Load(ctx, topo.Client, LoadSpec{Target: f.hostPort(2, 80), Rate: 200, Count: 10, ConnectOnly: true})
		if rs4.Count(OK) != 10 {
			t.Errorf("connect-only: %v", rs4)
		}
		deadline := time.Now().Add(2 * time.Second)
		for topo.Backend(2).Accepted()-acc < 10 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if d := topo.Backend(2).Accepted() - acc; d != 10 {
			t.Errorf("connect-only: backend accepted %d, want 10", d)
		}

		// Blackholed with a concurrency cap of 4: each attempt occupies a
		// slot for the 300ms connect timeout, so at 100/s for 0.5s most
		// attempts find no free slot.
		topo.Backend(3).SetMode(Blackhole)
		rs3, _ := Load(ctx, topo.Client, LoadSpec{
			Target: f.hostPort(3, 80), Rate: 100, Count: 50, Concurrency: 4,
			ConnectTimeout: connectTimeout,
		})
		topo.Backend(3).SetMode(Serve)
		t.Logf("blackhole: %v", rs3)
		ct, ns := rs3.Count(ConnectTimeout), rs3.Count(NotStarted)
		if ct+ns != 50 || ct < 4 || ns < 25 {
			t.Errorf("blackhole with cap 4: %v", rs3)
		}

		// A share refused at random: 30% of 400 is 120, ±40 is over four
		// standard deviations of the binomial draw.
		if err := topo.Backend(2).RefuseShare(0.3); err != nil {
			t.Fatal(err)
		}
		// Every attempt ends in an answer (accepted or refused): the
		// timeout only has to outlast a SYN the kernel retransmits, as it
		// does now and then at 400/s on a loaded machine or under qemu.
		rs5, _ := Load(ctx, topo.Client, LoadSpec{Target: f.hostPort(2, 80), Rate: 400, Count: 400, ConnectOnly: true,
			ConnectTimeout: serveTimeout})
		if n := rs5.Count(Refused); n < 80 || n > 160 || rs5.Count(OK)+n != 400 {
			t.Errorf("refuse share 0.3: %v", rs5)
		}
		if err := topo.Backend(2).RefuseShare(0); err != nil {
			t.Fatal(err)
		}
		if out, _ := topo.Backend(2).Run("nft", "list", "tables"); strings.Contains(out, shareTable) {
			t.Errorf("nft table left after refuse share 0: %q", out)
		}
		rs6, _ := Load(ctx, topo.Client, LoadSpec{Target: f.hostPort(2, 80), Rate: 400, Count: 100, ConnectOnly: true,
			ConnectTimeout: serveTimeout})
		if rs6.Count(OK) != 100 {
			t.Errorf("refuse share 0: %v", rs6)
		}

		// Held SYN-ACKs: every connect takes at least the delay (a lower
		// bound, which no noise can break), and works.
		if err := topo.Backend(2).DelayHandshakes(60 * time.Millisecond); err != nil {
			t.Fatal(err)
		}
		rs7, _ := Load(ctx, topo.Client, LoadSpec{Target: f.hostPort(2, 80), Rate: 100, Count: 20, ConnectOnly: true, ConnectTimeout: 3 * time.Second})
		for _, r := range rs7 {
			if r.Class != OK || r.Latency < 60*time.Millisecond {
				t.Errorf("delayed handshake: %v after %v", r.Class, r.Latency)
			}
		}
		if err := topo.Backend(2).DelayHandshakes(0); err != nil {
			t.Fatal(err)
		}
		rs8, _ := Load(ctx, topo.Client, LoadSpec{Target: f.hostPort(2, 80), Rate: 100, Count: 20, ConnectOnly: true})
		if rs8.Count(OK) != 20 {
			t.Errorf("after the delay: %v", rs8)
		}
	})
}

func TestOptionsGRO(t *testing.T) {
	topo := New(t, XDPOptions(2))
	for _, l := range topo.Links {
		gro, tx, err := l.Peer.Features("eth0")
		if err != nil || !gro || tx {
			t.Errorf("%s eth0: gro=%v txcsum=%v err=%v", l.Peer.Name, gro, tx, err)
		}
		gro, tx, err = topo.Node.Features(l.Name)
		if err != nil || gro || !tx {
			t.Errorf("node %s: gro=%v txcsum=%v err=%v (node side must be untouched)", l.Name, gro, tx, err)
		}
	}
	topo.Backend(2).ServeHTTP(8080)
	for _, f := range families {
		url := "http://" + hostOf(f.backend(2)) + ":8080/"
		body, err := topo.Client.HTTPGet(ctxT(t, 2*time.Second), url, connectTimeout)
		if body != "b2\n" {
			t.Errorf("GET %s: %q %v", url, body, err)
		}
	}
}

// TestStaticNeighbors checks that StaticNeighbors leaves permanent ARP and
// NDP entries on both ends of every link, after Build's probes have run
// over them, and that without it no entry is permanent.
func TestStaticNeighbors(t *testing.T) {
	for _, static := range []bool{true, false} {
		t.Run(fmt.Sprintf("static=%v", static), func(t *testing.T) {
			topo := New(t, Options{Backends: 2, StaticNeighbors: static})
			for _, l := range topo.Links {
				for _, e := range []struct {
					ns      *NS
					ifindex int
					ips     []netip.Addr
					mac     net.HardwareAddr
				}{
					{topo.Node, l.Index, []netip.Addr{l.PeerAddr.Addr(), l.PeerAddrV6.Addr()}, l.PeerMAC},
					{l.Peer, l.PeerIndex, []netip.Addr{l.Addr.Addr(), l.AddrV6.Addr()}, l.MAC},
				} {
					for _, ip := range e.ips {
						n, ok, err := neighbour(e.ns, e.ifindex, ip)
						if err != nil {
							t.Fatal(err)
						}
						perm := ok && n.State&netlink.NUD_PERMANENT != 0
						if perm != static || (ok && n.HardwareAddr.String() != e.mac.String()) {
							t.Errorf("%s: neighbour %s: found=%v %s state %#x, want permanent=%v at %s",
								e.ns.Role, ip, ok, n.HardwareAddr, n.State, static, e.mac)
						}
					}
				}
			}
		})
	}
}

// neighbour looks ip up in the neighbour table of ifindex in ns.
func neighbour(ns *NS, ifindex int, ip netip.Addr) (n netlink.Neigh, ok bool, err error) {
	family := netlink.FAMILY_V4
	if ip.Is6() {
		family = netlink.FAMILY_V6
	}
	err = ns.Do(func() error {
		list, err := netlink.NeighList(ifindex, family)
		for _, e := range list {
			if a, _ := netip.AddrFromSlice(e.IP); a.Unmap() == ip {
				n, ok = e, true
			}
		}
		return err
	})
	return n, ok, err
}

func TestParallelTopologies(t *testing.T) {
	a := New(t, Options{Backends: 1})
	b := New(t, Options{Backends: 1})
	if a.Node.Name == b.Node.Name {
		t.Fatal("names collide")
	}
	a.Backend(1).ServeHTTP(80)
	// b's backend serves nothing: refused there, served in a.
	for _, f := range families {
		if _, err := b.Client.HTTPGet(ctxT(t, 2*time.Second), f.url(1), connectTimeout); Classify(err) != Refused {
			t.Errorf("b %s: %v", f.name, err)
		}
		if body, err := a.Client.HTTPGet(ctxT(t, 2*time.Second), f.url(1), connectTimeout); body != "b1\n" {
			t.Errorf("a %s: %q %v", f.name, body, err)
		}
	}
}

func TestCleanupStale(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	live := New(t, Options{Backends: 1})

	// A PID that is certainly dead: a child we started and reaped.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	id := strconv.FormatInt(int64(pid), 36) + "_zz"
	dead := []string{nsName(id, "node"), nsName(id, "b1")}
	for _, n := range dead {
		if err := createNetns(n); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { deleteNetns(n) })
	}
	os.MkdirAll(RegistryDir, 0o755)
	os.WriteFile(registryPath(id), []byte(fmt.Sprintf(`{"pid":%d,"start_time":"1","namespaces":["%s","%s"]}`, pid, dead[0], dead[1])), 0o644)

	removed, err := CleanupStale()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(removed, ",") != strings.Join(dead, ",") && strings.Join(removed, ",") != dead[1]+","+dead[0] {
		// Other dead leftovers may be removed too; ours must be among them.
		for _, n := range dead {
			if !strings.Contains(","+strings.Join(removed, ",")+",", ","+n+",") {
				t.Errorf("%s not removed (removed %v)", n, removed)
			}
		}
	}
	list := netnsList(t)
	for _, n := range dead {
		if strings.Contains(list, n) {
			t.Errorf("%s still listed", n)
		}
	}
	if _, err := os.Stat(registryPath(id)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stale registry file left")
	}
	for _, ns := range live.namespaces() {
		if !strings.Contains(list, ns.Name) {
			t.Errorf("live namespace %s removed", ns.Name)
		}
	}
}

func TestDoRestoresThreads(t *testing.T) {
	topo := New(t, Options{Backends: 1})
	host, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		var inside string
		err := topo.Backend(1).Do(func() error {
			var err error
			inside, err = os.Readlink("/proc/thread-self/ns/net")
			return err
		})
		if err != nil || inside == host {
			t.Fatalf("Do ran in %s (host %s): %v", inside, host, err)
		}
	}
	if err := topo.Client.Do(func() error { panic("boom") }); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Errorf("panic in Do: %v", err)
	}
	// Every thread the scheduler may hand out must be back in the host
	// namespace: sample many.
	errc := make(chan error, 200)
	for i := 0; i < 200; i++ {
		go func() {
			ns, err := os.Readlink("/proc/thread-self/ns/net")
			if err == nil && ns != host {
				err = fmt.Errorf("goroutine ran in %s, host is %s", ns, host)
			}
			errc <- err
		}()
	}
	for i := 0; i < 200; i++ {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
}
