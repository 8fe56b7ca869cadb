// Package nfct clears the kernel's connection tracking (netfilter's
// conntrack) of what the datapath's flows leave in it when the datapath
// goes.
//
// Where the datapath forwards through the host's stack, the kernel tracks
// its flows in the forms it sees them: client -> backend (the DNAT done in
// XDP) and, from the replies rewritten in XDP, VIP -> client, an entry
// that never sees an answer and lingers minutes after the flow. Such an
// entry holds, in its reply direction, the tuple of kube-proxy's next
// connection from the same client port to the VIP: that SYN would join it,
// escape kube-proxy's DNAT and fail. While the datapath runs it expires
// them itself on the tuples it hands to kube-proxy (bpf/lb.c, nf_forget);
// once it is detached, ForgetReplies deletes the rest.
package nfct

import (
	"errors"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// ForgetReplies deletes the kernel's TCP and UDP conntrack entries, in the calling
// thread's network namespace, whose original direction comes from one of
// vips (VIP:port -> client): only the datapath's rewritten replies make
// those (kube-proxy's connections go to a VIP, never from one). It
// returns how many went.
func ForgetReplies(vips []netip.AddrPort) (int, error) {
	if len(vips) == 0 {
		return 0, nil
	}
	f := fromVIPs{}
	for _, v := range vips {
		f[netip.AddrPortFrom(v.Addr().Unmap(), v.Port())] = true
	}
	var n uint
	var errs []error
	for _, family := range []netlink.InetFamily{unix.AF_INET, unix.AF_INET6} {
		k, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, family, f)
		n += k
		if err != nil {
			errs = append(errs, err)
		}
	}
	return int(n), errors.Join(errs...)
}

// fromVIPs matches TCP and UDP entries whose original source is one of its
// keys.
type fromVIPs map[netip.AddrPort]bool

func (f fromVIPs) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool {
	src, ok := netip.AddrFromSlice(flow.Forward.SrcIP)
	p := flow.Forward.Protocol
	return ok && (p == unix.IPPROTO_TCP || p == unix.IPPROTO_UDP) && f[netip.AddrPortFrom(src.Unmap(), flow.Forward.SrcPort)]
}
