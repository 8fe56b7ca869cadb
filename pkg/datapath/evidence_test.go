// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Evidence no client can forge: each test here is a client (or a pod
// spoofing a backend) sending what the datapath used to count as a
// backend's failure or success, and the datapath counting nothing.

const evfVoid = uint8(bpf.LbPbEventFlagPB_EVF_VOID)

// stats sums pb_stats_v2 over CPUs.
func (f *fixture) stats() bpf.LbGlobalStats {
	f.t.Helper()
	s, err := f.Maps.GlobalStats()
	f.must(err)
	return s
}

// A client that sends each SYN twice: the second copy, right behind the
// first, is a duplicate, not the client's retransmission, and no timeout.
// Nor is a SYN with another ISN on the tuple. Only the same ISN, old
// enough, is.
func TestDuplicateSYNIsNoTimeout(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	_, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	if p.Dst != be1 {
		t.Fatalf("the duplicate went to %v, want it on to %v", p.Dst, be1)
	}
	f.wantEvents(ev(evNewFlow, 0, id1, client))
	if got := f.stats().SynDuplicate; got != 1 {
		t.Errorf("syn_duplicate %d, want 1", got)
	}

	// With no minimum age, the same ISN is a retransmission; another ISN
	// is still none.
	f.noRetransMinAge()
	f.run(bpftest.TCPSeq(client, vip, bpftest.SYN, nil, 777, 0))
	f.wantEvents()
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.wantEvents(ev(evSynRetrans, 0, id1, client))

	// The minimum age is the agent's setting: the same copy is a
	// duplicate under an hour's minimum, and a retransmission under a
	// nanosecond's.
	f.must(f.Maps.SetConfig(maps.Config{SYNRetransMinAge: time.Hour}))
	f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil))
	f.wantEvents(ev(evNewFlow, 0, id1, client2))
	f.noRetransMinAge()
	f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil))
	f.wantEvents(ev(evSynRetrans, 0, id1, client2))
}

// A RST that does not acknowledge the client's SYN is no refusal: the
// client's stack drops it too, and the backend still holds the SYN.
func TestRSTNotAckingTheSYNIsNoRefusal(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	for _, rst := range [][]byte{
		bpftest.TCPSeq(be1, client, bpftest.RST, nil, 5, bpftest.ISN+2),       // wrong ack
		bpftest.TCPSeq(be1, client, bpftest.TCPFlags{RST: true}, nil, 5, 0),   // no ack at all
		bpftest.TCPSeq(be1, client, bpftest.RST, nil, 5, bpftest.ISN),         // the ISN itself
		bpftest.TCPSeq(be1, client, bpftest.RST, nil, 5, bpftest.ISN+1+1<<20), // far ahead
	} {
		ret, p, _ := f.run(rst)
		if ret != bpftest.XDPPass || p.Src != vip {
			t.Fatalf("verdict %d, source %v: want it forwarded as the VIP's, as any reply", ret, p.Src)
		}
	}
	f.wantEvents(ev(evNewFlow, 0, id1, client))
	if got := f.stats().ReplyUnacked; got != 4 {
		t.Errorf("reply_unacked %d, want 4", got)
	}
	// The backend's real refusal still counts.
	f.run(bpftest.Refusal(be1, client, bpftest.ISN))
	f.wantEvents(ev(evRefused, 0, id1, client))
}

// A client sends its SYN and, right behind it, an ACK acknowledging a
// wrong number: the backend resets the half-open connection, as RFC 9293
// says it must. That reset is the client's doing: the flow ends without a
// verdict (its breaker slot goes back), and the kernel trips nothing.
func TestResetAfterAWrongHandshakeACKIsVoid(t *testing.T) {
	f := tripFixture(t, 1, maps.TripRefused|maps.TripReset, 5)
	f.limit(10, 0, id1)
	in := f.inflight()
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	f.run(bpftest.TCPSeq(client, vip, bpftest.ACK, nil, bpftest.ISN+1, 424242)) // not the backend's ISN+1
	f.run(bpftest.TCPSeq(be1, client, bpftest.TCPFlags{RST: true}, nil, 424242, 0))
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evEstablished, 0, id1, client), ev(evFlowEnd, evfVoid, id1, client))
	if f.state(id1) != maps.BackendActive {
		t.Errorf("backend 1 is %v: the client's mistake tripped it", f.state(id1))
	}
	if n := in.Service(svcID); n != 0 {
		t.Errorf("%d flows held: the reset flow's slot did not go back", n)
	}
	// After a right ACK, the backend's reset is its own.
	f.handshake(client2, be1)
	f.run(bpftest.TCP(be1, client2, bpftest.RST, nil))
	evs := f.events()
	if len(evs) != 3 || evs[2].Type != evReset || evs[2].Flags&evfTripped == 0 {
		t.Fatalf("events %+v: want a tripping RESET", evs)
	}
}

// A SYN-ACK that does not acknowledge the client's SYN hides nothing: the
// flow is not established, and its timeout still comes.
func TestSYNACKNotAckingTheSYNIsNoAnswer(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.run(bpftest.TCPSeq(be1, client, bpftest.SYNACK, nil, 9, bpftest.ISN+7))
	f.wantEvents(ev(evNewFlow, 0, id1, client))
	f.noRetransMinAge()
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.wantEvents(ev(evSynRetrans, 0, id1, client))
}

// corrupt flips a bit of a frame's TCP checksum.
func corrupt(frame []byte) []byte {
	out := append([]byte(nil), frame...)
	l4 := 14 + 40 // IPv6, no extension headers
	if out[14]>>4 == 4 {
		l4 = 14 + int(out[14]&0xf)*4
	}
	out[l4+16] ^= 0x40
	return out
}

// A RST or SYN-ACK with a bad checksum would be dropped by the client: it
// decides nothing here either.
func TestBadChecksumRepliesDecideNothing(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	// Forwarded (still bad: the client drops them), deciding nothing.
	bpftest.Run(t, f.PbXdp, corrupt(bpftest.Refusal(be1, client, bpftest.ISN)))
	bpftest.Run(t, f.PbXdp, corrupt(bpftest.TCP(be1, client, bpftest.SYNACK, nil)))
	f.wantEvents(ev(evNewFlow, 0, id1, client))
	if got := f.stats().ReplyBadChecksum; got != 2 {
		t.Errorf("reply_bad_checksum %d, want 2", got)
	}
	f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	f.wantEvents(ev(evEstablished, 0, id1, client))
}

// A client's RST that the backend would not take (RFC 5961: anything but
// the sequence number it expects next) leaves the backend's connection up:
// its breaker slot stays taken. The exact one frees it.
func TestClientRSTOutOfSequenceKeepsTheSlot(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.limit(1, 0, id1)
	in := f.inflight()
	f.handshake(client, be1)
	f.run(bpftest.TCP(be1, client, bpftest.ACK, []byte("hello"))) // acknowledges ISN+1 still
	f.events()
	for _, seq := range []uint32{bpftest.ISN + 1 + 1<<30, bpftest.ISN + 2, bpftest.ISN} {
		f.run(bpftest.TCPSeq(client, vip, bpftest.TCPFlags{RST: true}, nil, seq, 0))
	}
	if n := in.Service(svcID); n != 1 {
		t.Fatalf("%d flows held after out-of-sequence RSTs, want 1: the breaker would admit past its cap", n)
	}
	// The breaker still turns the next flow away.
	f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil))
	if got := f.stats().InflightRejected; got != 1 {
		t.Fatalf("inflight_rejected %d: a second flow got past a cap of 1", got)
	}
	if got := f.stats().ClientRstIgnored; got != 3 {
		t.Errorf("client_rst_ignored %d, want 3", got)
	}
	f.wantEvents()
	// The backend acknowledged ISN+1: that RST resets it.
	f.run(bpftest.TCPSeq(client, vip, bpftest.TCPFlags{RST: true}, nil, bpftest.ISN+1, 0))
	if n := in.Service(svcID); n != 0 {
		t.Fatalf("%d flows held after the exact RST", n)
	}
	f.wantEvents(ev(evFlowEnd, evfClient, id1, client))
}

// withTTL sets an IPv4 frame's TTL (or an IPv6 one's hop limit), keeping
// the IPv4 header checksum right.
func withTTL(frame []byte, ttl uint8) []byte {
	out := append([]byte(nil), frame...)
	if out[14]>>4 == 6 {
		out[14+7] = ttl
		return out
	}
	out[14+8] = ttl
	binary.BigEndian.PutUint16(out[14+10:], 0)
	binary.BigEndian.PutUint16(out[14+10:], ipChecksum(out[14:14+20]))
	return out
}

func ipChecksum(h []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(h); i += 2 {
		s += uint32(binary.BigEndian.Uint16(h[i:]))
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

// synWithOption is a Linux SYN with one more option of kind (and 16 bytes
// of data, as TCP-MD5's signature).
func synWithOption(src, dst netip.AddrPort, kind layers.TCPOptionKind) []byte {
	return synFrame(src, dst, kind, false, nil)
}

// synFrame is a SYN with an MSS, two no-ops and an option of kind (18
// bytes), with an IPv4 option (router alert) when ipOpt, and payload (a
// TCP Fast Open SYN's data): the shapes syn_doomed does not sum in place.
func synFrame(src, dst netip.AddrPort, kind layers.TCPOptionKind, ipOpt bool, payload []byte) []byte {
	ip := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolTCP, SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice()}
	if ipOpt {
		ip.Options = []layers.IPv4Option{{OptionType: 148, OptionLength: 4, OptionData: []byte{0, 0}}}
	}
	tcp := &layers.TCP{SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()), SYN: true, Seq: bpftest.ISN, Window: 64240,
		Options: []layers.TCPOption{
			{OptionType: layers.TCPOptionKindMSS, OptionLength: 4, OptionData: []byte{0x05, 0xb4}},
			{OptionType: layers.TCPOptionKindNop},
			{OptionType: layers.TCPOptionKindNop},
			{OptionType: kind, OptionLength: 18, OptionData: make([]byte, 16)},
		}}
	tcp.SetNetworkLayerForChecksum(ip)
	eth := &layers.Ethernet{SrcMAC: bpftest.ClientMAC, DstMAC: bpftest.NodeMAC, EthernetType: layers.EthernetTypeIPv4}
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, eth, ip, tcp, gopacket.Payload(payload)); err != nil {
		panic(err)
	}
	return buf.Bytes()
}

// A SYN the backend can never accept is not the backend's to answer: it
// passes as it came, starts no flow and leaves no verdict to come.
func TestDoomedSYNsStartNothing(t *testing.T) {
	badIP := bpftest.TCP(client, vip, bpftest.SYN, nil)
	badIP[14+10] ^= 0x01
	for _, c := range []struct {
		name string
		syn  []byte
	}{
		{"bad TCP checksum", corrupt(bpftest.LinuxSYN(client, vip, bpftest.ISN))},
		{"bad IPv4 header checksum", badIP},
		{"SYN|FIN", bpftest.TCP(client, vip, bpftest.TCPFlags{SYN: true, FIN: true}, nil)},
		{"TTL 1", withTTL(bpftest.LinuxSYN(client, vip, bpftest.ISN), 1)},
		{"TTL 0", withTTL(bpftest.LinuxSYN(client, vip, bpftest.ISN), 0)},
		{"hop limit 1", withTTL(bpftest.TCP(client6, vip6, bpftest.SYN, nil), 1)},
		{"bad TCP checksum, IPv6", corrupt(bpftest.TCP(client6, vip6, bpftest.SYN, nil))},
		{"TCP-MD5 option", synWithOption(client, vip, 19)},
		{"TCP-AO option", synWithOption(client, vip, 29)},
		// Not summed in place: copied out and summed (pb_csum).
		{"bad IPv4 header checksum, IP options", corruptIP(synFrame(client, vip, 30, true, nil))},
		{"bad TCP checksum, IP options", corrupt(synFrame(client, vip, 30, true, nil))},
		{"bad TCP checksum, SYN with data", corrupt(synFrame(client, vip, 30, false, []byte("fast open")))},
		{"TCP-MD5 option, SYN with data", synFrame(client, vip, 19, false, []byte("fast open"))},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := fixture6(t, 6) // an IPv6 service beside the IPv4 one
			f.table(id1)
			ret, out := bpftest.Run(t, f.PbXdp, c.syn)
			if ret != bpftest.XDPPass || !bytes.Equal(out[:len(c.syn)], c.syn) {
				t.Fatalf("verdict %d: want the SYN passed unchanged", ret)
			}
			f.wantEvents()
			if got := f.stats().SynDoomed; got != 1 {
				t.Errorf("syn_doomed %d, want 1", got)
			}
			var k bpf.LbCtKey
			var v bpf.LbCtValue
			if f.LbMaps.PbCtV2.Iterate().Next(&k, &v) {
				t.Errorf("conntrack entry %+v made for a doomed SYN", k)
			}
		})
	}
	// The same SYNs, whole, open flows.
	f := fixture6(t, 6)
	f.table(id1)
	f.run(bpftest.LinuxSYN(client, vip, bpftest.ISN))
	f.run(synWithOption(client2, vip, 30)) // MPTCP: no signature
	f.run(bpftest.TCP(client6, vip6, bpftest.SYN, nil))
	client3, client4 := netip.MustParseAddrPort("198.18.0.2:40002"), netip.MustParseAddrPort("198.18.0.2:40003")
	f.run(synFrame(client3, vip, 30, true, nil))
	f.run(synFrame(client4, vip, 30, false, []byte("fast open")))
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evNewFlow, 0, id1, client2), ev6(evNewFlow, 0, id6a, client6),
		ev(evNewFlow, 0, id1, client3), ev(evNewFlow, 0, id1, client4))
}

// corruptIP flips a bit of an IPv4 frame's header checksum.
func corruptIP(frame []byte) []byte {
	out := append([]byte(nil), frame...)
	out[14+10] ^= 0x01
	return out
}

// runOn runs frame through the program as if it arrived on ifindex (in the
// namespace the caller is in).
func (f *fixture) runOn(ifindex int, frame []byte) (uint32, []byte) {
	f.t.Helper()
	out := make([]byte, len(frame)+256)
	ret, err := f.PbXdp.Run(&ebpf.RunOptions{Data: frame, DataOut: out, Repeat: 1,
		Context: [6]uint32{0, uint32(len(frame)), 0, uint32(ifindex), 0, 0}})
	f.must(err)
	return ret, out[:len(frame)]
}

// A pod that spoofs a backend's address sends from its own interface,
// where the node does not route that backend: its RST, SYN-ACK or data
// pass unchanged and decide nothing. The same from the backend's side
// count. A bridge port passes for the addresses routed through its bridge.
func TestRepliesFromTheWrongSideDecideNothing(t *testing.T) {
	topo := testnet.New(t, testnet.Options{Backends: 2})
	f := newFixture(t)
	f.table(id1)
	f.must(f.Maps.SetConfig(maps.Config{ReversePath: true}))
	cl0, b1, b2 := topo.Links[0].Index, topo.Links[1].Index, topo.Links[2].Index
	f.must(topo.Node.Do(func() error {
		f.runOn(cl0, bpftest.TCP(client, vip, bpftest.SYN, nil))
		for _, c := range []struct {
			name    string
			ifindex int
		}{{"the client's own interface", cl0}, {"another backend's interface", b2}} {
			for _, pkt := range [][]byte{
				bpftest.Refusal(be1, client, bpftest.ISN),
				bpftest.TCP(be1, client, bpftest.SYNACK, nil),
			} {
				ret, out := f.runOn(c.ifindex, pkt)
				if ret != bpftest.XDPPass || !bytes.Equal(out, pkt) {
					t.Errorf("from %s: verdict %d, want it passed unchanged", c.name, ret)
				}
			}
		}
		f.wantEvents(ev(evNewFlow, 0, id1, client))
		if got := f.stats().ReplyWrongSide; got != 4 {
			t.Errorf("reply_wrong_side %d, want 4", got)
		}
		// From the backend's side, the SYN-ACK counts.
		if _, out := f.runOn(b1, bpftest.TCP(be1, client, bpftest.SYNACK, nil)); !bytes.Equal(out[26:30], vip.Addr().AsSlice()) {
			t.Errorf("the backend's SYN-ACK left with source %v, want the VIP", out[26:30])
		}
		f.wantEvents(ev(evEstablished, 0, id1, client))

		// A bridge port: the node routes be2 through b2 here; a port
		// whose master is b2 passes for it (the master is only ever
		// compared, never used).
		f.must(f.Maps.SetIfaces([]maps.Iface{{Index: uint32(cl0), Master: uint32(b2)}}))
		f.runOn(cl0, bpftest.TCP(client2, vip, bpftest.SYN, nil))
		f.table(id2)
		f.runOn(cl0, bpftest.TCP(netip.AddrPortFrom(client2.Addr(), client2.Port()+1), vip, bpftest.SYN, nil))
		f.runOn(cl0, bpftest.Refusal(be2, netip.AddrPortFrom(client2.Addr(), client2.Port()+1), bpftest.ISN))
		return nil
	}))
	evs := f.events()
	if len(evs) != 3 || evs[2].Type != evRefused || evs[2].BE != id2 {
		t.Errorf("events %+v: want backend 2's refusal counted through its bridge", evs)
	}
}

// An ICMP port unreachable is a UDP flow's refusal only from the backend's
// side and with a right checksum.
func TestForgedPortUnreachableIsNoRefusal(t *testing.T) {
	topo := testnet.New(t, testnet.Options{Backends: 1})
	f := newFixture(t)
	f.service(17, id1)
	f.must(f.Maps.SetConfig(maps.Config{ReversePath: true}))
	cl0, b1 := topo.Links[0].Index, topo.Links[1].Index
	f.must(topo.Node.Do(func() error {
		_, fwd := f.runOn(cl0, bpftest.UDP(client, vip, []byte("query")))
		unreach := bpftest.ICMPError(be1.Addr(), client.Addr(), bpftest.ICMPDestUnreach, bpftest.ICMPPortUnreach, 0, fwd, 0)
		if ret, out := f.runOn(cl0, unreach); ret != bpftest.XDPPass || !bytes.Equal(out, unreach) {
			t.Errorf("a port unreachable from the client's side: verdict %d, want it passed unchanged", ret)
		}
		bad := append([]byte(nil), unreach...)
		bad[14+20+2] ^= 0x10 // the ICMP checksum
		f.runOn(b1, bad)
		f.wantEvents(ev(evNewFlow, 0, id1, client))
		f.runOn(b1, unreach)
		f.wantEvents(ev(evRefused, 0, id1, client))
		return nil
	}))
}

// The flow hash is seeded with the cluster's secret: a client that knows
// the tables and the hash cannot tell which source port lands where.
func TestHashSeedMovesThePicks(t *testing.T) {
	f := newFixture(t)
	f.svc.BackendCount = 2
	f.alternate(id1, id2)
	picks := func(seed uint32) []netip.AddrPort {
		f.must(f.Maps.SetConfig(maps.Config{HashSeed: seed}))
		var out []netip.AddrPort
		for i := range 64 {
			c := netip.AddrPortFrom(client.Addr(), uint16(50000+i))
			_, p, _ := f.run(bpftest.TCP(c, vip, bpftest.SYN, nil))
			out = append(out, p.Dst)
			f.run(bpftest.TCP(c, vip, bpftest.RST, nil)) // the tuple is free again
		}
		return out
	}
	a, b := picks(1), picks(0xdeadbeef)
	differ := 0
	for i := range a {
		if a[i] != b[i] {
			differ++
		}
	}
	// Two backends: about half the picks move with the seed. Fewer than a
	// sixth moving, out of 64, would take a hash that ignores it.
	if differ < 64/6 {
		t.Fatalf("%d of 64 picks changed with the seed", differ)
	}
	f.events()
}
