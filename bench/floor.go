// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"runtime"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bench/xdpbase"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// The conntracking floor (bench/xdpbase lb_new and lb_known): the least a
// load balancer that keeps flows pays per packet, measured in the same
// rounds as pb_xdp (issue 35). Its one service is pkVIPNew with the same
// three backends and the same Maglev table as the datapath's service 1,
// and its flow table holds the A <-> B pair of the established rows, so
// lb_known's repeat runs alternate as pb_xdp's established runs do.

// floorBackends are the floor's backend ids 1-3, pb_xdp's service 1's.
var floorBackends = []string{"198.18.1.2:8080", "198.18.2.2:8080", "198.18.3.2:8080"}

// loadBase loads the baselines, the floor's flow table sized like pb_ct_v2
// (the same buckets; one entry per flow where pb_ct_v2 takes two) and
// emit_event writing into the datapath's ring buffer.
func (r *packetRig) loadBase() error {
	spec, err := xdpbase.LoadBase()
	if err != nil {
		return err
	}
	spec.Maps[xdpbase.BaseMapLbFlows].MaxEntries = r.dp.PbCtV2.MaxEntries()
	spec.Maps[xdpbase.BaseMapLbFlowsWide].MaxEntries = r.dp.PbCtV2.MaxEntries()
	return spec.LoadAndAssign(&r.base, &ebpf.CollectionOptions{
		MapReplacements: map[string]*ebpf.Map{xdpbase.BaseMapEvents: r.dp.PbEvents}})
}

func floorBE(a netip.AddrPort) xdpbase.BaseLbBackend {
	return xdpbase.BaseLbBackend{Addr: be32(a.Addr()), Port: maps.Port(a.Port())}
}

func floorKey(src, dst netip.AddrPort) xdpbase.BaseLbFlowKey {
	return xdpbase.BaseLbFlowKey{Src: be32(src.Addr()), Dst: be32(dst.Addr()),
		Sport: maps.Port(src.Port()), Dport: maps.Port(dst.Port()), Proto: 6}
}

// wideKey is floorKey as lb_new_wide keys it (pb_ct_v2's layout).
func wideKey(src, dst netip.AddrPort) xdpbase.BaseLbWideKey {
	return xdpbase.BaseLbWideKey{Src: [4]uint32{be32(src.Addr())}, Dst: [4]uint32{be32(dst.Addr())},
		Sport: maps.Port(src.Port()), Dport: maps.Port(dst.Port()), Proto: 6, Family: 1}
}

// programFloor writes the floor's service, Maglev table, backends and the
// known flows.
func (r *packetRig) programFloor() error {
	ids := []uint32{1, 2, 3}
	tbl, err := maglevTable(ids, floorBackends)
	if err != nil {
		return err
	}
	if uint32(len(tbl)) > r.base.LbMaglev.MaxEntries() {
		return fmt.Errorf("floor: a %d-slot table does not fit lb_maglev", len(tbl))
	}
	for i, a := range floorBackends {
		if err := r.base.LbBackends.Put(ids[i], floorBE(netip.MustParseAddrPort(a))); err != nil {
			return err
		}
	}
	keys := make([]uint32, len(tbl))
	for i := range keys {
		keys[i] = uint32(i)
	}
	if _, err := r.base.LbMaglev.BatchUpdate(keys, tbl, nil); err != nil {
		return fmt.Errorf("floor: lb_maglev: %w", err)
	}
	vk := xdpbase.BaseLbVipKey{Addr: be32(pkVIPNew.Addr()), Port: maps.Port(pkVIPNew.Port()), Proto: 6}
	if err := r.base.LbVips.Put(vk, xdpbase.BaseLbVip{Base: 0, Size: uint32(len(tbl))}); err != nil {
		return err
	}
	return r.floorKnownFlows()
}

// floorKnownFlows (re-)inserts the floor's A <-> B pair.
func (r *packetRig) floorKnownFlows() error {
	return errors.Join(
		r.base.LbFlows.Put(floorKey(pkClient, pkA), floorBE(pkB)),
		r.base.LbFlows.Put(floorKey(pkClient, pkB), floorBE(pkA)),
		r.base.LbFlowsWide.Put(wideKey(pkClient, pkA), floorBE(pkB)),
		r.base.LbFlowsWide.Put(wideKey(pkClient, pkB), floorBE(pkA)))
}

// floorKnown is the floor's known flow over the A <-> B pair: repeat runs
// of one LRU lookup and a rewrite each. wide: lb_known_wide, with
// pb_ct_v2's 40-byte key.
func (r *packetRig) floorKnown(repeat uint32, wide bool) (float64, error) {
	prog := r.base.LbKnown
	if wide {
		prog = r.base.LbKnownWide
	}
	ns, err := r.repeatRun(prog, tcpFrame(pkClient, pkA, bpftest.ACK), repeat, ended(pkClient, pkB))
	if err != nil {
		return 0, fmt.Errorf("floor known flow: %w", err)
	}
	return ns, nil
}

// floorNew runs n SYNs of distinct flows through lb_new, one
// BPF_PROG_TEST_RUN (repeat=1) each, as newFlows does for pb_xdp, and
// returns the median kernel time. Every output must go to one of the
// three backends (every 512th parsed in full). Into an empty table
// (full false) the batch's n entries are then deleted, which must find
// all n: every run inserted its flow. Into a full table the flow table is
// first filled to its size (every insert then evicts), the p99 of the
// batch is kept in floorFullP99, and the table is emptied after. wide:
// lb_new_wide, with pb_ct_v2's 40-byte key, into the empty table.
func (r *packetRig) floorNew(n int, full, wide bool) (float64, error) {
	prog := r.base.LbNew
	if wide {
		prog, full = r.base.LbNewWide, false
	}
	if full {
		r.floorFullP99 = math.NaN()
		if err := r.floorFill(); err != nil {
			return 0, err
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	backends := map[netip.AddrPort]bool{}
	for _, a := range floorBackends {
		backends[netip.MustParseAddrPort(a)] = true
	}
	pkt := tcpFrame(pkClient, pkVIPNew, bpftest.SYN)
	durs := make([]float64, 0, n)
	keys := make([]xdpbase.BaseLbFlowKey, 0, n)
	wkeys := make([]xdpbase.BaseLbWideKey, 0, n)
	for i := range n {
		c := r.nextClient()
		pkt.setSrc(c)
		ret, sz, ns, err := testRun(prog, pkt, r.out, 1)
		if err != nil {
			return 0, err
		}
		if err := wantPass(ret); err != nil {
			return 0, fmt.Errorf("floor new flow: %w", err)
		}
		out := r.out[:sz]
		if dst := dstOf(out); !backends[dst] {
			return 0, fmt.Errorf("floor new flow from %v went to %v", c, dst)
		}
		if i%512 == 0 {
			if _, _, err := checkFrame(out); err != nil {
				return 0, fmt.Errorf("floor new flow output: %w", err)
			}
		}
		durs = append(durs, float64(ns))
		keys = append(keys, floorKey(c, pkVIPNew))
		wkeys = append(wkeys, wideKey(c, pkVIPNew))
	}
	if full {
		var v xdpbase.BaseLbBackend
		if err := r.base.LbFlows.Lookup(keys[len(keys)-1], &v); err != nil {
			return 0, fmt.Errorf("floor new flow into a full table: %w: the last flow is not in the table (%v)", errPath, err)
		}
		r.floorFullP99 = percentile(durs, 99)
		r.floorFullSlow = slowShare(durs)
		r.floorFullP999 = percentile(durs, 99.9)
		return median(durs), r.floorReset()
	}
	if wide {
		if got, err := r.base.LbFlowsWide.BatchDelete(wkeys, nil); err != nil || got != len(wkeys) {
			return 0, fmt.Errorf("floor new flow, wide key: %w: deleted %d of %d entries: %v", errPath, got, len(wkeys), err)
		}
		return median(durs), nil
	}
	if got, err := r.base.LbFlows.BatchDelete(keys, nil); err != nil || got != len(keys) {
		return 0, fmt.Errorf("floor new flow: %w: deleted %d of %d entries: %v", errPath, got, len(keys), err)
	}
	return median(durs), nil
}

// floorFill fills the floor's flow table to its size through lb_new.
func (r *packetRig) floorFill() error {
	pkt := tcpFrame(pkClient, pkVIPNew, bpftest.SYN)
	for range r.base.LbFlows.MaxEntries() {
		pkt.setSrc(r.nextClient())
		if ret, _, _, err := testRun(r.base.LbNew, pkt, r.out, 1); err != nil || ret != bpftest.XDPPass {
			return fmt.Errorf("filling the floor's flow table: verdict %d, %v", ret, err)
		}
	}
	return nil
}

// floorReset empties the floor's flow table and puts the known pair back.
func (r *packetRig) floorReset() error {
	if err := emptyMap[xdpbase.BaseLbFlowKey, xdpbase.BaseLbBackend](r.base.LbFlows); err != nil {
		return fmt.Errorf("emptying the floor's flow table: %w", err)
	}
	return r.floorKnownFlows()
}

// Row names of the floor part (section 1a).
const (
	flKnown      = "floor: known flow (one LRU lookup, rewrite)"
	flNew        = "floor: new flow (VIP lookup, Maglev read, LRU insert, rewrite)"
	flFull       = "floor: new flow into a full LRU (every insert evicts)"
	flFull99     = "floor: new flow into a full LRU, p99 of single calls"
	flPass       = "XDP_PASS only (baseline)"
	flFull999    = "floor: new flow into a full LRU, p99.9 of single calls"
	flFull999PB  = "pb_xdp new flow into a full conntrack, p99.9 of single calls"
	flFullSlow   = "floor: new flow into a full LRU, single calls over 10 µs"
	flFullSlowPB = "pb_xdp new flow into a full conntrack, single calls over 10 µs"
	flKnownW     = "diagnostic: floor with pb_ct_v2's 40-byte key, known flow"
	flNewW       = "diagnostic: floor with pb_ct_v2's 40-byte key, new flow"

	flEst     = "pb_xdp established flow"
	flReply   = "pb_xdp backend reply (reverse NAT)"
	flNewPB   = "pb_xdp new flow SYN"
	flFullPB  = "pb_xdp new flow into a full conntrack"
	flFull99P = "pb_xdp new flow into a full conntrack, p99 of single calls"
	flEstP    = "pb_xdp established flow, against XDP_PASS"
	flPTP     = "pb_xdp pass-through, non-VIP port, against XDP_PASS"
	flPTVIPP  = "pb_xdp pass-through, VIP port, non-VIP address, against XDP_PASS"
	flKnownP  = "floor: known flow, against XDP_PASS"
	flDNATP   = "minimal DNAT, match, against XDP_PASS"
)

// floorFigures builds section 1a from the round's samples: pb_xdp's rows
// against the floor's, ratios round by round (each pair was measured in
// the same round, one right after the other), and the repeat paths
// against XDP_PASS, the comparison issue 35 quotes.
func floorFigures(res *Results, fig func(part, name, base string) *Figure) {
	cp := func(name, base, from string) {
		src := res.find("packet", from)
		if src == nil {
			return
		}
		f := fig("floor", name, base)
		f.Samples = src.Samples
	}
	cp(flPass, "", "XDP_PASS only (baseline)")
	cp(flEst, flKnown, "established flow")
	cp(flReply, flKnown, "backend reply (reverse NAT)")
	cp(flNewPB, flNew, "new flow SYN (Maglev pick + conntrack insert + event)")
	cp(flFullPB, flFull, "new flow into a full conntrack (every insert evicts)")
	cp(flFull99P, flFull99, "new flow into a full conntrack, p99 of single calls")
	cp(flEstP, flPass, "established flow")
	cp(flPTP, flPass, "pass-through, non-VIP port")
	cp(flPTVIPP, flPass, "pass-through, VIP port, non-VIP address")
	cp(flDNATP, flPass, "minimal DNAT, match (baseline floor)")
	if k := res.find("floor", flKnown); k != nil {
		f := fig("floor", flKnownP, flPass)
		f.Samples = k.Samples
	}
	// Baselines first, then pb_xdp against them.
	if f := res.find("floor", flKnownW); f != nil {
		f.Baseline = flKnown
	}
	if f := res.find("floor", flNewW); f != nil {
		f.Baseline = flNew
	}
	for _, n := range []string{flFullSlow, flFullSlowPB} {
		if f := res.find("floor", n); f != nil {
			f.Unit, f.Digits = "%", 2
		}
	}
	if f := res.find("floor", flFullSlowPB); f != nil {
		f.Baseline = flFullSlow
	}
	if f := res.find("floor", flFull999PB); f != nil {
		f.Baseline = flFull999
	}
	res.reorder("floor", []string{flPass, flKnown, flNew, flFull, flFull99, flFull999, flFullSlow, flEst, flReply, flNewPB, flFullPB, flFull99P,
		flFull999PB, flFullSlowPB, flKnownP, flDNATP, flEstP, flPTP, flPTVIPP, flKnownW, flNewW})
	res.note("floor", "The floor is bench/xdpbase's lb_new and lb_known (base.c), built with the datapath's compiler flags: what any load balancer that keeps flows does at least. lb_new: parse Ethernet/IPv4/TCP or UDP, one VIP hash lookup, a hash of the 5-tuple, one Maglev read from a flat ARRAY holding every service's table (the verifier inlines an array read; pb_xdp's array of maps costs a helper call for the inner table), one backend ARRAY read, one LRU_HASH insert of the 16-byte IPv4 5-tuple → backend address and port (one entry per flow), the DNAT rewrite with incremental checksums, XDP_PASS, which is pb_xdp's verdict here too (no redirect configured). No flow lookup before the insert (a SYN is taken as new, as Katran does), no clock, counter or event. lb_known: parse, one LRU_HASH lookup, the rewrite. Its flow table has pb_ct_v2's size (the same buckets; full, it holds twice as many flows, as one entry per flow does). Its service is pb_xdp's new-flow service: the same VIP, the same three backends, the same 16381-slot Maglev table.")
	res.note("floor", "Measured in the same rounds as pb_xdp, each floor row right after its pb_xdp twin and by the same method: the known flow as the established row (one call of repeat runs over the A ↔ B pair, the final packet parsed and checked), new flows as the new-flow rows (distinct flows, one call with repeat=1 each, every output's backend checked; into the empty table the batch's entries are deleted after, and the delete must find every one, so every run inserted; into the full table the table is first filled to its size through lb_new, so every measured insert evicts). Ratios are taken round by round.")
	res.note("floor", "Single calls over 10 µs into a full table are the LRU's refills: when a CPU's local free list is empty, one insert takes up to 128 nodes for it from the global list, evicting them (a bucket lock each) when none is free. The floor inserts one entry per flow, so about one flow in 128 pays a refill, under the 1%% a p99 looks at; pb_xdp inserts two, one flow in 64 (1.6%%), and its p99 is a refill. The p99.9 rows compare the refills themselves.")
	res.note("floor", "Diagnostic rows (not the floor): lb_known_wide and lb_new_wide are the floor with its flow keyed as pb_ct_v2 keys one (40 bytes: addresses of 16 bytes for either family, ports, protocol, direction, family) in a table of their own of the same size, measured right after the floor's rows: what the key's size costs a lookup and an insert.")
}

// floorTargets are issue 35's: pb_xdp within 1.3× the floor.
func floorTargets(res *Results) {
	res.target("floor", "established path ≤ 1.3× the floor's known flow", res.ratio("floor", flEst), 1.3, true, "%.2f×")
	res.target("floor", "new flow ≤ 1.3× the floor's new flow (repeat=1 both)", res.ratio("floor", flNewPB), 1.3, true, "%.2f×")
	res.target("floor", "new flow into a full conntrack ≤ 1.3× the floor's into a full LRU", res.ratio("floor", flFullPB), 1.3, true, "%.2f×")
}

// slowShare is the share of durations (ns) over 10 µs, in percent.
func slowShare(durs []float64) float64 {
	if len(durs) == 0 {
		return math.NaN()
	}
	n := 0
	for _, d := range durs {
		if d > 10000 {
			n++
		}
	}
	return 100 * float64(n) / float64(len(durs))
}
