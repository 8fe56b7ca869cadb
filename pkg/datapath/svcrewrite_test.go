// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// A service's pb_services entry is rewritten at every change of its
// endpoints (a new table flipped in), and the hash map replaces an entry by
// linking the new one at its bucket's head, then unlinking the old one. A
// lookup walking the bucket meanwhile, on an entry ahead of the old one,
// finds neither: a new flow to a service that exists would pass to the
// kernel as no service's. The apiscale bench saw it from userspace (one
// read in several thousand changes, 2026-12-05); here 116 services in the
// test loader's 256 buckets (so that buckets hold several) are rewritten in
// a loop while UDP flows to them begin, and not one may miss its service.
// Flows sent to another service's backend are counted too: the map reuses
// a replaced entry at once, for any key, so a value read through a pointer
// the lookup returned can be another service's (service_copy confirms
// its copy with a second look). Before: 3-7 of about 220,000 missed their
// service in each of three runs; with the second look but no
// confirmation, none missed and one run sent a flow to another service's
// backend.
func TestServiceRewriteNeverMissed(t *testing.T) {
	f := newFixture(t)
	const n = 116 // service ids 20-135, their backends' 140-255 (the test loader's maps hold 256)
	vips := make([]netip.AddrPort, n)
	slots := map[uint32]bool{}
	var reqs []maps.TableInstall
	for i := range vips {
		vips[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 128 + byte(i>>8), byte(i)}), 9053)
		slots[maps.VIPSlot(vips[i].Addr())] = true
		reqs = append(reqs, maps.TableInstall{SvcID: 20 + uint32(i), N: 0, Size: size}, maps.TableInstall{SvcID: 20 + uint32(i), N: 1, Size: size})
	}
	f.must(f.Maps.SetPorts(nil, map[uint16]uint8{9053: maps.PortVIP, 80: maps.PortVIP, 8080: maps.PortBackend}))
	f.must(f.Maps.SetVIPSlots(nil, slots))
	f.must(f.Maps.InstallTables(reqs))
	defer func() {
		for i := range vips {
			f.Maps.DeleteTables(20 + uint32(i))
		}
	}()
	// Each service has a backend of its own: a flow that took another
	// service's value would find no backend of its service there.
	backend := func(i int) (uint32, netip.AddrPort) {
		return 140 + uint32(i), netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 4, byte(i)}), 8080)
	}
	for i := range vips {
		id := 20 + uint32(i)
		be, addr := backend(i)
		f.must(f.Maps.SetBackend(be, maps.NewBackend(addr, id, maps.BackendActive, 0)))
		f.must(f.Maps.FillTable(id, 0, fill(be)))
		f.must(f.Maps.FillTable(id, 1, fill(be)))
		f.must(f.Maps.UpsertService(maps.ServiceKey(vips[i].Addr(), 9053, 17), bpf.LbSvcValue{Id: id, TableSize: size}))
	}
	stop := rewriting(t, func(k int) error {
		i := k % n
		return f.Maps.UpsertService(maps.ServiceKey(vips[i].Addr(), 9053, 17), bpf.LbSvcValue{Id: 20 + uint32(i), Table: uint32(k/n) & 1, TableSize: size})
	})
	defer stop()
	// Each a new flow (another client port): its service is looked up.
	misses, wrong, runs := 0, 0, 0
	deadline := time.Now().Add(3 * time.Second)
	for k := 0; time.Now().Before(deadline); k++ {
		c := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 0, byte(k / 50000)}), uint16(10000+k%50000))
		i := (k * 7) % n
		ret, p, _ := f.run(bpftest.UDP(c, vips[i], []byte("q")))
		runs++
		_, to := backend(i)
		switch {
		case ret == bpftest.XDPPass && p.Dst == to:
		case ret == bpftest.XDPPass && p.Dst == vips[i]:
			misses++ // passed as no service's
		case ret == bpftest.XDPPass && p.Dst.Port() == to.Port() && p.Dst.Addr().As4()[2] == 4:
			wrong++ // another service's backend: its value was read
		default:
			t.Fatalf("new flow to service %d: verdict %d, to %v; want %v", i, ret, p.Dst, to)
		}
	}
	writes := stop()
	// Sent to another service's backend is logged, not failed: the
	// confirmation narrows that race without closing it (one flow in
	// 17,000 still did under the kernel matrix's emulated CPUs on 6.1), and
	// without it the race showed in one native run of three, too seldom
	// for a test to tell the two apart.
	t.Logf("%d runs, %d service writes, %d missed, %d to another service's backend", runs, writes, misses, wrong)
	if misses > 0 {
		t.Errorf("of %d new flows while services were rewritten, %d missed their service", runs, misses)
	}
}

// The same for a service's list of active backends (pb_svc_backends),
// which the agent rewrites where an ejection changes it and which a new
// flow scans when its Maglev pick cannot take it: here every slot is an
// ejected backend, so each new flow is steered by the scan to the list's
// one entry, which the agent rewrites in a loop (be1, be2, be1, ...) among
// other services' entries rewritten too (so that buckets hold several).
// A miss would leave the flow nowhere else to go: it would be sent to the
// ejected backend.
func TestServiceListRewriteNeverMissed(t *testing.T) {
	f := newFixture(t)
	const ejected = 13
	f.must(f.Maps.SetBackend(ejected, maps.NewBackend(netip.MustParseAddrPort("198.18.3.2:8080"), svcID, maps.BackendEjected, 0)))
	f.service(17, ejected)
	f.svc.BackendCount = 1
	f.writeService()
	f.must(f.Maps.SetServiceBackends(svcID, nil, []uint32{id1}))
	// Other services' lists: 60 services of 3 entries in the loader's 256
	// buckets.
	const others = 60
	for s := range uint32(others) {
		f.must(f.Maps.SetServiceBackends(100+s, nil, []uint32{1, 2, 3}))
	}
	defer func() {
		for s := range uint32(others) {
			f.Maps.SetServiceBackends(100+s, []uint32{1, 2, 3}, nil)
		}
		f.Maps.SetServiceBackends(svcID, []uint32{id1}, nil)
	}()
	lists := [2][]uint32{{id1}, {id2}}
	stop := rewriting(t, func(k int) error {
		if s := k % (others + 1); s == others {
			return f.Maps.SetServiceBackends(svcID, lists[k/(others+1)%2], lists[(k/(others+1)+1)%2])
		}
		// Replaced with what they hold: new entries all the same.
		return f.Maps.SetServiceBackends(100+uint32(k%(others+1)), []uint32{0, 0, 0}, []uint32{1, 2, 3})
	})
	defer stop()
	missed, runs := 0, 0
	deadline := time.Now().Add(3 * time.Second)
	for k := 0; time.Now().Before(deadline); k++ {
		c := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 0, byte(k / 50000)}), uint16(10000+k%50000))
		ret, p, _ := f.run(bpftest.UDP(c, vip, []byte("q")))
		runs++
		switch {
		case ret == bpftest.XDPPass && (p.Dst == be1 || p.Dst == be2):
		case ret == bpftest.XDPPass && p.Dst.Addr() == netip.MustParseAddr("198.18.3.2"):
			missed++
		default:
			t.Fatalf("new flow: verdict %d, to %v; want it steered to %v or %v", ret, p.Dst, be1, be2)
		}
	}
	writes := stop()
	t.Logf("%d runs, %d list writes, %d sent to the ejected backend", runs, writes, missed)
	if missed > 0 {
		t.Errorf("%d of %d new flows went to the ejected backend: the scan missed the list's entry while it was rewritten", missed, runs)
	}
}

// rewriting calls write(0), write(1), ... on another goroutine until the
// function it returns is called, which waits for the writer and returns
// how many writes it made; an error ends the writes and fails the test.
func rewriting(t *testing.T, write func(k int) error) (stop func() int64) {
	var halt atomic.Bool
	var writes atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		for k := 0; !halt.Load(); k++ {
			if err := write(k); err != nil {
				t.Error(err)
				return
			}
			writes.Add(1)
		}
	})
	return func() int64 {
		halt.Store(true)
		wg.Wait()
		return writes.Load()
	}
}
