// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// ctFlow is a flow's two conntrack keys, for the expiry tests: client i
// of 198.18.x.x to a VIP, balanced to a backend.
func ctFlow(i int) (fk, rk bpf.LbCtKey) {
	client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)}), uint16(1024+i%50000))
	vip := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, 100, 1}), 80)
	backend := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, 1, byte(i % 7)}), 8080)
	return bpftest.FlowKeys(client, vip, backend)
}

// expireCase is one flow handed to ExpireCT: which of its entries the
// table holds, with which start, what is asked, and what must come back.
type expireCase struct {
	name             string
	revAt, fwdAt     uint64 // created_ns of the entry in the table; 0: none
	askRev, askFwd   bool
	wantRev, wantFwd uint8
	revLeft, fwdLeft bool // the entry is still there after
}

// The sweep's expiries: each entry goes only if it still has the flow's
// start, the forward entry only once the reverse one went; and the
// program (pb_ct_expire_run, in batches) does exactly what the system
// calls do, in every case and past one batch.
func TestExpireCT(t *testing.T) {
	const start = 1000
	cases := []expireCase{
		{"both halves the flow's", start, start, true, true, maps.ExpireDeleted, maps.ExpireDeleted, false, false},
		{"reverse entry reused", start + 1, start, true, true, maps.ExpireOther, maps.ExpireUnasked, true, true},
		{"reverse entry gone", 0, start, true, true, maps.ExpireAbsent, maps.ExpireUnasked, false, true},
		{"forward entry reused", start, start + 1, true, true, maps.ExpireDeleted, maps.ExpireOther, false, true},
		{"forward entry gone", start, 0, true, true, maps.ExpireDeleted, maps.ExpireAbsent, false, false},
		{"reverse half only", start, start, true, false, maps.ExpireDeleted, maps.ExpireUnasked, false, true},
		{"forward half only", start, start, false, true, maps.ExpireUnasked, maps.ExpireDeleted, true, false},
		{"forward half only, reused", 0, start + 1, false, true, maps.ExpireUnasked, maps.ExpireOther, false, true},
		{"forward half only, gone", 0, 0, false, true, maps.ExpireUnasked, maps.ExpireAbsent, false, false},
	}
	// Past one batch (PB_CT_EXPIRE_BATCH, 1024): the first case again.
	const bulk = 2500
	for _, prog := range []bool{true, false} {
		t.Run(fmt.Sprintf("program=%v", prog), func(t *testing.T) {
			// An eighth full at most: an LRU map may evict before it is.
			l := bpftest.LoadSweep(t, 1<<16, prog)
			m := l.Maps
			ct := l.LbMaps.PbCtV2
			var flows []maps.CTExpire
			var want []expireCase
			for i := range len(cases) + bulk {
				c := cases[0]
				if i < len(cases) {
					c = cases[i]
				}
				fk, rk := ctFlow(i)
				for _, e := range []struct {
					k  bpf.LbCtKey
					at uint64
				}{{rk, c.revAt}, {fk, c.fwdAt}} {
					if e.at != 0 {
						if err := ct.Put(e.k, bpf.LbCtValue{CreatedNs: e.at, SvcId: 1}); err != nil {
							t.Fatal(err)
						}
					}
				}
				x := maps.CTExpire{CreatedNs: start}
				if c.askRev {
					x.Rev = rk
				}
				if c.askFwd {
					x.Fwd = fk
				}
				flows, want = append(flows, x), append(want, c)
			}
			deleted, err := m.ExpireCT(flows)
			if err != nil {
				t.Fatal(err)
			}
			if m.CTExpireProgram() != prog {
				t.Fatalf("after ExpireCT: the program in use %v, want %v", m.CTExpireProgram(), prog)
			}
			wantDeleted := 0
			for i, c := range want {
				x := flows[i]
				if x.RevResult != c.wantRev || x.FwdResult != c.wantFwd {
					t.Errorf("%s (flow %d): results %d, %d; want %d, %d", c.name, i, x.RevResult, x.FwdResult, c.wantRev, c.wantFwd)
				}
				fk, rk := ctFlow(i)
				for _, e := range []struct {
					k    bpf.LbCtKey
					left bool
					what string
				}{{rk, c.revLeft, "reverse"}, {fk, c.fwdLeft, "forward"}} {
					var v bpf.LbCtValue
					err := ct.Lookup(e.k, &v)
					if left := err == nil; left != e.left {
						t.Errorf("%s (flow %d): %s entry left %v, want %v (%v)", c.name, i, e.what, left, e.left, err)
					} else if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
						t.Fatal(err)
					}
				}
				for _, r := range []uint8{x.RevResult, x.FwdResult} {
					if r == maps.ExpireDeleted {
						wantDeleted++
					}
				}
			}
			if deleted != wantDeleted {
				t.Errorf("deleted %d entries, want %d", deleted, wantDeleted)
			}
		})
	}
}

// A program that fails (here: closed under the maps) is not run again:
// the flows it was given are expired by system calls all the same, its
// error is returned that once, and the next ExpireCT does without it.
func TestExpireCTAfterTheProgramFails(t *testing.T) {
	l := bpftest.LoadSweep(t, 1<<16, true)
	m := l.Maps
	l.PbCtExpireRun.Close()
	for round := range 2 {
		fk, rk := ctFlow(round)
		for _, k := range []bpf.LbCtKey{fk, rk} {
			if err := l.LbMaps.PbCtV2.Put(k, bpf.LbCtValue{CreatedNs: 5}); err != nil {
				t.Fatal(err)
			}
		}
		flows := []maps.CTExpire{{Rev: rk, Fwd: fk, CreatedNs: 5}}
		deleted, err := m.ExpireCT(flows)
		if (err != nil) != (round == 0) {
			t.Errorf("round %d: error %v; want one in the first round only", round, err)
		}
		if deleted != 2 || flows[0].RevResult != maps.ExpireDeleted || flows[0].FwdResult != maps.ExpireDeleted {
			t.Errorf("round %d: deleted %d, results %d, %d; want 2, both deleted", round, deleted, flows[0].RevResult, flows[0].FwdResult)
		}
		if m.CTExpireProgram() {
			t.Errorf("round %d: the program still in use", round)
		}
	}
}

// A sweep through the program and one through system calls leave the
// same table and give the same result, over flows of every kind the
// sweep judges: live, closed and idle, idle with its forward tuple taken
// by a new flow, a forward entry without its reverse half (idle, and
// recent), moved off to another backend.
func TestSweepProgramAsSyscalls(t *testing.T) {
	var got []sweepOutcome
	for _, prog := range []bool{true, false} {
		t.Run(fmt.Sprintf("program=%v", prog), func(t *testing.T) {
			got = append(got, sweepOnce(t, prog))
		})
	}
	if len(got) != 2 {
		t.Fatal("a sweep failed")
	}
	a, b := got[0], got[1]
	if a.res.Entries != b.res.Entries || a.res.Expired != b.res.Expired || a.res.Released != b.res.Released || a.res.Counted != b.res.Counted {
		t.Errorf("program: %+v\nsyscalls: %+v", a.res, b.res)
	}
	for _, set := range []struct {
		what string
		x, y int
	}{{"services", len(a.res.InUse.Services), len(b.res.InUse.Services)}, {"backends", len(a.res.InUse.Backends), len(b.res.InUse.Backends)}, {"VIPs", len(a.res.InUse.VIPs), len(b.res.InUse.VIPs)}} {
		if set.x != set.y {
			t.Errorf("in use: %d %s through the program, %d through system calls", set.x, set.what, set.y)
		}
	}
	if !slices.Equal(a.left, b.left) {
		t.Errorf("the program left %d entries, the system calls %d, not the same", len(a.left), len(b.left))
	}
}

// sweepOutcome is what a sweep gave and left: its result, and the keys
// left in conntrack, sorted.
type sweepOutcome struct {
	res  conntrack.Result
	left []string
}

// sweepOnce fills conntrack with 3,000 flows of six kinds, sweeps it once
// (through pb_ct_expire_run or not), checks what must go went, and
// returns the result and the keys left.
func sweepOnce(t *testing.T, prog bool) (out sweepOutcome) {
	l := bpftest.LoadSweep(t, 1<<16, prog)
	m, in := l.Maps, l.Inflight
	clocks := conntrack.KernelClocks()
	now := uint64(clocks.Coarse())
	old := now - uint64(time.Hour)
	ct := l.LbMaps.PbCtV2
	put := func(k bpf.LbCtKey, v bpf.LbCtValue) {
		t.Helper()
		if err := ct.Put(k, v); err != nil {
			t.Fatal(err)
		}
	}
	const flows = 3000
	for i := range flows {
		fk, rk := ctFlow(i)
		created := uint64(i) + 1
		fv := bpf.LbCtValue{CreatedNs: created, LastSeenNs: now, SvcId: uint32(1 + i%3), BackendId: uint32(1 + i%7)}
		fv.NatAddr.Bytes, fv.NatPort = rk.Src.Bytes, rk.Sport
		rv := fv
		rv.NatAddr.Bytes, rv.NatPort = fk.Dst.Bytes, fk.Dport
		fv.Flags, rv.Flags = maps.CTClientAcked, maps.CTEstablished
		switch i % 6 {
		case 0: // live
		case 1: // closed, idle past the closed timeout: both halves go
			rv.Flags |= maps.CTClosed
			fv.LastSeenNs, rv.LastSeenNs = old, old
		case 2: // closed and idle, its forward tuple a new flow's since: the reverse half goes
			rv.Flags |= maps.CTClosed
			rv.LastSeenNs = old
			fv.CreatedNs = created + 5_000_000
		case 3: // a forward entry alone (its reverse half evicted), idle: it goes
			fv.LastSeenNs = old
		case 4: // a forward entry alone, recent: it stays, and pins its ids
		case 5: // moved off (PB_CT_MOVED): the forward entry is the new backend's flow
			rv.Flags |= maps.CTClosed
			rv.LastSeenNs = old
			fv.CreatedNs = created + 1_000_000
		}
		put(fk, fv)
		if k := i % 6; k != 3 && k != 4 {
			put(rk, rv)
		}
	}
	r := &conntrack.Reaper{Maps: m, Inflight: in, Timeouts: conntrack.DefaultTimeouts(), Clocks: clocks}
	res, err := r.Sweep()
	if err != nil {
		t.Fatal(err)
	}
	if res.ExpireErr != nil {
		t.Fatal(res.ExpireErr)
	}
	// Kinds 1, 2, 3 and 5 expire a flow each: 500 flows each.
	if want := 4 * flows / 6; res.Expired != want {
		t.Errorf("expired %d flows, want %d", res.Expired, want)
	}
	left, err := m.Conntrack(0)
	if err != nil {
		t.Fatal(err)
	}
	// Left: kind 0's two entries and the forward entries of kinds 2, 4, 5.
	if want := flows / 6 * 5; len(left) != want {
		t.Errorf("%d entries left, want %d", len(left), want)
	}
	for _, e := range left {
		out.left = append(out.left, fmt.Sprint(e.Key))
	}
	slices.Sort(out.left)
	out.res = res
	return out
}
