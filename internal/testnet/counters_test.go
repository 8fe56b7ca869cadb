// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"
)

// No root: the format of /proc/net/snmp and /proc/net/netstat.
func TestParseProcNetCounters(t *testing.T) {
	snmp := `Ip: Forwarding DefaultTTL
Ip: 1 64
Tcp: RtoAlgorithm MaxConn ActiveOpens
Tcp: 1 -1 7
Udp: InDatagrams
Udp: 3
`
	netstat := `TcpExt: SyncookiesSent ListenDrops TCPSynRetrans
TcpExt: 0 2 5
IpExt: InNoRoutes
IpExt: 9
`
	got := map[string]uint64{}
	for _, text := range []string{snmp, netstat} {
		if err := parseProcNetCounters(text, got); err != nil {
			t.Fatal(err)
		}
	}
	want := map[string]uint64{"Tcp.RtoAlgorithm": 1, "Tcp.ActiveOpens": 7,
		"TcpExt.SyncookiesSent": 0, "TcpExt.ListenDrops": 2, "TcpExt.TCPSynRetrans": 5}
	if len(got) != len(want) {
		t.Errorf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %d, want %d (all: %v)", k, got[k], v, got)
		}
	}
	if err := parseProcNetCounters("Tcp: A B\nTcp: 1\n", map[string]uint64{}); err == nil {
		t.Errorf("a values line shorter than its names parsed")
	}
	if err := parseProcNetCounters("Tcp: A\nTcp: 1\nUdp: B\n", map[string]uint64{}); err == nil {
		t.Errorf("a names line without its values parsed")
	}
}

// A namespace's counters are its own: the client's dial to a backend
// that drops SYNs shows as the client's SYN retransmission, not the
// backend's, and a served dial as the backend's passive open.
func TestTCPCounters(t *testing.T) {
	topo, b1, b2 := servingAndSilent(t)
	counters := func(ns *NS) map[string]uint64 {
		t.Helper()
		c, err := ns.TCPCounters()
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := c["TcpExt.TCPSynRetrans"]; !ok {
			t.Fatalf("%s: no TcpExt.TCPSynRetrans in %v", ns.Name, c)
		}
		return c
	}
	cl0, b10 := counters(topo.Client), counters(b1.NS)

	c, err := topo.Client.DialContext(context.Background(), "tcp", net.JoinHostPort(b1.Addr.String(), "80"))
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	// Linux retransmits an unanswered SYN after 1 s.
	d := topo.Client.Dialer(1500 * time.Millisecond)
	if _, err := d.DialContext(context.Background(), "tcp", net.JoinHostPort(b2.Addr.String(), "80")); err == nil || !strings.Contains(err.Error(), "timeout") {
		t.Fatalf("dial to a backend that drops SYNs: %v, want a timeout", err)
	}
	cl1, b11 := counters(topo.Client), counters(b1.NS)
	if got := cl1["Tcp.ActiveOpens"] - cl0["Tcp.ActiveOpens"]; got != 2 {
		t.Errorf("client's ActiveOpens rose by %d, want 2", got)
	}
	if got := cl1["TcpExt.TCPSynRetrans"] - cl0["TcpExt.TCPSynRetrans"]; got < 1 {
		t.Errorf("client's TCPSynRetrans rose by %d, want >= 1", got)
	}
	if got := b11["Tcp.PassiveOpens"] - b10["Tcp.PassiveOpens"]; got != 1 {
		t.Errorf("b1's PassiveOpens rose by %d, want 1", got)
	}
	if got := b11["TcpExt.TCPSynRetrans"]; got != b10["TcpExt.TCPSynRetrans"] {
		t.Errorf("b1's TCPSynRetrans moved (%d -> %d): the client's dial counted in another namespace", b10["TcpExt.TCPSynRetrans"], got)
	}
}

// A connection whose first SYN was dropped, and its retransmission
// answered, says so in its Result; one answered at once does not.
func TestLoadCountsSYNRetransmits(t *testing.T) {
	topo, b1, b2 := servingAndSilent(t)
	// Healed within the client's first RTO (1 s): its retransmission
	// connects.
	healed := time.AfterFunc(300*time.Millisecond, func() {
		if err := b2.SetMode(Serve); err != nil {
			t.Error(err)
		}
	})
	defer healed.Stop()
	for _, c := range []struct {
		b    *Backend
		want int
	}{{b2, 1}, {b1, 0}} {
		rs, err := Load(context.Background(), topo.Client, LoadSpec{Target: net.JoinHostPort(c.b.Addr.String(), "80"),
			Rate: 10, Count: 1, ConnectOnly: true, ConnectTimeout: 3 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if r := rs[0]; r.Class != OK || r.SYNRetransmits != c.want || r.Connect < time.Duration(c.want)*time.Second {
			t.Errorf("%s: %v, %d SYN retransmits after %v; want ok, %d", c.b.Name, r.Class, r.SYNRetransmits, r.Connect, c.want)
		}
	}
}

// servingAndSilent is a topology of two backends serving HTTP on port 80,
// the second dropping SYNs.
func servingAndSilent(t *testing.T) (*Topology, *Backend, *Backend) {
	topo := New(t, Options{Backends: 2})
	b1, b2 := topo.Backend(1), topo.Backend(2)
	for _, b := range []*Backend{b1, b2} {
		if err := b.ServeHTTP(80); err != nil {
			t.Fatal(err)
		}
	}
	if err := b2.SetMode(Blackhole); err != nil {
		t.Fatal(err)
	}
	return topo, b1, b2
}
