// SPDX-License-Identifier: Apache-2.0

// Package nodelinks tells which of a Kubernetes node's network interfaces
// carry Service traffic, as they come and go: the node's external
// interfaces (by default those of its default routes) and the host side of
// every pod's veth, recognised by name (Calico's cali*, Cilium's lxc*,
// bridge CNIs' veth*, ...). It also reports the node's own IPv4 and IPv6
// addresses. It watches rtnetlink, so a pod's veth is reported as the CNI
// creates it and dropped as it is deleted.
package nodelinks

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"path"
	"slices"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// DefaultPodPatterns match the host-side pod interfaces of common CNIs:
// bridge-based ones (flannel, kindnet, the reference bridge plugin) use
// veth*, Calico cali*, Cilium lxc*, the AWS VPC CNI eni*, GKE gke*, Azure
// azv*.
const DefaultPodPatterns = "veth*,cali*,lxc*,eni*,gke*,azv*"

// DefaultTunnelPatterns match the VXLAN devices of overlay pod networks:
// flannel's (flannel.1, flannel-v6.1 for IPv6) and Calico's (vxlan.calico,
// vxlan-v6.calico). A
// reply from a backend pod on another node arrives inside the tunnel, so
// the node's NIC sees only the outer packet; the tunnel device hands the
// stack the inner frame, and XDP there (generic: VXLAN has no native XDP)
// rewrites it. IPIP's tunl0 is not among them: it carries bare IP packets
// (see DefaultIPIPPatterns).
const DefaultTunnelPatterns = "flannel.*,flannel-v6.*,vxlan.calico,vxlan-v6.calico"

// DefaultIPIPPatterns match IPIP tunnel devices: Calico's tunl0 (IPIPMode
// Always or CrossSubnet). The datapath is not attached to them: a reply
// from a backend pod on another node is rewritten inside its IPIP packet
// on the node's uplink, before the stack unwraps it. The device is
// reported so that the datapath knows a route through it (reverse-path
// check: the reply must come from the node the route names).
const DefaultIPIPPatterns = "tunl0"

// Auto, as the external interfaces, means those of the default routes.
const Auto = "auto"

// Options say which interfaces to report.
type Options struct {
	// External are names or globs of the node's external interfaces. Nil
	// with AutoExternal means the interfaces of the default routes (IPv4 and
	// IPv6, every next hop), re-resolved as routes and links change.
	External     []string
	AutoExternal bool
	// Pods are globs (path.Match) of host-side pod interface names.
	Pods []string
	// Tunnels are globs of overlay tunnel device names (VXLAN).
	Tunnels []string
	// IPIP are globs of IPIP tunnel device names.
	IPIP   []string
	Logger *slog.Logger
}

// ParseExternal parses the --node-interfaces flag: "auto", "" (none), or
// a comma-separated list of names and globs.
func ParseExternal(s string) (patterns []string, auto bool, err error) {
	if strings.TrimSpace(s) == Auto {
		return nil, true, nil
	}
	p, err := ParsePatterns(s)
	return p, false, err
}

// ParsePatterns parses a comma-separated list of globs; empty means none.
func ParsePatterns(s string) ([]string, error) {
	var out []string
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		if _, err := path.Match(p, ""); err != nil {
			return nil, fmt.Errorf("interface pattern %q: %w", p, err)
		}
		out = append(out, p)
	}
	return out, nil
}

// Link is an interface that carries Service traffic.
type Link struct {
	Name  string
	Index int
	// Pod is true for a pod's host-side interface, false for an external one.
	Pod bool
	// Tunnel is true for an overlay's tunnel device.
	Tunnel bool
	// IPIP is true for an IPIP tunnel device: known to the datapath, not
	// attached.
	IPIP bool
	// Master is its master's ifindex (a bridged pod's bridge), 0: none.
	// The datapath takes a reply from a bridged pod only through it (the
	// node routes the pod through the bridge), and a CNI sets it after it
	// creates the veth: a change of master is a change of the link.
	Master int
}

// Seen is what the watch keeps of one of the node's links.
type Seen struct {
	Name   string
	Master int // its master's ifindex, 0: none
}

// seen is what a link's attributes say of it.
func seen(a *netlink.LinkAttrs) Seen { return Seen{Name: a.Name, Master: a.MasterIndex} }

// Attach says whether the datapath runs on the link (all but IPIP
// tunnels).
func (l Link) Attach() bool { return !l.IPIP }

// External is true for one of the node's uplinks.
func (l Link) External() bool { return !l.Pod && !l.Tunnel && !l.IPIP }

// Select picks, from the node's links (by ifindex) and the ifindexes of
// its default routes, the links to report, sorted by name. Loopback is
// never reported.
func Select(links map[int]Seen, defaultRoutes map[int]bool, o Options) []Link {
	var out []Link
	for idx, s := range links {
		if s.Name == "lo" {
			continue
		}
		l := Link{Name: s.Name, Index: idx, Master: s.Master}
		switch {
		case matchAny(o.Pods, l.Name):
			l.Pod = true
		case matchAny(o.Tunnels, l.Name):
			l.Tunnel = true
		case matchAny(o.IPIP, l.Name):
			l.IPIP = true
		case matchAny(o.External, l.Name) || (o.AutoExternal && defaultRoutes[idx]):
		default:
			continue
		}
		out = append(out, l)
	}
	slices.SortFunc(out, func(a, b Link) int { return strings.Compare(a.Name, b.Name) })
	return out
}

func matchAny(patterns []string, name string) bool {
	for _, p := range patterns {
		if ok, _ := path.Match(p, name); ok {
			return true
		}
	}
	return false
}

// Update is the node's state as Watch reports it.
type Update struct {
	Links []Link
	// Addrs are the node's own addresses, IPv4 and IPv6 (every
	// interface's, sorted).
	Addrs []netip.Addr
}

func (u Update) equal(v Update) bool {
	return slices.Equal(u.Links, v.Links) && slices.Equal(u.Addrs, v.Addrs)
}

// Watch reports the selected links and the node's addresses on out: first
// the current state, then the whole state again after every change, until
// ctx ends. It watches the
// network namespace of the calling process. When the kernel drops
// notifications (a netlink socket overrun on a node creating many pods at
// once), it subscribes again and relists, so no change is missed for
// long.
func Watch(ctx context.Context, o Options, out chan<- Update) error {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	var last Update
	first := true
	for {
		err := watchOnce(ctx, o, func(u Update) bool {
			if !first && u.equal(last) {
				return true
			}
			first, last = false, u
			select {
			case out <- u:
				return true
			case <-ctx.Done():
				return false
			}
		})
		if ctx.Err() != nil {
			return nil
		}
		o.Logger.Warn("interface watch interrupted; subscribing again", "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
}

// watchOnce subscribes, lists, and follows updates until the subscription
// fails or ctx ends.
func watchOnce(ctx context.Context, o Options, emit func(Update) bool) error {
	done := make(chan struct{})
	defer close(done)
	errc := make(chan error, 2)
	onErr := func(err error) {
		select {
		case errc <- err:
		default:
		}
	}
	// Subscribe before listing: a change between the two is then both in
	// the list and in the stream, and applying it twice is harmless.
	linkCh := make(chan netlink.LinkUpdate, 256)
	if err := netlink.LinkSubscribeWithOptions(linkCh, done, netlink.LinkSubscribeOptions{ErrorCallback: onErr}); err != nil {
		return fmt.Errorf("subscribe to links: %w", err)
	}
	// After done, drain what a subscription still sends so its goroutine
	// can see the closed socket and exit.
	defer drain(linkCh)
	addrCh := make(chan netlink.AddrUpdate, 256)
	if err := netlink.AddrSubscribeWithOptions(addrCh, done, netlink.AddrSubscribeOptions{ErrorCallback: onErr}); err != nil {
		return fmt.Errorf("subscribe to addresses: %w", err)
	}
	defer drain(addrCh)
	var routeCh chan netlink.RouteUpdate // nil: never ready in select
	if o.AutoExternal {
		routeCh = make(chan netlink.RouteUpdate, 256)
		if err := netlink.RouteSubscribeWithOptions(routeCh, done, netlink.RouteSubscribeOptions{ErrorCallback: onErr}); err != nil {
			return fmt.Errorf("subscribe to routes: %w", err)
		}
		defer drain(routeCh)
	}
	all, err := netlink.LinkList()
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		return fmt.Errorf("list links: %w", err)
	}
	links := map[int]Seen{}
	for _, l := range all {
		links[l.Attrs().Index] = seen(l.Attrs())
	}
	routes := defaultRoutes(o)
	addrs, err := localAddrs()
	if err != nil {
		return err
	}
	if !emit(Update{Select(links, routes, o), addrs}) {
		return nil
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-errc:
			return err
		case u, ok := <-linkCh:
			if !ok {
				return errors.New("link subscription closed")
			}
			if bridgeFamily(u) {
				continue
			}
			if u.Header.Type == unix.RTM_DELLINK {
				delete(links, int(u.Index))
			} else {
				links[int(u.Index)] = seen(u.Attrs())
			}
			if o.AutoExternal {
				routes = defaultRoutes(o)
			}
		case u, ok := <-routeCh:
			if !ok {
				return errors.New("route subscription closed")
			}
			if !isDefault(u.Dst) {
				continue
			}
			routes = defaultRoutes(o)
		case _, ok := <-addrCh:
			if !ok {
				return errors.New("address subscription closed")
			}
		}
		// Apply everything queued before reporting: a CNI creating a veth
		// sends several updates for it.
		if !drained(linkCh, routeCh, addrCh, links) {
			return errors.New("subscription closed")
		}
		if o.AutoExternal {
			routes = defaultRoutes(o)
		}
		if addrs, err = localAddrs(); err != nil {
			return err
		}
		if !emit(Update{Select(links, routes, o), addrs}) {
			return nil
		}
	}
}

// bridgeFamily says whether u is one of the bridge's own notifications
// about a port (family AF_BRIDGE), beside the link's: its master is the
// bridge even when it is about the bridge itself, and its RTM_DELLINK
// means the port left the bridge, not that the link is gone.
func bridgeFamily(u netlink.LinkUpdate) bool { return u.IfInfomsg.Family == unix.AF_BRIDGE }

func drain[T any](ch <-chan T) {
	go func() {
		for range ch {
		}
	}()
}

// drained applies the link updates already queued and consumes the
// others (the caller relists routes and addresses); false if a
// subscription closed.
func drained(linkCh <-chan netlink.LinkUpdate, routeCh <-chan netlink.RouteUpdate, addrCh <-chan netlink.AddrUpdate, links map[int]Seen) bool {
	for {
		select {
		case u, ok := <-linkCh:
			if !ok {
				return false
			}
			if bridgeFamily(u) {
				continue
			}
			if u.Header.Type == unix.RTM_DELLINK {
				delete(links, int(u.Index))
			} else {
				links[int(u.Index)] = seen(u.Attrs())
			}
		case _, ok := <-routeCh:
			if !ok {
				return false
			}
		case _, ok := <-addrCh:
			if !ok {
				return false
			}
		default:
			return true
		}
	}
}

// localAddrs lists the node's own addresses, IPv4 and IPv6 (link-local
// ones aside: no Service endpoint has one).
func localAddrs() ([]netip.Addr, error) {
	as, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		return nil, fmt.Errorf("list addresses: %w", err)
	}
	var out []netip.Addr
	for _, a := range as {
		if ip, ok := netip.AddrFromSlice(a.IP); ok && !ip.Unmap().IsLinkLocalUnicast() {
			out = append(out, ip.Unmap())
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out), nil
}

// defaultRoutes returns the ifindexes of the main table's default routes.
func defaultRoutes(o Options) map[int]bool {
	out := map[int]bool{}
	if !o.AutoExternal {
		return out
	}
	for _, family := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := netlink.RouteList(nil, family)
		if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
			o.Logger.Warn("list routes", "err", err)
			continue
		}
		for _, r := range rs {
			if !isDefault(r.Dst) {
				continue
			}
			if r.LinkIndex > 0 {
				out[r.LinkIndex] = true
			}
			for _, nh := range r.MultiPath {
				out[nh.LinkIndex] = true
			}
		}
	}
	return out
}

func isDefault(dst *net.IPNet) bool {
	if dst == nil {
		return true
	}
	ones, _ := dst.Mask.Size()
	return ones == 0
}
