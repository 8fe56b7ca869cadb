// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

// A backend whose listener is gone still holds the TIME_WAIT sockets of
// the connections it closed, and a SYN on one of their tuples (a client
// reusing its port) gets that old connection's ACK, not a RST. The client
// answers it with a RST (RFC 9293 3.10.7.3) and, as Linux does, sends its
// SYN again two jiffies later; that SYN is refused now and replayed. The
// client connects having sent its SYN twice, without waiting out its
// initial RTO. This is why the replay tests (noneWaited) count a
// retransmission as a wait only past it.
func TestRefusingBackendsTimeWaitAnswerCostsNoRTO(t *testing.T) {
	if !bpftest.Replays(t) {
		t.Skip("no SYN replays here (neither the live-frame mode nor a raw socket): a refused client waits for its RTO")
	}
	for _, v6 := range []bool{false, true} {
		name := "IPv4"
		if v6 {
			name = "IPv6"
		}
		t.Run(name, func(t *testing.T) { refusedAfterTimeWait(t, v6) })
	}
}

func refusedAfterTimeWait(t *testing.T, v6 bool) {
	e := newEnv(t, 3)
	cfg, target, client := config(e.topo, all(3), ejectAfterFive), netip.AddrPortFrom(testnet.VIPAddr, 80), e.topo.ClientAddr()
	if v6 {
		cfg, target, client = ipv6Config(e.topo, ejectAfterFive), netip.AddrPortFrom(testnet.VIP6Addr, 80), e.topo.ClientAddrV6()
	}
	e.startAgent(cfg)
	b3 := e.topo.Backend(3)

	// A client port whose flow Maglev sends to b3; b3 closes the connection
	// first (Connection: close), so its socket is left in TIME_WAIT. The
	// ports that went elsewhere leave theirs on b1 and b2, which decide
	// nothing here.
	var port uint16
	for p := uint16(40000); p < 40060 && port == 0; p++ {
		backend, _, _, err := getFrom(e, netip.AddrPortFrom(client, p), target)
		if err != nil {
			t.Fatalf("port %d: %v", p, err)
		}
		if backend == "b3" {
			port = p
		}
	}
	if port == 0 {
		t.Fatal("no client port of 60 went to b3")
	}
	from := netip.AddrPortFrom(client, port)
	// b3's socket is in TIME_WAIT once the client's FIN reached it (until
	// then FIN_WAIT2, which answers a SYN with a RST). The servers'
	// sockets are dual-stack: an IPv4 peer shows mapped.
	mapped := netip.AddrPortFrom(netip.AddrFrom16(client.As16()), port)
	var tw string
	var err error
	held := false
	for i := 0; i < 20 && !held; i++ {
		if i > 0 {
			time.Sleep(50 * time.Millisecond)
		}
		if tw, err = b3.Run("ss", "-Htan", "state", "time-wait"); err != nil {
			t.Fatal(err)
		}
		held = strings.Contains(tw, from.String()) || strings.Contains(tw, mapped.String())
	}
	if !held {
		t.Fatalf("b3 holds no TIME_WAIT socket of %s: %q", from, tw)
	}

	if err := b3.SetMode(testnet.Refuse); err != nil {
		t.Fatal(err)
	}
	before, err := e.topo.Client.TCPCounters()
	if err != nil {
		t.Fatal(err)
	}
	backend, retransmits, connect, err := getFrom(e, from, target)
	if err != nil {
		t.Fatalf("the second connection from %s: %v", from, err)
	}
	after, err := e.topo.Client.TCPCounters()
	if err != nil {
		t.Fatal(err)
	}
	rsts := after["Tcp.OutRsts"] - before["Tcp.OutRsts"]
	t.Logf("from %s after b3 refused: answered by %s, connected after %v, its SYN sent %d more times, the client sent %d RSTs",
		from, backend, connect, retransmits, rsts)
	if backend == "b3" || backend == "" {
		t.Errorf("answered by %q, want b1 or b2", backend)
	}
	// The old connection's ACK made the client's kernel send its SYN
	// again two jiffies later: one retransmission, after a RST of its own.
	if retransmits != 1 || rsts < 1 {
		t.Errorf("the client sent its SYN %d more times and %d RSTs; want one retransmission and a RST (b3's TIME_WAIT answered with an ACK)", retransmits, rsts)
	}
	m := e.metrics()
	// The replay spared it the RTO, unless (in the kernel matrix's VM) the
	// agent read the refusal too late to replay it (noneWaited's allowance).
	if connect >= rtoWait && !(inVM() && m.Get("penaltybox_syn_replays_total", "reason", "refused", "result", "stale") > 0) {
		t.Errorf("connected after %v, with %d retransmissions: it waited out its initial RTO", connect, retransmits)
	}
	b3Addr := netip.AddrPortFrom(b3.Addr, 8080).String()
	if v6 {
		b3Addr = netip.AddrPortFrom(b3.AddrV6, 8080).String()
	}
	if got := m.Get("penaltybox_endpoint_failures_by_kind_total", "backend", b3Addr, "kind", "refused"); got != 1 {
		t.Errorf("refused failures of b3 = %v, want 1 (the SYN sent again)", got)
	}
	if got := m.Get("penaltybox_syn_replays_total", "reason", "refused", "result", "sent"); got != 1 && !inVM() {
		t.Errorf("refused SYNs replayed = %v, want 1", got)
	}
}

// getFrom makes one HTTP request over a new connection from the client's
// address and port from to target, reading to the backend's close (so
// the backend closes first and keeps the TIME_WAIT socket). It returns the
// answering backend, how many times the client sent its SYN again
// (TCP_INFO) and how long the connect took.
func getFrom(e *env, from, target netip.AddrPort) (backend string, retransmits int, connect time.Duration, err error) {
	d := &testnet.Dialer{NS: e.topo.Client, Timeout: 3 * time.Second, LocalAddr: from}
	start := time.Now()
	c, err := d.DialContext(e.ctx, "tcp", target.String())
	if err != nil {
		return "", 0, 0, err
	}
	defer c.Close()
	connect = time.Since(start)
	retransmits = testnet.SYNRetransmits(c)
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", target); err != nil {
		return "", retransmits, connect, err
	}
	r := bufio.NewReader(c)
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		return "", retransmits, connect, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return "", retransmits, connect, err
	}
	// The backend's FIN: read to the end before closing.
	if _, err := io.Copy(io.Discard, r); err != nil {
		return "", retransmits, connect, err
	}
	return testnet.BackendOf(string(body)), retransmits, connect, nil
}
