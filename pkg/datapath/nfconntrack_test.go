package datapath_test

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// kernelConntrack is the kernel's conntrack table of a network namespace
// of the test's own, which the datapath's runs on the locked thread see.
type kernelConntrack struct {
	t *testing.T
	h *netlink.Handle
}

// inOwnNetns moves the test's goroutine into a network namespace of its
// own (testnet.OwnNetns), where the datapath's runs see that namespace's
// conntrack.
func inOwnNetns(t *testing.T) *kernelConntrack {
	t.Helper()
	h := testnet.OwnNetns(t, true)
	if !datapath.HaveNFKfuncs() {
		t.Skip("the kernel has no conntrack kfuncs (Linux 6.0 with BTF, nf_conntrack loaded)")
	}
	return &kernelConntrack{t: t, h: h}
}

// add inserts an entry, as the kernel would have made it for a TCP flow in
// state (netlink's TCP_CONNTRACK_*), seen orig and answered as reply.
func (k *kernelConntrack) add(orig, reply [2]netip.AddrPort, state uint8) {
	k.t.Helper()
	k.addProto(orig, reply, unix.IPPROTO_TCP, &netlink.ProtoInfoTCP{State: state})
}

// addProto inserts an entry of protocol proto.
func (k *kernelConntrack) addProto(orig, reply [2]netip.AddrPort, proto uint8, info netlink.ProtoInfo) {
	k.t.Helper()
	if err := testnet.AddConntrack(k.h, orig, reply, proto, info); err != nil {
		k.t.Fatalf("conntrack entry %v / %v: %v", orig, reply, err)
	}
}

// has says whether an entry with orig as its original tuple is there (an
// expired one is not: the kernel drops it when a dump meets it).
func (k *kernelConntrack) has(orig [2]netip.AddrPort) bool {
	k.t.Helper()
	family := netlink.InetFamily(unix.AF_INET)
	if orig[0].Addr().Is6() {
		family = unix.AF_INET6
	}
	flows, err := k.h.ConntrackTableList(netlink.ConntrackTable, family)
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		k.t.Fatal(err)
	}
	for _, f := range flows {
		if f.Forward.SrcIP.Equal(orig[0].Addr().AsSlice()) && f.Forward.DstIP.Equal(orig[1].Addr().AsSlice()) &&
			f.Forward.SrcPort == orig[0].Port() && f.Forward.DstPort == orig[1].Port() {
			return true
		}
	}
	return false
}

const (
	nfTimeWait    = 7 // TCP_CONNTRACK_TIME_WAIT
	nfEstablished = 3 // TCP_CONNTRACK_ESTABLISHED
)

func tup(a, b netip.AddrPort) [2]netip.AddrPort { return [2]netip.AddrPort{a, b} }

// Where kube-proxy's path and the datapath's meet, a SYN's tuple is freed
// of what the kernel's conntrack still holds of the other path's finished
// flow on the same client port; anywhere else the datapath leaves the
// kernel's table alone.
//
//   - A service just taken over: kube-proxy's flow from client to the VIP,
//     DNATed to any backend, holds client -> VIP, the reply tuple of the
//     new flow's replies as the datapath rewrites them (the kernel would
//     move their source port, and the client would answer them with a
//     RST). Expired, whether kube-proxy picked the backend the datapath
//     picks or another.
//   - New flows handed to kube-proxy (the dead-man's switch, draining, a
//     service handed back): an entry the datapath's rewritten replies made,
//     VIP -> client, holds the SYN's own tuple in its reply direction (the
//     SYN would join it and escape kube-proxy's DNAT). Expired.
func TestForgetsKernelConntrackWherePathsMeet(t *testing.T) {
	f := newFixture(t)
	k := inOwnNetns(t)
	f.table(id1)
	kubeProxys := func(c, be netip.AddrPort) { k.add(tup(c, vip), tup(be, c), nfTimeWait) }
	ours := func(c netip.AddrPort) { k.add(tup(vip, c), tup(c, vip), nfEstablished) }

	// A service the datapath has had all along: nothing to forget.
	kubeProxys(client, be1)
	if _, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil)); p.Dst != be1 {
		t.Fatalf("SYN went to %v", p.Dst)
	}
	if !k.has(tup(client, vip)) {
		t.Error("a service not taken over: the kernel's entry was expired")
	}

	f.svc.Flags = maps.ServiceTakenOver
	f.writeService()
	for i, kpBackend := range []netip.AddrPort{be1, be2} {
		c := clientPort(40010 + uint16(i))
		kubeProxys(c, kpBackend)
		if _, p, _ := f.run(bpftest.TCP(c, vip, bpftest.SYN, nil)); p.Dst != be1 {
			t.Fatalf("SYN went to %v", p.Dst)
		}
		if k.has(tup(c, vip)) {
			t.Errorf("taken over: kube-proxy's finished flow to %v still holds the new flow's replies", kpBackend)
		}
	}
	// Only a SYN: a packet of a flow already here changes nothing.
	c3 := clientPort(40003)
	f.run(bpftest.TCP(c3, vip, bpftest.SYN, nil))
	kubeProxys(c3, be1)
	f.run(bpftest.TCP(c3, vip, bpftest.ACK, []byte("data")))
	if !k.has(tup(c3, vip)) {
		t.Error("a mid-stream packet expired an entry")
	}

	f.svc.Flags = maps.ServiceHandedBack
	f.writeService()
	c4 := clientPort(40004)
	ours(c4)
	f.passesUnchanged("a new flow of a service handed back", bpftest.TCP(c4, vip, bpftest.SYN, nil))
	if k.has(tup(vip, c4)) {
		t.Error("handed back: the entry of our rewritten replies still holds the SYN's tuple")
	}

	f.svc.Flags = 0
	f.writeService()
	f.must(f.Maps.SetConfig(maps.Config{Drain: true}))
	c5 := clientPort(40005)
	ours(c5)
	f.passesUnchanged("a new flow while draining", bpftest.TCP(c5, vip, bpftest.SYN, nil))
	if k.has(tup(vip, c5)) {
		t.Error("draining: the entry of our rewritten replies still holds the SYN's tuple")
	}
	f.must(f.Maps.SetConfig(maps.Config{}))

	n, err := f.Maps.NFForgotten()
	if err != nil {
		t.Fatal(err)
	}
	if n.TakenOver != 2 || n.HandedOver != 2 {
		t.Errorf("pb_nf_stats %+v, want 2 taken over, 2 handed over", n)
	}
}

// The same for IPv6.
func TestForgetsKernelConntrackIPv6(t *testing.T) {
	f := fixture6(t, 6)
	k := inOwnNetns(t)
	f.svc6(6, 0, maps.ServiceTakenOver)
	k.add(tup(client6, vip6), tup(be6a, client6), nfTimeWait)
	if _, p, _ := f.run(bpftest.TCP(client6, vip6, bpftest.SYN, nil)); p.Dst != be6a {
		t.Fatalf("SYN went to %v", p.Dst)
	}
	if k.has(tup(client6, vip6)) {
		t.Error("taken over: kube-proxy's finished IPv6 flow still holds the new flow's replies")
	}
	f.svc6(6, 0, maps.ServiceHandedBack)
	k.add(tup(vip6, client6b), tup(client6b, vip6), nfEstablished)
	f.passesUnchanged("an IPv6 SYN of a service handed back", bpftest.TCP(client6b, vip6, bpftest.SYN, nil))
	if k.has(tup(vip6, client6b)) {
		t.Error("handed back: the IPv6 entry of our rewritten replies still holds the SYN's tuple")
	}
}

// UDP too: a datagram opening a flow of a service taken over expires
// kube-proxy's finished flow from the same client port; one handed to kube-proxy,
// the entry of the datapath's rewritten replies. A datagram of a flow
// already here changes nothing.
func TestForgetsKernelConntrackUDP(t *testing.T) {
	f := newFixture(t)
	k := inOwnNetns(t)
	f.service(17, id1)
	f.svc.Flags |= maps.ServiceTakenOver
	f.writeService()
	udp := func(c netip.AddrPort) []byte { return bpftest.UDP(c, vip, []byte("q")) }
	k.addProto(tup(client, vip), tup(be1, client), unix.IPPROTO_UDP, nil)
	if _, p, _ := f.run(udp(client)); p.Dst != be1 {
		t.Fatalf("datagram went to %v", p.Dst)
	}
	if k.has(tup(client, vip)) {
		t.Error("taken over: kube-proxy's finished UDP flow still holds the new flow's replies")
	}
	k.addProto(tup(client, vip), tup(be1, client), unix.IPPROTO_UDP, nil)
	f.run(udp(client))
	if !k.has(tup(client, vip)) {
		t.Error("a datagram of a flow already here expired an entry")
	}
	f.svc.Flags = maps.ServiceHandedBack
	f.writeService()
	k.addProto(tup(vip, client2), tup(client2, vip), unix.IPPROTO_UDP, nil)
	f.passesUnchanged("a UDP flow of a service handed back", udp(client2))
	if k.has(tup(vip, client2)) {
		t.Error("handed back: the UDP entry of our rewritten replies still holds the datagram's tuple")
	}
}
