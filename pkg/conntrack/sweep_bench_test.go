// SPDX-License-Identifier: Apache-2.0

package conntrack_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// BenchmarkSweep is one conntrack sweep of the table a node held at
// 10,000 new connections/s when closed flows stayed 10 s (now those
// closed by a FIN each way leave at their last ACK; reset ones still
// stay): 100,000 flows, both entries each, 90% of them closed, from 20
// services of 10 backends.
// Nothing is due to expire: what it measures is the scan, which every
// sweep pays (the agentcpu bench's 10 s window holds one). On a copy of
// the table, and in the kernel (pb_ct_sweep_run). Needs root.
func BenchmarkSweep(b *testing.B) {
	for _, kernel := range []bool{false, true} {
		b.Run(sweepName(kernel), func(b *testing.B) {
			l := loadSweep(b, kernel)
			m, in := l.Maps, l.Inflight
			const flows = 100_000
			clocks := conntrack.KernelClocks()
			fillSweepTable(b, m, flows, uint64(clocks.Coarse()), false)
			r := &conntrack.Reaper{Maps: m, Inflight: in, Timeouts: conntrack.DefaultTimeouts(), Clocks: clocks}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				res, err := r.Sweep()
				if err != nil {
					b.Fatal(err)
				}
				if res.Kernel != kernel || res.Entries != 2*flows || res.Expired != 0 {
					b.Fatalf("swept in the kernel %v, %d entries, expired %d: want %v, %d, 0", res.Kernel, res.Entries, res.Expired, kernel, 2*flows)
				}
				if u := res.InUse; len(u.Services) != 20 || len(u.Backends) != 200 || len(u.VIPs) != 20 {
					b.Fatalf("in use: %d services, %d backends, %d VIPs; want 20, 200, 20", len(u.Services), len(u.Backends), len(u.VIPs))
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/flows, "ns/flow")
		})
	}
}

func sweepName(kernel bool) string {
	if kernel {
		return "kernel"
	}
	return "copy"
}

// loadSweep loads a table of the default size, swept in the kernel or on
// a copy (with pb_ct_expire_run's deletes).
func loadSweep(b *testing.B, kernel bool) *bpftest.Sweep {
	l := bpftest.LoadSweep(b, 1<<18, true)
	if kernel {
		if err := l.Maps.UseCTSweep(l.Datapath.PbCtSweepRun); err != nil {
			b.Fatal(err)
		}
	}
	return l
}

// BenchmarkSweepFirst is BenchmarkSweep's scan by a reaper that has no
// snapshot yet, as a started agent's first sweep of a filled table is (a
// restart): the snapshot, the index and the entries' states are all
// allocated as the scan reads the table. 65,000 flows (130,000 entries,
// half the default table). Needs root.
func BenchmarkSweepFirst(b *testing.B) {
	l := bpftest.LoadSweep(b, 1<<18, true)
	m, in := l.Maps, l.Inflight
	const flows = 65_000
	clocks := conntrack.KernelClocks()
	fillSweepTable(b, m, flows, uint64(clocks.Coarse()), false)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		r := &conntrack.Reaper{Maps: m, Inflight: in, Timeouts: conntrack.DefaultTimeouts(), Clocks: clocks}
		res, err := r.Sweep()
		if err != nil {
			b.Fatal(err)
		}
		if res.Entries != 2*flows || res.Expired != 0 {
			b.Fatalf("swept %d entries, expired %d: want %d, 0", res.Entries, res.Expired, 2*flows)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/flows, "ns/flow")
}

// BenchmarkSweepExpire is a sweep that finds every flow of the table due:
// what a node pays, once per flow, to delete the closed flows of 10,000
// connections/s (10 s of them a sweep). Through the datapath's program
// (pb_ct_expire_run, a system call per 1,024 flows) and through a lookup
// and a delete per entry, each after a copy of the table; and the whole
// sweep in the kernel (pb_ct_sweep_run). Needs root.
func BenchmarkSweepExpire(b *testing.B) {
	for _, way := range []string{"kernel", "program", "syscalls"} {
		b.Run(way, func(b *testing.B) {
			l := bpftest.LoadSweep(b, 1<<18, way == "program")
			if way == "kernel" {
				if err := l.Maps.UseCTSweep(l.Datapath.PbCtSweepRun); err != nil {
					b.Fatal(err)
				}
			}
			m, in := l.Maps, l.Inflight
			const flows = 100_000
			clocks := conntrack.KernelClocks()
			r := &conntrack.Reaper{Maps: m, Inflight: in, Timeouts: conntrack.DefaultTimeouts(), Clocks: clocks}
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				fillSweepTable(b, m, flows, uint64(clocks.Coarse())-uint64(time.Minute), true)
				b.StartTimer()
				res, err := r.Sweep()
				if err != nil {
					b.Fatal(err)
				}
				if res.Entries != 2*flows || res.Expired != flows {
					b.Fatalf("swept %d entries, expired %d: want %d, %d", res.Entries, res.Expired, 2*flows, flows)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/flows, "ns/flow")
		})
	}
}

// fillSweepTable writes flows flows, both entries each, last seen at
// seen: 90% of them closed (all, with allClosed), from 20 services of
// 10 backends.
func fillSweepTable(b *testing.B, m *maps.Maps, flows int, seen uint64, allClosed bool) {
	keys := make([]bpf.LbCtKey, 0, 2*flows)
	vals := make([]bpf.LbCtValue, 0, 2*flows)
	for i := 0; i < flows; i++ {
		svc := uint32(i % 20)
		client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, byte(i >> 16), byte(i >> 8)}), uint16(1024+i%50000))
		vip := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, 100, byte(svc)}), 80)
		backend := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, 1, byte(i % 200)}), 8080)
		fk, rk := bpftest.FlowKeys(client, vip, backend)
		var fv, rv bpf.LbCtValue
		fv.NatAddr.Bytes, fv.NatPort = maps.Addr16(backend.Addr()), maps.Port(backend.Port())
		rv.NatAddr.Bytes, rv.NatPort = maps.Addr16(vip.Addr()), maps.Port(vip.Port())
		fv.SvcId, rv.SvcId = svc+1, svc+1
		fv.BackendId, rv.BackendId = uint32(i%200)+1, uint32(i%200)+1
		fv.CreatedNs, rv.CreatedNs = uint64(i)+1, uint64(i)+1
		fv.LastSeenNs, rv.LastSeenNs = seen, seen
		fv.Flags = maps.CTClientAcked
		rv.Flags = maps.CTEstablished
		if allClosed || i%10 != 0 {
			rv.Flags |= maps.CTClosed
		}
		keys, vals = append(keys, fk, rk), append(vals, fv, rv)
	}
	if _, err := m.Raw().PbCtV2.BatchUpdate(keys, vals, nil); err != nil {
		b.Fatal(err)
	}
}
