// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"bytes"
	"net/netip"
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

var router = netip.MustParseAddr("198.18.9.1")

// icmp runs an ICMP error through the program and parses what it left.
func (f *fixture) icmp(pkt []byte) (uint32, bpftest.ParsedICMP, []byte) {
	f.t.Helper()
	ret, out := bpftest.Run(f.t, f.PbXdp, pkt)
	out = out[:len(pkt)]
	p, err := bpftest.ParseICMP(out)
	if err != nil {
		f.t.Fatalf("output ICMP error: %v", err)
	}
	return ret, p, out
}

func (f *fixture) icmpTranslated() uint64 {
	f.t.Helper()
	g, err := f.Maps.GlobalStats()
	f.must(err)
	return g.IcmpTranslated
}

// openedFlow is a fixture with a client's SYN sent to be1, and that SYN
// as the datapath forwarded it (what a router's error would quote).
func openedFlow(t *testing.T) (*fixture, []byte) {
	f := newFixture(t)
	f.table(id1)
	_, p, dnated := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	if p.Dst != be1 {
		t.Fatalf("SYN went to %v", p.Dst)
	}
	f.events()
	return f, dnated
}

// A router between the node and a backend cannot forward a client's
// segment (fragmentation needed): its error quotes client -> backend, which
// the client never sent. Translated, it quotes client -> VIP, so the
// client's stack finds the connection and learns the path MTU; the MTU,
// the router's address and every checksum are kept right.
func TestICMPFragNeededFromARouterIsTranslated(t *testing.T) {
	f, dnated := openedFlow(t)
	// Linux quotes as much as fits in 576 bytes: here the whole segment,
	// so the quoted TCP checksum is checked too; then only 8 L4 bytes.
	for _, quote := range []int{0, 28} {
		ret, got, _ := f.icmp(bpftest.ICMPError(router, client.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPFragNeeded, 1280, dnated, quote))
		if ret != bpftest.XDPPass || got.Src != router || got.Dst != client.Addr() || got.Rest != 1280 {
			t.Fatalf("quote %d: verdict %d, %+v: want passed, from the router to the client, MTU 1280", quote, ret, got)
		}
		if got.QuotedSrc != client || got.QuotedDst != vip {
			t.Errorf("quote %d: quotes %v -> %v, want %v -> %v", quote, got.QuotedSrc, got.QuotedDst, client, vip)
		}
		if got.QuotedL4Checked != (quote == 0) {
			t.Errorf("quote %d: quoted L4 checksum checked %v", quote, got.QuotedL4Checked)
		}
	}
	if n := f.icmpTranslated(); n != 2 {
		t.Errorf("icmp_translated = %d, want 2", n)
	}
	f.wantEvents() // no verdict: the flow goes on
}

// An ICMP error whose IP header claims a total length that does not hold
// its quote, or more than the frame, is malformed (the kernel drops it):
// it passes untouched, even when the quote names a flow the datapath
// knows (FuzzXDP found the short one translated, CI55).
func TestICMPWithAWrongTotalLengthPassesUnchanged(t *testing.T) {
	f, dnated := openedFlow(t)
	good := bpftest.ICMPError(router, client.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPFragNeeded, 1280, dnated, 28)
	if ret, got, _ := f.icmp(good); ret != bpftest.XDPPass || got.QuotedDst != vip {
		t.Fatalf("the well-formed error: verdict %d, quotes -> %v; want it translated (the check this test relies on)", ret, got.QuotedDst)
	}
	whole := len(good) - 14
	for _, tot := range []int{18, 20 + 8 + 20 + 7, whole + 1} {
		pkt := bytes.Clone(good)
		pkt[16], pkt[17] = byte(tot>>8), byte(tot)
		ret, out := bpftest.Run(t, f.PbXdp, pkt)
		if ret != bpftest.XDPPass || !bytes.Equal(out[:len(pkt)], pkt) {
			t.Errorf("total length %d of a %d-byte packet: verdict %d, changed %v; want it passed unchanged", tot, whole, ret, !bytes.Equal(out[:len(pkt)], pkt))
		}
	}
	if n := f.icmpTranslated(); n != 1 {
		t.Errorf("icmp_translated = %d, want 1 (the well-formed one)", n)
	}
}

// The client's own error about a reply (it quotes VIP -> client, sent to
// the VIP) goes to the backend, quoting backend -> client as the backend
// sent it.
func TestICMPFromTheClientGoesToTheBackend(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	_, p, reply := f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	if p.Src != vip {
		t.Fatalf("reply from %v", p.Src)
	}
	f.events()
	ret, got, _ := f.icmp(bpftest.ICMPError(client.Addr(), vip.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPFragNeeded, 1400, reply, 0))
	if ret != bpftest.XDPPass || got.Src != client.Addr() || got.Dst != be1.Addr() {
		t.Fatalf("verdict %d, %+v: want passed on to the backend", ret, got)
	}
	if got.QuotedSrc != be1 || got.QuotedDst != client || !got.QuotedL4Checked {
		t.Errorf("quotes %v -> %v (L4 checked %v), want %v -> %v", got.QuotedSrc, got.QuotedDst, got.QuotedL4Checked, be1, client)
	}
}

// A UDP backend with nothing on its port answers with port unreachable:
// that is the flow's refusal (once), reported like a TCP refusal, the
// error reaches the client from the VIP, and the flow ends, so the
// client's next datagram on the same ports is a new flow. A reply is the
// flow's success; a port unreachable after it is no refusal.
func TestUDPPortUnreachableIsARefusal(t *testing.T) {
	f := newFixture(t)
	f.service(17, id1)
	_, p, dnated := f.run(bpftest.UDP(client, vip, []byte("query")))
	if p.Dst != be1 {
		t.Fatalf("datagram went to %v", p.Dst)
	}
	unreach := bpftest.ICMPError(be1.Addr(), client.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPPortUnreach, 0, dnated, 0)
	ret, got, _ := f.icmp(unreach)
	if ret != bpftest.XDPPass || got.Src != vip.Addr() || got.Dst != client.Addr() || got.QuotedDst != vip || !got.QuotedL4Checked {
		t.Fatalf("verdict %d, %+v: want passed from the VIP, quoting the client's datagram to the VIP", ret, got)
	}
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evRefused, 0, id1, client))
	// The flow is gone: a second error finds nothing to translate, and
	// the next datagram is a new flow.
	ret, out := bpftest.Run(t, f.PbXdp, unreach)
	if ret != bpftest.XDPPass || !bytes.Equal(out[:len(unreach)], unreach) {
		t.Errorf("a second error for the ended flow: verdict %d, changed %v", ret, !bytes.Equal(out[:len(unreach)], unreach))
	}
	f.run(bpftest.UDP(client, vip, []byte("again")))
	f.wantEvents(ev(evNewFlow, 0, id1, client))

	// Answered, then unreachable: a success, no refusal.
	f.run(bpftest.UDP(be1, client, []byte("answer")))
	f.wantEvents(ev(evEstablished, 0, id1, client))
	f.run(bpftest.UDP(be1, client, []byte("more")))
	f.wantEvents() // one success per flow
	_, _, dnated = f.run(bpftest.UDP(client, vip, []byte("later")))
	f.icmp(bpftest.ICMPError(be1.Addr(), client.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPPortUnreach, 0, dnated, 0))
	f.wantEvents()
}

// What is not an error about a NATed flow passes untouched: an echo, an
// error quoting a flow conntrack does not know, a quote too short to hold
// the ports.
func TestICMPNotOursPassesUnchanged(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	_, _, dnated := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	other := bpftest.TCP(client2, be1, bpftest.SYN, nil) // never through the VIP
	for name, pkt := range map[string][]byte{
		"echo request":  bpftest.ICMPError(router, client.Addr(), 8, 0, 0, dnated, 0),
		"unknown flow":  bpftest.ICMPError(router, client2.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPFragNeeded, 1280, other, 0),
		"short quote":   bpftest.ICMPError(router, client.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPFragNeeded, 1280, dnated, 24),
		"time exceeded": bpftest.ICMPError(router, client2.Addr(), bpftest.ICMPTimeExceeded, 0, 0, other, 0),
	} {
		ret, out := bpftest.Run(t, f.PbXdp, pkt)
		if ret != bpftest.XDPPass || !bytes.Equal(out[:len(pkt)], pkt) {
			t.Errorf("%s: verdict %d, changed %v", name, ret, !bytes.Equal(out[:len(pkt)], pkt))
		}
	}
	if n := f.icmpTranslated(); n != 0 {
		t.Errorf("icmp_translated = %d, want 0", n)
	}
}

// A late port unreachable for a flow whose forward entry the LRU evicted,
// after the tuple's next datagram made a new flow to another backend,
// ends only the old flow: the new one keeps its entry.
func TestUDPRefusalSparesTheTuplesNewFlow(t *testing.T) {
	f := newFixture(t)
	f.service(17, id1)
	_, _, dnated := f.run(bpftest.UDP(client, vip, []byte("q1")))
	var fk bpf.LbCtKey
	fk.Src.Bytes, fk.Dst.Bytes = maps.Addr16(client.Addr()), maps.Addr16(vip.Addr())
	fk.Sport, fk.Dport = maps.Port(client.Port()), maps.Port(vip.Port())
	fk.Proto, fk.Dir, fk.Family = 17, maps.DirFwd, maps.FamilyIPv4
	f.must(f.Maps.DeleteCT(fk)) // evicted
	f.table(id2)
	if _, p, _ := f.run(bpftest.UDP(client, vip, []byte("q2"))); p.Dst != be2 {
		t.Fatalf("the new flow went to %v, want %v", p.Dst, be2)
	}
	f.events()
	f.icmp(bpftest.ICMPError(be1.Addr(), client.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPPortUnreach, 0, dnated, 0))
	f.wantEvents(ev(evRefused, 0, id1, client))
	if _, p, _ := f.run(bpftest.UDP(client, vip, []byte("q3"))); p.Dst != be2 {
		t.Fatalf("after the old flow's refusal the tuple's datagram went to %v, want %v", p.Dst, be2)
	}
	f.wantEvents() // the new flow is still there: no new flow begins
}
