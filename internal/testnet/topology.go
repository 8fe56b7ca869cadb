// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// VIP is the default virtual IP for tests. VIPs live in VIPNet and are not
// assigned to any interface: the XDP program DNATs them. Without a load
// balancer the node has no route for them, so a connect to a VIP fails fast
// with "network unreachable" (the node answers with ICMP).
const (
	VIP    = "198.18.100.1"
	VIPNet = "198.18.100.0/24"
)

// VIP6 is the default IPv6 virtual IP for tests, VIP's counterpart. IPv6
// VIPs live in VIP6Net and are not assigned to any interface: the XDP
// program DNATs them. Without a load balancer the node has no route for
// them, so a connect to an IPv6 VIP fails fast with "network unreachable"
// (the node answers with ICMPv6 "no route to destination"). In a URL or a
// dial address it needs brackets: "[" + VIP6 + "]:80".
const (
	VIP6    = "2001:2:0:100::1"
	VIP6Net = "2001:2:0:100::/64"
)

// VIPAddr is VIP as a netip.Addr.
var VIPAddr = netip.MustParseAddr(VIP)

// VIP6Addr is VIP6 as a netip.Addr.
var VIP6Addr = netip.MustParseAddr(VIP6)

// MaxBackends is the largest Options.Backends accepted.
const MaxBackends = 99

// Options configures Build.
type Options struct {
	// Backends is the number of backend namespaces, 1..MaxBackends.
	// Zero means 1.
	Backends int

	// GRO enables GRO on the client's and every backend's eth0 (the peers of
	// the node-side veths). XDP_REDIRECT into a veth (node cl0 or b<i>)
	// drops the frame unless the peer end has an XDP program or GRO (NAPI)
	// enabled; with GRO on, the peer consumes redirected frames.
	GRO bool

	// TxChecksumOff disables tx checksum offload on the client's and every
	// backend's eth0, so packets leave with complete L4 checksums instead of
	// CHECKSUM_PARTIAL. XDP_REDIRECT turns the skb into a bare frame and
	// loses the "checksum not yet computed" mark, so without this the
	// receiver drops redirected TCP segments as bad-checksum. Needed
	// together with GRO for XDP_REDIRECT datapaths; see the package doc.
	TxChecksumOff bool

	// StaticNeighbors installs permanent neighbour entries on both ends of
	// every link, ARP (IPv4) and NDP (IPv6) alike, so bpf_fib_lookup in the
	// node succeeds from the first packet of either family (no
	// BPF_FIB_LKUP_RET_NO_NEIGH while ARP or neighbour discovery resolves).
	StaticNeighbors bool
}

// XDPOptions are the options an XDP_REDIRECT datapath needs to deliver
// packets: GRO and complete checksums on the peers, static neighbours.
func XDPOptions(backends int) Options {
	return Options{Backends: backends, GRO: true, TxChecksumOff: true, StaticNeighbors: true}
}

// Link is one veth pair between the node and a client or backend namespace.
// i is the link's index: 0 for the client's link cl0, i for b<i>. Every link
// is dual-stack. In its IPv6 addresses the fourth group spells i with the
// same decimal digits as the IPv4 address does (b12: 198.18.12.2 and
// 2001:2:0:12::2), as VIP and VIP6 do (198.18.100.1, 2001:2:0:100::1).
type Link struct {
	Name   string           // node-side name: "cl0", "b1", ...
	Index  int              // node-side ifindex (in the node namespace)
	MAC    net.HardwareAddr // node-side MAC
	Addr   netip.Prefix     // node-side address: 198.18.<i>.1/24
	AddrV6 netip.Prefix     // node-side IPv6 address: 2001:2:0:<i>::1/64

	Peer       *NS              // the client or backend namespace
	PeerName   string           // always "eth0"
	PeerIndex  int              // peer ifindex (in Peer)
	PeerMAC    net.HardwareAddr // peer MAC
	PeerAddr   netip.Prefix     // peer address: 198.18.<i>.2/24
	PeerAddrV6 netip.Prefix     // peer IPv6 address: 2001:2:0:<i>::2/64
}

// Topology is a node namespace connected by dual-stack veth pairs to one
// client and N backend namespaces:
//
//	client eth0 198.18.0.2    ── cl0  198.18.0.1    ┐
//	            2001:2:0:0::2         2001:2:0:0::1 │
//	                                                node (ip_forward=1, rp_filter=0,
//	                                                │     IPv6 forwarding=1)
//	b<i>   eth0 198.18.i.2    ── b<i> 198.18.i.1    │
//	            2001:2:0:i::2         2001:2:0:i::1 ┘
//
// Client and backends route everything via the node, IPv4 and IPv6 (a
// default route of each family via the node's address on their link).
// Names are unique per instance, so topologies can coexist (tests may run
// in parallel).
type Topology struct {
	ID       string     // unique id, the namespace name prefix is "pbt"+ID
	Node     *NS        // "pbt<ID>-node": interfaces cl0, b1..bN
	Client   *NS        // "pbt<ID>-cl": interface eth0
	Backends []*Backend // Backends[i-1] is "b<i>" in "pbt<ID>-b<i>"
	Links    []*Link    // Links[0] is cl0, Links[i] is b<i>
	Options  Options

	created   []string // namespaces actually created, deleted by Close
	extra     []*NS    // namespaces added by AddNS
	closeOnce sync.Once
	closeErr  error
}

// ClientAddr is the client's address, 198.18.0.2.
func (t *Topology) ClientAddr() netip.Addr { return t.Links[0].PeerAddr.Addr() }

// ClientAddrV6 is the client's IPv6 address, 2001:2:0:0::2 (2001:2::2).
func (t *Topology) ClientAddrV6() netip.Addr { return t.Links[0].PeerAddrV6.Addr() }

// NodeIfaces returns the node-side interface names: cl0, b1, ..., bN (the
// interfaces to attach XDP to).
func (t *Topology) NodeIfaces() []string {
	names := make([]string, len(t.Links))
	for i, l := range t.Links {
		names[i] = l.Name
	}
	return names
}

// Backend returns backend i (1-based, like its name "b<i>").
func (t *Topology) Backend(i int) *Backend { return t.Backends[i-1] }

// namespaces lists every namespace of the topology that was opened.
func (t *Topology) namespaces() []*NS {
	var out []*NS
	if t.Node != nil {
		out = append(out, t.Node)
	}
	if t.Client != nil {
		out = append(out, t.Client)
	}
	for _, b := range t.Backends {
		out = append(out, b.NS)
	}
	return append(out, t.extra...)
}

// AddNS creates one more namespace of the topology, "pbt<ID>-<role>", with
// only its loopback, for a test that wires its own links (a router, a host
// behind it). Close deletes it with the others.
func (t *Topology) AddNS(role string) (*NS, error) {
	name := nsName(t.ID, role)
	if err := createNetns(name); err != nil {
		return nil, err
	}
	t.created = append(t.created, name)
	ns, err := openNS(name, role)
	if err != nil {
		return nil, err
	}
	t.extra = append(t.extra, ns)
	return ns, nil
}

var topoSeq atomic.Uint64

func newID() string {
	return strconv.FormatInt(int64(os.Getpid()), 36) + "_" + strconv.FormatUint(topoSeq.Add(1), 36)
}

func nsName(id, role string) string { return "pbt" + id + "-" + role }

// New builds a topology for a test and registers Close with tb.Cleanup. It
// skips the test if not running as root or if iproute2 is missing, and
// fails it if the build fails.
func New(tb testing.TB, opts Options) *Topology {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("testnet: needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces; run the tests as root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		tb.Skip("testnet: iproute2 (`ip`) is not installed")
	}
	t, err := Build(opts)
	if err != nil {
		tb.Fatalf("testnet: %v", err)
	}
	tb.Cleanup(func() {
		if err := t.Close(); err != nil {
			tb.Errorf("testnet: close: %v", err)
		}
	})
	return t
}

// Build creates the namespaces, veths, addresses, routes and sysctls of a
// topology. The caller must Close it. Before building, it removes stale
// topologies left behind by dead processes (see CleanupStale).
func Build(opts Options) (*Topology, error) {
	if opts.Backends == 0 {
		opts.Backends = 1
	}
	if opts.Backends < 1 || opts.Backends > MaxBackends {
		return nil, fmt.Errorf("testnet: Backends must be in 1..%d, got %d", MaxBackends, opts.Backends)
	}
	CleanupStale() // best effort

	id := newID()
	names := []string{nsName(id, "node"), nsName(id, "cl")}
	for i := 1; i <= opts.Backends; i++ {
		names = append(names, nsName(id, "b"+strconv.Itoa(i)))
	}
	// Register before creating anything, so a crash mid-build is cleanable.
	if err := writeRegistry(id, names); err != nil {
		return nil, err
	}
	t := &Topology{ID: id, Options: opts}
	if err := t.build(names); err != nil {
		if cerr := t.Close(); cerr != nil {
			err = fmt.Errorf("%w (cleanup: %v)", err, cerr)
		}
		return nil, err
	}
	return t, nil
}

// mac returns the deterministic MAC of link i: 02:00:c6:12:<i>:01 on the
// node side, ...:02 on the peer side (c6:12 = 198.18).
func mac(i, side int) net.HardwareAddr {
	return net.HardwareAddr{0x02, 0x00, 0xc6, 0x12, byte(i), byte(side)}
}

// addr4 is 198.18.<i>.<host>/24, link i's IPv4 address on side host
// (1 = node, 2 = peer).
func addr4(i, host int) netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{198, 18, byte(i), byte(host)}), 24)
}

// addr6 is 2001:2:0:<i>::<host>/64, link i's IPv6 address on side host.
// The fourth group spells i in decimal digits (i = 12 is 2001:2:0:12::),
// so the IPv4 and IPv6 addresses of a link read alike.
func addr6(i, host int) netip.Prefix {
	return netip.PrefixFrom(netip.MustParseAddr(fmt.Sprintf("2001:2:0:%d::%d", i, host)), 64)
}

func (t *Topology) build(names []string) error {
	opts := t.Options
	var created []string
	defer func() { t.created = created }()
	for _, name := range names {
		if err := createNetns(name); err != nil {
			return err
		}
		created = append(created, name)
	}
	var err error
	if t.Node, err = openNS(names[0], "node"); err != nil {
		return err
	}
	if t.Client, err = openNS(names[1], "client"); err != nil {
		return err
	}
	for i := 1; i <= opts.Backends; i++ {
		role := "b" + strconv.Itoa(i)
		ns, err := openNS(names[1+i], role)
		if err != nil {
			return err
		}
		t.Backends = append(t.Backends, newBackend(ns, i))
	}

	peers := []*NS{t.Client}
	for _, b := range t.Backends {
		peers = append(peers, b.NS)
	}
	for i, p := range peers {
		name := "cl0"
		if i > 0 {
			name = "b" + strconv.Itoa(i)
		}
		t.Links = append(t.Links, &Link{
			Name:       name,
			MAC:        mac(i, 1),
			Addr:       addr4(i, 1),
			AddrV6:     addr6(i, 1),
			Peer:       p,
			PeerName:   "eth0",
			PeerMAC:    mac(i, 2),
			PeerAddr:   addr4(i, 2),
			PeerAddrV6: addr6(i, 2),
		})
	}

	// Node: sysctls first, so the interfaces created next inherit "default".
	err = t.Node.Do(func() error {
		if err := linkUp("lo"); err != nil {
			return err
		}
		if err := writeSysctls([][2]string{
			{"net/ipv4/ip_forward", "1"},
			{"net/ipv4/conf/all/forwarding", "1"},
			{"net/ipv4/conf/all/rp_filter", "0"},
			{"net/ipv4/conf/default/rp_filter", "0"},
			{"net/ipv4/conf/all/accept_local", "1"},
			{"net/ipv4/conf/default/accept_local", "1"},
			{"net/ipv4/conf/all/send_redirects", "0"},
			{"net/ipv4/conf/default/send_redirects", "0"},
		}); err != nil {
			return err
		}
		// IPv6: enabled, forwarding (which also makes the node ignore
		// router advertisements, whatever accept_ra says), and no DAD, so
		// the link-local addresses are usable at once like the global ones
		// (added with nodad). all/forwarding also sets default/forwarding.
		if err := writeSysctls([][2]string{
			{"net/ipv6/conf/all/disable_ipv6", "0"},
			{"net/ipv6/conf/default/disable_ipv6", "0"},
			{"net/ipv6/conf/all/forwarding", "1"},
			{"net/ipv6/conf/all/accept_dad", "0"},
			{"net/ipv6/conf/default/accept_dad", "0"},
		}); err != nil {
			return err
		}
		for _, l := range t.Links {
			if err := t.addNodeLink(l); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("testnet: configure %s: %w", t.Node.Name, err)
	}

	for i, l := range t.Links {
		if err := t.configurePeer(i, l); err != nil {
			return fmt.Errorf("testnet: configure %s: %w", l.Peer.Name, err)
		}
	}
	for i, b := range t.Backends {
		b.Link = t.Links[i+1]
		b.Addr = b.Link.PeerAddr.Addr()
		b.AddrV6 = b.Link.PeerAddrV6.Addr()
	}
	// See waitOperUp and probeLinks: a freshly built topology must not eat
	// the first packets of the test.
	if err := t.waitOperUp(readyTimeout); err != nil {
		return err
	}
	return t.probeLinks(readyTimeout)
}

// addNodeLink creates link l, both ends, from the node's namespace (the
// caller's), and configures the node's end.
func (t *Topology) addNodeLink(l *Link) error {
	peerFd, err := unix.Open(l.Peer.Path(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	veth := &netlink.Veth{
		LinkAttrs:        netlink.LinkAttrs{Name: l.Name, HardwareAddr: l.MAC},
		PeerName:         l.PeerName,
		PeerHardwareAddr: l.PeerMAC,
		PeerNamespace:    netlink.NsFd(peerFd),
	}
	err = netlink.LinkAdd(veth)
	unix.Close(peerFd)
	if err != nil {
		return fmt.Errorf("testnet: add veth %s<->%s/%s: %w", l.Name, l.Peer.Name, l.PeerName, err)
	}
	link, err := netlink.LinkByName(l.Name)
	if err != nil {
		return err
	}
	l.Index = link.Attrs().Index
	for _, kv := range [][2]string{
		{"rp_filter", "0"}, {"accept_local", "1"}, {"forwarding", "1"}, {"send_redirects", "0"},
	} {
		if err := writeSysctl("net/ipv4/conf/"+l.Name+"/"+kv[0], kv[1]); err != nil {
			return err
		}
	}
	for _, kv := range [][2]string{
		{"disable_ipv6", "0"}, {"forwarding", "1"}, {"accept_dad", "0"},
	} {
		if err := writeSysctl("net/ipv6/conf/"+l.Name+"/"+kv[0], kv[1]); err != nil {
			return err
		}
	}
	if err := addAddrs(link, l.Addr, l.AddrV6); err != nil {
		return err
	}
	if t.Options.StaticNeighbors {
		if err := addNeighs(link.Attrs().Index, l.PeerMAC, l.PeerAddr.Addr(), l.PeerAddrV6.Addr()); err != nil {
			return err
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return err
	}
	return nil
}

// configurePeer configures the peer's end of link l, the topology's i-th
// (0: the client's).
func (t *Topology) configurePeer(i int, l *Link) error {
	return l.Peer.Do(func() error {
		if err := linkUp("lo"); err != nil {
			return err
		}
		// IPv6: enabled; neither router advertisements (the node sends
		// none, and the routes are static) nor autoconfiguration, so the
		// peer sends no router solicitations either; no DAD (see the
		// node). eth0 exists already (it was created from the node), so
		// it is set explicitly, not only through default.
		if err := writeSysctls([][2]string{
			{"net/ipv4/conf/all/rp_filter", "0"},
			{"net/ipv4/conf/default/rp_filter", "0"},
			{"net/ipv4/conf/eth0/rp_filter", "0"},
			{"net/ipv4/tcp_tw_reuse", "1"},
			{"net/ipv6/conf/all/disable_ipv6", "0"},
			{"net/ipv6/conf/default/disable_ipv6", "0"},
			{"net/ipv6/conf/eth0/disable_ipv6", "0"},
			{"net/ipv6/conf/all/accept_ra", "0"},
			{"net/ipv6/conf/default/accept_ra", "0"},
			{"net/ipv6/conf/eth0/accept_ra", "0"},
			{"net/ipv6/conf/default/autoconf", "0"},
			{"net/ipv6/conf/eth0/autoconf", "0"},
			{"net/ipv6/conf/all/accept_dad", "0"},
			{"net/ipv6/conf/default/accept_dad", "0"},
			{"net/ipv6/conf/eth0/accept_dad", "0"},
		}); err != nil {
			return err
		}
		if i == 0 {
			// The client opens many short connections (load tests).
			if err := writeSysctl("net/ipv4/ip_local_port_range", "1024 65535"); err != nil {
				return err
			}
		}
		link, err := netlink.LinkByName(l.PeerName)
		if err != nil {
			return err
		}
		l.PeerIndex = link.Attrs().Index
		if err := addAddrs(link, l.PeerAddr, l.PeerAddrV6); err != nil {
			return err
		}
		if t.Options.StaticNeighbors {
			if err := addNeighs(link.Attrs().Index, l.MAC, l.Addr.Addr(), l.AddrV6.Addr()); err != nil {
				return err
			}
		}
		if t.Options.TxChecksumOff {
			if err := setFeature(l.PeerName, unix.ETHTOOL_STXCSUM, unix.ETHTOOL_GTXCSUM, false); err != nil {
				return err
			}
		}
		if err := netlink.LinkSetUp(link); err != nil {
			return err
		}
		// GRO must be switched on while the device is up: veth only
		// enables NAPI and marks its peer as an XDP_REDIRECT target
		// (xdp_features NDO_XMIT) in ndo_set_features when IFF_UP is set.
		// Set before "up", GRO reads back as on but redirected frames
		// are still dropped.
		if t.Options.GRO {
			if err := setFeature(l.PeerName, unix.ETHTOOL_SGRO, unix.ETHTOOL_GGRO, true); err != nil {
				return err
			}
		}
		for _, gw := range []netip.Addr{l.Addr.Addr(), l.AddrV6.Addr()} {
			if err := netlink.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Gw: gw.AsSlice()}); err != nil {
				return fmt.Errorf("testnet: default route via %s: %w", gw, err)
			}
		}
		return nil
	})
}

// RecreateLink deletes link i (0: the client's, i: backend i's) and
// creates it again as Build did, under the same names and addresses: a
// new interface for the same name, with another ifindex (Link.Index is
// the new one). It returns once the link carries traffic again.
func (t *Topology) RecreateLink(i int) error {
	l := t.Links[i]
	err := t.Node.Do(func() error {
		old, err := netlink.LinkByName(l.Name)
		if err != nil {
			return err
		}
		// Deleting one end of a veth deletes the other.
		if err := netlink.LinkDel(old); err != nil {
			return err
		}
		return t.addNodeLink(l)
	})
	if err != nil {
		return fmt.Errorf("testnet: recreate %s: %w", l.Name, err)
	}
	if err := t.configurePeer(i, l); err != nil {
		return fmt.Errorf("testnet: recreate %s: configure %s: %w", l.Name, l.Peer.Name, err)
	}
	if err := t.waitOperUp(readyTimeout); err != nil {
		return err
	}
	return t.probeLinks(readyTimeout)
}

// readyTimeout bounds each of the two readiness waits of Build.
const readyTimeout = 5 * time.Second

// waitOperUp waits until every veth end is operationally up. The end that
// is set up first has no carrier at that moment (its peer is still down),
// so the kernel defers activating its queueing discipline — until then it
// silently drops what it should send — to the linkwatch worker, which also
// sets the operstate. Measured on the 6.18 test VM: building with no wait
// at all, the node's first ARP request was lost in ~3% of fresh topologies
// (a 1 s ARP retransmit, or a failed first connection in the test); with
// this wait, in none of 750 — although it practically never sees an end
// that is not up yet: the few milliseconds it takes are what the worker
// needs. probeLinks is the actual guarantee.
func (t *Topology) waitOperUp(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	type end struct {
		ns   *NS
		name string
	}
	var pending []end
	for _, l := range t.Links {
		pending = append(pending, end{t.Node, l.Name}, end{l.Peer, l.PeerName})
	}
	for {
		var still []end
		for _, e := range pending {
			var up bool
			err := e.ns.Do(func() error {
				l, err := netlink.LinkByName(e.name)
				if err != nil {
					return err
				}
				up = l.Attrs().OperState == netlink.OperUp
				return nil
			})
			if err != nil {
				return err
			}
			if !up {
				still = append(still, e)
			}
		}
		if len(still) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("testnet: %s/%s not operationally up after %v", still[0].ns.Name, still[0].name, timeout)
		}
		pending = still
		time.Sleep(10 * time.Millisecond)
	}
}

// probeLinks proves that every link carries traffic both ways, over IPv4
// and over IPv6, before Build returns: from the node, a TCP connect to each
// peer's port 9 at its IPv4 and at its IPv6 address (nothing listens there
// in a fresh namespace) must be answered — normally by a RST. It is the
// end-to-end guarantee behind waitOperUp (which normally makes the first
// probe succeed). The probes also leave resolved ARP and NDP entries behind
// on both ends of every link. All probes share one deadline, timeout from
// now.
func (t *Topology) probeLinks(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	d := t.Node.Dialer(100 * time.Millisecond)
	for _, l := range t.Links {
		for _, peer := range []netip.Addr{l.PeerAddr.Addr(), l.PeerAddrV6.Addr()} {
			target := netip.AddrPortFrom(peer, 9).String()
			for attempt := 1; ; attempt++ {
				c, err := d.DialContext(context.Background(), "tcp", target)
				if err == nil {
					c.Close()
					break
				}
				if errors.Is(err, unix.ECONNREFUSED) {
					break
				}
				if time.Now().After(deadline) {
					return fmt.Errorf("testnet: link %s <-> %s/%s carries no traffic to %s after %d probes: %w",
						l.Name, l.Peer.Name, l.PeerName, peer, attempt, err)
				}
				if Classify(err) != ConnectTimeout {
					time.Sleep(10 * time.Millisecond)
				}
			}
		}
	}
	return nil
}

func linkUp(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return err
	}
	return netlink.LinkSetUp(l)
}

// addAddrs assigns addresses to link (in the calling thread's namespace).
// IPv6 addresses are added with nodad: no duplicate address detection, so
// they are usable at once instead of tentative for a second or more.
func addAddrs(link netlink.Link, addrs ...netip.Prefix) error {
	for _, p := range addrs {
		a := &netlink.Addr{IPNet: prefixToIPNet(p)}
		if p.Addr().Is6() {
			a.Flags = unix.IFA_F_NODAD
		}
		if err := netlink.AddrAdd(link, a); err != nil {
			return fmt.Errorf("testnet: add %s to %s: %w", p, link.Attrs().Name, err)
		}
	}
	return nil
}

// addNeighs installs a permanent neighbour entry (ARP for IPv4, NDP for
// IPv6) for each of ips, all at hw, on ifindex.
func addNeighs(ifindex int, hw net.HardwareAddr, ips ...netip.Addr) error {
	for _, ip := range ips {
		if err := addNeigh(ifindex, ip, hw); err != nil {
			return err
		}
	}
	return nil
}

func addNeigh(ifindex int, ip netip.Addr, hw net.HardwareAddr) error {
	family := unix.AF_INET
	if ip.Is6() {
		family = unix.AF_INET6
	}
	err := netlink.NeighSet(&netlink.Neigh{
		LinkIndex:    ifindex,
		Family:       family,
		State:        netlink.NUD_PERMANENT,
		IP:           ip.AsSlice(),
		HardwareAddr: hw,
	})
	if err != nil {
		return fmt.Errorf("testnet: neighbour %s -> %s: %w", ip, hw, err)
	}
	return nil
}

func prefixToIPNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// Close stops the backends, closes every socket and thread this package
// holds in the namespaces, and deletes the namespaces (the veths go with
// them). It is idempotent and safe to call on a partly built topology.
// Sockets that callers created in the namespaces (listeners, connections)
// keep a namespace alive, anonymously, until they are closed.
func (t *Topology) Close() error {
	t.closeOnce.Do(func() {
		var errs []error
		for _, b := range t.Backends {
			if err := b.Close(); err != nil {
				errs = append(errs, err)
			}
		}
		for _, ns := range t.namespaces() {
			ns.close()
		}
		for _, name := range t.created {
			if err := deleteNetns(name); err != nil {
				errs = append(errs, err)
			}
		}
		if err := removeRegistry(t.ID); err != nil {
			errs = append(errs, err)
		}
		t.closeErr = errors.Join(errs...)
	})
	return t.closeErr
}
