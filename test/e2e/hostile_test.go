// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

// Evidence no client can forge. Each test runs three healthy backends
// under a legit load of 100 new connections a second while a client with
// a raw socket (any pod with CAP_NET_RAW) forges what the datapath used to
// take as a backend's failure or success. Nothing it sends may count a
// failure or eject anything, and the legit load is not hurt.

// hostileAccrual: 5 failures eject, as in the failure tests; the connect
// deadline has room for a noisy machine's handshakes (a legit connect
// slower than it would count, and this suite asserts zero).
const hostileAccrual = `    failureAccrual:
      maxFailures: 5
      minPenalty: 4s
      maxPenalty: 30s
      jitterRatio: 0.2
      connectTimeout: 2s
`

var backendAddrs = []netip.Addr{
	netip.MustParseAddr("198.18.1.2"), netip.MustParseAddr("198.18.2.2"), netip.MustParseAddr("198.18.3.2"),
}

var vipTCP = netip.AddrPortFrom(testnet.VIPAddr, 80)

// hostileEnv is three healthy HTTP backends behind the agent, a forger on
// the client's eth0, and the legit load running.
type hostileEnv struct {
	*env
	forge *testnet.RawSender
	load  chan testnet.Results
}

func newHostileEnv(t *testing.T, extra string, args ...string) *hostileEnv {
	e := newEnv(t, 3)
	e.startAgent(config(e.topo, all(3), hostileAccrual+extra), args...)
	s, err := e.topo.Links[0].RawSender()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return &hostileEnv{env: e, forge: s}
}

// startLoad runs the legit load for d in the background (see checkLoad).
func (h *hostileEnv) startLoad(d time.Duration) {
	h.load = make(chan testnet.Results, 1)
	go func() {
		rs, err := testnet.Load(h.ctx, h.topo.Client, testnet.LoadSpec{
			Target: testnet.VIP + ":80", Rate: 100, Duration: d,
			ConnectTimeout: 3 * time.Second, RequestTimeout: 3 * time.Second,
		})
		if err != nil {
			h.t.Error(err)
		}
		h.load <- rs
	}()
}

// send forges frames from the client's namespace.
func (h *hostileEnv) send(frames ...[]byte) {
	h.t.Helper()
	for _, f := range frames {
		if err := h.forge.Send(f); err != nil {
			h.t.Fatal(err)
		}
	}
}

// tuples is n client ports of the attack, out of the legit load's range.
func tuples(n int) []netip.AddrPort {
	out := make([]netip.AddrPort, n)
	base := 20000 + rand.IntN(5000)
	for i := range out {
		out[i] = netip.AddrPortFrom(netip.MustParseAddr("198.18.0.2"), uint16(base+i))
	}
	return out
}

// checkNothingCounted is the suite's promise: the legit load all went
// through, no endpoint had a failure counted, none was ejected.
func (h *hostileEnv) checkNothingCounted(unproven string, atLeast float64) {
	h.t.Helper()
	if h.load != nil {
		rs := <-h.load
		h.t.Logf("legit load: %v", rs)
		if rate := rs.SuccessRate(); rate < 1 {
			h.t.Errorf("legit load: %.2f%% succeeded, want all (healthy backends)", 100*rate)
		}
	}
	// The agent's verdicts come within its connect timeout (2s).
	time.Sleep(2500 * time.Millisecond)
	m := h.metrics()
	if got := m.Get("penaltybox_endpoint_failures_total"); got != 0 {
		h.t.Errorf("%v failures counted against healthy backends (by kind: refused %v, timeout %v, reset %v)", got,
			m.Get("penaltybox_endpoint_failures_by_kind_total", "kind", "refused"), m.Get("penaltybox_endpoint_failures_by_kind_total", "kind", "timeout"),
			m.Get("penaltybox_endpoint_failures_by_kind_total", "kind", "reset"))
	}
	if got := m.Get("penaltybox_endpoint_ejections_total"); got != 0 {
		h.t.Errorf("%v ejections of healthy backends", got)
	}
	if unproven != "" {
		got := m.Get("penaltybox_datapath_unproven_packets_total", "reason", unproven)
		h.t.Logf("unproven packets, %s: %v", unproven, got)
		if got < atLeast {
			h.t.Errorf("unproven packets (%s) = %v, want at least %v: the attack did not reach the check", unproven, got, atLeast)
		}
	}
}

// slowHandshakes makes every backend's SYN-ACK take 30 ms, as from a
// backend on another node. Here the whole exchange can otherwise finish
// within the forger's send (a SYN, its SYN-ACK and the client kernel's RST
// for a socket it never had, all in one softirq), and a forged packet
// right behind the SYN would find the flow closed already.
func (h *hostileEnv) slowHandshakes() {
	h.t.Helper()
	for i := 1; i <= 3; i++ {
		if err := h.topo.Backend(i).DelayHandshakes(30 * time.Millisecond); err != nil {
			h.t.Fatal(err)
		}
	}
}

// A client sends each SYN twice, back to back: the second copy comes
// before the answer, and used to be taken for the client's
// retransmission, a timeout.
func TestHostileDuplicateSYNs(t *testing.T) {
	h := newHostileEnv(t, "")
	h.slowHandshakes()
	h.startLoad(4 * time.Second)
	for _, c := range tuples(60) {
		syn := bpftest.LinuxSYN(c, vipTCP, rand.Uint32())
		h.send(syn, syn)
		time.Sleep(20 * time.Millisecond)
	}
	h.checkNothingCounted("syn_duplicate", 30)
}

// A client sends a SYN and, right behind it, an ACK acknowledging a wrong
// number: the backend resets the half-open connection, as RFC 9293 says it
// must. That reset is the client's doing, not the backend's.
func TestHostileWrongACKAfterSYN(t *testing.T) {
	h := newHostileEnv(t, "")
	h.slowHandshakes()
	h.startLoad(4 * time.Second)
	for _, c := range tuples(60) {
		isn := rand.Uint32()
		h.send(bpftest.LinuxSYN(c, vipTCP, isn),
			bpftest.TCPSeq(c, vipTCP, bpftest.ACK, nil, isn+1, rand.Uint32()))
		time.Sleep(20 * time.Millisecond)
	}
	h.checkNothingCounted("reply_unacked", 30)
}

// A client spoofs the backends: right behind each SYN it sends, from every
// backend's address, the refusal that backend would send (RST|ACK of
// ISN+1). It comes from the client's own interface, where the node does
// not route any backend.
func TestHostileForgedRefusals(t *testing.T) {
	h := newHostileEnv(t, "")
	h.slowHandshakes()
	h.startLoad(4 * time.Second)
	for _, c := range tuples(60) {
		isn := rand.Uint32()
		h.send(bpftest.LinuxSYN(c, vipTCP, isn))
		for _, b := range backendAddrs {
			h.send(bpftest.Refusal(netip.AddrPortFrom(b, 8080), c, isn))
		}
		time.Sleep(20 * time.Millisecond)
	}
	h.checkNothingCounted("reply_wrong_side", 60)
}

// A backend that answers nothing is ejected as fast while a client forges
// its SYN-ACKs (and data) for connections of its own: a success that did
// not come from the backend hides nothing.
func TestHostileForgedSYNACKsHideNothing(t *testing.T) {
	h := newHostileEnv(t, "")
	if err := h.topo.Backend(3).SetMode(testnet.Blackhole); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(h.ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		b3 := netip.AddrPortFrom(backendAddrs[2], 8080)
		for _, c := range tuples(2000) {
			if ctx.Err() != nil {
				return
			}
			isn := rand.Uint32()
			h.forge.Send(bpftest.LinuxSYN(c, vipTCP, isn))
			h.forge.Send(bpftest.TCPSeq(b3, c, bpftest.SYNACK, nil, 7, isn+1))
			h.forge.Send(bpftest.TCPSeq(b3, c, bpftest.ACK, []byte("HTTP/1.1 200 OK\r\n"), 8, isn+1))
			time.Sleep(5 * time.Millisecond)
		}
	}()
	start := time.Now()
	for {
		if h.metrics().Get("penaltybox_endpoint_ejections_total", "backend", b3) > 0 {
			t.Logf("b3 ejected after %v", time.Since(start).Round(time.Millisecond))
			break
		}
		if time.Since(start) > 15*time.Second {
			t.Fatalf("b3 answers nothing and is still not ejected after 15 s of load and forged SYN-ACKs")
		}
		for range 10 {
			h.dialVIPOnce()
		}
	}
	cancel()
	wg.Wait()
	m := h.metrics()
	if got := m.Get("penaltybox_endpoint_connects_total", "backend", b3); got != 0 {
		t.Errorf("%v successful connects counted for a backend that answers nothing", got)
	}
	if got := m.Get("penaltybox_datapath_unproven_packets_total", "reason", "reply_wrong_side"); got < 1 {
		t.Errorf("no forged reply was seen from the wrong side: the attack did not run")
	}
}

// dialVIPOnce opens one connection through the VIP and closes it (the
// legit traffic a blackholed backend fails), waiting at most 100 ms.
func (h *hostileEnv) dialVIPOnce() {
	c, err := h.topo.Client.Dialer(100*time.Millisecond).DialContext(h.ctx, "tcp", testnet.VIP+":80")
	if err == nil {
		c.Close()
	}
}

// A client's RST the backend does not take (out of its sequence) used to
// free the connection's breaker slot while the backend kept it: the cap
// could be exceeded at will.
func TestHostileClientRSTsKeepTheBreaker(t *testing.T) {
	h := newHostileEnv(t, "    maxInflight: 20\n")
	for i := 1; i <= 3; i++ {
		h.topo.Backend(i).SetMode(testnet.Hold)
	}
	dial := func(n int) (held []net.Conn, refused int) {
		for range n {
			c, err := h.topo.Client.Dialer(3*time.Second).DialContext(h.ctx, "tcp", testnet.VIP+":80")
			switch {
			case err == nil:
				held = append(held, c)
			case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET):
				refused++
			default:
				t.Fatalf("dial: %v", err)
			}
		}
		return held, refused
	}
	first, _ := dial(20)
	defer func() {
		for _, c := range first {
			c.Close()
		}
	}()
	if len(first) != 20 {
		t.Fatalf("%d of 20 connections under a cap of 20", len(first))
	}
	for _, c := range first {
		local := netip.MustParseAddrPort(c.LocalAddr().String())
		for _, seq := range []uint32{rand.Uint32(), rand.Uint32(), rand.Uint32()} {
			h.send(bpftest.TCPSeq(local, vipTCP, bpftest.TCPFlags{RST: true}, nil, seq, 0))
		}
	}
	time.Sleep(200 * time.Millisecond)
	more, refused := dial(20)
	for _, c := range more {
		c.Close()
	}
	held := 0
	for i := 1; i <= 3; i++ {
		held += h.topo.Backend(i).Stats().Held
	}
	t.Logf("after 60 forged RSTs: %d more admitted, %d refused; backends hold %d", len(more), refused, held)
	if len(more) != 0 || held > 20 {
		t.Errorf("%d connections admitted past a full cap of 20 (backends hold %d)", len(more), held)
	}
	if got := h.metrics().Get("penaltybox_datapath_unproven_packets_total", "reason", "client_rst_ignored"); got < 60 {
		t.Errorf("client_rst_ignored = %v, want 60", got)
	}
}

// SYNs no backend can accept: a bad TCP or IPv4 checksum, SYN|FIN, a TTL
// the node's forwarding uses up. They used to open flows whose deadline
// judged the backend silent.
func TestHostileDoomedSYNs(t *testing.T) {
	h := newHostileEnv(t, "")
	h.startLoad(5 * time.Second)
	kinds := []func(c netip.AddrPort) []byte{
		func(c netip.AddrPort) []byte { // bad TCP checksum
			f := bpftest.LinuxSYN(c, vipTCP, rand.Uint32())
			f[14+20+17] ^= 0x5a
			return f
		},
		func(c netip.AddrPort) []byte { // bad IPv4 header checksum
			f := bpftest.LinuxSYN(c, vipTCP, rand.Uint32())
			f[14+11] ^= 0x5a
			return f
		},
		func(c netip.AddrPort) []byte {
			return bpftest.TCP(c, vipTCP, bpftest.TCPFlags{SYN: true, FIN: true}, nil)
		},
		func(c netip.AddrPort) []byte { return ttl1(bpftest.LinuxSYN(c, vipTCP, rand.Uint32())) },
	}
	for i, c := range tuples(240) {
		h.send(kinds[i%len(kinds)](c))
		time.Sleep(10 * time.Millisecond)
	}
	h.checkNothingCounted("syn_doomed", 240)
}

// ttl1 sets an IPv4 frame's TTL to 1, its header checksum kept right.
func ttl1(f []byte) []byte {
	f[14+8] = 1
	f[14+10], f[14+11] = 0, 0
	var s uint32
	for i := 14; i < 14+20; i += 2 {
		s += uint32(f[i])<<8 | uint32(f[i+1])
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	f[14+10], f[14+11] = byte(^s>>8), byte(^s)
	return f
}

// A UDP client forges the ICMP port unreachable a closed port would send,
// from every backend's address, for each of its queries.
func TestHostileForgedPortUnreachables(t *testing.T) {
	e := newEnv(t, 3)
	for i := 1; i <= 3; i++ {
		if err := e.topo.Backend(i).ServeUDPEcho(udpPort); err != nil {
			t.Fatal(err)
		}
	}
	e.startAgent(udpConfig(e.topo, false, hostileAccrual))
	h := &hostileEnv{env: e}
	s, err := e.topo.Links[0].RawSender()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	h.forge = s
	vipUDP := netip.AddrPortFrom(testnet.VIPAddr, 53)
	ok := 0
	for i, c := range tuples(60) {
		h.send(bpftest.UDP(c, vipUDP, []byte(fmt.Sprintf("q%d", i))))
		for _, b := range backendAddrs {
			// What the backend received: the datagram, DNATed to it.
			quoted := bpftest.UDP(c, netip.AddrPortFrom(b, udpPort), []byte(fmt.Sprintf("q%d", i)))
			h.send(bpftest.ICMPError(b, c.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPPortUnreach, 0, quoted, 0))
		}
		if query(e, false, i) == "ok" {
			ok++
		}
	}
	if ok != 60 {
		t.Errorf("%d of 60 legit queries answered", ok)
	}
	h.checkNothingCounted("reply_wrong_side", 60)
}

// One tenant's service, whose backends answer nothing, under a slow stream
// of SYNs with the longest connect timeout allowed: its pending connects
// used to hold the whole node in flood mode (every service's timeouts
// withheld). They are capped per service now.
func TestHostileOneTenantCannotHoldFloodMode(t *testing.T) {
	e := newEnv(t, 3)
	e.topo.Backend(3).SetMode(testnet.Blackhole)
	cfg := config(e.topo, []int{1, 2}, hostileAccrual) + fmt.Sprintf(`  - name: tenant
    vip: %s
    port: 81
    protocol: tcp
    backends: ["198.18.3.2:8080"]
    failureAccrual:
      connectTimeout: 30s
`, testnet.VIP)
	e.startAgent(cfg)
	res, err := e.topo.Client.SYNFlood(e.ctx, testnet.FloodSpec{
		Sources: []netip.Addr{netip.MustParseAddr("198.18.0.2")}, Target: netip.AddrPortFrom(testnet.VIPAddr, 81),
		Rate: 1200, Duration: 10 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	m := e.metrics()
	t.Logf("sent %d SYNs at %.0f/s; pending connects %v, flood mode %v", res.Sent, res.Rate(),
		m.Get("penaltybox_pending_connects"), m.Get("penaltybox_flood_mode"))
	if res.Sent < 10500 {
		t.Fatalf("sent only %d SYNs: not enough pending connects to have held flood mode", res.Sent)
	}
	// Flood mode lasts 10 s past its last sign: read right after the
	// flood, it would still be on.
	if got := m.Get("penaltybox_flood_mode"); got != 0 {
		t.Errorf("flood mode %v: one service's pending connects hold the node", got)
	}
}
