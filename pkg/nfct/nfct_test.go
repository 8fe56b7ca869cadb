package nfct

import (
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// The matcher alone: TCP and UDP entries from a VIP (IPv4, IPv6, an IPv4
// address in IPv6 form) match, those to it or of another protocol do not.
func TestFromVIPs(t *testing.T) {
	f := fromVIPs{netip.MustParseAddrPort("198.18.100.1:80"): true, netip.MustParseAddrPort("[2001:2::1]:443"): true}
	flow := func(src, dst string, proto uint8) *netlink.ConntrackFlow {
		s, d := netip.MustParseAddrPort(src), netip.MustParseAddrPort(dst)
		return &netlink.ConntrackFlow{Forward: netlink.IPTuple{SrcIP: net.IP(s.Addr().AsSlice()), DstIP: net.IP(d.Addr().AsSlice()),
			SrcPort: s.Port(), DstPort: d.Port(), Protocol: proto}}
	}
	for _, c := range []struct {
		flow *netlink.ConntrackFlow
		want bool
	}{
		{flow("198.18.100.1:80", "198.18.0.2:40000", unix.IPPROTO_TCP), true},
		{flow("[::ffff:198.18.100.1]:80", "198.18.0.2:40000", unix.IPPROTO_TCP), true},
		{flow("[2001:2::1]:443", "[2001:2::2]:40000", unix.IPPROTO_TCP), true},
		{flow("198.18.0.2:40000", "198.18.100.1:80", unix.IPPROTO_TCP), false},
		{flow("198.18.100.1:81", "198.18.0.2:40000", unix.IPPROTO_TCP), false},
		{flow("198.18.100.1:80", "198.18.0.2:40000", unix.IPPROTO_UDP), true},
		{flow("198.18.100.1:80", "198.18.0.2:40000", unix.IPPROTO_SCTP), false},
	} {
		if got := f.MatchConntrackFlow(c.flow); got != c.want {
			t.Errorf("%v -> %v proto %d: match %v, want %v", c.flow.Forward.SrcIP, c.flow.Forward.DstIP, c.flow.Forward.Protocol, got, c.want)
		}
	}
}

// In a network namespace of the test's own: the entries the datapath's
// replies made go, kube-proxy's connections to the VIP and others stay.
func TestForgetReplies(t *testing.T) {
	h := testnet.OwnNetns(t, true)
	add := func(src, dst string) {
		t.Helper()
		s, d := netip.MustParseAddrPort(src), netip.MustParseAddrPort(dst)
		if err := testnet.AddConntrack(h, [2]netip.AddrPort{s, d}, [2]netip.AddrPort{d, s}, unix.IPPROTO_TCP,
			&netlink.ProtoInfoTCP{State: 3}); err != nil {
			t.Fatal(err)
		}
	}
	add("198.18.100.1:80", "198.18.0.2:40000")  // ours
	add("[2001:2::1]:443", "[2001:2::2]:40000") // ours, IPv6
	add("198.18.0.2:40001", "198.18.100.1:80")  // kube-proxy's
	add("198.18.0.3:40000", "198.18.1.2:8080")  // a datapath flow's forward half: the next kube-proxy flow moves around it
	n, err := ForgetReplies([]netip.AddrPort{netip.MustParseAddrPort("198.18.100.1:80"), netip.MustParseAddrPort("[2001:2::1]:443")})
	if err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Errorf("forgot %d entries, want 2", n)
	}
	left := 0
	for _, fam := range []netlink.InetFamily{unix.AF_INET, unix.AF_INET6} {
		flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, fam)
		if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
			t.Fatal(err)
		}
		left += len(flows)
	}
	if left != 2 {
		t.Errorf("%d entries left, want kube-proxy's and the forward half", left)
	}
}
