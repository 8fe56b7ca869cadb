// SPDX-License-Identifier: Apache-2.0

package conntrack

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
)

// sweepTable is a conntrack table, its counted flows and their breaker
// counts, as a test writes them into the maps.
type sweepTable struct {
	ct    map[bpf.LbCtKey]bpf.LbCtValue
	flows map[bpf.LbCtKey]bpf.LbFlowValue
	svcs  map[uint32]int64 // pb_svc_inflight
	bes   map[uint32]int64 // pb_be_inflight
}

// randomSweepTable draws n flows of every shape the sweep judges: both
// halves, one half, a flow moved off its first backend (with or without
// its new backend's answer); TCP in each state and UDP; IPv4 and IPv6;
// each half last seen from now to hours ago; counted by a breaker or not,
// and counted flows whose entries are gone, young and old.
func randomSweepTable(rng *rand.Rand, n int, coarse, mono uint64) sweepTable {
	t := sweepTable{ct: map[bpf.LbCtKey]bpf.LbCtValue{}, flows: map[bpf.LbCtKey]bpf.LbFlowValue{},
		svcs: map[uint32]int64{}, bes: map[uint32]int64{}}
	ages := []time.Duration{0, 3 * time.Second, 9 * time.Second, 11 * time.Second, 50 * time.Second,
		70 * time.Second, 5 * time.Hour, 7 * time.Hour}
	seen := func() uint64 { return coarse - uint64(ages[rng.IntN(len(ages))]) }
	addr := func(v6 bool, a, b, c byte) netip.Addr {
		if v6 {
			return netip.AddrFrom16([16]byte{0x20, 0x01, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, a, b, c})
		}
		return netip.AddrFrom4([4]byte{198, 18 + a%2, b, c})
	}
	count := func(fk bpf.LbCtKey, svc, be uint32, created uint64) {
		t.flows[fk] = bpf.LbFlowValue{SvcId: svc, BackendId: be, CreatedNs: created}
		t.svcs[svc]++
		t.bes[be]++
	}
	for i := range n {
		// Ids across several words of the kernel's bitmaps (the test's
		// maps hold 256 of each). A service is of one family: one VIP.
		svc := uint32(1 + rng.IntN(200))
		be := uint32(1 + rng.IntN(250))
		v6 := svc%4 == 0
		client := netip.AddrPortFrom(addr(v6, 0, byte(i>>8), byte(i)), uint16(1024+i))
		vip := netip.AddrPortFrom(addr(v6, 1, 100, byte(svc)), 80)
		backend := netip.AddrPortFrom(addr(v6, 1, 1, byte(be)), 8080)
		rk, rv := reverseEntry(client, vip, backend)
		proto := uint8(6)
		if rng.IntN(8) == 0 {
			proto = 17
		}
		rk.Proto = proto
		fk := ForwardKey(rk, rv)
		var fv bpf.LbCtValue
		fv.NatAddr.Bytes, fv.NatPort = rk.Src.Bytes, rk.Sport
		created := uint64(i+1) * 1000
		fv.CreatedNs, rv.CreatedNs = created, created
		fv.SvcId, rv.SvcId, fv.BackendId, rv.BackendId = svc, svc, be, be
		fv.LastSeenNs, rv.LastSeenNs = seen(), seen()
		if rng.IntN(3) > 0 {
			fv.Flags |= pbmaps.CTClientAcked
		}
		switch rng.IntN(3) {
		case 1:
			rv.Flags |= pbmaps.CTEstablished
		case 2:
			rv.Flags |= pbmaps.CTEstablished | pbmaps.CTClosed
		}
		switch shape := rng.IntN(10); {
		case shape < 6: // both halves
			t.ct[fk], t.ct[rk] = fv, rv
		case shape == 6: // the forward half only
			t.ct[fk] = fv
		case shape == 7: // the reverse half only
			t.ct[rk] = rv
		default: // moved off be to another backend, which answered (8) or not (9)
			rv.Flags |= pbmaps.CTMoved
			t.ct[rk] = rv
			nb := uint32(1 + rng.IntN(250))
			nbackend := netip.AddrPortFrom(addr(v6, 1, 2, byte(nb)), 8080)
			nrk, nrv := reverseEntry(client, vip, nbackend)
			nrk.Proto = proto
			nfv := fv
			nfv.NatAddr.Bytes, nfv.NatPort = nrk.Src.Bytes, nrk.Sport
			nfv.CreatedNs, nrv.CreatedNs = created+1, created+1
			nfv.BackendId, nrv.BackendId = nb, nb
			nrv.SvcId = svc
			nfv.LastSeenNs, nrv.LastSeenNs = seen(), seen()
			nrv.Flags = rv.Flags &^ pbmaps.CTMoved
			t.ct[fk] = nfv
			if shape == 8 {
				t.ct[nrk] = nrv
			}
			be = nb
		}
		if rng.IntN(2) == 0 {
			// Counted, long ago or just now as the flow table's clock goes.
			c := mono - uint64(time.Minute)
			if rng.IntN(4) == 0 {
				c = mono - uint64(time.Second)
			}
			count(fk, svc, be, c)
		}
	}
	// Counted flows with no conntrack entry at all.
	for i := range n / 10 {
		client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, 200, byte(i)}), uint16(2000+i))
		vip := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, 100, 1}), 80)
		fk, _ := bpftest.FlowKeys(client, vip, netip.MustParseAddrPort("198.19.1.1:8080"))
		c := mono - uint64(time.Minute)
		if i%3 == 0 {
			c = mono - uint64(time.Second)
		}
		count(fk, 1+uint32(i%200), 1+uint32(i%250), c)
	}
	return t
}

// write puts t into a freshly loaded datapath's maps.
func (t sweepTable) write(tb testing.TB, l *bpftest.Sweep) {
	tb.Helper()
	for k, v := range t.ct {
		if err := l.Datapath.LbMaps.PbCtV2.Put(k, v); err != nil {
			tb.Fatal(err)
		}
	}
	for k, v := range t.flows {
		if err := l.Datapath.LbMaps.PbFlows.Put(k, v); err != nil {
			tb.Fatal(err)
		}
	}
	for id, n := range t.svcs {
		if err := l.Datapath.LbMaps.PbSvcInflight.Put(id, bpf.LbInflight{Count: n}); err != nil {
			tb.Fatal(err)
		}
	}
	for id, n := range t.bes {
		if err := l.Datapath.LbMaps.PbBeInflight.Put(id, bpf.LbInflight{Count: n}); err != nil {
			tb.Fatal(err)
		}
	}
}

// read is what a sweep left of the table t was written from.
func (t sweepTable) read(tb testing.TB, l *bpftest.Sweep) sweepTable {
	tb.Helper()
	got := sweepTable{ct: map[bpf.LbCtKey]bpf.LbCtValue{}, flows: map[bpf.LbCtKey]bpf.LbFlowValue{},
		svcs: map[uint32]int64{}, bes: map[uint32]int64{}}
	for _, e := range tableEntries(tb, l) {
		got.ct[e.Key] = e.Value
	}
	fl, err := l.Maps.Flows()
	if err != nil {
		tb.Fatal(err)
	}
	for _, f := range fl {
		got.flows[f.Key] = f.Value
	}
	for id := range t.svcs {
		got.svcs[id] = l.Inflight.Service(id)
	}
	for id := range t.bes {
		got.bes[id] = l.Inflight.Backend(id)
	}
	return got
}

// The kernel's sweep (pb_ct_sweep_run) does what the agent's sweep of a
// copy of the table does: the same entries expired, the same counted
// flows released and slots given back, the same ids and VIPs in use, the
// same counts; on random tables of every shape, several seeds. A second
// sweep, after a third of the reverse entries left were dropped (as the
// LRU does) and 15 s passed, must judge the forward entries now without
// their reverse half, and must not report what was in use at the first
// (the young orphans are old by then, and released). Marks an earlier
// agent left (the first sweep's own, on every entry) and a mark that came
// round (the third sweep's, put on before the second) must not make a
// sweep pass an entry by: a third sweep, 15 s on, must
// expire the forward entries without a reverse half that only their
// clients' traffic kept alive at the second. The sweeps after an agent's
// first must still mark (it is what lets the walk pass a flow's second
// half by).
func TestKernelSweepMatchesTheCopy(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			clocks := KernelClocks()
			coarse, mono := uint64(clocks.Coarse()), uint64(clocks.Mono())
			fixed := Clocks{Coarse: func() int64 { return int64(coarse) }, Mono: func() int64 { return int64(mono) }}
			tbl := randomSweepTable(rand.New(rand.NewPCG(seed, 35)), 3000, coarse, mono)

			copyL := bpftest.LoadSweep(t, 1<<14, true)
			kernL := bpftest.LoadSweep(t, 1<<14, true)
			if err := kernL.Maps.UseCTSweep(kernL.Datapath.PbCtSweepRun); err != nil {
				t.Fatal(err)
			}
			tbl.write(t, copyL)
			tbl.write(t, kernL)
			// What the sweeps of the agent before this one left: here the
			// first sweep's own mark, on every entry. Trusted, it would pass
			// the entries without their other half by.
			markAll(t, kernL, nextMark(kernL.Maps.CTSweepMark()))
			copyR := &Reaper{Maps: copyL.Maps, Inflight: copyL.Inflight, Timeouts: DefaultTimeouts(), Clocks: fixed}
			kernR := &Reaper{Maps: kernL.Maps, Inflight: kernL.Inflight, Timeouts: DefaultTimeouts(), Clocks: fixed}
			compareSweeps(t, "first sweep", tbl, copyL, kernL, copyR, kernR)

			dropped := 0
			for k := range tbl.read(t, copyL).ct {
				if k.Dir != pbmaps.DirRev || k.Dport%3 != 0 {
					continue
				}
				for _, l := range []*bpftest.Sweep{copyL, kernL} {
					if err := l.Datapath.LbMaps.PbCtV2.Delete(k); err != nil {
						t.Fatal(err)
					}
				}
				dropped++
			}
			if dropped == 0 {
				t.Fatal("no reverse entry dropped")
			}
			coarse += uint64(15 * time.Second)
			mono += uint64(15 * time.Second)
			// Some forward entries just seen (their clients still send):
			// not due at the second sweep, due at the third.
			if touchForward(t, coarse, copyL, kernL) == 0 {
				t.Fatal("no forward entry touched")
			}
			// A mark that came round (after 65,534 sweeps): the third
			// sweep's, on every entry. The second sweep marks the live
			// flows' second halves anew, and must clear it from the others.
			markAll(t, kernL, nextMark(nextMark(kernL.Maps.CTSweepMark())))
			compareSweeps(t, "second sweep", tbl, copyL, kernL, copyR, kernR)
			if n := countMarked(t, kernL, kernL.Maps.CTSweepMark()); n == 0 {
				t.Fatal("no entry carries the second sweep's mark: it marked nothing")
			}
			coarse += uint64(15 * time.Second)
			mono += uint64(15 * time.Second)
			compareSweeps(t, "third sweep", tbl, copyL, kernL, copyR, kernR)
		})
	}
}

// A due flow's other half is deleted at the walk's next step, and may be
// just ahead of the walk there: the entry the walk is on (its deletion
// must wait for the step after), or the one after it (which kernels since
// 6.15 read before the step, so the walk comes to it deleted). Either way
// each entry counts once and the flow expires once. An unseeded table
// puts the entries there: one bucket holds, in the walk's order, a due
// flow's forward half, a live flow's forward half and the due flow's
// reverse half; another, a due flow's forward half and then its reverse
// half.
func TestKernelSweepDeletesAheadOfItsWalk(t *testing.T) {
	const size = 1 << 10
	l := bpftest.LoadSweepUnseeded(t, size, true)
	if err := l.Maps.UseCTSweep(l.Datapath.PbCtSweepRun); err != nil {
		t.Fatal(err)
	}
	clocks := KernelClocks()
	now := uint64(clocks.Coarse())
	vip := netip.MustParseAddrPort("198.19.100.1:80")
	backend := netip.MustParseAddrPort("198.19.1.1:8080")
	type entry struct {
		k bpf.LbCtKey
		v bpf.LbCtValue
	}
	flow := func(port uint16, seen uint64) (f, r entry) {
		client := netip.AddrPortFrom(netip.MustParseAddr("198.18.0.1"), port)
		rk, rv := reverseEntry(client, vip, backend)
		fv := bpf.LbCtValue{SvcId: 1, BackendId: 1, CreatedNs: uint64(port), LastSeenNs: seen, Flags: pbmaps.CTClientAcked}
		fv.NatAddr.Bytes, fv.NatPort = rk.Src.Bytes, rk.Sport
		rv.SvcId, rv.BackendId, rv.CreatedNs, rv.LastSeenNs = 1, 1, uint64(port), seen
		rv.Flags = pbmaps.CTEstablished | pbmaps.CTClosed
		return entry{ForwardKey(rk, rv), fv}, entry{rk, rv}
	}
	bucket := func(e entry) uint32 { return bpftest.CTBucket(e.k, size) }
	var due [2][2]entry // forward, reverse
	n, port := 0, uint16(1024)
	for ; n < 2 && port < 30000; port++ {
		f, r := flow(port, now-uint64(time.Minute))
		if bucket(f) == bucket(r) && (n == 0 || bucket(f) != bucket(due[0][0])) {
			due[n] = [2]entry{f, r}
			n++
		}
	}
	var live [2]entry
	for ; port < 60000 && live[0].v.CreatedNs == 0; port++ {
		f, r := flow(port, now)
		if bucket(f) == bucket(due[0][0]) && bucket(r) != bucket(due[0][0]) && bucket(r) != bucket(due[1][0]) {
			live = [2]entry{f, r}
		}
	}
	if n < 2 || live[0].v.CreatedNs == 0 {
		t.Fatalf("no flows of the shape wanted below port %d", port)
	}
	// A new entry goes at the head of its bucket: written in the reverse
	// of the walk's order.
	for _, e := range []entry{due[0][1], live[0], due[0][0], due[1][1], due[1][0], live[1]} {
		if err := l.Datapath.LbMaps.PbCtV2.Put(e.k, e.v); err != nil {
			t.Fatal(err)
		}
	}
	r := &Reaper{Maps: l.Maps, Inflight: l.Inflight, Timeouts: DefaultTimeouts(), Clocks: clocks}
	res, err := r.Sweep()
	if err != nil || !res.Kernel || res.KernelErr != nil {
		t.Fatalf("sweep: %v; in the kernel %v (%v)", err, res.Kernel, res.KernelErr)
	}
	if res.Entries != 6 || res.Expired != 2 {
		t.Errorf("swept %d entries, expired %d flows: want 6, 2", res.Entries, res.Expired)
	}
	left := map[bpf.LbCtKey]bool{}
	for _, e := range tableEntries(t, l) {
		left[e.Key] = true
	}
	if len(left) != 2 || !left[live[0].k] || !left[live[1].k] {
		t.Errorf("left %d entries, want the live flow's two: %v", len(left), left)
	}
}

// nextMark is the kernel sweep's mark after m (0 is no sweep's, 0xffff
// an entry's the sweep deleted).
func nextMark(m uint16) uint16 {
	if m++; m == 0 || m == 0xffff {
		m = 1
	}
	return m
}

// tableEntries lists the entries in l's table.
func tableEntries(tb testing.TB, l *bpftest.Sweep) []pbmaps.CTEntry {
	tb.Helper()
	ents, err := l.Maps.ConntrackInto(nil, 0)
	if err != nil {
		tb.Fatal(err)
	}
	return ents
}

// forwardEntries lists the forward entries in l's table.
func forwardEntries(t *testing.T, l *bpftest.Sweep) []pbmaps.CTEntry {
	t.Helper()
	var fwd []pbmaps.CTEntry
	for _, e := range tableEntries(t, l) {
		if e.Key.Dir == pbmaps.DirFwd {
			fwd = append(fwd, e)
		}
	}
	return fwd
}

// markAll gives every entry in l's table mark, as sweeps would have.
func markAll(t *testing.T, l *bpftest.Sweep, mark uint16) {
	t.Helper()
	ents := tableEntries(t, l)
	if len(ents) == 0 {
		t.Fatal("no entry to mark")
	}
	for _, e := range ents {
		e.Value.SweepMark = mark
		if err := l.Datapath.LbMaps.PbCtV2.Put(e.Key, e.Value); err != nil {
			t.Fatal(err)
		}
	}
}

// countMarked counts the entries in l's table that carry mark.
func countMarked(t *testing.T, l *bpftest.Sweep, mark uint16) int {
	t.Helper()
	n := 0
	for _, e := range tableEntries(t, l) {
		if e.Value.SweepMark == mark {
			n++
		}
	}
	return n
}

// touchForward makes a quarter of the forward entries last seen at
// coarse, in each of the tables (the same entries: they hold the same
// flows), and returns how many it touched.
func touchForward(t *testing.T, coarse uint64, ls ...*bpftest.Sweep) int {
	t.Helper()
	n := 0
	for _, e := range forwardEntries(t, ls[0]) {
		if e.Key.Sport%4 != 0 {
			continue
		}
		for _, l := range ls {
			var v bpf.LbCtValue
			if err := l.Datapath.LbMaps.PbCtV2.Lookup(e.Key, &v); err != nil {
				t.Fatal(err)
			}
			v.LastSeenNs = coarse
			if err := l.Datapath.LbMaps.PbCtV2.Put(e.Key, v); err != nil {
				t.Fatal(err)
			}
		}
		n++
	}
	return n
}

// compareSweeps sweeps both tables, the copy's way and the kernel's, and
// compares what each did and left.
func compareSweeps(t *testing.T, what string, tbl sweepTable, copyL, kernL *bpftest.Sweep, copyR, kernR *Reaper) {
	t.Helper()
	want, err := copyR.Sweep()
	if err != nil {
		t.Fatal(err)
	}
	got, err := kernR.Sweep()
	if err != nil {
		t.Fatal(err)
	}
	if want.Kernel || !got.Kernel || got.KernelErr != nil {
		t.Fatalf("%s: copy swept in the kernel %v; kernel %v, err %v", what, want.Kernel, got.Kernel, got.KernelErr)
	}
	if want.Expired == 0 || len(want.InUse.VIPs) == 0 {
		t.Fatalf("%s: the table tests too little: %+v", what, want)
	}
	for _, c := range []struct {
		what      string
		got, want int
	}{{"entries", got.Entries, want.Entries}, {"expired", got.Expired, want.Expired},
		{"released", got.Released, want.Released}, {"counted", got.Counted, want.Counted}} {
		if c.got != c.want {
			t.Errorf("%s: %s: kernel %d, copy %d", what, c.what, c.got, c.want)
		}
	}
	if !maps.Equal(got.InUse.Services, want.InUse.Services) || !maps.Equal(got.InUse.Backends, want.InUse.Backends) ||
		!maps.Equal(got.InUse.VIPs, want.InUse.VIPs) {
		t.Errorf("%s: in use: kernel %v %v %v\ncopy %v %v %v", what, got.InUse.Services, got.InUse.Backends, got.InUse.VIPs,
			want.InUse.Services, want.InUse.Backends, want.InUse.VIPs)
	}
	left, wantLeft := tbl.read(t, kernL), tbl.read(t, copyL)
	if len(wantLeft.ct) == len(tbl.ct) || len(wantLeft.ct) == 0 {
		t.Fatalf("%s: the copy left %d of %d entries", what, len(wantLeft.ct), len(tbl.ct))
	}
	for k := range tbl.ct {
		_, g := left.ct[k]
		_, w := wantLeft.ct[k]
		if g != w {
			t.Errorf("%s: entry %+v: kept by the kernel %v, by the copy %v", what, k, g, w)
		}
	}
	if !reflect.DeepEqual(left.flows, wantLeft.flows) {
		t.Errorf("%s: pb_flows: kernel kept %d, copy %d", what, len(left.flows), len(wantLeft.flows))
	}
	if !maps.Equal(left.svcs, wantLeft.svcs) || !maps.Equal(left.bes, wantLeft.bes) {
		t.Errorf("%s: inflight: kernel %v %v, copy %v %v", what, left.svcs, left.bes, wantLeft.svcs, wantLeft.bes)
	}
}

// The kernel sweep cannot mark an id past its bitmaps (the maps can be
// made bigger than PB_MAX_SERVICES): that sweep is done again on a copy
// of the table, which reports the id in use, and says why. What the
// kernel expired stays expired. A program that fails (here: closed) is
// not run again: its sweep and the later ones copy the table.
func TestKernelSweepFallsBackToTheCopy(t *testing.T) {
	l := bpftest.LoadSweep(t, 1<<14, true)
	if err := l.Maps.UseCTSweep(l.Datapath.PbCtSweepRun); err != nil {
		t.Fatal(err)
	}
	clocks := KernelClocks()
	now := uint64(clocks.Coarse())
	vip := netip.MustParseAddrPort("198.19.100.1:80")
	flow := func(i int, svc uint32, seen uint64) {
		client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 0, byte(i)}), uint16(3000+i))
		rk, rv := reverseEntry(client, vip, netip.MustParseAddrPort("198.19.1.1:8080"))
		fk := ForwardKey(rk, rv)
		fv := bpf.LbCtValue{SvcId: svc, BackendId: 1, CreatedNs: uint64(i + 1), LastSeenNs: seen, Flags: pbmaps.CTClientAcked}
		fv.NatAddr.Bytes, fv.NatPort = rk.Src.Bytes, rk.Sport
		rv.SvcId, rv.BackendId, rv.CreatedNs, rv.LastSeenNs, rv.Flags = svc, 1, uint64(i+1), seen, pbmaps.CTEstablished
		for k, v := range map[bpf.LbCtKey]bpf.LbCtValue{fk: fv, rk: rv} {
			if err := l.Datapath.LbMaps.PbCtV2.Put(k, v); err != nil {
				t.Fatal(err)
			}
		}
	}
	flow(0, 70_000, now)                // live, its service id past the bitmap
	flow(1, 3, now-uint64(8*time.Hour)) // idle past the established timeout
	r := &Reaper{Maps: l.Maps, Inflight: l.Inflight, Timeouts: DefaultTimeouts(), Clocks: clocks}
	res, err := r.Sweep()
	if err != nil {
		t.Fatal(err)
	}
	var inc pbmaps.ErrSweepIncomplete
	if !errors.As(res.KernelErr, &inc) || inc.Failed&pbmaps.SweepFailID == 0 || res.Kernel {
		t.Fatalf("kernel %v, err %v; want the copy, for an id past the bitmap", res.Kernel, res.KernelErr)
	}
	if !res.InUse.Services[70_000] || res.InUse.Services[3] || res.Expired != 1 || res.Entries != 2 {
		t.Errorf("services in use %v, expired %d, entries %d; want 70000 alone, 1, 2", res.InUse.Services, res.Expired, res.Entries)
	}
	if !l.Maps.CTSweepProgram() {
		t.Fatal("the program was dropped for a sweep it could not finish")
	}

	l.Datapath.PbCtSweepRun.Close()
	for round := range 2 {
		res, err := r.Sweep()
		if err != nil {
			t.Fatal(err)
		}
		if res.Kernel || (res.KernelErr != nil) != (round == 0) || !res.InUse.Services[70_000] {
			t.Errorf("round %d: kernel %v, err %v, in use %v; want the copy, an error the first time",
				round, res.Kernel, res.KernelErr, res.InUse.Services)
		}
		if l.Maps.CTSweepProgram() {
			t.Errorf("round %d: the failed program is still used", round)
		}
	}
}
