// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/csum"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

var (
	thisNode   = netip.MustParseAddr("198.18.250.1")
	remoteNode = netip.MustParseAddr("198.18.250.2")
)

// ipip wraps frame's IP packet in an IPIP packet from src to dst (no
// options, DF, as the kernel's tunnels send it); outer changes the outer
// header before its checksum is computed.
func ipip(src, dst netip.Addr, frame []byte, outer ...func(h []byte)) []byte {
	inner := frame[14:]
	h := make([]byte, 20)
	h[0] = 0x45
	binary.BigEndian.PutUint16(h[2:], uint16(20+len(inner)))
	binary.BigEndian.PutUint16(h[6:], 0x4000)
	h[8], h[9] = 64, 4 // TTL, IPPROTO_IPIP
	copy(h[12:], src.AsSlice())
	copy(h[16:], dst.AsSlice())
	for _, f := range outer {
		f(h)
	}
	binary.BigEndian.PutUint16(h[10:], ^csum.Fold(csum.Sum(h, 0)))
	out := append([]byte{}, frame[:14]...)
	out = append(out, h...)
	return append(out, inner...)
}

// unwrap is what the stack hands on after the tunnel: the inner packet
// behind the outer frame's Ethernet header, the outer header checked
// unchanged against sent's.
func unwrap(t *testing.T, sent, got []byte) bpftest.Parsed {
	t.Helper()
	if !bytes.Equal(sent[:34], got[:34]) {
		t.Fatalf("the outer Ethernet and IP headers changed:\n% x\n% x", sent[:34], got[:34])
	}
	p, err := bpftest.Parse(append(append([]byte{}, got[:14]...), got[34:]...))
	if err != nil {
		t.Fatalf("inner packet: %v", err)
	}
	return p
}

// A backend's reply from another node arrives on the node's uplink inside
// an IPIP packet (Calico's tunl0): the datapath rewrites the inner packet
// in place, checksums right, the outer header untouched, and judges it as
// any reply. Only on an interface marked as an uplink: a pod's veth can
// wrap whatever it likes. A tunnelled packet to a VIP opens nothing, and
// outer options or fragments are left alone.
func TestIPIPReplies(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.noRetransMinAge()
	t.Cleanup(func() { f.must(f.Maps.SetConfig(maps.Config{})) })
	// lo (BPF_PROG_TEST_RUN's default interface), marked an uplink or not.
	const uplink = 1
	t.Cleanup(func() { f.must(f.Maps.SetIfaces(nil)) })

	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.events()

	// Not an uplink: unchanged, nothing decided.
	synack := ipip(remoteNode, thisNode, bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	f.must(f.Maps.SetIfaces(nil))
	if ret, out := f.runOn(uplink, synack); ret != bpftest.XDPPass || !bytes.Equal(out, synack) {
		t.Fatalf("a tunnelled reply off the uplink: verdict %d, changed %v", ret, !bytes.Equal(out, synack))
	}
	f.wantEvents()
	f.must(f.Maps.SetIfaces([]maps.Iface{{Index: uplink, Decap: true}}))

	ret, out := f.runOn(uplink, synack)
	if ret != bpftest.XDPPass {
		t.Fatalf("verdict %d, want XDP_PASS (the stack unwraps it)", ret)
	}
	if p := unwrap(t, synack, out); p.Src != vip || p.Dst != client {
		t.Fatalf("inner reply %v -> %v, want %v -> %v", p.Src, p.Dst, vip, client)
	}
	f.wantEvents(ev(evEstablished, 0, id1, client))

	// A refusal through the tunnel is the backend's refusal.
	f.run(bpftest.LinuxSYN(client2, vip, bpftest.ISN))
	f.events()
	rst := ipip(remoteNode, thisNode, bpftest.Refusal(be1, client2, bpftest.ISN))
	if _, out := f.runOn(uplink, rst); unwrap(t, rst, out).Src != vip {
		t.Fatal("the tunnelled RST was not rewritten")
	}
	if got := f.events(); len(got) == 0 || got[0].Type != evRefused {
		t.Fatalf("events %+v, want the refusal", got)
	}

	// To a VIP through a tunnel: not a flow of this node's clients.
	toVIP := ipip(remoteNode, thisNode, bpftest.TCP(clientPort(40100), vip, bpftest.SYN, nil))
	if ret, out := f.runOn(uplink, toVIP); ret != bpftest.XDPPass || !bytes.Equal(out, toVIP) {
		t.Fatalf("a tunnelled SYN to the VIP: verdict %d, changed %v", ret, !bytes.Equal(out, toVIP))
	}
	f.wantEvents()

	// Outer options, or a fragment: left to the stack.
	c3 := clientPort(40003)
	f.run(bpftest.TCP(c3, vip, bpftest.SYN, nil))
	f.events()
	frag := ipip(remoteNode, thisNode, bpftest.TCP(be1, c3, bpftest.SYNACK, nil), func(h []byte) { h[6] = 0x20 })
	if ret, out := f.runOn(uplink, frag); ret != bpftest.XDPPass || !bytes.Equal(out, frag) {
		t.Fatalf("a fragmented IPIP packet: verdict %d, changed %v", ret, !bytes.Equal(out, frag))
	}
	f.wantEvents()
}
