// SPDX-License-Identifier: Apache-2.0

// Package bpftest loads the datapath into a private bpffs for tests and
// benchmarks, crafts packets with gopacket and runs them through the
// program with BPF_PROG_TEST_RUN.
package bpftest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/replay"
)

// RequireRoot skips when BPF cannot be used at all (not root). CI runs as
// root, so there these tests always run.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root for BPF (CI runs as root)")
	}
}

// LiveFrames says whether this kernel runs XDP programs in BPF_PROG_RUN's
// live-frame mode (replay.Probe), which SYN replays use: some hardened
// kernels refuse it even to root, and an agent there sends them through a
// raw socket instead (Replays). A probe that cannot run at all fails tb.
func LiveFrames(tb testing.TB) bool {
	tb.Helper()
	RequireRoot(tb)
	switch err := replay.Probe(); {
	case errors.Is(err, replay.ErrLiveFramesRefused):
		tb.Logf("this kernel refuses the live-frame mode: %v", err)
		return false
	case err != nil:
		tb.Fatal(err)
	}
	return true
}

// Replays says whether an agent here sends SYN replays: in the live-frame
// mode (LiveFrames) or, where the kernel refuses it, through a raw socket
// (replay.Socket), which root may open.
func Replays(tb testing.TB) bool {
	tb.Helper()
	if LiveFrames(tb) {
		return true
	}
	s, err := replay.OpenSocket()
	if err != nil {
		tb.Logf("no raw socket either: an agent here sends no SYN replays: %v", err)
		return false
	}
	s.Close()
	tb.Logf("an agent here sends its SYN replays through a raw socket")
	return true
}

// RequireLiveFrames skips tb where the kernel refuses the live-frame mode
// (LiveFrames).
func RequireLiveFrames(tb testing.TB) {
	tb.Helper()
	if !LiveFrames(tb) {
		tb.Skip("this kernel refuses the live-frame mode")
	}
}

// TempBPFFS mounts a private bpffs and returns a pin root inside it. The
// mount goes away with the test.
func TempBPFFS(tb testing.TB) string {
	tb.Helper()
	dir, err := os.MkdirTemp("", "pb-bpffs-")
	if err != nil {
		tb.Fatal(err)
	}
	mnt := filepath.Join(dir, "bpffs")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		tb.Fatal(err)
	}
	if err := unix.Mount("bpf", mnt, "bpf", 0, "mode=0700"); err != nil {
		tb.Fatalf("mount bpffs: %v", err)
	}
	tb.Cleanup(func() {
		unix.Unmount(mnt, unix.MNT_DETACH)
		os.RemoveAll(dir)
	})
	return filepath.Join(mnt, "penaltybox")
}

// Loaded is a datapath loaded for a test.
type Loaded struct {
	*datapath.Datapath
	Maps *maps.Maps
}

// Load loads the datapath with small maps into a private bpffs.
func Load(tb testing.TB) *Loaded {
	tb.Helper()
	RequireRoot(tb)
	root := TempBPFFS(tb)
	d, err := datapath.Load(loadOptions(root))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { d.Close() })
	return &Loaded{Datapath: d, Maps: newMaps(tb, d, true)}
}

// newMaps wraps d's maps as the agent does (agent.Open): with the
// counters' reset program, and with prog the conntrack sweep's deletes
// through pb_ct_expire_run, which every supported kernel loads; without,
// through system calls.
func newMaps(tb testing.TB, d *datapath.Datapath, prog bool) *maps.Maps {
	tb.Helper()
	m, err := maps.New(&d.LbMaps, d.InnerSpec)
	if err != nil {
		tb.Fatal(err)
	}
	if err := m.UseStatsReset(d.PbStatsResetRun); err != nil {
		m.Close()
		tb.Fatal(err)
	}
	if prog {
		if err := m.UseCTExpire(d.PbCtExpireRun); err != nil {
			m.Close()
			tb.Fatal(err)
		}
	}
	return m
}

// loadOptions are the small maps tests load with, pinned under root.
func loadOptions(root string) datapath.Options {
	return datapath.Options{Root: root, MaxServices: 256, MaxBackends: 256, ConntrackSize: 4096, EventsBytes: 1 << 16}
}

// Run runs one packet through the program and returns the verdict and the
// packet as the program left it (its length included).
func Run(tb testing.TB, prog *ebpf.Program, pkt []byte) (uint32, []byte) {
	tb.Helper()
	opts := &ebpf.RunOptions{Data: pkt, DataOut: make([]byte, len(pkt)+256), Repeat: 1}
	ret, err := prog.Run(opts)
	if err != nil {
		tb.Fatalf("prog test run: %v", err)
	}
	return ret, opts.DataOut
}

// XDP verdicts.
const (
	XDPAborted  = 0
	XDPDrop     = 1
	XDPPass     = 2
	XDPTX       = 3
	XDPRedirect = 4
)

// TCP flag sets for Packet.
type TCPFlags struct{ SYN, ACK, RST, FIN, PSH bool }

var (
	SYN    = TCPFlags{SYN: true}
	SYNACK = TCPFlags{SYN: true, ACK: true}
	ACK    = TCPFlags{ACK: true}
	RST    = TCPFlags{RST: true, ACK: true}
	FIN    = TCPFlags{FIN: true, ACK: true}
)

var (
	ClientMAC = net.HardwareAddr{0x02, 0, 0, 0, 0, 1}
	NodeMAC   = net.HardwareAddr{0x02, 0, 0, 0, 0, 2}
)

// ipLayer is an IPv4 or IPv6 header (by src's family) for proto.
func ipLayer(src, dst netip.Addr, proto layers.IPProtocol) interface {
	gopacket.SerializableLayer
	gopacket.NetworkLayer
} {
	if src.Is6() && !src.Is4In6() {
		return &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: proto, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
	}
	return &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: proto, SrcIP: src.AsSlice(), DstIP: dst.AsSlice(), Id: 1}
}

// ISN is the initial sequence number of both ends of the connections TCP
// crafts: a SYN carries it, every later segment ISN+1, and an ACK
// acknowledges the other end's ISN+1, as a handshake leaves them. The
// datapath counts a reply only if it acknowledges what the client sent.
const ISN = 1000

// TCP crafts an Ethernet/IPv4/TCP packet (Ethernet/IPv6/TCP for IPv6
// addresses) with valid checksums, numbered as ISN says.
func TCP(src, dst netip.AddrPort, f TCPFlags, payload []byte) []byte {
	return TCPSeq(src, dst, f, payload, seqFor(f), ISN+1)
}

func seqFor(f TCPFlags) uint32 {
	if f.SYN {
		return ISN
	}
	return ISN + 1
}

// TCPSeq is TCP with the sequence and acknowledgment numbers given (ack is
// sent only with the ACK flag).
func TCPSeq(src, dst netip.AddrPort, f TCPFlags, payload []byte, seq, ack uint32) []byte {
	ip := ipLayer(src.Addr(), dst.Addr(), layers.IPProtocolTCP)
	tcp := &layers.TCP{SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()),
		SYN: f.SYN, ACK: f.ACK, RST: f.RST, FIN: f.FIN, PSH: f.PSH, Seq: seq, Window: 65535}
	if f.ACK {
		tcp.Ack = ack
	}
	tcp.SetNetworkLayerForChecksum(ip)
	return serialize(ip, tcp, payload)
}

// LinuxSYN crafts the SYN a Linux client sends: DF, TTL 64, and the
// options MSS 1460, SACK permitted, timestamps, window scale 7.
func LinuxSYN(src, dst netip.AddrPort, seq uint32) []byte {
	ip := ipLayer(src.Addr(), dst.Addr(), layers.IPProtocolTCP)
	if ip4, ok := ip.(*layers.IPv4); ok {
		ip4.Flags = layers.IPv4DontFragment
	}
	tcp := &layers.TCP{SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()),
		SYN: true, Seq: seq, Window: 64240, Options: []layers.TCPOption{
			{OptionType: layers.TCPOptionKindMSS, OptionLength: 4, OptionData: []byte{0x05, 0xb4}},
			{OptionType: layers.TCPOptionKindSACKPermitted, OptionLength: 2},
			{OptionType: layers.TCPOptionKindTimestamps, OptionLength: 10, OptionData: []byte{0, 0, 0x30, 0x39, 0, 0, 0, 0}},
			{OptionType: layers.TCPOptionKindNop},
			{OptionType: layers.TCPOptionKindWindowScale, OptionLength: 3, OptionData: []byte{7}},
		}}
	tcp.SetNetworkLayerForChecksum(ip)
	return serialize(ip, tcp, nil)
}

// Refusal is the RST a listener-less host answers a SYN with: RST|ACK
// acknowledging the SYN's sequence number plus one (TCP sends its SYNs with
// Seq 1000).
func Refusal(src, dst netip.AddrPort, synSeq uint32) []byte {
	ip := ipLayer(src.Addr(), dst.Addr(), layers.IPProtocolTCP)
	tcp := &layers.TCP{SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()),
		RST: true, ACK: true, Ack: synSeq + 1}
	tcp.SetNetworkLayerForChecksum(ip)
	return serialize(ip, tcp, nil)
}

// UDP crafts an Ethernet/IPv4/UDP packet (IPv6 for IPv6 addresses) with a
// valid checksum.
func UDP(src, dst netip.AddrPort, payload []byte) []byte {
	ip := ipLayer(src.Addr(), dst.Addr(), layers.IPProtocolUDP)
	udp := &layers.UDP{SrcPort: layers.UDPPort(src.Port()), DstPort: layers.UDPPort(dst.Port())}
	udp.SetNetworkLayerForChecksum(ip)
	return serialize(ip, udp, payload)
}

func serialize(ip gopacket.SerializableLayer, l4 gopacket.SerializableLayer, payload []byte) []byte {
	eth := &layers.Ethernet{SrcMAC: ClientMAC, DstMAC: NodeMAC, EthernetType: layers.EthernetTypeIPv4}
	if _, ok := ip.(*layers.IPv6); ok {
		eth.EthernetType = layers.EthernetTypeIPv6
	}
	buf := gopacket.NewSerializeBuffer()
	opts := gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}
	if err := gopacket.SerializeLayers(buf, opts, eth, ip, l4, gopacket.Payload(payload)); err != nil {
		panic(err)
	}
	return append([]byte(nil), buf.Bytes()...)
}

// Parsed is what an independent parser sees in a packet.
type Parsed struct {
	Src, Dst netip.AddrPort
	Proto    layers.IPProtocol
	TTL      uint8
	SrcMAC   net.HardwareAddr
	DstMAC   net.HardwareAddr
}

// Parse decodes pkt with gopacket and verifies the IPv4 and L4 checksums
// by recomputing them from scratch.
func Parse(pkt []byte) (Parsed, error) {
	p := gopacket.NewPacket(pkt, layers.LayerTypeEthernet, gopacket.Default)
	if el := p.ErrorLayer(); el != nil {
		return Parsed{}, fmt.Errorf("decode: %v", el.Error())
	}
	eth, _ := p.Layer(layers.LayerTypeEthernet).(*layers.Ethernet)
	if ip6, _ := p.Layer(layers.LayerTypeIPv6).(*layers.IPv6); eth != nil && ip6 != nil {
		return parse6(pkt, eth)
	}
	ip, _ := p.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
	if eth == nil || ip == nil {
		return Parsed{}, fmt.Errorf("not Ethernet/IPv4")
	}
	var out Parsed
	out.Proto = ip.Protocol
	out.TTL = ip.TTL
	out.SrcMAC, out.DstMAC = eth.SrcMAC, eth.DstMAC
	src, _ := netip.AddrFromSlice(ip.SrcIP)
	dst, _ := netip.AddrFromSlice(ip.DstIP)
	var l4 gopacket.SerializableLayer
	var want uint16
	switch ip.Protocol {
	case layers.IPProtocolTCP:
		tcp := p.Layer(layers.LayerTypeTCP).(*layers.TCP)
		out.Src, out.Dst = netip.AddrPortFrom(src.Unmap(), uint16(tcp.SrcPort)), netip.AddrPortFrom(dst.Unmap(), uint16(tcp.DstPort))
		want = tcp.Checksum
		tcp.SetNetworkLayerForChecksum(ip)
		l4 = tcp
	case layers.IPProtocolUDP:
		udp := p.Layer(layers.LayerTypeUDP).(*layers.UDP)
		out.Src, out.Dst = netip.AddrPortFrom(src.Unmap(), uint16(udp.SrcPort)), netip.AddrPortFrom(dst.Unmap(), uint16(udp.DstPort))
		want = udp.Checksum
		udp.SetNetworkLayerForChecksum(ip)
		l4 = udp
	default:
		return out, fmt.Errorf("unexpected protocol %v", ip.Protocol)
	}
	ipWant := ip.Checksum
	buf := gopacket.NewSerializeBuffer()
	var payload []byte
	if app := p.ApplicationLayer(); app != nil {
		payload = app.Payload()
	}
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{ComputeChecksums: true}, ip, l4, gopacket.Payload(payload)); err != nil {
		return out, err
	}
	re := gopacket.NewPacket(buf.Bytes(), layers.LayerTypeIPv4, gopacket.Default)
	rip := re.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
	if rip.Checksum != ipWant {
		return out, fmt.Errorf("IPv4 checksum %#04x, want %#04x", ipWant, rip.Checksum)
	}
	var got uint16
	switch l := re.Layer(l4.LayerType()).(type) {
	case *layers.TCP:
		got = l.Checksum
	case *layers.UDP:
		got = l.Checksum
		if want == 0 {
			got = 0 // "no checksum" stays valid
		} else if got == 0 {
			// A sum of zero goes on the wire as all ones (RFC 768), as
			// the datapath writes it; gopacket leaves it zero.
			got = 0xffff
		}
	}
	if got != want {
		return out, fmt.Errorf("%v checksum %#04x, want %#04x", ip.Protocol, want, got)
	}
	return out, nil
}

// ICMPv4 error types and codes for ICMPError.
const (
	ICMPDestUnreach  = 3
	ICMPPortUnreach  = 3 // code
	ICMPFragNeeded   = 4 // code
	ICMPTimeExceeded = 11
)

// ICMPError crafts an Ethernet/IPv4 ICMP error from src to dst that quotes
// the first quoteLen bytes of the IP packet in the frame quoted (all of it
// when quoteLen is 0 or larger), with rest in the header's last four bytes
// (the next-hop MTU, for fragmentation needed).
func ICMPError(src, dst netip.Addr, typ, code uint8, rest uint32, quoted []byte, quoteLen int) []byte {
	q := quoted[14:]
	if tot := int(binary.BigEndian.Uint16(q[2:])); tot < len(q) {
		q = q[:tot] // a test run's output buffer has room after the packet
	}
	if quoteLen > 0 && quoteLen < len(q) {
		q = q[:quoteLen]
	}
	ip := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolICMPv4,
		SrcIP: src.AsSlice(), DstIP: dst.AsSlice(), Id: 1}
	icmp := &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(typ, code), Id: uint16(rest >> 16), Seq: uint16(rest)}
	return serialize(ip, icmp, q)
}

// ParsedICMP is what an independent parser sees in an ICMP error.
type ParsedICMP struct {
	Src, Dst             netip.Addr // outer
	Type, Code           uint8
	Rest                 uint32
	QuotedSrc, QuotedDst netip.AddrPort
	// QuotedL4Checked: the quote held the whole L4 segment, whose checksum
	// was verified.
	QuotedL4Checked bool
}

// ParseICMP decodes an ICMP error and verifies the outer IPv4, the ICMP,
// the quoted IPv4 and, when the quote holds the whole segment, the quoted
// L4 checksum, each recomputed from scratch.
func ParseICMP(pkt []byte) (ParsedICMP, error) {
	var out ParsedICMP
	if len(pkt) < 14+20+8+20+8 {
		return out, fmt.Errorf("%d bytes: too short for a quoting ICMP error", len(pkt))
	}
	ip := pkt[14:]
	ihl := int(ip[0]&0xf) * 4
	if ip[0]>>4 != 4 || ip[9] != 1 || ihl < 20 || len(ip) < ihl+8 {
		return out, fmt.Errorf("not IPv4 ICMP")
	}
	tot := int(binary.BigEndian.Uint16(ip[2:]))
	if tot > len(ip) {
		return out, fmt.Errorf("IPv4 total length %d beyond the frame", tot)
	}
	ip = ip[:tot]
	if s := onesSum(ip[:ihl]); s != 0xffff {
		return out, fmt.Errorf("outer IPv4 checksum wrong")
	}
	out.Src, out.Dst = netip.AddrFrom4([4]byte(ip[12:16])), netip.AddrFrom4([4]byte(ip[16:20]))
	icmp := ip[ihl:]
	if s := onesSum(icmp); s != 0xffff {
		return out, fmt.Errorf("ICMP checksum wrong")
	}
	out.Type, out.Code, out.Rest = icmp[0], icmp[1], binary.BigEndian.Uint32(icmp[4:])
	in := icmp[8:]
	qihl := int(in[0]&0xf) * 4
	if in[0]>>4 != 4 || qihl < 20 || len(in) < qihl+8 {
		return out, fmt.Errorf("quote is not IPv4 with 8 L4 bytes")
	}
	if s := onesSum(in[:qihl]); s != 0xffff {
		return out, fmt.Errorf("quoted IPv4 checksum wrong")
	}
	qs, qd := netip.AddrFrom4([4]byte(in[12:16])), netip.AddrFrom4([4]byte(in[16:20]))
	l4 := in[qihl:]
	out.QuotedSrc = netip.AddrPortFrom(qs, binary.BigEndian.Uint16(l4[0:]))
	out.QuotedDst = netip.AddrPortFrom(qd, binary.BigEndian.Uint16(l4[2:]))
	if qtot := int(binary.BigEndian.Uint16(in[2:])); qtot == len(in) {
		proto := in[9]
		if proto == 17 && binary.BigEndian.Uint16(l4[6:]) == 0 {
			return out, nil // no UDP checksum
		}
		pseudo := make([]byte, 12, 12+len(l4))
		copy(pseudo, in[12:20])
		pseudo[9] = proto
		binary.BigEndian.PutUint16(pseudo[10:], uint16(len(l4)))
		if s := onesSum(append(pseudo, l4...)); s != 0xffff {
			return out, fmt.Errorf("quoted L4 checksum wrong")
		}
		out.QuotedL4Checked = true
	}
	return out, nil
}

// onesSum is the ones' complement sum of b (0xffff over a region whose
// checksum field is right).
func onesSum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}

// parse6 is Parse for IPv6: it walks the extension headers itself and
// verifies the L4 checksum over the IPv6 pseudo-header (RFC 8200 8.1).
func parse6(pkt []byte, eth *layers.Ethernet) (Parsed, error) {
	out := Parsed{SrcMAC: eth.SrcMAC, DstMAC: eth.DstMAC}
	ip := pkt[14:]
	if len(ip) < 40 {
		return out, fmt.Errorf("IPv6 header truncated")
	}
	plen := int(binary.BigEndian.Uint16(ip[4:]))
	if 40+plen > len(ip) {
		return out, fmt.Errorf("IPv6 payload length %d beyond the frame", plen)
	}
	out.TTL = ip[7]
	src, dst := netip.AddrFrom16([16]byte(ip[8:24])), netip.AddrFrom16([16]byte(ip[24:40]))
	nh, off := ip[6], 40
	for nh == 0 || nh == 43 || nh == 60 {
		if off+2 > 40+plen {
			return out, fmt.Errorf("extension header truncated")
		}
		nh, off = ip[off], off+(int(ip[off+1])+1)*8
	}
	l4 := ip[off : 40+plen]
	out.Proto = layers.IPProtocol(nh)
	if (nh != 6 || len(l4) < 20) && (nh != 17 || len(l4) < 8) {
		return out, fmt.Errorf("unexpected L4 %d of %d bytes", nh, len(l4))
	}
	out.Src = netip.AddrPortFrom(src, binary.BigEndian.Uint16(l4[0:]))
	out.Dst = netip.AddrPortFrom(dst, binary.BigEndian.Uint16(l4[2:]))
	pseudo := make([]byte, 40, 40+len(l4))
	copy(pseudo, ip[8:40])
	binary.BigEndian.PutUint32(pseudo[32:], uint32(len(l4)))
	pseudo[39] = nh
	if s := onesSum(append(pseudo, l4...)); s != 0xffff {
		return out, fmt.Errorf("%v checksum wrong over the IPv6 pseudo-header", out.Proto)
	}
	return out, nil
}

// WithDestOpts inserts n destination-options extension headers (8 bytes
// each, padding only) after an Ethernet/IPv6 frame's fixed header. The L4
// checksum stays valid: the pseudo-header holds the upper-layer length,
// not the extension headers.
func WithDestOpts(pkt []byte, n int) []byte {
	out := append([]byte(nil), pkt[:14+40]...)
	next := out[14+6]
	out[14+6] = 60
	for i := range n {
		nh := byte(60)
		if i == n-1 {
			nh = next
		}
		out = append(out, nh, 0, 1, 4, 0, 0, 0, 0) // PadN, 4 bytes
	}
	out = append(out, pkt[14+40:]...)
	binary.BigEndian.PutUint16(out[14+4:], binary.BigEndian.Uint16(pkt[14+4:])+uint16(8*n))
	return out
}

// ICMPv6 error types and codes for ICMP6Error.
const (
	ICMP6DestUnreach  = 1
	ICMP6PortUnreach  = 4 // code
	ICMP6PacketTooBig = 2
	ICMP6TimeExceeded = 3
)

// ICMP6Error crafts an Ethernet/IPv6 ICMPv6 error from src to dst quoting
// the first quoteLen bytes (all when 0) of the IPv6 packet in the frame
// quoted, with rest in the four bytes after the checksum (the MTU of a
// packet too big).
func ICMP6Error(src, dst netip.Addr, typ, code uint8, rest uint32, quoted []byte, quoteLen int) []byte {
	q := quoted[14:]
	if tot := 40 + int(binary.BigEndian.Uint16(q[4:])); tot < len(q) {
		q = q[:tot]
	}
	if quoteLen > 0 && quoteLen < len(q) {
		q = q[:quoteLen]
	}
	ip := &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: layers.IPProtocolICMPv6, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
	icmp := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(typ, code)}
	icmp.SetNetworkLayerForChecksum(ip)
	body := binary.BigEndian.AppendUint32(nil, rest)
	return serialize(ip, icmp, append(body, q...))
}

// ParseICMP6 is ParseICMP for ICMPv6: the ICMPv6 checksum is verified over
// its pseudo-header (RFC 4443 2.3), and the quoted L4 checksum over the
// quoted packet's when the quote holds the whole segment.
func ParseICMP6(pkt []byte) (ParsedICMP, error) {
	var out ParsedICMP
	if len(pkt) < 14+40+8+40+8 {
		return out, fmt.Errorf("%d bytes: too short for a quoting ICMPv6 error", len(pkt))
	}
	ip := pkt[14:]
	if ip[0]>>4 != 6 || ip[6] != 58 {
		return out, fmt.Errorf("not IPv6 ICMPv6 (next header %d)", ip[6])
	}
	plen := int(binary.BigEndian.Uint16(ip[4:]))
	if 40+plen > len(ip) {
		return out, fmt.Errorf("payload length %d beyond the frame", plen)
	}
	out.Src, out.Dst = netip.AddrFrom16([16]byte(ip[8:24])), netip.AddrFrom16([16]byte(ip[24:40]))
	icmp := ip[40 : 40+plen]
	if s := onesSum(append(pseudo6(ip[8:24], ip[24:40], 58, len(icmp)), icmp...)); s != 0xffff {
		return out, fmt.Errorf("ICMPv6 checksum wrong")
	}
	out.Type, out.Code, out.Rest = icmp[0], icmp[1], binary.BigEndian.Uint32(icmp[4:])
	in := icmp[8:]
	if in[0]>>4 != 6 || len(in) < 48 {
		return out, fmt.Errorf("quote is not IPv6 with 8 L4 bytes")
	}
	l4 := in[40:]
	qs, qd := netip.AddrFrom16([16]byte(in[8:24])), netip.AddrFrom16([16]byte(in[24:40]))
	out.QuotedSrc = netip.AddrPortFrom(qs, binary.BigEndian.Uint16(l4[0:]))
	out.QuotedDst = netip.AddrPortFrom(qd, binary.BigEndian.Uint16(l4[2:]))
	if qlen := int(binary.BigEndian.Uint16(in[4:])); qlen == len(l4) {
		if s := onesSum(append(pseudo6(in[8:24], in[24:40], in[6], len(l4)), l4...)); s != 0xffff {
			return out, fmt.Errorf("quoted L4 checksum wrong")
		}
		out.QuotedL4Checked = true
	}
	return out, nil
}

func pseudo6(src, dst []byte, nh byte, n int) []byte {
	p := make([]byte, 40, 40+n)
	copy(p, src)
	copy(p[16:], dst)
	binary.BigEndian.PutUint32(p[32:], uint32(n))
	p[39] = nh
	return p
}

// Sweep is a datapath's maps for the conntrack sweep's tests and
// benchmarks: loaded into a private bpffs with the sweep's program (not
// the XDP one), wrapped, and the circuit breaker's counters.
type Sweep struct {
	*datapath.Datapath
	Maps     *maps.Maps
	Inflight *maps.Inflight
}

// LoadSweep loads a Sweep with a conntrack table of ctSize entries. The
// maps run the sweep's deletes through its program (as agent.Open has
// them) when prog, through system calls otherwise.
func LoadSweep(tb testing.TB, ctSize uint32, prog bool) *Sweep {
	tb.Helper()
	return loadSweep(tb, ctSize, prog, false)
}

// LoadSweepUnseeded is LoadSweep with pb_ct_v2's hash unseeded
// (datapath.Options.UnseededConntrack): an entry's bucket is
// CTBucket's.
func LoadSweepUnseeded(tb testing.TB, ctSize uint32, prog bool) *Sweep {
	tb.Helper()
	return loadSweep(tb, ctSize, prog, true)
}

func loadSweep(tb testing.TB, ctSize uint32, prog, unseeded bool) *Sweep {
	tb.Helper()
	RequireRoot(tb)
	d, err := datapath.LoadMaps(datapath.Options{Root: TempBPFFS(tb), MaxServices: 256, MaxBackends: 256,
		ConntrackSize: ctSize, EventsBytes: 1 << 16, UnseededConntrack: unseeded})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { d.Close() })
	m := newMaps(tb, d, prog)
	tb.Cleanup(m.Close)
	in, err := m.OpenInflight()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { in.Close() })
	return &Sweep{Datapath: d, Maps: m, Inflight: in}
}

// FlowKeys are the conntrack keys of an IPv4 TCP flow from client to vip
// balanced to backend: the forward (client -> VIP) and the reverse
// (backend -> client) one, as the datapath writes them.
func FlowKeys(client, vip, backend netip.AddrPort) (fk, rk bpf.LbCtKey) {
	fk.Src.Bytes, fk.Dst.Bytes = maps.Addr16(client.Addr()), maps.Addr16(vip.Addr())
	fk.Sport, fk.Dport = maps.Port(client.Port()), maps.Port(vip.Port())
	fk.Proto, fk.Dir, fk.Family = 6, maps.DirFwd, maps.FamilyIPv4
	rk.Src.Bytes, rk.Dst.Bytes = maps.Addr16(backend.Addr()), maps.Addr16(client.Addr())
	rk.Sport, rk.Dport = maps.Port(backend.Port()), maps.Port(client.Port())
	rk.Proto, rk.Dir, rk.Family = 6, maps.DirRev, maps.FamilyIPv4
	return fk, rk
}

// CTBucket is the bucket of an unseeded pb_ct_v2 of size entries (a power
// of two: the kernel's hash maps have as many buckets as entries, rounded
// up) that key k goes in: the kernel hashes a key whose length is a
// multiple of 4 with jhash2 over its 32-bit words (htab_map_hash), here
// with a zero seed.
func CTBucket(k bpf.LbCtKey, size uint32) uint32 {
	raw := unsafe.Slice((*byte)(unsafe.Pointer(&k)), unsafe.Sizeof(k))
	words := make([]uint32, len(raw)/4)
	for i := range words {
		words[i] = binary.NativeEndian.Uint32(raw[4*i:])
	}
	return jhash2(words, 0) & (size - 1)
}

// jhash2 is the kernel's (include/linux/jhash.h).
func jhash2(k []uint32, initval uint32) uint32 {
	rol := bits.RotateLeft32
	a := 0xdeadbeef + uint32(len(k))<<2 + initval
	b, c := a, a
	for len(k) > 3 {
		a += k[0]
		b += k[1]
		c += k[2]
		a -= c
		a ^= rol(c, 4)
		c += b
		b -= a
		b ^= rol(a, 6)
		a += c
		c -= b
		c ^= rol(b, 8)
		b += a
		a -= c
		a ^= rol(c, 16)
		c += b
		b -= a
		b ^= rol(a, 19)
		a += c
		c -= b
		c ^= rol(b, 4)
		b += a
		k = k[3:]
	}
	switch len(k) {
	case 3:
		c += k[2]
		fallthrough
	case 2:
		b += k[1]
		fallthrough
	case 1:
		a += k[0]
		c ^= b
		c -= rol(b, 14)
		a ^= c
		a -= rol(c, 11)
		b ^= a
		b -= rol(a, 25)
		c ^= b
		c -= rol(b, 16)
		a ^= c
		a -= rol(c, 4)
		b ^= a
		b -= rol(a, 14)
		c ^= b
		c -= rol(b, 24)
	}
	return c
}
