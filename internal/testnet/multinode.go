package testnet

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// PodNetwork is how a Fleet's pods on different nodes reach each other.
type PodNetwork string

const (
	// Routed: plain IP between nodes, a route per node's pod subnet via
	// that node's address (flannel host-gw, Calico BGP without
	// encapsulation, cloud VPC CNIs).
	Routed PodNetwork = "routed"
	// VXLAN: flannel's vxlan backend: a flannel.1 device per node with the
	// other nodes' VTEPs in its FDB and neighbour table, routes onlink via
	// the remote subnet's .0 address, pods at MTU 1450.
	VXLAN PodNetwork = "vxlan"
	// IPIP: Calico's IPIPMode Always: every node's tunl0 (the ipip
	// module's per-namespace device) up with the first address of its pod
	// subnet, routes to the other nodes' subnets via their underlay
	// addresses through tunl0, onlink; pods at MTU 1480. Needs the ipip
	// module (this machine's own kernel has none: the kernel matrix's
	// have).
	IPIP PodNetwork = "ipip"
)

// IPIPTunnel is the IPIP device on every node (IPIP only).
const IPIPTunnel = "tunl0"

// FleetOptions configures NewFleet.
type FleetOptions struct {
	Nodes       int // 2..5
	PodsPerNode int // 1..9
	Network     PodNetwork
}

// Fleet is several nodes on one L2 underlay, each with pods on a bridge,
// as a cluster's CNI wires them:
//
//	fabric: bridge fab0 198.18.250.254/24 (the API server's address)
//	node i: eth0 198.18.250.i/24 (on fab0), bridge cbr0 198.18.(250+i).1/24,
//	        host-side pod veths veth<j> on cbr0
//	pod j of node i: eth0 198.18.(250+i).(1+j)/24, default via .1
//
// plus, per Network, the routes (or VXLAN tunnel) between nodes' pod
// subnets. Every namespace is registered for CleanupStale.
type Fleet struct {
	ID      string
	Network PodNetwork
	Fabric  *NS
	Nodes   []*FleetNode

	created   []string
	closeOnce sync.Once
	closeErr  error
}

// FleetNode is one node of a Fleet.
type FleetNode struct {
	*NS
	Index   int          // 1-based
	Addr    netip.Addr   // on the underlay
	PodCIDR netip.Prefix // its pods' subnet
	// Pods are the node's pod namespaces, as backends with servers on
	// demand (Backend.ServeHTTP etc.); any of them can be a client too.
	Pods []*Backend
}

// FabricAddr is the underlay address of the fabric namespace.
var FabricAddr = netip.MustParseAddr("198.18.250.254")

// Tunnel is the overlay device's name on every node (VXLAN only).
const Tunnel = "flannel.1"

// NewFleet builds a fleet for a test and deletes it at the test's end.
func NewFleet(tb testing.TB, o FleetOptions) *Fleet {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("testnet: needs root to create network namespaces; run the tests as root")
	}
	for _, tool := range []string{"ip", "bridge"} {
		if _, err := exec.LookPath(tool); err != nil {
			tb.Skipf("testnet: %s (iproute2) is not installed", tool)
		}
	}
	f, err := BuildFleet(o)
	if err != nil {
		tb.Fatalf("testnet: fleet: %v", err)
	}
	tb.Cleanup(func() {
		if err := f.Close(); err != nil {
			tb.Errorf("testnet: fleet close: %v", err)
		}
	})
	return f
}

// BuildFleet creates a fleet; the caller must Close it.
func BuildFleet(o FleetOptions) (*Fleet, error) {
	if o.Nodes < 2 || o.Nodes > 5 || o.PodsPerNode < 1 || o.PodsPerNode > 9 {
		return nil, fmt.Errorf("nodes must be 2..5 and pods per node 1..9, got %d and %d", o.Nodes, o.PodsPerNode)
	}
	if o.Network != Routed && o.Network != VXLAN && o.Network != IPIP {
		return nil, fmt.Errorf("pod network %q: want %q, %q or %q", o.Network, Routed, VXLAN, IPIP)
	}
	CleanupStale()
	id := newID()
	names := []string{nsName(id, "fab")}
	for i := 1; i <= o.Nodes; i++ {
		names = append(names, nsName(id, fmt.Sprintf("n%d", i)))
		for j := 1; j <= o.PodsPerNode; j++ {
			names = append(names, nsName(id, fmt.Sprintf("n%dp%d", i, j)))
		}
	}
	if err := writeRegistry(id, names); err != nil {
		return nil, err
	}
	f := &Fleet{ID: id, Network: o.Network}
	if err := f.build(o, names); err != nil {
		if cerr := f.Close(); cerr != nil {
			err = fmt.Errorf("%w (cleanup: %v)", err, cerr)
		}
		return nil, err
	}
	return f, nil
}

// ipc runs `ip` with args and reports its output on failure.
func ipc(args ...string) error {
	_, err := runCmd(exec.Command("ip", args...), nil)
	return err
}

func (f *Fleet) open(name, role string) (*NS, error) {
	if err := createNetns(name); err != nil {
		return nil, err
	}
	f.created = append(f.created, name)
	return openNS(name, role)
}

func podCIDR(i int) netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{198, 18, byte(250 + i), 0}), 24)
}

func (f *Fleet) build(o FleetOptions, names []string) error {
	var err error
	if f.Fabric, err = f.open(names[0], "fabric"); err != nil {
		return err
	}
	fab := f.Fabric.Name
	mtu := "1500"
	switch o.Network {
	case VXLAN:
		mtu = "1450" // room for the 50 bytes of VXLAN over IPv4
	case IPIP:
		mtu = "1480" // room for the outer IPv4 header
	}
	for _, c := range [][]string{
		{"-n", fab, "link", "set", "lo", "up"},
		{"-n", fab, "link", "add", "fab0", "type", "bridge"},
		{"-n", fab, "addr", "add", FabricAddr.String() + "/24", "dev", "fab0"},
		{"-n", fab, "link", "set", "fab0", "up"},
	} {
		if err := ipc(c...); err != nil {
			return err
		}
	}
	k := 1
	for i := 1; i <= o.Nodes; i++ {
		ns, err := f.open(names[k], fmt.Sprintf("n%d", i))
		if err != nil {
			return err
		}
		k++
		n := &FleetNode{NS: ns, Index: i, Addr: netip.AddrFrom4([4]byte{198, 18, 250, byte(i)}), PodCIDR: podCIDR(i)}
		f.Nodes = append(f.Nodes, n)
		gw := n.PodCIDR.Addr().Next()
		// Sysctls first: the interfaces created next inherit "default"
		// (a new namespace copies the host's, rp_filter=2 on some
		// distributions, and the stricter of "all" and the interface's
		// applies).
		if err := ns.Do(func() error {
			if err := writeSysctls([][2]string{
				{"net/ipv4/ip_forward", "1"},
				{"net/ipv4/conf/all/rp_filter", "0"},
				{"net/ipv4/conf/default/rp_filter", "0"},
			}); err != nil {
				return err
			}
			return nil
		}); err != nil {
			return err
		}
		for _, c := range [][]string{
			{"-n", ns.Name, "link", "set", "lo", "up"},
			{"-n", ns.Name, "link", "add", "eth0", "type", "veth", "peer", "name", fmt.Sprintf("n%d", i), "netns", fab},
			{"-n", fab, "link", "set", fmt.Sprintf("n%d", i), "master", "fab0", "up"},
			{"-n", ns.Name, "addr", "add", n.Addr.String() + "/24", "dev", "eth0"},
			{"-n", ns.Name, "link", "set", "eth0", "up"},
			{"-n", ns.Name, "link", "add", "cbr0", "type", "bridge"},
			{"-n", ns.Name, "addr", "add", gw.String() + "/24", "dev", "cbr0"},
			{"-n", ns.Name, "link", "set", "cbr0", "mtu", mtu, "up"},
		} {
			if err := ipc(c...); err != nil {
				return err
			}
		}
		// A NIC hands the stack complete checksums; a veth passes the
		// sender's unfinished ones on, even through a tunnel. Off here, the
		// node's uplink finishes them as hardware would.
		if err := ns.Do(func() error {
			return setFeature("eth0", unix.ETHTOOL_STXCSUM, unix.ETHTOOL_GTXCSUM, false)
		}); err != nil {
			return err
		}
		for j := 1; j <= o.PodsPerNode; j++ {
			pns, err := f.open(names[k], fmt.Sprintf("n%dp%d", i, j))
			if err != nil {
				return err
			}
			k++
			// Owned by n.Pods from here, so Close closes it on any error.
			n.Pods = append(n.Pods, newBackend(pns, j))
			addr := netip.AddrFrom4([4]byte{198, 18, byte(250 + i), byte(1 + j)})
			host := "veth" + strconv.Itoa(j)
			for _, c := range [][]string{
				{"-n", pns.Name, "link", "set", "lo", "up"},
				{"-n", ns.Name, "link", "add", host, "mtu", mtu, "type", "veth", "peer", "name", "eth0", "mtu", mtu, "netns", pns.Name},
				{"-n", ns.Name, "link", "set", host, "master", "cbr0", "up"},
				{"-n", pns.Name, "addr", "add", addr.String() + "/24", "dev", "eth0"},
				{"-n", pns.Name, "link", "set", "eth0", "up"},
				{"-n", pns.Name, "route", "add", "default", "via", gw.String()},
			} {
				if err := ipc(c...); err != nil {
					return err
				}
			}
		}
	}
	return f.connect()
}

// vtepMAC is node i's VXLAN device MAC (flannel gives each a fixed one).
func vtepMAC(i int) string { return fmt.Sprintf("02:00:c6:fa:%02x:01", i) }

// connect wires the nodes' pod subnets together over the pod network.
func (f *Fleet) connect() error {
	for _, n := range f.Nodes {
		if f.Network == IPIP {
			// tunl0 exists in every namespace once the ipip module is
			// loaded; `ip` loads it on first use of an ipip link.
			if _, err := os.Stat("/sys/module/ipip"); err != nil {
				if err := ipc("-n", n.Name, "link", "add", "pbprobe0", "type", "ipip"); err != nil {
					return fmt.Errorf("IPIP pod network: the kernel has no ipip module: %w", err)
				}
				if err := ipc("-n", n.Name, "link", "del", "pbprobe0"); err != nil {
					return err
				}
			}
			for _, c := range [][]string{
				{"-n", n.Name, "addr", "add", n.PodCIDR.Addr().String() + "/32", "dev", IPIPTunnel},
				{"-n", n.Name, "link", "set", IPIPTunnel, "mtu", "1480", "up"},
			} {
				if err := ipc(c...); err != nil {
					return err
				}
			}
		}
		if f.Network == VXLAN {
			for _, c := range [][]string{
				{"-n", n.Name, "link", "add", Tunnel, "address", vtepMAC(n.Index), "type", "vxlan", "id", "1",
					"local", n.Addr.String(), "dev", "eth0", "dstport", "8472", "nolearning"},
				{"-n", n.Name, "addr", "add", n.PodCIDR.Addr().String() + "/32", "dev", Tunnel},
				{"-n", n.Name, "link", "set", Tunnel, "up"},
			} {
				if err := ipc(c...); err != nil {
					return err
				}
			}
		}
		for _, m := range f.Nodes {
			if m == n {
				continue
			}
			var cmds [][]string
			switch f.Network {
			case Routed:
				cmds = [][]string{{"-n", n.Name, "route", "add", m.PodCIDR.String(), "via", m.Addr.String(), "dev", "eth0"}}
			case IPIP:
				cmds = [][]string{{"-n", n.Name, "route", "add", m.PodCIDR.String(), "via", m.Addr.String(), "dev", IPIPTunnel, "onlink"}}
			default:
				remote := m.PodCIDR.Addr().String()
				cmds = [][]string{
					{"-n", n.Name, "neigh", "add", remote, "lladdr", vtepMAC(m.Index), "dev", Tunnel, "nud", "permanent"},
					{"-n", n.Name, "route", "add", m.PodCIDR.String(), "via", remote, "dev", Tunnel, "onlink"},
				}
			}
			for _, c := range cmds {
				if err := ipc(c...); err != nil {
					return err
				}
			}
			if f.Network == VXLAN {
				if _, err := runCmd(exec.Command("bridge", "-n", n.Name, "fdb", "append", vtepMAC(m.Index), "dev", Tunnel,
					"dst", m.Addr.String()), nil); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// Node returns node i (1-based).
func (f *Fleet) Node(i int) *FleetNode { return f.Nodes[i-1] }

// Close stops the pods' servers and deletes every namespace.
func (f *Fleet) Close() error {
	f.closeOnce.Do(func() {
		var errs []error
		for _, n := range f.Nodes {
			for _, p := range n.Pods {
				if err := p.Close(); err != nil {
					errs = append(errs, err)
				}
			}
			n.close()
		}
		if f.Fabric != nil {
			f.Fabric.close()
		}
		for _, name := range f.created {
			if err := deleteNetns(name); err != nil {
				errs = append(errs, err)
			}
		}
		if err := removeRegistry(f.ID); err != nil {
			errs = append(errs, err)
		}
		f.closeErr = errors.Join(errs...)
	})
	return f.closeErr
}
