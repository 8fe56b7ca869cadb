// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/replay"
)

// sockNet is a network namespace of the test's own (the test's thread
// joins it for the rest of the test) with one veth pair, and a packet
// socket that sees what leaves through its first end. The backends'
// prefixes (198.18.2.0/24, 2001:2:0:2::/64) are routed there only for the
// fixture's clients (198.18.0.2, 2001:2::2): by a policy rule on the
// source, in a table of their own, as CNIs route each pod's traffic out of
// its own interface; the main table has no route to them. Every address
// there is a static neighbour, so nothing waits for ARP or neighbour
// discovery. A replay sent through a raw socket opened here can go nowhere
// but that veth: the host's network is never touched.
type sockNet struct {
	t   *testing.T
	cap int    // the packet socket
	idx uint32 // the veth end's ifindex
}

const sockNetTable = 100

func newSockNet(t *testing.T) *sockNet {
	t.Helper()
	h := testnet.OwnNetns(t, false)
	v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pbt-replay0"}, PeerName: "pbt-replay1"}
	if err := h.LinkAdd(v); err != nil {
		t.Fatal(err)
	}
	peer, err := h.LinkByName("pbt-replay1")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range []netlink.Link{v, peer} {
		if err := h.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
	// Until then the replay's packet could be dropped unseen (the first
	// case once failed so in the 6.1 VM).
	if err := testnet.WaitOperUp(h, 5*time.Second, "pbt-replay0", "pbt-replay1"); err != nil {
		t.Fatal(err)
	}
	idx := v.Attrs().Index
	// The program's own forwarding (bpf_fib_lookup) needs the
	// namespace to forward, and the replay's ingress (ifindex 1, lo) up.
	lo, err := h.LinkByIndex(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"ipv4/conf/all/forwarding", "ipv6/conf/all/forwarding"} {
		// /proc/sys/net is the namespace of the thread that opens it:
		// this one's.
		if err := os.WriteFile("/proc/sys/net/"+k, []byte("1"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range []struct{ own, prefix, client, neighbour string }{
		{"198.18.2.1/32", "198.18.2.0/24", "198.18.0.2/32", "198.18.2.2"},
		{"2001:2:0:2::1/128", "2001:2:0:2::/64", "2001:2::2/128", "2001:2:0:2::2"},
	} {
		// The node's own address on the link, with no prefix route.
		a, err := netlink.ParseAddr(n.own)
		if err != nil {
			t.Fatal(err)
		}
		if a.IP.To4() == nil {
			a.Flags = unix.IFA_F_NODAD // usable at once
		}
		if err := h.AddrAdd(v, a); err != nil {
			t.Fatal(err)
		}
		_, dst, _ := net.ParseCIDR(n.prefix)
		if err := h.RouteAdd(&netlink.Route{LinkIndex: idx, Dst: dst, Table: sockNetTable, Scope: netlink.SCOPE_LINK}); err != nil {
			t.Fatal(err)
		}
		_, src, _ := net.ParseCIDR(n.client)
		r := netlink.NewRule()
		r.Src, r.Table, r.Family = src, sockNetTable, netlink.FAMILY_V4
		if src.IP.To4() == nil {
			r.Family = netlink.FAMILY_V6
		}
		if err := h.RuleAdd(r); err != nil {
			t.Fatal(err)
		}
		nb := &netlink.Neigh{LinkIndex: idx, IP: net.ParseIP(n.neighbour), State: netlink.NUD_PERMANENT,
			HardwareAddr: net.HardwareAddr{0x02, 0, 0, 0, 0, 2}}
		if err := h.NeighSet(nb); err != nil {
			t.Fatal(err)
		}
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: idx}); err != nil {
		t.Fatal(err)
	}
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 2}); err != nil {
		t.Fatal(err)
	}
	return &sockNet{t: t, cap: fd, idx: uint32(idx)}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// tcpTo returns the first TCP packet to dst that leaves the interface (the
// interface's own traffic, IPv6's neighbour and router messages, is passed
// over), failing the test if none does within a few seconds.
func (n *sockNet) tcpTo(dst netip.AddrPort) (bpftest.Parsed, []byte) {
	n.t.Helper()
	buf := make([]byte, 2048)
	for range 64 {
		sz, _, err := unix.Recvfrom(n.cap, buf, 0)
		if err != nil {
			n.t.Fatalf("no packet to %v left the interface: %v", dst, err)
		}
		p, err := bpftest.Parse(buf[:sz])
		if err == nil && p.Proto == 6 && p.Dst == dst {
			return p, buf[:sz]
		}
	}
	n.t.Fatalf("no packet to %v among the first 64 to leave the interface", dst)
	return bpftest.Parsed{}, nil
}

// tcpSeqFlags reads a captured TCP packet's sequence number and flags
// (IPv4 without options or IPv6 without extension headers, as replays are).
func tcpSeqFlags(frame []byte) (seq uint32, flags byte) {
	l4 := 14 + 20
	if binary.BigEndian.Uint16(frame[12:14]) == unix.ETH_P_IPV6 {
		l4 = 14 + 40
	}
	return binary.BigEndian.Uint32(frame[l4+4:]), frame[l4+13]
}

// Where the kernel refuses the live-frame mode the agent sends its
// replays through a raw socket: the datapath runs on the rebuilt SYN in
// the ordinary mode, moves the flow, and the packet it returns leaves on
// the route the client's own packets take (here one that only a rule on
// the client's source address finds), DNATed to the other backend, one hop
// older (the forward the live frame would have taken: the socket takes it
// off a passed frame, the program itself off one it redirects), the
// client's address and sequence number kept. The flow is then the
// retry's, as after a live replay.
func TestReplayThroughARawSocket(t *testing.T) {
	type replayCase struct {
		name                 string
		v6, redirect         bool
		client, vip, be, new netip.AddrPort
	}
	var cases []replayCase
	for _, redirect := range []bool{false, true} {
		suffix := ", passed"
		if redirect {
			suffix = ", redirected"
		}
		cases = append(cases, replayCase{"IPv4" + suffix, false, redirect, client, vip, be1, be2},
			replayCase{"IPv6" + suffix, true, redirect, client6, vip6, be6a, be6b})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var f *fixture
			if tc.v6 {
				f = fixture6(t, 6)
				f.svc6(6, 0, maps.ServiceRetryRefused)
			} else {
				f = newFixture(t)
				f.svc.Flags = maps.ServiceRetryRefused
				f.table(id1)
			}
			n := newSockNet(t)
			if tc.redirect {
				// Forwarded by the program (bpf_fib_lookup, which finds
				// the route by the client's source too, and the devmap).
				c, err := f.Maps.Config()
				f.must(err)
				c.Redirect = true
				f.must(f.Maps.SetConfig(c))
				f.must(f.Maps.SetRedirect([]uint32{n.idx}))
			}
			sock, err := replay.OpenSocket()
			f.must(err)
			t.Cleanup(func() { sock.Close() })
			r := replay.New(func() (*ebpf.Program, error) { return f.PbXdp, nil }, f.Maps).SendThrough(sock)

			const isn = 0x12345678
			syn := bpftest.LinuxSYN(tc.client, tc.vip, isn)
			f.run(syn)
			if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.Refusal(tc.be, tc.client, isn)); ret != bpftest.XDPDrop {
				t.Fatalf("refusal verdict %d, want it kept from the client", ret)
			}
			// Every slot on the other backend now: the replay goes there.
			if tc.v6 {
				tbl := make([]uint32, size6)
				for i := range tbl {
					tbl[i] = id6b
				}
				f.must(f.Maps.FillTable(svc6, 0, tbl))
			} else {
				f.table(id2)
			}
			if err := r.Replay(tc.client, tc.vip, tc.be); err != nil {
				t.Fatalf("replay through the raw socket: %v", err)
			}
			p, frame := n.tcpTo(tc.new)
			seq, flags := tcpSeqFlags(frame)
			if p.Src != tc.client || seq != isn || flags != 0x02 || p.TTL != 63 {
				t.Errorf("replay left as %v -> %v seq %#x flags %#x TTL %d, want %v -> %v seq %#x, a bare SYN, TTL 63 (the client's 64, forwarded once)",
					p.Src, p.Dst, seq, flags, p.TTL, tc.client, tc.new, uint32(isn))
			}
			gs, err := f.Maps.GlobalStats()
			f.must(err)
			if redirected := gs.Redirected != 0; redirected != tc.redirect {
				t.Errorf("the program redirected %d frames, want the replay redirected: %v", gs.Redirected, tc.redirect)
			}
			fwd, err := f.Maps.CTEntry(maps.RequestKey(tc.client, tc.vip))
			f.must(err)
			if fwd.Flags&maps.CTRetry == 0 || fwd.NatAddr.Bytes != maps.Addr16(tc.new.Addr()) {
				t.Errorf("flow after the replay: flags %#x to %v, want the retry's, to %v", fwd.Flags, net.IP(fwd.NatAddr.Bytes[:]), tc.new)
			}
		})
	}
}

// A replay the datapath drops sends nothing through the socket either
// (here any send would fail: the namespace has no route to the backends),
// and the replayer says it went nowhere. One the datapath moves but the
// socket cannot send says where the flow went (replay.NotSentError), for
// the agent to take nothing that flow does as evidence.
func TestReplayThroughARawSocketTheDatapathDrops(t *testing.T) {
	f := newFixture(t)
	f.svc.Flags = maps.ServiceRetryRefused
	f.table(id1)
	testnet.OwnNetns(t, false)
	sock, err := replay.OpenSocket()
	f.must(err)
	t.Cleanup(func() { sock.Close() })
	r := replay.New(func() (*ebpf.Program, error) { return f.PbXdp, nil }, f.Maps).SendThrough(sock)
	f.runMeta(nil, bpftest.LinuxSYN(client, vip, 42))
	f.svc.BackendCount = 1
	f.writeService()
	if err := r.ReplayUnanswered(client, vip, be1, id1); !errors.Is(err, replay.ErrDropped) {
		t.Fatalf("replay with nowhere to move the flow: %v, want ErrDropped", err)
	}

	// A rescued refusal (another client port), moved to the other backend.
	f.svc.BackendCount = 2
	f.writeService()
	client2 := netip.AddrPortFrom(client.Addr(), client.Port()+1)
	f.runMeta(nil, bpftest.LinuxSYN(client2, vip, 5000))
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.Refusal(be1, client2, 5000)); ret != bpftest.XDPDrop {
		t.Fatalf("refusal verdict %d, want it kept from the client", ret)
	}
	f.table(id2)
	var ns *replay.NotSentError
	if err := r.Replay(client2, vip, be1); !errors.As(err, &ns) || ns.Backend != id2 || !errors.Is(err, unix.ENETUNREACH) {
		t.Fatalf("replay moved to backend %d with no route there: %v, want a NotSentError naming it (ENETUNREACH)", id2, err)
	}
}
