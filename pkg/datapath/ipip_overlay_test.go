// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// ipipOverlay is a three-node fleet on Calico's IPIP pod network with the
// datapath on node 1, as the agent sets it up there: on the node's
// uplink (eth0, where replies from the other nodes' pods arrive inside
// IPIP) and on its client pod's veth; tunl0 known, not attached. The
// service's backends are the first pods of nodes 2 and 3.
type ipipOverlay struct {
	*fixture
	fleet        *testnet.Fleet
	client       *testnet.Backend
	be2, be3     *testnet.Backend
	addr2, addr3 netip.AddrPort
}

const (
	idNode2 = 21
	idNode3 = 22
)

func newIPIPOverlay(t *testing.T) *ipipOverlay {
	bpftest.RequireRoot(t)
	fl, err := testnet.BuildFleet(testnet.FleetOptions{Nodes: 3, PodsPerNode: 2, Network: testnet.IPIP})
	if err != nil && strings.Contains(err.Error(), "no ipip module") {
		t.Skipf("%v: this kernel cannot carry IPIP (CONFIG_NET_IPIP); make kernel-matrix runs this test on 6.1 and 6.12", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := fl.Close(); err != nil {
			t.Error(err)
		}
	})
	o := &ipipOverlay{fixture: newFixture(t), fleet: fl, client: fl.Node(1).Pods[0],
		be2: fl.Node(2).Pods[0], be3: fl.Node(3).Pods[0]}
	o.addr2 = netip.AddrPortFrom(netip.MustParseAddr("198.18.252.2"), 8080)
	o.addr3 = netip.AddrPortFrom(netip.MustParseAddr("198.18.253.2"), 8080)
	for _, b := range []*testnet.Backend{o.be2, o.be3} {
		if err := b.ServeHTTP(8080); err != nil {
			t.Fatal(err)
		}
	}
	f := o.fixture
	f.svc.BackendCount = 2
	overlayService(t, f.Loaded, map[uint32]netip.AddrPort{idNode2: o.addr2, idNode3: o.addr3})
	f.svc.Table, f.svc.TableSize = 0, size
	t.Cleanup(func() {
		f.must(f.Maps.SetServiceBackends(svcID, []uint32{idNode2, idNode3}, nil))
		f.Maps.SetServiceTrip(svcID, maps.TripSettings{}, 0)
	})
	attachOverlay(t, f.Loaded, fl.Node(1), "veth1")
	f.events()
	return o
}

// overlayService programs the service (vip, port 80) over backends, its
// table alternating them, with the reverse-path check on, into l.
func overlayService(t *testing.T, l *bpftest.Loaded, backends map[uint32]netip.AddrPort) {
	t.Helper()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	var ids []uint32
	for id, a := range backends {
		must(l.Maps.SetBackend(id, maps.NewBackend(a, svcID, maps.BackendActive, 0)))
		ids = append(ids, id)
	}
	slices.Sort(ids)
	must(l.Maps.SetPorts(nil, map[uint16]uint8{80: maps.PortVIP, 8080: maps.PortBackend}))
	must(l.Maps.SetVIPSlots(nil, map[uint32]bool{maps.VIPSlot(vip.Addr()): true}))
	must(l.Maps.InstallTables([]maps.TableInstall{{SvcID: svcID, N: 0, Size: size}}))
	must(l.Maps.SetServiceBackends(svcID, nil, ids))
	slots := make([]uint32, size)
	for i := range slots {
		slots[i] = ids[i%len(ids)]
	}
	must(l.Maps.FillTable(svcID, 0, slots))
	must(l.Maps.UpsertService(maps.ServiceKey(vip.Addr(), vip.Port(), 6),
		bpf.LbSvcValue{Id: svcID, Table: 0, TableSize: size, BackendCount: uint32(len(ids))}))
	must(l.Maps.SetConfig(maps.Config{ReversePath: true}))
	t.Cleanup(func() { must(l.Maps.SetConfig(maps.Config{})) })
}

// attachOverlay sets l up on node as the agent does: XDP on the node's
// uplink and on the client pod's veth, pb_ifaces saying which is which,
// tunl0 known, not attached.
func attachOverlay(t *testing.T, l *bpftest.Loaded, node *testnet.FleetNode, clientVeth string) {
	t.Helper()
	var ifs []maps.Iface
	err := node.Do(func() error {
		idx := map[string]int{}
		for _, name := range []string{"eth0", clientVeth, "cbr0", testnet.IPIPTunnel} {
			i, err := net.InterfaceByName(name)
			if err != nil {
				return err
			}
			idx[name] = i.Index
		}
		for _, name := range []string{"eth0", clientVeth} {
			xl, err := link.AttachXDP(link.XDPOptions{Program: l.PbXdp, Interface: idx[name], Flags: link.XDPGenericMode})
			if err != nil {
				return fmt.Errorf("attach to %s: %w", name, err)
			}
			t.Cleanup(func() { xl.Close() })
		}
		ifs = []maps.Iface{
			{Index: uint32(idx["eth0"]), Decap: true},
			{Index: uint32(idx[clientVeth]), Partial: true, Master: uint32(idx["cbr0"])},
			{Index: uint32(idx[testnet.IPIPTunnel]), IPIP: true},
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Maps.SetIfaces(ifs); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Maps.SetIfaces(nil) })
}

// get opens a connection from the client pod to the VIP, sends one
// request and returns the backend's name; the connection is closed after.
func (o *ipipOverlay) get(ctx context.Context) (string, error) {
	c, err := o.client.Dialer(2*time.Second).DialContext(ctx, "tcp", vip.String())
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\n\r\n"); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	if err != nil {
		return "", err
	}
	s := string(b)
	return strings.TrimSpace(s[strings.LastIndex(s, "\r\n\r\n")+4:]), nil
}

// gets runs n connections and counts them by backend (errors by class).
func (o *ipipOverlay) gets(t *testing.T, n int) map[string]int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	got := map[string]int{}
	for range n {
		name, err := o.get(ctx)
		switch {
		case errors.Is(err, syscall.ECONNREFUSED):
			got["refused"]++
		case err != nil:
			got["error: "+err.Error()]++
		default:
			got[name]++
		}
	}
	return got
}

// Calico's IPIP pod network, on the kernels that have it: a pod's
// connections to a ClusterIP reach backend pods on two other nodes, their
// replies rewritten inside the tunnel's packets on the node's uplink; the
// evidence of a backend arriving through the tunnel counts only from the
// node the route through tunl0 names; the breaker's slots come back with
// the tunnelled FINs; a probation backend gets its probe; a refusing
// backend is ejected by the kernel.
func TestIPIPOverlay(t *testing.T) {
	o := newIPIPOverlay(t)
	f := o.fixture
	n2, n3 := o.be2.Name, o.be3.Name

	got := o.gets(t, 30)
	if got[n2] == 0 || got[n3] == 0 || got[n2]+got[n3] != 30 {
		t.Fatalf("30 connections through IPIP: %v, want all answered, by both backends", got)
	}
	if evs := f.events(); !hasEvent(evs, evEstablished, idNode2) || !hasEvent(evs, evEstablished, idNode3) {
		t.Fatalf("events %+v: no handshake seen through the tunnel", evs)
	}

	t.Run("a tunnelled reply from a node the route does not name decides nothing", func(t *testing.T) {
		c, err := o.client.Dialer(2*time.Second).DialContext(context.Background(), "tcp", vip.String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		first, err := keepAliveGet(c)
		if err != nil {
			t.Fatal(err)
		}
		// The backend's RST (RST|ACK: it would count from its own node),
		// sent through the tunnel from the other node, as a pod there
		// could.
		be, other := o.addr2, o.fleet.Node(3)
		if first == n3 {
			be, other = o.addr3, o.fleet.Node(2)
		}
		f.events()
		before := f.stats().ReplyWrongSide
		local := netip.MustParseAddrPort(c.LocalAddr().String())
		forged := bpftest.TCPSeq(be, local, bpftest.RST, nil, 1, 0)[14:]
		f.must(other.Do(func() error { return sendIPIP(o.fleet.Node(1).Addr, forged) }))
		time.Sleep(200 * time.Millisecond) // the frame crosses three namespaces
		if d := f.stats().ReplyWrongSide - before; d != 1 {
			t.Errorf("unproven reply_wrong_side grew by %d, want 1 (node %d claiming %v)", d, other.Index, be)
		}
		for _, e := range f.events() {
			if e.Type == evRefused || e.Type == evReset {
				t.Errorf("a forged tunnelled RST made a verdict: %+v", e)
			}
		}
		if again, err := keepAliveGet(c); err != nil || again != first {
			t.Errorf("the connection after the forged RST: %q, %v (was on %s)", again, err, first)
		}
	})

	t.Run("breaker slots come back through the tunnel", func(t *testing.T) {
		f.svc.MaxInflightPerBackend = 2
		f.writeService()
		defer func() { f.svc.MaxInflightPerBackend = 0; f.writeService() }()
		in := f.inflight()
		var held []net.Conn
		for range 4 {
			c, err := o.client.Dialer(2*time.Second).DialContext(context.Background(), "tcp", vip.String())
			if err != nil {
				t.Fatalf("connection %d under the limit: %v", len(held)+1, err)
			}
			held = append(held, c)
		}
		if _, err := o.client.Dialer(2*time.Second).DialContext(context.Background(), "tcp", vip.String()); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("a fifth connection with both backends at 2: %v, want refused by the breaker", err)
		}
		for _, c := range held {
			c.Close()
		}
		deadline := time.Now().Add(10 * time.Second)
		for in.Backend(idNode2)+in.Backend(idNode3) != 0 && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if n := in.Backend(idNode2) + in.Backend(idNode3); n != 0 {
			t.Fatalf("%d breaker slots still held after the connections closed", n)
		}
		f.events()
	})

	t.Run("a probation backend gets one probe, answered through the tunnel", func(t *testing.T) {
		f.must(f.Maps.SetBackend(idNode3, maps.NewBackend(o.addr3, svcID, maps.BackendProbation, 1)))
		got := o.gets(t, 20)
		if got[n2]+got[n3] != 20 || got[n3] != 1 {
			t.Fatalf("20 connections with %s in probation: %v, want all answered, one by it", n3, got)
		}
		evs := f.events()
		probed := false
		for _, e := range evs {
			if e.Type == evEstablished && e.BE == idNode3 {
				probed = e.Flags&evfProbe != 0
			}
		}
		if !probed {
			t.Fatalf("events %+v: no established probe of %s", evs, n3)
		}
		f.must(f.Maps.SetBackend(idNode3, maps.NewBackend(o.addr3, svcID, maps.BackendActive, 0)))
	})

	t.Run("a refusing backend is ejected by its tunnelled refusals", func(t *testing.T) {
		f.Maps.SetServiceTrip(svcID, maps.TripSettings{MaxFailures: 3, Kinds: maps.TripRefused, Settle: time.Second}, 1)
		if err := o.be3.SetMode(testnet.Refuse); err != nil {
			t.Fatal(err)
		}
		got := o.gets(t, 30)
		if got["refused"] != 3 || got[n2] != 27 {
			t.Fatalf("30 connections with %s refusing: %v, want 3 refused (the trip), the rest answered by %s", n3, got, n2)
		}
		if st := f.state(idNode3); st != maps.BackendEjected {
			t.Fatalf("%s is %v, want ejected", n3, st)
		}
	})
}

// keepAliveGet sends one HTTP/1.1 request on c and returns the backend's
// name, leaving the connection open.
func keepAliveGet(c net.Conn) (string, error) {
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: vip\r\n\r\n"); err != nil {
		return "", err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return strings.TrimSpace(string(b)), err
}

// The other way, with a datapath of its own on node 2 (as each node's
// agent has): its second pod reaches a backend on node 1 through the
// tunnel, and the reply is rewritten on node 2's uplink.
func TestIPIPOverlayOtherWay(t *testing.T) {
	o := newIPIPOverlay(t)
	l := bpftest.Load(t)
	be := o.fleet.Node(1).Pods[1]
	if err := be.ServeHTTP(8080); err != nil {
		t.Fatal(err)
	}
	overlayService(t, l, map[uint32]netip.AddrPort{31: netip.MustParseAddrPort("198.18.251.3:8080")})
	attachOverlay(t, l, o.fleet.Node(2), "veth2")
	client := o.fleet.Node(2).Pods[1]
	for i := range 10 {
		c, err := client.Dialer(2*time.Second).DialContext(context.Background(), "tcp", vip.String())
		if err != nil {
			t.Fatalf("connection %d from node 2 to a backend on node 1: %v", i, err)
		}
		name, err := keepAliveGet(c)
		c.Close()
		if err != nil || name != be.Name {
			t.Fatalf("connection %d: %q, %v; want %s", i, name, err, be.Name)
		}
	}
}

func hasEvent(evs []event, typ uint8, be uint32) bool {
	for _, e := range evs {
		if e.Type == typ && e.BE == be {
			return true
		}
	}
	return false
}

// sendIPIP sends the IP packet inner to dst wrapped in IPIP, from the
// calling thread's namespace (the kernel adds the outer header).
func sendIPIP(dst netip.Addr, inner []byte) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_IPIP)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Sendto(fd, inner, 0, &unix.SockaddrInet4{Addr: dst.As4()})
}
