// Package bpftest loads the datapath into a private bpffs for tests and
// benchmarks, crafts packets with gopacket and runs them through the
// program with BPF_PROG_TEST_RUN.
package bpftest

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// RequireRoot skips when BPF cannot be used at all (not root). CI runs as
// root, so there these tests always run.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root for BPF (CI runs as root)")
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
	d, err := datapath.Load(datapath.Options{Root: root, MaxServices: 256, MaxBackends: 256, ConntrackSize: 4096, EventsBytes: 1 << 16})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { d.Close() })
	m, err := maps.New(&d.LbMaps, d.InnerSpec)
	if err != nil {
		tb.Fatal(err)
	}
	return &Loaded{Datapath: d, Maps: m}
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

// TCP crafts an Ethernet/IPv4/TCP packet with valid checksums.
func TCP(src, dst netip.AddrPort, f TCPFlags, payload []byte) []byte {
	ip := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolTCP,
		SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice(), Id: 1}
	tcp := &layers.TCP{SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()),
		SYN: f.SYN, ACK: f.ACK, RST: f.RST, FIN: f.FIN, PSH: f.PSH, Seq: 1000, Window: 65535}
	if f.ACK {
		tcp.Ack = 2000
	}
	tcp.SetNetworkLayerForChecksum(ip)
	return serialize(ip, tcp, payload)
}

// LinuxSYN crafts the SYN a Linux client sends: DF, TTL 64, and the
// options MSS 1460, SACK permitted, timestamps, window scale 7.
func LinuxSYN(src, dst netip.AddrPort, seq uint32) []byte {
	ip := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolTCP, Flags: layers.IPv4DontFragment,
		SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice(), Id: 1}
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
	ip := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolTCP,
		SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice(), Id: 1}
	tcp := &layers.TCP{SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()),
		RST: true, ACK: true, Ack: synSeq + 1}
	tcp.SetNetworkLayerForChecksum(ip)
	return serialize(ip, tcp, nil)
}

// UDP crafts an Ethernet/IPv4/UDP packet with a valid checksum.
func UDP(src, dst netip.AddrPort, payload []byte) []byte {
	ip := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolUDP,
		SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice(), Id: 1}
	udp := &layers.UDP{SrcPort: layers.UDPPort(src.Port()), DstPort: layers.UDPPort(dst.Port())}
	udp.SetNetworkLayerForChecksum(ip)
	return serialize(ip, udp, payload)
}

func serialize(ip *layers.IPv4, l4 gopacket.SerializableLayer, payload []byte) []byte {
	eth := &layers.Ethernet{SrcMAC: ClientMAC, DstMAC: NodeMAC, EthernetType: layers.EthernetTypeIPv4}
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
		}
	}
	if got != want {
		return out, fmt.Errorf("%v checksum %#04x, want %#04x", ip.Protocol, want, got)
	}
	return out, nil
}
