// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"bytes"
	"net/netip"
	"testing"

	"github.com/penaltybox/penaltybox/internal/bpftest"
)

var router6 = netip.MustParseAddr("2001:2:0:9::1")

func (f *fixture) icmp6(pkt []byte) (uint32, bpftest.ParsedICMP) {
	f.t.Helper()
	ret, out := bpftest.Run(f.t, f.PbXdp, pkt)
	p, err := bpftest.ParseICMP6(out[:len(pkt)])
	if err != nil {
		f.t.Fatalf("output ICMPv6 error: %v", err)
	}
	return ret, p
}

// A router's "packet too big" about a client's segment to an IPv6 backend
// quotes client -> backend; translated, it quotes client -> VIP and keeps
// the MTU, the router's address and every checksum (ICMPv6's over its
// pseudo-header) right.
func TestICMPv6PacketTooBigIsTranslated(t *testing.T) {
	f := fixture6(t, 6)
	_, p, dnated := f.run(bpftest.TCP(client6, vip6, bpftest.SYN, []byte("payload")))
	if p.Dst != be6a {
		t.Fatalf("SYN went to %v", p.Dst)
	}
	f.events()
	for _, quote := range []int{0, 48} {
		ret, got := f.icmp6(bpftest.ICMP6Error(router6, client6.Addr(), bpftest.ICMP6PacketTooBig, 0, 1280, dnated, quote))
		if ret != bpftest.XDPPass || got.Src != router6 || got.Dst != client6.Addr() || got.Rest != 1280 {
			t.Fatalf("quote %d: verdict %d, %+v", quote, ret, got)
		}
		if got.QuotedSrc != client6 || got.QuotedDst != vip6 || got.QuotedL4Checked != (quote == 0) {
			t.Errorf("quote %d: %v -> %v (L4 checked %v), want %v -> %v", quote, got.QuotedSrc, got.QuotedDst, got.QuotedL4Checked, client6, vip6)
		}
	}
	f.wantEvents()

	// The client's own error about a reply goes on to the backend.
	_, _, reply := f.run(bpftest.TCP(be6a, client6, bpftest.SYNACK, nil))
	f.events()
	ret, got := f.icmp6(bpftest.ICMP6Error(client6.Addr(), vip6.Addr(), bpftest.ICMP6PacketTooBig, 0, 1400, reply, 0))
	if ret != bpftest.XDPPass || got.Dst != be6a.Addr() || got.QuotedSrc != be6a || got.QuotedDst != client6 || !got.QuotedL4Checked {
		t.Fatalf("client's error: verdict %d, %+v", ret, got)
	}
}

// An IPv6 UDP backend's port unreachable is the flow's refusal, reaching
// the client from the VIP; the flow ends.
func TestICMPv6PortUnreachableIsARefusal(t *testing.T) {
	f := fixture6(t, 17)
	dns := netip.AddrPortFrom(vip6.Addr(), 80)
	_, p, dnated := f.run(bpftest.UDP(client6, dns, []byte("query")))
	if p.Dst != be6a {
		t.Fatalf("datagram went to %v", p.Dst)
	}
	unreach := bpftest.ICMP6Error(be6a.Addr(), client6.Addr(), bpftest.ICMP6DestUnreach, bpftest.ICMP6PortUnreach, 0, dnated, 0)
	ret, got := f.icmp6(unreach)
	if ret != bpftest.XDPPass || got.Src != vip6.Addr() || got.QuotedDst != dns || !got.QuotedL4Checked {
		t.Fatalf("verdict %d, %+v: want from the VIP, quoting the datagram to the VIP", ret, got)
	}
	f.wantEvents(ev6(evNewFlow, 0, id6a, client6), ev6(evRefused, 0, id6a, client6))
	ret, out := bpftest.Run(t, f.PbXdp, unreach)
	if ret != bpftest.XDPPass || !bytes.Equal(out[:len(unreach)], unreach) {
		t.Error("a second error for the ended flow was changed")
	}
	if n := f.icmpTranslated(); n != 1 {
		t.Errorf("icmp_translated = %d, want 1", n)
	}
}
