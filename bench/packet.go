// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bench/xdpbase"
	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/csum"
	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/maglev"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// packetOpts sizes part 1.
type packetOpts struct {
	Rounds   int
	Repeat   uint32 // runs per BPF_PROG_TEST_RUN for the repeat paths (odd)
	NewFlows int    // repeat=1 calls per new-flow figure per round
	Trips    int    // refused flows per kernel-trip figure per round
	// Variants are other builds of pb_xdp measured beside it (section 1d).
	Variants []pbVariant
}

// Addresses of part 1 (all in 198.18.0.0/15; nothing is sent anywhere:
// the packets only go through BPF_PROG_TEST_RUN).
var (
	pkClient = netip.MustParseAddrPort("198.18.0.2:5000")
	// A and B are two VIPs whose single backend is the other VIP, so an
	// established packet to A is DNATed to B, whose flow DNATs it back to
	// A: every repetition of the reused buffer takes the established path
	// again, with a real address change and checksum update each time.
	pkA  = netip.MustParseAddrPort("198.18.100.20:80")
	pkB  = netip.MustParseAddrPort("198.18.100.21:80")
	pkA2 = netip.MustParseAddrPort("198.18.100.22:80") // the same, with a circuit-breaker limit
	pkB2 = netip.MustParseAddrPort("198.18.100.23:80")

	pkVIPNew   = netip.MustParseAddrPort("198.18.100.10:80") // 3 active backends
	pkVIPProb  = netip.MustParseAddrPort("198.18.100.11:80") // every slot on a backend in probation
	pkVIPLim   = netip.MustParseAddrPort("198.18.100.12:80") // maxInflight set
	pkVIPLimBe = netip.MustParseAddrPort("198.18.100.13:80") // maxInflight and maxInflightPerBackend set
	pkVIPRep   = netip.MustParseAddrPort("198.18.100.14:80") // retryRefused: each SYN copied for a replay
	pkVIPTO    = netip.MustParseAddrPort("198.18.100.16:80") // lately kube-proxy's (PB_SVC_F_TAKEN_OVER)
	pkVIPAff   = netip.MustParseAddrPort("198.18.100.17:80") // sessionAffinity ClientIP

	pkNode = netip.MustParseAddrPort("198.18.0.1:22")

	// IPv6: the established pair (as A and B) and a new-flow VIP with 3
	// backends, in 2001:2::/48.
	pkClient6  = netip.MustParseAddrPort("[2001:2::2]:5000")
	pkA6       = netip.MustParseAddrPort("[2001:2:0:100::20]:80")
	pkB6       = netip.MustParseAddrPort("[2001:2:0:100::21]:80")
	pkVIPNew6  = netip.MustParseAddrPort("[2001:2:0:100::10]:80")
	pkBackend6 = []string{"[2001:2:0:1::2]:8080", "[2001:2:0:2::2]:8080", "[2001:2:0:3::2]:8080"}
	// No VIP's: the pass-through packet to a VIP port goes here.
	pkNotVIP = netip.MustParseAddr("198.18.0.1")
)

const pkTableSize = maglev.DefaultTableSize

// packetRig is the datapath and the baselines loaded side by side.
type packetRig struct {
	dp      *datapath.Datapath
	m       *maps.Maps
	base    xdpbase.BaseObjects
	unmount func()

	reader  *outcomes.Reader
	read    atomic.Uint64
	drained chan struct{}

	flowSeq uint32
	out     []byte
	// fullP99: the 99th percentile of the single calls of the last
	// newFlows into a full conntrack, ns (NaN while it fails).
	fullP99 float64
	// floorFullP99: the same for the floor (lb_new) into a full table.
	floorFullP99 float64
	// fullSlow, floorFullSlow: the share of those calls over 10 µs, %
	// (the LRU's refills of a CPU's free list: see the floor part's note).
	fullSlow, floorFullSlow float64
	// fullP999, floorFullP999: their 99.9th percentiles, ns.
	fullP999, floorFullP999 float64

	unregister func() // the interrupt cleanup (the bpffs mount)
}

func newPacketRig() (*packetRig, error) {
	root, unmount, err := mountBPFFS()
	if err != nil {
		return nil, err
	}
	r := &packetRig{unmount: unmount, out: make([]byte, 2048)}
	r.unregister = atInterrupt(unmount)
	// The agent's default sizes for conntrack and the ring buffer.
	r.dp, err = datapath.Load(datapath.Options{Root: root, MaxServices: 1024, MaxBackends: 4096,
		ConntrackSize: datapath.DefaultConntrackSize, EventsBytes: datapath.DefaultEventsBytes})
	if err != nil {
		unmount()
		return nil, err
	}
	if r.m, err = maps.New(&r.dp.LbMaps, r.dp.InnerSpec); err != nil {
		r.close()
		return nil, err
	}
	if err = r.m.UseStatsReset(r.dp.PbStatsResetRun); err != nil {
		r.close()
		return nil, err
	}
	// emit_event writes into the datapath's own ring buffer.
	if err := r.loadBase(); err != nil {
		r.close()
		return nil, fmt.Errorf("baselines: %w", err)
	}
	if err := r.program(); err != nil {
		r.close()
		return nil, err
	}
	if err := r.programFloor(); err != nil {
		r.close()
		return nil, fmt.Errorf("floor: %w", err)
	}
	// Drain the ring buffer as the agent does, so new flows take the
	// normal emit path, not the events-lost one.
	if r.reader, err = outcomes.NewReader(r.dp.PbEvents); err != nil {
		r.close()
		return nil, err
	}
	ch := make(chan []outcomes.Event, 256)
	r.drained = make(chan struct{})
	go func() {
		defer close(r.drained)
		for b := range ch {
			r.read.Add(uint64(len(b)))
		}
	}()
	go func() { r.reader.Run(func(b []outcomes.Event) { ch <- b }); close(ch) }()
	r.waitRead(6) // the established flows' NEW_FLOW events, before any count
	return r, nil
}

func (r *packetRig) close() {
	r.unregister()
	if r.reader != nil {
		r.reader.Close()
		<-r.drained
	}
	r.base.Close()
	if r.dp != nil {
		r.dp.Close()
	}
	r.unmount()
}

type svcDef struct {
	id       uint32
	vip      netip.AddrPort
	backends []uint32 // ids, slots filled by Maglev over these
	limit    uint32
	perBE    uint32
	flags    uint32
	affinity uint32 // sessionAffinity ClientIP's timeout, s (0: off)
}

func (r *packetRig) program() error {
	m := r.m
	be := func(id uint32, addr string, svc uint32, st maps.BackendState) error {
		return m.SetBackend(id, maps.NewBackend(netip.MustParseAddrPort(addr), svc, st, 0))
	}
	var errs []error
	for i, a := range []string{"198.18.1.2:8080", "198.18.2.2:8080", "198.18.3.2:8080"} {
		id := uint32(i)
		errs = append(errs,
			be(1+id, a, 1, maps.BackendActive),
			be(7+id, a, 3, maps.BackendActive),
			be(10+id, a, 4, maps.BackendActive),
			be(30+id, a, 5, maps.BackendActive),
			be(50+id, a, 7, maps.BackendActive),
			be(53+id, a, 8, maps.BackendActive))
	}
	errs = append(errs,
		be(4, "198.18.3.2:8080", 2, maps.BackendProbation),
		be(5, "198.18.1.2:8080", 2, maps.BackendActive),
		be(6, "198.18.2.2:8080", 2, maps.BackendActive),
		be(20, pkB.String(), 10, maps.BackendActive),
		be(21, pkA.String(), 11, maps.BackendActive),
		be(22, pkB2.String(), 12, maps.BackendActive),
		be(23, pkA2.String(), 13, maps.BackendActive),
		be(pkTripBEID, pkTripBE.String(), pkTripSvc, maps.BackendActive),
		be(60, pkB6.String(), 20, maps.BackendActive),
		be(61, pkA6.String(), 21, maps.BackendActive),
		be(62, pkBackend6[0], 22, maps.BackendActive),
		be(63, pkBackend6[1], 22, maps.BackendActive),
		be(64, pkBackend6[2], 22, maps.BackendActive),
		m.SetPorts(nil, map[uint16]uint8{80: maps.PortVIP | maps.PortBackend, 8080: maps.PortBackend}),
		// The SYN guard as the agent sets it, but never arming: these
		// runs open millions of new flows a second on one CPU, which
		// would arm it and time its drops instead of the new-flow path.
		m.SetSYNGuard(maps.SYNGuard{Rate: 2000, Burst: 200, Trust: time.Hour}),
	)
	const lim = 1 << 30 // a limit that is configured but never reached
	svcs := []svcDef{
		{id: 1, vip: pkVIPNew, backends: []uint32{1, 2, 3}},
		{id: 2, vip: pkVIPProb, backends: []uint32{4}},
		{id: 3, vip: pkVIPLim, backends: []uint32{7, 8, 9}, limit: lim},
		{id: 4, vip: pkVIPLimBe, backends: []uint32{10, 11, 12}, limit: lim, perBE: lim},
		{id: 5, vip: pkVIPRep, backends: []uint32{30, 31, 32}, flags: maps.ServiceRetryRefused},
		{id: 7, vip: pkVIPTO, backends: []uint32{50, 51, 52}, flags: maps.ServiceTakenOver},
		{id: 8, vip: pkVIPAff, backends: []uint32{53, 54, 55}, affinity: 10800},
		{id: pkTripSvc, vip: pkVIPTrip, backends: []uint32{pkTripBEID}},
		{id: 20, vip: pkA6, backends: []uint32{60}},
		{id: 21, vip: pkB6, backends: []uint32{61}},
		{id: 22, vip: pkVIPNew6, backends: []uint32{62, 63, 64}},
		{id: 10, vip: pkA, backends: []uint32{20}},
		{id: 11, vip: pkB, backends: []uint32{21}},
		{id: 12, vip: pkA2, backends: []uint32{22}, limit: lim},
		{id: 13, vip: pkB2, backends: []uint32{23}, limit: lim},
	}
	// Both prefilters: the VIP ports above, and every VIP's address slot.
	slots := map[uint32]bool{}
	for _, s := range svcs {
		slots[maps.VIPSlot(s.vip.Addr())] = true
	}
	if slots[maps.VIPSlot(pkNotVIP)] {
		return fmt.Errorf("the pass-through address %v shares a slot with a VIP: pick another", pkNotVIP)
	}
	errs = append(errs, m.SetVIPSlots(nil, slots))
	for _, s := range svcs {
		errs = append(errs, r.service(s))
	}
	// The probation service's table without its probation backend.
	fb, err := maglevTable([]uint32{5, 6}, []string{"198.18.1.2:8080", "198.18.2.2:8080"})
	errs = append(errs, err)
	if err == nil {
		errs = append(errs, m.SetFallback(2, fb))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}

	// The minimal DNAT's map: A <-> B, as the datapath's established pair.
	k := func(a netip.AddrPort) xdpbase.BaseDnatKey {
		return xdpbase.BaseDnatKey{Addr: be32(a.Addr()), Port: maps.Port(a.Port()), Proto: 6}
	}
	v := func(a netip.AddrPort) xdpbase.BaseDnatValue {
		return xdpbase.BaseDnatValue{Addr: be32(a.Addr()), Port: maps.Port(a.Port())}
	}
	if err := r.base.Dnat.Put(k(pkA), v(pkB)); err != nil {
		return err
	}
	if err := r.base.Dnat.Put(k(pkB), v(pkA)); err != nil {
		return err
	}

	// The established flows: one SYN each through the datapath.
	for _, vip := range []netip.AddrPort{pkA, pkB, pkA2, pkB2, pkA6, pkB6} {
		c := pkClient
		if vip.Addr().Is6() {
			c = pkClient6
		}
		ret, _, _, err := testRun(r.dp.PbXdp, tcpFrame(c, vip, bpftest.SYN), r.out, 1)
		if err != nil {
			return err
		}
		if ret != bpftest.XDPPass {
			g, _ := r.m.GlobalStats()
			return fmt.Errorf("SYN to %v: verdict %d (datapath counters %+v)", vip, ret, g)
		}
	}
	return nil
}

func maglevTable(ids []uint32, keys []string) ([]uint32, error) {
	slots, err := maglev.NewBuilder(pkTableSize).Build(keys, nil)
	if err != nil {
		return nil, err
	}
	out := make([]uint32, len(slots))
	for i, s := range slots {
		out[i] = ids[s]
	}
	return out, nil
}

func (r *packetRig) service(s svcDef) error {
	var keys []string
	for _, id := range s.backends {
		b, err := r.m.Backend(id)
		if err != nil {
			return err
		}
		keys = append(keys, netip.AddrPortFrom(maps.AddrFromFamily(b.Family, b.Addr.Bytes), maps.Port(b.Port)).String())
	}
	tbl, err := maglevTable(s.backends, keys)
	if err != nil {
		return err
	}
	// Table 0 of the service's two, installed and filled the way the
	// agent does it, then made live by the pb_services entry.
	if err := r.m.InstallTables([]maps.TableInstall{{SvcID: s.id, N: 0, Size: uint32(len(tbl))}}); err != nil {
		return err
	}
	if err := r.m.FillTable(s.id, 0, tbl); err != nil {
		return err
	}
	v := bpf.LbSvcValue{Id: s.id, Table: 0, TableSize: uint32(len(tbl)), MaxInflight: s.limit, MaxInflightPerBackend: s.perBE, Flags: s.flags,
		AffinityTimeoutS: s.affinity}
	if s.perBE != 0 {
		if err := r.m.SetServiceBackends(s.id, nil, s.backends); err != nil {
			return err
		}
		v.BackendCount = uint32(len(s.backends))
	}
	return r.m.UpsertService(maps.ServiceKey(s.vip.Addr(), s.vip.Port(), 6), v)
}

// repeatRun runs one packet opts.Repeat times in one call and checks with
// check what the runs did. It returns the kernel's ns per run.
func (r *packetRig) repeatRun(prog *ebpf.Program, in frame, repeat uint32, check func(ret uint32, out []byte) error) (float64, error) {
	ret, n, ns, err := testRun(prog, in, r.out, repeat)
	if err != nil {
		return 0, err
	}
	if err := check(ret, r.out[:n]); err != nil {
		return 0, err
	}
	return float64(ns), nil
}

func wantPass(ret uint32) error {
	if ret != bpftest.XDPPass {
		return fmt.Errorf("verdict %d, want XDP_PASS", ret)
	}
	return nil
}

// unchanged checks a pass-through run left the packet alone.
func unchanged(in frame) func(uint32, []byte) error {
	return func(ret uint32, out []byte) error {
		if err := wantPass(ret); err != nil {
			return err
		}
		if !bytes.Equal(out, in) {
			return errors.New("pass-through packet was modified")
		}
		return nil
	}
}

// ended checks the final packet is valid and addressed as want says.
func ended(src, dst netip.AddrPort) func(uint32, []byte) error {
	return func(ret uint32, out []byte) error {
		if err := wantPass(ret); err != nil {
			return err
		}
		s, d, err := checkFrame(out)
		if err != nil {
			return err
		}
		if s != src || d != dst {
			return fmt.Errorf("final packet %v -> %v, want %v -> %v", s, d, src, dst)
		}
		return nil
	}
}

// counters is what the per-path checks compare before and after a run.
type counters struct {
	g      bpf.LbGlobalStats
	svc    map[uint32]bpf.LbSvcStats
	be     map[uint32]bpf.LbBeStats
	events uint64
}

func (r *packetRig) snapshot(svcs, bes []uint32) (counters, error) {
	c := counters{svc: map[uint32]bpf.LbSvcStats{}, be: map[uint32]bpf.LbBeStats{}, events: r.read.Load()}
	var err error
	if c.g, err = r.m.GlobalStats(); err != nil {
		return c, err
	}
	for _, id := range svcs {
		if c.svc[id], err = r.m.ServiceStats(id); err != nil {
			return c, err
		}
	}
	for _, id := range bes {
		if c.be[id], err = r.m.BackendStats(id); err != nil {
			return c, err
		}
	}
	return c, nil
}

// established measures the established-flow path of client over the pair
// (a, b) of services sa, sb (either family): every run must count one
// packet on one of them, no new flow, no rewrite left undone.
func (r *packetRig) established(client, a, b netip.AddrPort, sa, sb uint32, repeat uint32) (float64, error) {
	before, err := r.snapshot([]uint32{sa, sb}, nil)
	if err != nil {
		return 0, err
	}
	ns, err := r.repeatRun(r.dp.PbXdp, tcpFrame(client, a, bpftest.ACK), repeat, ended(client, b))
	if err != nil {
		return 0, fmt.Errorf("established: %w", err)
	}
	after, err := r.snapshot([]uint32{sa, sb}, nil)
	if err != nil {
		return 0, err
	}
	da := after.svc[sa].Packets - before.svc[sa].Packets
	db := after.svc[sb].Packets - before.svc[sb].Packets
	df := after.svc[sa].Flows + after.svc[sb].Flows - before.svc[sa].Flows - before.svc[sb].Flows
	if da != uint64(repeat+1)/2 || db != uint64(repeat-1)/2 || df != 0 ||
		after.g.PassedAfterNat-before.g.PassedAfterNat != uint64(repeat) {
		return 0, fmt.Errorf("established: %w: packets %d+%d, new flows %d over %d runs", errPath, da, db, df, repeat)
	}
	return ns, nil
}

// reply measures the reverse-NAT path: the reply of the flow to A comes
// from B (its backend) and leaves from A; the next run sees it coming
// from A, the backend of the flow to B, and so on.
func (r *packetRig) reply(repeat uint32) (float64, error) {
	before, err := r.snapshot(nil, []uint32{20, 21})
	if err != nil {
		return 0, err
	}
	ns, err := r.repeatRun(r.dp.PbXdp, tcpFrame(pkB, pkClient, bpftest.ACK), repeat, ended(pkA, pkClient))
	if err != nil {
		return 0, fmt.Errorf("reply: %w", err)
	}
	after, err := r.snapshot(nil, []uint32{20, 21})
	if err != nil {
		return 0, err
	}
	d20 := after.be[20].ReplyPackets - before.be[20].ReplyPackets
	d21 := after.be[21].ReplyPackets - before.be[21].ReplyPackets
	if d20 != uint64(repeat+1)/2 || d21 != uint64(repeat-1)/2 {
		return 0, fmt.Errorf("reply: %w: reply packets %d+%d over %d runs", errPath, d20, d21, repeat)
	}
	return ns, nil
}

// passThrough measures a packet that is not ours: left untouched and
// counted nowhere.
func (r *packetRig) passThrough(in frame, repeat uint32) (float64, error) {
	before, err := r.snapshot(nil, nil)
	if err != nil {
		return 0, err
	}
	ns, err := r.repeatRun(r.dp.PbXdp, in, repeat, unchanged(in))
	if err != nil {
		return 0, fmt.Errorf("pass-through: %w", err)
	}
	after, err := r.snapshot(nil, nil)
	if err != nil {
		return 0, err
	}
	if after.g != before.g {
		return 0, fmt.Errorf("pass-through: %w: datapath counters moved", errPath)
	}
	return ns, nil
}

// waitRead waits (up to 2 s) until the reader has delivered n events in
// total.
func (r *packetRig) waitRead(n uint64) {
	deadline := time.Now().Add(2 * time.Second)
	for r.read.Load() < n && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
}

// emitLost sums emit_event's lost counter over CPUs.
func (r *packetRig) emitLost() (uint64, error) {
	var per []uint64
	if err := r.base.EmitLost.Lookup(uint32(0), &per); err != nil {
		return 0, err
	}
	var s uint64
	for _, v := range per {
		s += v
	}
	return s, nil
}

// nextClient returns a client address no earlier run used.
func (r *packetRig) nextClient() netip.AddrPort {
	i := r.flowSeq
	r.flowSeq++
	ip := netip.AddrFrom4([4]byte{198, 18, byte(128 + i>>23), byte(i >> 15)})
	return netip.AddrPortFrom(ip, uint16(16384+i&32767))
}

// newFlowKind selects the variant of the new-flow measurement.
type newFlowKind int

const (
	nfPlain     newFlowKind = iota // 3 active backends
	nfSteered                      // the slot's backend is in probation, no grant left
	nfProbe                        // the slot's backend is in probation and has a grant
	nfLimit                        // maxInflight configured
	nfLimitBE                      // maxInflight and maxInflightPerBackend configured
	nfFullCT                       // as nfPlain, into a full conntrack LRU (every insert evicts)
	nfReplay                       // as nfPlain, with retryRefused: the SYN is copied to pb_syns
	nfXDPPass                      // baseline: XDP_PASS only, same method
	nfMinDNAT                      // baseline: minimal DNAT (a match), same method
	nfLinuxSYN                     // as nfPlain, the SYN a Linux client sends (20 bytes of options)
	nfTakenOver                    // as nfPlain, to a service lately kube-proxy's (nf_conntrack looked up)
	nfAffinity                     // as nfPlain, to a service with sessionAffinity ClientIP
)

// newFlows runs n SYNs of distinct new flows, one BPF_PROG_TEST_RUN
// (repeat=1) each, and returns the median kernel-measured ns per run. Every
// run's output is checked, and the counters must show n new flows on the
// intended path with no event lost; the conntrack (and circuit-breaker)
// entries are removed afterwards so every round starts from the same
// occupancy.
func (r *packetRig) newFlows(kind newFlowKind, n int) (float64, error) {
	if kind == nfFullCT {
		r.fullP99 = math.NaN() // a failed run leaves no tail to report
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	prog := r.dp.PbXdp
	var vip netip.AddrPort
	var svc uint32
	backends := map[netip.AddrPort]bool{}
	for i := 1; i <= 3; i++ {
		backends[netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, byte(i), 2}), 8080)] = true
	}
	switch kind {
	case nfPlain:
		vip, svc = pkVIPNew, 1
	case nfFullCT:
		vip, svc = pkVIPNew, 1
		if err := r.fillCT(); err != nil {
			return 0, err
		}
	case nfSteered, nfProbe:
		vip, svc = pkVIPProb, 2
		grants := int32(0)
		if kind == nfProbe {
			grants = math.MaxInt32
		}
		if err := r.m.SetBackend(4, maps.NewBackend(netip.MustParseAddrPort("198.18.3.2:8080"), 2, maps.BackendProbation, grants)); err != nil {
			return 0, err
		}
	case nfLimit:
		vip, svc = pkVIPLim, 3
	case nfLimitBE:
		vip, svc = pkVIPLimBe, 4
	case nfReplay:
		vip, svc = pkVIPRep, 5
	case nfLinuxSYN:
		vip, svc = pkVIPNew, 1
	case nfTakenOver:
		vip, svc = pkVIPTO, 7
	case nfAffinity:
		vip, svc = pkVIPAff, 8
	case nfXDPPass:
		prog, vip = r.base.XdpPass, pkA
	case nfMinDNAT:
		prog, vip = r.base.MinDnat, pkA
	}
	before, err := r.snapshot([]uint32{svc}, nil)
	if err != nil {
		return 0, err
	}
	pkt := tcpFrame(pkClient, vip, bpftest.SYN)
	if kind == nfLinuxSYN {
		pkt = frame(bpftest.LinuxSYN(pkClient, vip, bpftest.ISN))
	}
	durs := make([]float64, 0, n)
	clients := make([]netip.AddrPort, 0, n)
	picked := make([]netip.AddrPort, 0, n)
	for i := range n {
		c := r.nextClient()
		pkt.setSrc(c)
		ret, sz, ns, err := testRun(prog, pkt, r.out, 1)
		if err != nil {
			return 0, err
		}
		if ret != bpftest.XDPPass {
			return 0, fmt.Errorf("new flow: verdict %d", ret)
		}
		out := r.out[:sz]
		dst := dstOf(out)
		switch kind {
		case nfXDPPass:
			if !bytes.Equal(out, pkt) {
				return 0, errors.New("XDP_PASS program changed the packet")
			}
		case nfMinDNAT:
			if dst != pkB {
				return 0, fmt.Errorf("minimal DNAT sent %v to %v", c, dst)
			}
		default:
			if !backends[dst] {
				return 0, fmt.Errorf("new flow from %v went to %v", c, dst)
			}
			if kind == nfSteered && dst.Addr() == netip.MustParseAddr("198.18.3.2") {
				return 0, fmt.Errorf("new flow from %v went to the probation backend without a grant", c)
			}
		}
		if i%512 == 0 {
			if _, _, err := checkFrame(out); err != nil {
				return 0, fmt.Errorf("new flow output: %w", err)
			}
		}
		durs = append(durs, float64(ns))
		clients = append(clients, c)
		picked = append(picked, dst)
	}
	if kind == nfXDPPass || kind == nfMinDNAT {
		return median(durs), nil
	}
	// Every event delivered before the checks (the reader runs beside).
	deadline := time.Now().Add(2 * time.Second)
	for r.read.Load()-before.events < uint64(n) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	after, err := r.snapshot([]uint32{svc}, nil)
	if err != nil {
		return 0, err
	}
	g0, g1 := before.g, after.g
	flows := after.svc[svc].Flows - before.svc[svc].Flows
	bad := []string{}
	if flows != uint64(n) {
		bad = append(bad, fmt.Sprintf("%d new flows counted, want %d", flows, n))
	}
	if d := g1.EventsLost - g0.EventsLost; d != 0 {
		bad = append(bad, fmt.Sprintf("%d events lost", d))
	}
	if d := r.read.Load() - before.events; d != uint64(n) {
		bad = append(bad, fmt.Sprintf("%d events read, want %d", d, n))
	}
	if d := g1.CtCreateFailed - g0.CtCreateFailed; d != 0 {
		bad = append(bad, fmt.Sprintf("%d conntrack inserts failed", d))
	}
	if d := g1.InflightUntracked - g0.InflightUntracked; d != 0 {
		bad = append(bad, fmt.Sprintf("%d flows not counted by the breaker", d))
	}
	if d := g1.InflightRejected - g0.InflightRejected; d != 0 {
		bad = append(bad, fmt.Sprintf("%d flows rejected by the breaker", d))
	}
	steered, probes := g1.Steered-g0.Steered, g1.ProbeAdmitted-g0.ProbeAdmitted
	switch kind {
	case nfSteered:
		if steered != uint64(n) || probes != 0 {
			bad = append(bad, fmt.Sprintf("steered %d, probes %d, want %d steered", steered, probes, n))
		}
	case nfProbe:
		if probes != uint64(n) || steered != 0 {
			bad = append(bad, fmt.Sprintf("probes %d, steered %d, want %d probes", probes, steered, n))
		}
	default:
		if steered+probes != 0 {
			bad = append(bad, fmt.Sprintf("steered %d, probes %d, want none", steered, probes))
		}
	}
	if len(bad) > 0 {
		return 0, fmt.Errorf("new flow (kind %d): %w: %v", kind, errPath, bad)
	}
	if kind == nfFullCT {
		r.fullP99 = percentile(durs, 99)
		r.fullSlow = slowShare(durs)
		r.fullP999 = percentile(durs, 99.9)
		return median(durs), r.resetCT()
	}
	if err := r.forget(vip, clients, picked, kind == nfLimit || kind == nfLimitBE, svc); err != nil {
		return 0, err
	}
	return median(durs), nil
}

// guardDrops runs n SYNs of distinct new flows from untrusted sources
// (the source address changes every 32,768 ports, so the trust lookup
// misses on a warm bucket: a spoofed flood from random addresses costs a
// little more) while the SYN guard is on and its budget spent (one SYN a
// second): a flood's SYN, dropped at its first XDP pass. It returns the
// median kernel-measured ns of the dropped runs. The few the budget admits
// are forgotten; the guard's drop counter must have moved by exactly the
// drops, and nothing else may count a flow.
func (r *packetRig) guardDrops(n int) (float64, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const svc = 1
	vip := pkVIPNew
	if err := r.m.SetSYNGuard(maps.SYNGuard{Lease: time.Minute, Rate: 1, Burst: 1, Trust: time.Hour}); err != nil {
		return 0, err
	}
	g0, err := r.m.SYNGuardStats()
	if err != nil {
		return 0, err
	}
	before, err := r.snapshot([]uint32{svc}, nil)
	if err != nil {
		return 0, err
	}
	pkt := tcpFrame(pkClient, vip, bpftest.SYN)
	durs := make([]float64, 0, n)
	var clients, picked []netip.AddrPort
	for range n {
		c := r.nextClient()
		pkt.setSrc(c)
		ret, sz, ns, err := testRun(r.dp.PbXdp, pkt, r.out, 1)
		if err != nil {
			return 0, err
		}
		switch ret {
		case bpftest.XDPDrop:
			durs = append(durs, float64(ns))
		case bpftest.XDPPass: // the budget's one a second
			clients = append(clients, c)
			picked = append(picked, dstOf(r.out[:sz]))
		default:
			return 0, fmt.Errorf("guarded SYN: verdict %d", ret)
		}
	}
	// The rig's guard again: off, and never arming.
	if err := r.m.SetSYNGuard(maps.SYNGuard{Rate: 2000, Burst: 200, Trust: time.Hour}); err != nil {
		return 0, err
	}
	deadline := time.Now().Add(2 * time.Second)
	for r.read.Load()-before.events < uint64(len(clients)) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	g1, err := r.m.SYNGuardStats()
	if err != nil {
		return 0, err
	}
	after, err := r.snapshot([]uint32{svc}, nil)
	if err != nil {
		return 0, err
	}
	bad := []string{}
	if len(durs) < n*99/100 {
		bad = append(bad, fmt.Sprintf("%d of %d dropped", len(durs), n))
	}
	if d := g1.Dropped - g0.Dropped; d != uint64(len(durs)) {
		bad = append(bad, fmt.Sprintf("guard counted %d drops, want %d", d, len(durs)))
	}
	if d := after.svc[svc].Flows - before.svc[svc].Flows; d != uint64(len(clients)) {
		bad = append(bad, fmt.Sprintf("%d new flows counted, want %d (the admitted)", d, len(clients)))
	}
	if d := after.g.EventsLost - before.g.EventsLost; d != 0 {
		bad = append(bad, fmt.Sprintf("%d events lost", d))
	}
	if len(bad) > 0 {
		return 0, fmt.Errorf("guarded SYNs: %w: %v", errPath, bad)
	}
	if err := r.forget(vip, clients, picked, false, svc); err != nil {
		return 0, err
	}
	return median(durs), nil
}

// fillCT fills conntrack to its size with flows of service 1, so every
// further insert evicts.
func (r *packetRig) fillCT() error {
	pkt := tcpFrame(pkClient, pkVIPNew, bpftest.SYN)
	read0 := r.read.Load()
	n := r.dp.PbCtV2.MaxEntries() / 2
	for range n {
		pkt.setSrc(r.nextClient())
		if ret, _, _, err := testRun(r.dp.PbXdp, pkt, r.out, 1); err != nil || ret != bpftest.XDPPass {
			return fmt.Errorf("filling conntrack: verdict %d, %v", ret, err)
		}
	}
	r.waitRead(read0 + uint64(n)) // their events are not the measurement's
	return nil
}

// emptyMap deletes every entry of a hash map (K, V: its key and value
// types), in batches.
func emptyMap[K, V any](m *ebpf.Map) error {
	var keys []K
	var k K
	var v V
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, k)
	}
	if err := it.Err(); err != nil {
		return err
	}
	for len(keys) > 0 {
		n := min(len(keys), 4096)
		if _, err := m.BatchDelete(keys[:n], nil); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
		keys = keys[n:]
	}
	return nil
}

// resetCT empties conntrack and re-creates the established flows of
// the repeat paths (an LRU eviction may have taken them).
func (r *packetRig) resetCT() error {
	if err := emptyMap[bpf.LbCtKey, bpf.LbCtValue](r.dp.PbCtV2); err != nil {
		return fmt.Errorf("emptying conntrack: %w", err)
	}
	read0 := r.read.Load()
	for _, vip := range []netip.AddrPort{pkA, pkB, pkA2, pkB2, pkA6, pkB6} {
		c := pkClient
		if vip.Addr().Is6() {
			c = pkClient6
		}
		if ret, _, _, err := testRun(r.dp.PbXdp, tcpFrame(c, vip, bpftest.SYN), r.out, 1); err != nil || ret != bpftest.XDPPass {
			return fmt.Errorf("SYN to %v: verdict %d, %v", vip, ret, err)
		}
	}
	r.waitRead(read0 + 6)
	return nil
}

// forget removes the conntrack and circuit-breaker state of new flows.
func (r *packetRig) forget(vip netip.AddrPort, clients, picked []netip.AddrPort, limited bool, svc uint32) error {
	keys := make([]bpf.LbCtKey, 0, 2*len(clients))
	fwd := make([]bpf.LbCtKey, 0, len(clients))
	for i, c := range clients {
		var f, rv bpf.LbCtKey
		f.Src.Bytes, f.Dst.Bytes = maps.Addr16(c.Addr()), maps.Addr16(vip.Addr())
		f.Sport, f.Dport = maps.Port(c.Port()), maps.Port(vip.Port())
		f.Proto, f.Dir, f.Family = 6, maps.DirFwd, maps.FamilyIPv4
		rv.Src.Bytes, rv.Dst.Bytes = maps.Addr16(picked[i].Addr()), f.Src.Bytes
		rv.Sport, rv.Dport = maps.Port(picked[i].Port()), f.Sport
		rv.Proto, rv.Dir, rv.Family = 6, maps.DirRev, maps.FamilyIPv4
		keys = append(keys, f, rv)
		fwd = append(fwd, f)
	}
	if n, err := r.dp.PbCtV2.BatchDelete(keys, nil); err != nil || n != len(keys) {
		return fmt.Errorf("conntrack cleanup: deleted %d of %d: %v (an LRU eviction during the run?)", n, len(keys), err)
	}
	if limited {
		if n, err := r.dp.PbFlows.BatchDelete(fwd, nil); err != nil || n != len(fwd) {
			return fmt.Errorf("pb_flows cleanup: deleted %d of %d: %v", n, len(fwd), err)
		}
		var errs []error
		errs = append(errs, r.dp.PbSvcInflight.Put(svc, bpf.LbInflight{}))
		for id := uint32(1); id <= 12; id++ {
			errs = append(errs, r.dp.PbBeInflight.Put(id, bpf.LbInflight{}))
		}
		return errors.Join(errs...)
	}
	return nil
}

// progStats describes a loaded program as the verifier and JIT saw it.
func progStats(name string, p *ebpf.Program) string {
	info, err := p.Info()
	if err != nil {
		return fmt.Sprintf("| %s | ? | ? | ? |", name)
	}
	verified, _ := info.VerifiedInstructions()
	xlated, _ := info.TranslatedSize()
	jited, _ := info.JitedSize()
	return fmt.Sprintf("| %s | %d | %d | %d |", name, xlated/8, jited, verified)
}

// runPacket is part 1 (and the circuit breaker's counting cost).
func runPacket(res *Results, o packetOpts, logf func(string, ...any)) error {
	r, err := newPacketRig()
	if err != nil {
		return err
	}
	defer r.close()

	res.extra("packet", "Programs as loaded (`bpftool prog show` reports the same sizes):\n")
	res.extra("packet", "| program | xlated insns | jited bytes | insns processed by the verifier |\n|---|--:|--:|--:|")
	res.extra("packet", "%s", progStats("pb_xdp (penaltybox)", r.dp.PbXdp))
	res.extra("packet", "%s", progStats("min_dnat (baseline)", r.base.MinDnat))
	res.extra("packet", "%s", progStats("xdp_pass (baseline)", r.base.XdpPass))
	res.extra("packet", "%s", progStats("lb_new (conntracking floor, new flow)", r.base.LbNew))
	res.extra("packet", "%s", progStats("lb_known (conntracking floor, known flow)", r.base.LbKnown))
	// A variant that does not load (the verifier refuses what an ablation
	// left) is reported and left out, not the end of the part.
	var variants []pbVariant
	for _, v := range o.Variants {
		if v.prog, err = r.loadVariant(v.Path); err != nil {
			logf("packet: --pb-variant %s left out: %v", v.Name, err)
			res.note("variant", "%s (%s) did not load and is not measured: %s", v.Name, v.Path, firstLine(err.Error()))
			continue
		}
		defer v.prog.Close()
		variants = append(variants, v)
	}

	rep := o.Repeat
	rs := fmt.Sprintf("repeat=%d", rep)
	fig := func(part, name, base string) *Figure {
		f := res.figure(part, name, "ns/pkt")
		f.Baseline = base
		f.Digits = 1
		return f
	}
	const (
		fPass     = "XDP_PASS only (baseline)"
		fDNAT     = "minimal DNAT, match (baseline floor)"
		fDNATMiss = "minimal DNAT, no match (baseline floor)"
		fPass1    = "XDP_PASS only, repeat=1 (baseline)"
		fDNAT1    = "minimal DNAT, match, repeat=1 (baseline floor)"
		fEst      = "established flow"
		fReply    = "backend reply (reverse NAT)"
		fPT       = "pass-through, non-VIP port"
		fPTVIP    = "pass-through, VIP port, non-VIP address"
		fNew      = "new flow SYN (Maglev pick + conntrack insert + event)"
		fSteer    = "new flow, picked backend in probation (steered)"
		fProbe    = "new flow, picked backend in probation (probe admitted)"
		fFull     = "new flow into a full conntrack (every insert evicts)"
		fFullP99  = "new flow into a full conntrack, p99 of single calls"
		fEst6     = "established flow, IPv6"
		fNew6     = "new flow SYN, IPv6"
		fFlKnown  = "floor: known flow (one LRU lookup, rewrite)"
		fFlNew    = "floor: new flow (VIP lookup, Maglev read, LRU insert, rewrite)"
		fFlFull   = "floor: new flow into a full LRU (every insert evicts)"
		fFlFull99 = "floor: new flow into a full LRU, p99 of single calls"
	)
	frames := struct{ dnat, miss, pass, ptVIP frame }{
		dnat:  tcpFrame(pkClient, pkA, bpftest.ACK),
		miss:  tcpFrame(netip.MustParseAddrPort("198.18.0.2:40000"), pkNode, bpftest.ACK),
		pass:  tcpFrame(netip.MustParseAddrPort("198.18.0.2:40000"), pkNode, bpftest.ACK),
		ptVIP: tcpFrame(netip.MustParseAddrPort("198.18.0.2:40000"), netip.AddrPortFrom(pkNotVIP, 80), bpftest.ACK),
	}
	type step struct {
		part, name, base string
		run              func() (float64, error)
	}
	steps := []step{
		{"packet", fPass, "", func() (float64, error) {
			return r.repeatRun(r.base.XdpPass, frames.pass, rep, unchanged(frames.pass))
		}},
		{"packet", fDNAT, "", func() (float64, error) {
			return r.repeatRun(r.base.MinDnat, frames.dnat, rep, ended(pkClient, pkB))
		}},
		{"packet", fDNATMiss, "", func() (float64, error) {
			return r.repeatRun(r.base.MinDnat, frames.miss, rep, unchanged(frames.miss))
		}},
		{"packet", fEst, fDNAT, func() (float64, error) {
			return counted(func() (float64, error) { return r.established(pkClient, pkA, pkB, 10, 11, rep) })
		}},
		{"floor", fFlKnown, "", func() (float64, error) { return r.floorKnown(rep, false) }},
		{"floor", flKnownW, "", func() (float64, error) { return r.floorKnown(rep, true) }},
		{"packet", fReply, fDNAT, func() (float64, error) { return counted(func() (float64, error) { return r.reply(rep) }) }},
		{"packet", fPT, fDNATMiss, func() (float64, error) {
			return counted(func() (float64, error) { return r.passThrough(frames.pass, rep) })
		}},
		{"packet", fPTVIP, fDNATMiss, func() (float64, error) {
			return counted(func() (float64, error) { return r.passThrough(frames.ptVIP, rep) })
		}},
		{"packet", fPass1, "", func() (float64, error) { return r.newFlows(nfXDPPass, o.NewFlows) }},
		{"packet", fDNAT1, "", func() (float64, error) { return r.newFlows(nfMinDNAT, o.NewFlows) }},
		{"packet", fNew, fDNAT1, func() (float64, error) { return r.newFlows(nfPlain, o.NewFlows) }},
		{"floor", fFlNew, "", func() (float64, error) { return r.floorNew(o.NewFlows, false, false) }},
		{"floor", flNewW, "", func() (float64, error) { return r.floorNew(o.NewFlows, false, true) }},
		{"packet", fSteer, fDNAT1, func() (float64, error) { return r.newFlows(nfSteered, o.NewFlows) }},
		{"packet", fProbe, fDNAT1, func() (float64, error) { return r.newFlows(nfProbe, o.NewFlows) }},
		{"packet", "new flow, a Linux client's SYN (MSS, SACK, timestamps, window scale: 20 bytes of options)", fNew, func() (float64, error) { return r.newFlows(nfLinuxSYN, o.NewFlows) }},
		{"packet", "new flow to a service lately kube-proxy's (the kernel's conntrack entry of the SYN's tuple looked up)", fNew, func() (float64, error) { return r.newFlows(nfTakenOver, o.NewFlows) }},
		{"packet", "new flow to a service with sessionAffinity ClientIP (the client's pin looked up and written; the bench's clients share an address per 32768 flows)", fNew, func() (float64, error) { return r.newFlows(nfAffinity, o.NewFlows) }},
		{"packet", fFull, fDNAT1, func() (float64, error) { return r.newFlows(nfFullCT, o.NewFlows) }},
		// The tail of the row above's calls, in the same round.
		{"packet", fFullP99, "", func() (float64, error) { return r.fullP99, nil }},
		{"floor", fFlFull, "", func() (float64, error) { return r.floorNew(o.NewFlows, true, false) }},
		{"floor", fFlFull99, "", func() (float64, error) { return r.floorFullP99, nil }},
		{"floor", flFullSlowPB, "", func() (float64, error) { return r.fullSlow, nil }},
		{"floor", flFullSlow, "", func() (float64, error) { return r.floorFullSlow, nil }},
		{"floor", flFull999PB, "", func() (float64, error) { return r.fullP999, nil }},
		{"floor", flFull999, "", func() (float64, error) { return r.floorFullP999, nil }},
		{"packet", "new flow SYN, retryRefused (the SYN copied for a replay)", fNew, func() (float64, error) { return r.newFlows(nfReplay, o.NewFlows) }},
		{"packet", "flood SYN the SYN guard drops (untrusted source, budget spent)", fDNAT1, func() (float64, error) { return r.guardDrops(o.NewFlows) }},
		{"packet", fEst6, fEst, func() (float64, error) {
			return counted(func() (float64, error) { return r.established(pkClient6, pkA6, pkB6, 20, 21, rep) })
		}},
		{"packet", fNew6, fNew, func() (float64, error) { return r.newFlows6(o.NewFlows) }},
		{"breaker", "new flow, limit: maxInflight", "new flow, no limit (check off)", func() (float64, error) { return r.newFlows(nfLimit, o.NewFlows) }},
		{"breaker", "new flow, limit: maxInflight + maxInflightPerBackend", "new flow, no limit (check off)", func() (float64, error) { return r.newFlows(nfLimitBE, o.NewFlows) }},
		{"breaker", "established flow, limit: maxInflight", "established flow, no limit (check off)", func() (float64, error) {
			return counted(func() (float64, error) { return r.established(pkClient, pkA2, pkB2, 12, 13, rep) })
		}},
	}
	for round := range o.Rounds {
		for _, s := range steps {
			v, err := s.run()
			if err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			fig(s.part, s.name, s.base).Samples = append(fig(s.part, s.name, s.base).Samples, v)
		}
		if err := tripFigures(r, res, o.Trips); err != nil {
			return err
		}
		if len(variants) > 0 {
			if err := r.variantRound(res, variants, rep, o.NewFlows); err != nil {
				return err
			}
		}
		logf("packet: round %d/%d: established %.1f ns, new flow %.1f ns, minimal DNAT %.1f ns, tripping RST p99 %.0f ns", round+1, o.Rounds,
			last(res.find("packet", fEst)), last(res.find("packet", fNew)), last(res.find("packet", fDNAT)),
			last(res.find("trip", fTrip+", p99")))
	}
	// The breaker's baselines are the packet part's figures, under names
	// that say what they are here.
	nl := fig("breaker", "new flow, no limit (check off)", "")
	nl.Samples = res.find("packet", fNew).Samples
	el := fig("breaker", "established flow, no limit (check off)", "")
	el.Samples = res.find("packet", fEst).Samples
	// Keep the breaker rows in a readable order: baselines first.
	reorderBreaker(res)
	floorFigures(res, fig)
	if len(variants) > 0 {
		variantFigures(res, variants, r)
	}

	for _, f := range res.Figures {
		if f.Part == "packet" && (f.Name == fEst || f.Name == fReply || f.Name == fPT || f.Name == fPTVIP || f.Name == fEst6) {
			f.Note = rs
		}
	}
	res.note("packet", "Kernel-measured time per run (BPF_PROG_TEST_RUN's `duration`, taken with ktime_get_ns around the program). Repeat paths: one call of %d runs per round; the kernel reuses one packet buffer, so each path is built so that every run takes it again: established and reply packets alternate between two flows whose backends are each other's VIP (A→B, B→A), so every run does a full DNAT with a real address change and checksum update. After each call the final packet is parsed with an independent parser (checksums recomputed) and the per-path counters must have moved by exactly the number of runs (pb_svc_stats packets, pb_be_stats reply_packets, no new flow, no counter at all for pass-through). The VIP-port pass-through packet goes to an address whose pb_vip_slots slot no VIP of the benchmark shares (checked), the case of most traffic that only shares a port with a service.", rep)
	res.note("packet", "New flows: %d SYNs of distinct flows per figure per round, one call with repeat=1 each, median of the per-call kernel times; the baselines are measured the same way (repeat=1 rows), so the ratio is like for like (a repeat=1 time includes one ktime_get_ns pair that a repeat=%d average spreads thin). Each output is checked (backend, port; every 512th fully parsed), and after each batch pb_svc_stats.flows, events read by an outcomes.Reader draining the ring buffer as the agent does, events_lost = 0, ct_create_failed = 0, steered/probe_admitted must match. Conntrack is the agent's default size (%d entries) and is emptied of the batch's entries after each batch, so every round inserts into the same occupancy without LRU eviction.", o.NewFlows, rep, datapath.DefaultConntrackSize)
	res.note("packet", "Maglev tables have %d slots (the default). The minimal DNAT (bench/xdpbase/base.c) is built with the datapath's compiler flags; its match maps A↔B exactly like the datapath's established pair. XDP_PASS after NAT is the datapath's path here (no redirect configured): the same for both.", pkTableSize)
	res.note("packet", "For scale, the issue's reference figures on this kind of machine (not measured in this run): XDP_PASS ≈ 28 ns, minimal DNAT ≈ 66 ns (no match 52 ns), Katran ≈ 187 ns known flow, 399 ns new flow with LRU insert, 91 ns pass-through.")
	res.note("trip", "Kernel trips (issue 14): %d refused flows per figure per round, one BPF_PROG_TEST_RUN (repeat=1) for each flow's SYN and one for its backend's RST (`bpftest.Refusal`: RST|ACK acknowledging the SYN), of which the RST's kernel-measured duration is the figure; the rows are the round's p50, p99 and max over those runs. Tripping: the service's max_failures is 1 and its backend is made active again before each flow, so every RST is its backend's deciding failure and the XDP run that parses it also marks the backend ejected: the run's duration bounds the time from the deciding failure reaching the datapath to the backend being excluded, the issue's reaction measured in the kernel (checked per run: the backend ejected, pb_svc_trip.trips up by one, pb_be_trip.tripped_ns inside that very call). Baseline: the same RST with max_failures 2^30 (counted in the streak, never deciding). Without kernel trips the exclusion waits for the agent: its reaction time (part 4) is the figure to compare, about a millisecond.", o.Trips)
	res.note("breaker", "A limit is configured by setting maxInflight (and maxInflightPerBackend, with the service's backend list in pb_svc_backends) to 2^30, so every flow is counted and none is refused (inflight_rejected and inflight_untracked must stay 0). Services without a limit skip the check entirely, so \"no limit\" is the check disabled. Established packets never touch the counters (only SYN/FIN/RST do): their ratio should be 1.")

	// Targets.
	res.target("packet", "established path ≤ 1.5× minimal DNAT", res.ratio("packet", fEst), 1.5, true, "%.2f×")
	res.target("packet", "reply path ≤ 2× minimal DNAT", res.ratio("packet", fReply), 2, true, "%.2f×")
	res.target("packet", "new flow into a full conntrack: p99 of single calls ≤ 2 µs", res.median("packet", fFullP99)/1000, 2, true, "%.2f µs")
	res.target("packet", "pass-through ≤ 1.2× minimal DNAT's no-match path", res.ratio("packet", fPT), 1.2, true, "%.2f×")
	// The same target on the other pass-through: a packet to a port some
	// service uses, at an address that is no VIP (a pod's egress to :443).
	res.target("packet", "pass-through to a VIP port, non-VIP address ≤ 1.2× minimal DNAT's no-match path", res.ratio("packet", fPTVIP), 1.2, true, "%.2f×")
	res.target("packet", "established under Katran's known flow (187 ns)", res.median("packet", fEst), 187, true, "%.1f ns")
	res.target("packet", "new flow under Katran's new flow (399 ns)", res.median("packet", fNew), 399, true, "%.1f ns")
	res.target("packet", "pass-through under Katran's (91 ns)", res.median("packet", fPT), 91, true, "%.1f ns")
	res.target("packet", "pass-through to a VIP port, non-VIP address under Katran's (91 ns)", res.median("packet", fPTVIP), 91, true, "%.1f ns")
	res.target("packet", "IPv6 established path ≤ 1.2× IPv4's (same build, same run)", res.ratio("packet", fEst6), 1.2, true, "%.2f×")
	res.target("packet", "IPv6 new-flow path ≤ 1.2× IPv4's (same build, same run)", res.ratio("packet", fNew6), 1.2, true, "%.2f×")
	floorTargets(res)
	res.target("trip", "reaction (deciding failure → endpoint excluded), kernel-measured p99 < 50 µs", res.median("trip", fTrip+", p99")/1000, 50, true, "%.2f µs")
	return nil
}

func last(f *Figure) float64 {
	if f == nil || len(f.Samples) == 0 {
		return math.NaN()
	}
	return f.Samples[len(f.Samples)-1]
}

func reorderBreaker(res *Results) {
	res.reorder("breaker", []string{"new flow, no limit (check off)", "new flow, limit: maxInflight", "new flow, limit: maxInflight + maxInflightPerBackend",
		"established flow, no limit (check off)", "established flow, limit: maxInflight"})
}

// reorder puts part's figures last, in the order of names (a figure not
// named is dropped from the part).
func (r *Results) reorder(part string, names []string) {
	other, _ := r.split(part)
	var in []*Figure
	for _, n := range names {
		if f := r.find(part, n); f != nil {
			in = append(in, f)
		}
	}
	r.Figures = append(other, in...)
}

// newFlows6 is newFlows(nfPlain) for IPv6: n SYNs of distinct flows to
// pkVIPNew6, one BPF_PROG_TEST_RUN (repeat=1) each, every output parsed;
// the median kernel time. Their conntrack entries are removed after.
func (r *packetRig) newFlows6(n int) (float64, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	backends := map[netip.AddrPort]bool{}
	for _, b := range pkBackend6 {
		backends[netip.MustParseAddrPort(b)] = true
	}
	before, err := r.snapshot([]uint32{22}, nil)
	if err != nil {
		return 0, err
	}
	durs := make([]float64, 0, n)
	keys := make([]bpf.LbCtKey, 0, 2*n)
	// One frame re-addressed in place, as the IPv4 rows do: building a
	// frame per run would leave the caches colder for each run.
	pkt := frame(bpftest.TCP(pkClient6, pkVIPNew6, bpftest.SYN, nil))
	for i := range n {
		seq := r.nextClient()
		a := pkClient6.Addr().As16()
		a[12], a[13], a[14], a[15] = byte(i>>8), byte(i), byte(seq.Port()>>8), byte(seq.Port())
		c := netip.AddrPortFrom(netip.AddrFrom16(a), seq.Port())
		copy(pkt[14+8:], a[:])
		binary.BigEndian.PutUint16(pkt[14+40:], c.Port())
		csum.SetTCP6(pkt)
		ret, sz, ns, err := testRun(r.dp.PbXdp, pkt, r.out, 1)
		if err != nil {
			return 0, err
		}
		if ret != bpftest.XDPPass {
			return 0, fmt.Errorf("IPv6 new flow from %v: verdict %d", c, ret)
		}
		// The destination is the output's [38:54] and [56:58]; every 512th
		// output is parsed in full (checksum included), as for IPv4.
		out := r.out[:sz]
		dst := netip.AddrPortFrom(netip.AddrFrom16([16]byte(out[14+24:14+40])), binary.BigEndian.Uint16(out[14+42:]))
		if !backends[dst] {
			return 0, fmt.Errorf("IPv6 new flow from %v went to %v", c, dst)
		}
		if i%512 == 0 {
			if p, err := bpftest.Parse(out); err != nil || p.Dst != dst {
				return 0, fmt.Errorf("IPv6 new flow output: %v (%v)", err, p.Dst)
			}
		}
		p := struct{ Dst netip.AddrPort }{dst}
		durs = append(durs, float64(ns))
		var f, rv bpf.LbCtKey
		f.Src.Bytes, f.Dst.Bytes = maps.Addr16(c.Addr()), maps.Addr16(pkVIPNew6.Addr())
		f.Sport, f.Dport = maps.Port(c.Port()), maps.Port(pkVIPNew6.Port())
		f.Proto, f.Dir, f.Family = 6, maps.DirFwd, maps.FamilyIPv6
		rv.Src.Bytes, rv.Dst.Bytes = maps.Addr16(p.Dst.Addr()), f.Src.Bytes
		rv.Sport, rv.Dport = maps.Port(p.Dst.Port()), f.Sport
		rv.Proto, rv.Dir, rv.Family = 6, maps.DirRev, maps.FamilyIPv6
		keys = append(keys, f, rv)
	}
	deadline := time.Now().Add(2 * time.Second)
	for r.read.Load()-before.events < uint64(n) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	after, err := r.snapshot([]uint32{22}, nil)
	if err != nil {
		return 0, err
	}
	if flows := after.svc[22].Flows - before.svc[22].Flows; flows != uint64(n) {
		return 0, fmt.Errorf("IPv6 new flow: %w: %d new flows counted, want %d", errPath, flows, n)
	}
	if d := after.g.EventsLost - before.g.EventsLost; d != 0 {
		return 0, fmt.Errorf("IPv6 new flow: %w: %d events lost", errPath, d)
	}
	if got, err := r.dp.PbCtV2.BatchDelete(keys, nil); err != nil || got != len(keys) {
		return 0, fmt.Errorf("IPv6 conntrack cleanup: deleted %d of %d: %v", got, len(keys), err)
	}
	return median(durs), nil
}
