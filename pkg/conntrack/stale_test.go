// SPDX-License-Identifier: Apache-2.0

package conntrack

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// A sweep's snapshot is old by the time it deletes: the datapath may have
// reused a tuple for a new flow, or the LRU dropped an entry. Closed idle
// flows whose table changes after the snapshot, four ways, through the
// sweep's program and through system calls:
//   - untouched: both halves go, one flow expired;
//   - its tuple reused by a new flow (both halves rewritten with another
//     start): nothing goes, and the tuple's ids stay in use;
//   - its reverse half gone: the forward half goes, one flow expired;
//   - both halves gone: nothing to do, nothing counted.
func TestSweepAfterTheSnapshot(t *testing.T) {
	for _, prog := range []bool{true, false} {
		t.Run(fmt.Sprintf("program=%v", prog), func(t *testing.T) {
			l := bpftest.LoadSweep(t, 1<<16, prog)
			d, m, in := l.Datapath, l.Maps, l.Inflight
			clocks := KernelClocks()
			now := uint64(clocks.Coarse())
			old := now - uint64(time.Hour)
			ct := d.LbMaps.PbCtV2
			put := func(k bpf.LbCtKey, v bpf.LbCtValue) {
				t.Helper()
				if err := ct.Put(k, v); err != nil {
					t.Fatal(err)
				}
			}
			// Past one batch (1,024) of each kind's: the deferred results
			// of a full batch are applied mid-sweep.
			const flows = 4 * 1500
			type flow struct {
				fk, rk bpf.LbCtKey
				fv, rv bpf.LbCtValue
			}
			all := make([]flow, flows)
			for i := range all {
				client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)}), uint16(1024+i))
				vip := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, 100, 1}), 80)
				rk, rv := reverseEntry(client, vip, netip.MustParseAddrPort("198.19.1.1:8080"))
				f := flow{rk: rk, rv: rv}
				f.fk = ForwardKey(rk, rv)
				f.fv.NatAddr.Bytes, f.fv.NatPort = rk.Src.Bytes, rk.Sport
				f.fv.CreatedNs, f.rv.CreatedNs = uint64(i)+1, uint64(i)+1
				f.fv.LastSeenNs, f.rv.LastSeenNs = old, old
				f.fv.SvcId, f.rv.SvcId = 1, 1
				f.fv.BackendId, f.rv.BackendId = 1, 1
				f.fv.Flags = maps.CTClientAcked
				f.rv.Flags = maps.CTEstablished | maps.CTClosed
				put(f.fk, f.fv)
				put(f.rk, f.rv)
				all[i] = f
			}
			r := &Reaper{Maps: m, Inflight: in, Timeouts: DefaultTimeouts(), Clocks: clocks}
			r.afterSnapshot = func() {
				for i, f := range all {
					switch i % 4 {
					case 1: // reused: a new flow, of service 7, on both halves
						nf, nr := f.fv, f.rv
						nf.CreatedNs, nr.CreatedNs = uint64(i)+1_000_000, uint64(i)+1_000_000
						nf.LastSeenNs, nr.LastSeenNs = now, now
						nf.SvcId, nr.SvcId = 7, 7
						nf.BackendId, nr.BackendId = 9, 9
						nr.Flags = maps.CTEstablished
						put(f.fk, nf)
						put(f.rk, nr)
						// Counted by the breaker, long ago as the flow
						// table's clock goes: kept only if its entry lives.
						if err := d.LbMaps.PbFlows.Put(f.fk, bpf.LbFlowValue{SvcId: 7, BackendId: 9, CreatedNs: 1}); err != nil {
							t.Fatal(err)
						}
					case 2:
						if err := ct.Delete(f.rk); err != nil {
							t.Fatal(err)
						}
					case 3:
						if err := ct.Delete(f.rk); err != nil {
							t.Fatal(err)
						}
						if err := ct.Delete(f.fk); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
			res, err := r.Sweep()
			if err != nil {
				t.Fatal(err)
			}
			if res.ExpireErr != nil || m.CTExpireProgram() != prog {
				t.Fatalf("the program: error %v, in use %v after the sweep; want none, %v", res.ExpireErr, m.CTExpireProgram(), prog)
			}
			if want := flows / 4; res.Counted != want || res.Released != 0 {
				t.Errorf("breaker flows: %d counted, %d released; want %d, 0", res.Counted, res.Released, want)
			}
			if want := flows / 2; res.Expired != want {
				t.Errorf("expired %d flows, want %d (untouched and reverse-half-gone ones)", res.Expired, want)
			}
			// The reused tuples' entries live on: the ids the snapshot
			// had for them (1) and their counted flows' (7, 9) stay in
			// use, nothing else's.
			if u := res.InUse; len(u.Services) != 2 || !u.Services[1] || !u.Services[7] ||
				len(u.Backends) != 2 || !u.Backends[1] || !u.Backends[9] {
				t.Errorf("in use: services %v, backends %v; want 1 and 7, 1 and 9", u.Services, u.Backends)
			}
			left, err := m.Conntrack(0)
			if err != nil {
				t.Fatal(err)
			}
			if want := 2 * flows / 4; len(left) != want {
				t.Errorf("%d entries left, want %d (the new flows')", len(left), want)
			}
			for _, e := range left {
				if e.Value.SvcId != 7 {
					t.Errorf("left %+v, not a new flow's", e.Key)
					break
				}
			}
		})
	}
}
