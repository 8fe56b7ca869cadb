// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"bytes"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// FuzzXDP runs arbitrary frames through pb_xdp as if a client sent them
// on its own interface (a real one, in a topology: the reverse-path check
// is the kernel's), with a service, two backends and a pending flow whose
// replies a forger would aim at. Whatever the frame:
//   - no verdict comes of it (refused, reset, established, first data, a
//     retransmission): only a backend's side of the node can answer;
//   - a frame neither to the VIP nor from a backend passes unchanged;
//   - a TCP or UDP frame the program rewrote leaves with right checksums
//     when it came with right ones.
//
// make test fuzzes it for a bounded time; its seeds run with every go test.
func FuzzXDP(f *testing.F) {
	bpftest.RequireRoot(f)
	topo := testnet.New(f, testnet.Options{Backends: 2})
	cl0 := topo.Links[0].Index
	pending := netip.MustParseAddrPort("198.18.0.2:45000")
	for _, seed := range [][]byte{
		bpftest.LinuxSYN(client, vip, bpftest.ISN),
		bpftest.LinuxSYN(pending, vip, bpftest.ISN),
		bpftest.TCP(client, vip, bpftest.ACK, []byte("GET / HTTP/1.1\r\n\r\n")),
		bpftest.TCP(client, vip, bpftest.RST, nil),
		bpftest.TCP(client, vip, bpftest.FIN, nil),
		bpftest.TCP(client, vip, bpftest.TCPFlags{SYN: true, FIN: true}, nil),
		bpftest.Refusal(be1, pending, bpftest.ISN),
		bpftest.TCP(be1, pending, bpftest.SYNACK, nil),
		bpftest.TCP(be2, pending, bpftest.ACK, []byte("HTTP/1.1 200 OK\r\n")),
		bpftest.UDP(client, vip, []byte("query")),
		bpftest.ICMPError(be1.Addr(), pending.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPPortUnreach, 0,
			bpftest.UDP(pending, be1, []byte("query")), 0),
		bpftest.TCP(netip.MustParseAddrPort("[2001:2::2]:40000"), netip.MustParseAddrPort("[2001:2:0:100::1]:80"), bpftest.SYN, nil),
		bpftest.TCP(client, netip.MustParseAddrPort("198.18.5.5:80"), bpftest.SYN, nil),
		{},
		make([]byte, 14),
	} {
		f.Add(seed)
	}
	// One datapath for every input: what earlier inputs left in the maps
	// is one more state the invariants must hold in.
	fx := newFixture(f)
	fx.table(id1)
	// A client's own SYN, sent again with the same ISN once the minimum
	// age has passed, is a real retransmission: the one timing signal a
	// client gives about its own flow, by design (duplicates sent sooner
	// are the hostile tests' case). The fuzzer replays a seed's SYN
	// seconds later, so the age is held above any fuzzing run: within
	// it, a SYN_RETRANS could only be a forgery.
	fx.must(fx.Maps.SetConfig(maps.Config{ReversePath: true, SYNRetransMinAge: 24 * time.Hour}))
	f.Fuzz(func(t *testing.T, frame []byte) {
		if len(frame) < 14 || len(frame) > 1514 {
			return // not an Ethernet frame BPF_PROG_TEST_RUN takes
		}
		fx.t = t
		fx.must(topo.Node.Do(func() error {
			// The pending flow, (re)opened; a SYN again on it is a
			// duplicate, no verdict.
			fx.runOn(cl0, bpftest.LinuxSYN(pending, vip, bpftest.ISN))
			fx.events()
			ret, out := fx.runOn(cl0, frame)
			for _, e := range fx.events() {
				if e.Type != evNewFlow && e.Type != evFlowEnd {
					t.Errorf("a frame from the client's side made a verdict: %+v", e)
				}
			}
			if !aimed(frame) && (ret != bpftest.XDPPass || !bytes.Equal(out, frame)) {
				t.Errorf("a frame to no VIP and from no backend: verdict %d, changed %v", ret, !bytes.Equal(out, frame))
			}
			if ret == bpftest.XDPPass && !bytes.Equal(out, frame) && l4(frame) {
				if _, err := bpftest.Parse(frame); err == nil {
					if _, err := bpftest.Parse(out); err != nil {
						t.Errorf("rewritten frame: %v", err)
					}
				}
			}
			return nil
		}))
	})
}

// aimed says whether a frame could concern the service: to the VIP, from
// a backend, or an ICMP error (which quotes either).
func aimed(frame []byte) bool {
	p := gopacket.NewPacket(frame, layers.LayerTypeEthernet, gopacket.NoCopy)
	var src, dst netip.Addr
	switch ip := p.NetworkLayer().(type) {
	case *layers.IPv4:
		src, _ = netip.AddrFromSlice(ip.SrcIP)
		dst, _ = netip.AddrFromSlice(ip.DstIP)
	case *layers.IPv6:
		src, _ = netip.AddrFromSlice(ip.SrcIP)
		dst, _ = netip.AddrFromSlice(ip.DstIP)
	default:
		// Not IP as gopacket reads it: the datapath may still parse an
		// IP header gopacket refuses, so judge by the raw bytes.
		return len(frame) >= 34 && (bytes.Contains(frame[14:], vip.Addr().AsSlice()) ||
			bytes.Contains(frame[14:], be1.Addr().AsSlice()) || bytes.Contains(frame[14:], be2.Addr().AsSlice()))
	}
	if p.Layer(layers.LayerTypeICMPv4) != nil || p.Layer(layers.LayerTypeICMPv6) != nil {
		return true
	}
	return slices.Contains([]netip.Addr{vip.Addr(), netip.MustParseAddr("2001:2:0:100::1")}, dst.Unmap()) ||
		slices.Contains([]netip.Addr{be1.Addr(), be2.Addr()}, src.Unmap())
}

// l4 says whether a frame is TCP or UDP over IPv4 or IPv6, as gopacket
// decodes it whole.
func l4(frame []byte) bool {
	p := gopacket.NewPacket(frame, layers.LayerTypeEthernet, gopacket.NoCopy)
	return p.ErrorLayer() == nil && (p.Layer(layers.LayerTypeTCP) != nil || p.Layer(layers.LayerTypeUDP) != nil)
}
