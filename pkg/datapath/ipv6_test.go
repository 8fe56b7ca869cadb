// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"bytes"
	"net/netip"
	"testing"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

var (
	vip6     = netip.MustParseAddrPort("[2001:2:0:100::1]:80")
	client6  = netip.MustParseAddrPort("[2001:2::2]:40000")
	client6b = netip.MustParseAddrPort("[2001:2::2]:40001")
	be6a     = netip.MustParseAddrPort("[2001:2:0:1::2]:8080")
	be6b     = netip.MustParseAddrPort("[2001:2:0:2::2]:8080")
)

const (
	svc6  = 9
	id6a  = 21
	id6b  = 22
	size6 = 7
)

// fixture6 is an IPv6 service on vip6 (protocol proto) with backends
// id6a and id6b, every table slot on id6a, beside the IPv4 fixture's.
func fixture6(t *testing.T, proto uint8) *fixture {
	f := newFixture(t)
	f.must(f.Maps.SetBackend(id6a, maps.NewBackend(be6a, svc6, maps.BackendActive, 0)))
	f.must(f.Maps.SetBackend(id6b, maps.NewBackend(be6b, svc6, maps.BackendActive, 0)))
	f.must(f.Maps.SetVIPSlots(nil, map[uint32]bool{maps.VIPSlot(vip.Addr()): true, maps.VIPSlot(vip6.Addr()): true}))
	f.must(f.Maps.InstallTables([]maps.TableInstall{{SvcID: svc6, N: 0, Size: size6}}))
	tbl := make([]uint32, size6)
	for i := range tbl {
		tbl[i] = id6a
	}
	f.must(f.Maps.FillTable(svc6, 0, tbl))
	f.svc6(proto, 0, 0)
	return f
}

// svc6 writes the IPv6 service's value with a circuit-breaker limit.
func (f *fixture) svc6(proto uint8, maxInflight uint32, flags uint32) {
	f.t.Helper()
	v := bpfSvc(svc6, size6, maxInflight, flags)
	f.must(f.Maps.UpsertService(maps.ServiceKey(vip6.Addr(), vip6.Port(), proto), v))
}

func ev6(typ, flags uint8, be uint32, c netip.AddrPort) event {
	return event{Type: typ, Flags: flags, Svc: svc6, BE: be, Client: c}
}

// An IPv6 flow is balanced like an IPv4 one: the SYN goes to the backend
// (checksum over the IPv6 pseudo-header right), the SYN-ACK comes back
// from the VIP, and the events name the IPv6 client.
func TestIPv6DNATAndReverseNAT(t *testing.T) {
	f := fixture6(t, 6)
	ret, p, _ := f.run(bpftest.TCP(client6, vip6, bpftest.SYN, nil))
	if ret != bpftest.XDPPass || p.Dst != be6a || p.Src != client6 {
		t.Fatalf("SYN: verdict %d, %v -> %v, want %v -> %v", ret, p.Src, p.Dst, client6, be6a)
	}
	_, p, _ = f.run(bpftest.TCP(be6a, client6, bpftest.SYNACK, nil))
	if p.Src != vip6 || p.Dst != client6 {
		t.Fatalf("SYN-ACK %v -> %v, want %v -> %v", p.Src, p.Dst, vip6, client6)
	}
	_, p, _ = f.run(bpftest.TCP(client6, vip6, bpftest.ACK, []byte("GET / HTTP/1.1\r\n\r\n")))
	if p.Dst != be6a {
		t.Fatalf("established packet went to %v", p.Dst)
	}
	f.wantEvents(ev6(evNewFlow, 0, id6a, client6), ev6(evEstablished, 0, id6a, client6))

	// UDP too.
	f.svc6(17, 0, 0)
	_, p, _ = f.run(bpftest.UDP(client6b, netip.AddrPortFrom(vip6.Addr(), 80), []byte("q")))
	if p.Dst != be6a {
		t.Fatalf("UDP datagram went to %v", p.Dst)
	}
	_, p, _ = f.run(bpftest.UDP(be6a, client6b, []byte("a")))
	if p.Src != vip6 {
		t.Fatalf("UDP reply from %v", p.Src)
	}
	f.wantEvents(ev6(evNewFlow, 0, id6a, client6b), ev6(evEstablished, 0, id6a, client6b))
}

// Extension headers before TCP are skipped (up to four); a fragment, or
// more headers than that, passes untouched.
func TestIPv6ExtensionHeaders(t *testing.T) {
	f := fixture6(t, 6)
	syn := bpftest.TCP(client6, vip6, bpftest.SYN, nil)
	for _, n := range []int{1, 4} {
		c := netip.AddrPortFrom(client6.Addr(), uint16(41000+n))
		ret, p, _ := f.run(bpftest.WithDestOpts(bpftest.TCP(c, vip6, bpftest.SYN, nil), n))
		if ret != bpftest.XDPPass || p.Dst != be6a {
			t.Errorf("%d extension headers: verdict %d, to %v", n, ret, p.Dst)
		}
	}
	frag := bpftest.TCP(client6, vip6, bpftest.SYN, nil)
	frag[14+6] = 44 // a fragment header would follow
	// A routing header (type 4, segment routing) with one segment left:
	// the destination is not the final one.
	routed := bpftest.WithDestOpts(syn, 1)
	routed[14+6] = 43
	routed[14+40+2], routed[14+40+3] = 4, 1
	for name, pkt := range map[string][]byte{
		"5 extension headers": bpftest.WithDestOpts(syn, 5),
		"fragment":            frag,
		"segments left":       routed,
		"truncated TCP":       bpftest.TCP(client6, vip6, bpftest.SYN, nil)[:14+40+12],
	} {
		ret, out := bpftest.Run(t, f.PbXdp, pkt)
		if ret != bpftest.XDPPass || !bytes.Equal(out[:len(pkt)], pkt) {
			t.Errorf("%s: verdict %d, changed %v", name, ret, !bytes.Equal(out[:len(pkt)], pkt))
		}
	}
}

// The refusal of an IPv6 flow is reported and trips the backend in the
// kernel like an IPv4 one.
func TestIPv6RefusalTrips(t *testing.T) {
	f := fixture6(t, 6)
	f.Maps.SetServiceTrip(svc6, maps.TripSettings{MaxFailures: 1, Kinds: maps.TripRefused}, 1)
	f.run(bpftest.TCP(client6, vip6, bpftest.SYN, nil))
	ret, p, _ := f.run(bpftest.Refusal(be6a, client6, 1000))
	if ret != bpftest.XDPPass || p.Src != vip6 {
		t.Fatalf("RST: verdict %d from %v", ret, p.Src)
	}
	f.wantEvents(ev6(evNewFlow, 0, id6a, client6), ev6(evRefused, evfTripped, id6a, client6))
	if st := f.state(id6a); st != maps.BackendEjected {
		t.Errorf("backend %v after the deciding refusal, want ejected", st)
	}
}

// The circuit breaker's RST for an IPv6 SYN: from the VIP, the SYN's
// sequence number acknowledged, checksum right over the IPv6 pseudo-header.
func TestIPv6BreakerRejects(t *testing.T) {
	f := fixture6(t, 6)
	f.must(f.Maps.SetServiceBackends(svc6, nil, []uint32{id6a}))
	v := bpfSvc(svc6, size6, 1, 0)
	v.BackendCount = 1
	f.must(f.Maps.UpsertService(maps.ServiceKey(vip6.Addr(), vip6.Port(), 6), v))
	f.run(bpftest.TCP(client6, vip6, bpftest.SYN, nil))
	ret, out := bpftest.Run(t, f.PbXdp, bpftest.TCP(client6b, vip6, bpftest.SYN, nil))
	if ret != bpftest.XDPPass {
		t.Fatalf("verdict %d", ret)
	}
	out = out[:14+40+20]
	p, err := bpftest.Parse(out)
	if err != nil {
		t.Fatal(err)
	}
	tcp := gopacket.NewPacket(out, layers.LayerTypeEthernet, gopacket.Default).Layer(layers.LayerTypeTCP).(*layers.TCP)
	if p.Src != vip6 || p.Dst != client6b || !tcp.RST || !tcp.ACK || tcp.Ack != 1001 || tcp.Seq != 0 {
		t.Fatalf("RST %v -> %v rst=%v ack=%d seq=%d", p.Src, p.Dst, tcp.RST, tcp.Ack, tcp.Seq)
	}
}

func bpfSvc(id, size, maxInflight, flags uint32) bpf.LbSvcValue {
	return bpf.LbSvcValue{Id: id, TableSize: size, MaxInflight: maxInflight, Flags: flags}
}
