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
// read in several thousand changes, 2026-12-05); here 200 services in the
// test loader's 256 buckets (so that buckets hold several) are rewritten in
// a loop while UDP flows to them begin, and not one may miss its service.
// Before service() looked twice, 11-15 of about 240,000 did.
func TestServiceRewriteNeverMissed(t *testing.T) {
	f := newFixture(t)
	const n = 200
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
	for i := range vips {
		id := 20 + uint32(i)
		f.must(f.Maps.FillTable(id, 0, fill(id1)))
		f.must(f.Maps.FillTable(id, 1, fill(id1)))
		f.must(f.Maps.UpsertService(maps.ServiceKey(vips[i].Addr(), 9053, 17), bpf.LbSvcValue{Id: id, TableSize: size}))
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stop.Store(true)
	var writes atomic.Int64
	wg.Go(func() {
		for k := 0; !stop.Load(); k++ {
			i := k % n
			id := 20 + uint32(i)
			if err := f.Maps.UpsertService(maps.ServiceKey(vips[i].Addr(), 9053, 17), bpf.LbSvcValue{Id: id, Table: uint32(k/n) & 1, TableSize: size}); err != nil {
				t.Error(err)
				return
			}
			writes.Add(1)
		}
	})
	// Each a new flow (another client port): its service is looked up.
	misses, runs := 0, 0
	deadline := time.Now().Add(3 * time.Second)
	for k := 0; time.Now().Before(deadline); k++ {
		c := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 0, byte(k / 50000)}), uint16(10000+k%50000))
		ret, p, _ := f.run(bpftest.UDP(c, vips[(k*7)%n], []byte("q")))
		runs++
		if ret == bpftest.XDPPass && p.Dst != be1 {
			misses++
		}
	}
	stop.Store(true)
	wg.Wait()
	t.Logf("%d runs, %d service writes, %d missed", runs, writes.Load(), misses)
	if misses > 0 {
		t.Errorf("%d of %d new flows missed their service while it was rewritten", misses, runs)
	}
}
