// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/desired"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/maps/mapsfake"
)

// A restarted agent adopts what the previous one left in the pinned maps
// and, given the same desired state and admissions, changes nothing in the
// kernel: same ids, same entries, same tables, and no fresh probe grant.
func TestAdoption(t *testing.T) {
	web := svc("web", vip1, 80, epn(beA, "ns/a"), epn(beB, "ns/b"), epn(beC, "ns/c"), epn(beD, "ns/d"))
	web.MaxInflight = 500
	api := svc("api", vip2, 443, ep("198.19.2.1:8443"), ep("198.19.2.2:8443"))
	api.Key.Protocol = desired.UDP
	gone := svc("gone", vip3, 80, ep("198.19.3.1:9090"))

	for _, tc := range []struct {
		name    string
		reorder bool // the new agent lists web's endpoints in another order
	}{
		{name: "same state"},
		{name: "endpoints in another order", reorder: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			// The previous agent's life.
			e.apply(web, api, gone)
			w := e.service(web.Key)
			a, b, c, d := e.bid(web.Key, beA), e.bid(web.Key, beB), e.bid(web.Key, beC), e.bid(web.Key, beD)
			apiS := e.service(api.Key)
			apiIDs := slices.Clone(apiS.Backends)
			goneID := e.service(gone.Key).Backends[0]
			e.program(w.ID, []uint32{a, b}, nil, false)
			e.program(w.ID, []uint32{a, b}, []uint32{c}, false) // d stays ejected
			e.program(apiS.ID, apiIDs, nil, false)
			// gone is removed while the old agent runs: its backend is
			// left removed, not yet freed. (This Apply prepares api's
			// spare table: both services have both tables.)
			e.apply(web, api)
			e.spendGrants(c) // the kernel admitted the probe
			webID, apiID := w.ID, apiS.ID
			e.checkKernel()
			for _, id := range []uint32{webID, apiID} {
				if got, _ := e.f.TableSizes(id); got != [2]uint32{testTableSize, testTableSize} {
					t.Fatalf("setup: service %d has tables %v, want both", id, got)
				}
			}
			before := snapshotOf(e.f)
			liveBefore := map[uint32][]uint32{
				webID: slices.Clone(e.liveTable(web.Key)),
				apiID: slices.Clone(e.liveTable(api.Key)),
			}
			e.f.TakeOps()

			// Restart.
			e.clk.Step(time.Hour)
			restartAt := e.clk.Now()
			e.restart()
			if ops := e.f.TakeOps(); len(ops) != 0 {
				t.Errorf("New wrote %s", opsString(ops))
			}
			wantAdopted := map[desired.Key]map[netip.AddrPort]uint32{
				web.Key: {mustAP(beA): a, mustAP(beB): b, mustAP(beC): c, mustAP(beD): d},
				api.Key: {api.Endpoints[0].Addr: apiIDs[0], api.Endpoints[1].Addr: apiIDs[1]},
			}
			if got := e.r.Adopted(); !adoptedEqual(got, wantAdopted) {
				t.Errorf("Adopted() = %v, want %v", got, wantAdopted)
			}
			if s, ok := e.r.ServiceByKey(web.Key); !ok || s.ID != webID {
				t.Errorf("web not adopted with id %d", webID)
			} else if s.sizes != [2]uint32{testTableSize, testTableSize} {
				t.Errorf("web adopted with table sizes %v", s.sizes)
			}
			if s, ok := e.r.ServiceByKey(api.Key); !ok || s.ID != apiID {
				t.Errorf("api not adopted with id %d", apiID)
			}
			if _, ok := e.r.ServiceByKey(gone.Key); ok {
				t.Error("removed service adopted")
			}
			for id, st := range map[uint32]pbmaps.BackendState{
				a: pbmaps.BackendActive, b: pbmaps.BackendActive, c: pbmaps.BackendProbation,
				d: pbmaps.BackendEjected, goneID: pbmaps.BackendRemoved,
			} {
				if be, ok := e.r.Backend(id); !ok || be.State != st {
					t.Errorf("Backend(%d) = %+v, %v; want state %s", id, be, ok, st)
				}
			}

			// The new agent's first Apply.
			desiredWeb := web
			if tc.reorder {
				desiredWeb.Endpoints = []desired.Endpoint{web.Endpoints[3], web.Endpoints[1], web.Endpoints[0], web.Endpoints[2]}
			}
			changes := e.apply(desiredWeb, api)
			ops := e.f.TakeOps()
			// Only the removed service's VIP slot may go: the new agent does
			// not know its key, and no sweep reported flows to it.
			if len(ops) > 1 || (len(ops) == 1 && ops[0].Kind != opSetVIPSlots) {
				t.Errorf("first Apply after a restart wrote %s", opsString(ops))
			}
			if gs := pbmaps.VIPSlot(gone.Key.VIP); e.f.PbVIPSlots[gs] && gs != pbmaps.VIPSlot(web.Key.VIP) && gs != pbmaps.VIPSlot(api.Key.VIP) {
				t.Errorf("the removed service's VIP slot is still marked")
			}
			if !tc.reorder && len(changes) != 0 {
				t.Errorf("changes %+v", changes)
			}
			for _, ch := range changes {
				if len(ch.Retired) != 0 || ch.Removed {
					t.Errorf("change %+v after adopting the same state", ch)
				}
			}
			// Names come from the desired state, without a write.
			if be, _ := e.r.Backend(a); be.Name != "ns/a" {
				t.Errorf("backend %d name %q", a, be.Name)
			}
			if s := e.service(web.Key); s.Spec.Name != "web" {
				t.Errorf("adopted service name %q", s.Spec.Name)
			}

			// Accrual restored from its own state admits the same sets.
			// Each service's spare table is refilled and flipped to; none
			// is installed (both exist at the right size).
			spares := map[uint32]uint32{webID: e.spare(webID), apiID: e.spare(apiID)}
			e.program(webID, []uint32{a, b}, []uint32{c}, false)
			e.program(apiID, apiIDs, nil, false)
			ops = e.f.TakeOps()
			if n := count(ops, kindIs(opSetBackend, opClearBackend, opDeleteService, opInstallTables,
				opResetBeStats, opResetSvcStats, opSetPorts)); n != 0 {
				t.Errorf("programming adopted services wrote entries: %s", opsString(ops))
			}
			for id, n := range spares {
				inOrder(t, ops, "refill the spare, flip", fill(id, n), flip(id, n, testTableSize))
				if n := count(ops, is(opUpsertService, id)); n != 1 {
					t.Errorf("service %d written %d times, want the flip only: %s", id, n, opsString(ops))
				}
			}
			// The probe's grant was spent before the restart and stays spent.
			e.wantKernelState(c, pbmaps.BackendProbation, 0)
			// Tables are rebuilt byte for byte: the live tables hold what
			// they held, the values changed only in which table is live.
			after := snapshotOf(e.f)
			for k, v := range before.services {
				w := after.services[k]
				if w.Table != 1-v.Table {
					t.Errorf("service %d: table %d, want a flip from %d", v.Id, w.Table, v.Table)
				}
				w.Table = v.Table
				after.services[k] = w
				if got, _ := e.f.Installed(v.Id, 1-v.Table); !slices.Equal(got, liveBefore[v.Id]) {
					t.Errorf("service %d: live table differs from the one before the restart", v.Id)
				}
			}
			before.tables, after.tables = nil, nil
			before.diff(t, after)
			e.checkKernel()

			// Removed backends are freed a cooldown after the restart.
			e.sweep(InUse{})
			if _, ok := e.r.Backend(goneID); !ok {
				t.Error("removed backend freed right at restart")
			}
			e.clk.SetTime(restartAt.Add(testCooldown))
			e.sweep(InUse{})
			if _, ok := e.r.Backend(goneID); ok {
				t.Error("removed backend not freed after the cooldown")
			}
			if kb := e.f.PbBackends[goneID]; kb.Family != 0 {
				t.Errorf("pb_backends[%d] = %+v", goneID, kb)
			}
			if _, ok := e.f.PbPorts[9090]; ok {
				t.Error("port of the freed backend kept")
			}

			// New ids never collide with adopted ones.
			web3 := desiredWeb
			web3.Endpoints = append(slices.Clone(web3.Endpoints), ep("198.19.1.9:8080"))
			e.apply(web3, api, svc("new", "198.18.0.30", 80, ep("198.19.5.1:8080")))
			nid := e.bid(web.Key, "198.19.1.9:8080")
			if slices.Contains([]uint32{a, b, c, d, apiIDs[0], apiIDs[1]}, nid) {
				t.Errorf("new endpoint got adopted id %d", nid)
			}
			if s := e.service(desired.Key{VIP: netip.MustParseAddr("198.18.0.30"), Port: 80, Protocol: desired.TCP}); s.ID == webID || s.ID == apiID {
				t.Errorf("new service got adopted id %d", s.ID)
			}
			e.programAll()
			e.checkKernel()
		})
	}
}

// A restarted agent whose desired state lost a service or an endpoint
// while it was down retires them like any other removal.
func TestAdoptionThenRemoval(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep(beA), ep(beB))
	api := svc("api", vip2, 443, ep("198.19.2.1:8443"))
	e.apply(web, api)
	e.programAll()
	a, b := e.bid(web.Key, beA), e.bid(web.Key, beB)
	apiID := e.service(api.Key).ID
	apiBe := e.service(api.Key).Backends[0]

	e.restart()
	e.f.TakeOps()
	web.Endpoints = web.Endpoints[:1]
	changes := e.apply(web)
	if len(changes) != 2 {
		t.Fatalf("changes %+v", changes)
	}
	for _, ch := range changes {
		switch ch.Service.ID {
		case apiID:
			if !ch.Removed || !slices.Equal(ch.Retired, []uint32{apiBe}) {
				t.Errorf("api change %+v", ch)
			}
		default:
			if ch.Removed || !slices.Equal(ch.Retired, []uint32{b}) {
				t.Errorf("web change %+v", ch)
			}
		}
	}
	e.wantKernelState(b, pbmaps.BackendRemoved, 0)
	e.wantKernelState(apiBe, pbmaps.BackendRemoved, 0)
	if _, ok := e.f.PbServices[keyOf(api.Key)]; ok {
		t.Error("api still in pb_services")
	}
	for n := range uint32(2) {
		if _, ok := e.f.Installed(apiID, n); ok {
			t.Errorf("api's table %d still there", n)
		}
	}
	e.program(e.service(web.Key).ID, []uint32{a}, nil, false)
	e.checkKernel()
}

// Entries a previous agent could not have left consistently: a service
// with an id the new agent cannot use, a backend of a service that is not
// in pb_services, a removed backend.
func TestAdoptionOfInconsistentMaps(t *testing.T) {
	f := mapsfake.New(t)
	kWeb := pbmaps.ServiceKey(netip.MustParseAddr(vip1), 80, uint8(desired.TCP))
	kBad := pbmaps.ServiceKey(netip.MustParseAddr(vip2), 80, uint8(desired.TCP))
	kZero := pbmaps.ServiceKey(netip.MustParseAddr(vip3), 80, uint8(desired.TCP))
	f.PbServices[kBad] = bpf.LbSvcValue{Id: 100, TableSize: testTableSize} // >= MaxServices
	f.PbServices[kZero] = bpf.LbSvcValue{Id: 0, TableSize: testTableSize}
	f.PbBackends[7] = pbmaps.NewBackend(mustAP(beA), 5, pbmaps.BackendActive, 0)
	f.PbBackends[8] = pbmaps.NewBackend(mustAP(beB), 5, pbmaps.BackendRemoved, 0)
	f.PbBackends[9] = pbmaps.NewBackend(mustAP("198.19.9.1:7070"), 42, pbmaps.BackendActive, 0)      // no service 42
	f.PbBackends[10] = pbmaps.NewBackend(mustAP("198.19.9.2:7070"), 100, pbmaps.BackendProbation, 1) // service dropped
	f.PbServices[kWeb] = bpf.LbSvcValue{Id: 5, Table: 1, TableSize: testTableSize}
	f.PbMaglev[pbmaps.TableKey(5, 0)] = slices.Repeat([]uint32{7}, 13) // an older size
	f.PbMaglev[pbmaps.TableKey(5, 1)] = slices.Repeat([]uint32{7}, testTableSize)
	f.PbMaglev[pbmaps.TableKey(100, 0)] = slices.Repeat([]uint32{10}, testTableSize)
	f.PbMaglev[pbmaps.TableKey(100, 1)] = slices.Repeat([]uint32{10}, testTableSize)
	f.PbPorts = map[uint16]uint8{80: pbmaps.PortVIP, 8080: pbmaps.PortBackend, 7070: pbmaps.PortBackend}
	// The kernel checks below need every table to hold only ids that exist.
	f.Check = nil

	clk := testingclock.NewFakeClock(t0)
	r, err := New(f, Options{MaxServices: 64, MaxBackends: 256, TableSize: testTableSize,
		Cooldown: testCooldown, Clock: clk, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ops := f.TakeOps()
	for _, id := range []uint32{0, 100} {
		if index(ops, is(opDeleteService, id)) < 0 {
			t.Errorf("service with unusable id %d not deleted: %s", id, opsString(ops))
		}
	}
	if _, ok := f.PbServices[kBad]; ok {
		t.Error("service with an unusable id kept in pb_services")
	}
	for n := range uint32(2) {
		if _, ok := f.Installed(100, n); ok {
			t.Errorf("table %d of the dropped service kept", n)
		}
	}
	if s, ok := r.Service(5); !ok || s.sizes != [2]uint32{13, testTableSize} || s.value.Table != 1 {
		t.Errorf("service 5 adopted as %+v, want tables of 13 and %d slots, table 1 live", s, testTableSize)
	}
	want := map[desired.Key]map[netip.AddrPort]uint32{
		{VIP: netip.MustParseAddr(vip1), Port: 80, Protocol: desired.TCP}: {mustAP(beA): 7},
	}
	if got := r.Adopted(); !adoptedEqual(got, want) {
		t.Errorf("Adopted() = %v, want %v", got, want)
	}
	for _, id := range []uint32{8, 9, 10} {
		b, ok := r.Backend(id)
		if !ok || b.State != pbmaps.BackendRemoved {
			t.Errorf("backend %d: %+v %v, want known and removed", id, b, ok)
		}
		// Orphans are removed in the kernel too: their flows' SYN
		// retransmits get re-picked, and nothing sees them as usable.
		if st := pbmaps.BackendState(f.PbBackends[id].State); st != pbmaps.BackendRemoved {
			t.Errorf("pb_backends[%d] state %s, want removed", id, st)
		}
		if g := f.PbBackends[id].ProbeGrants; g != 0 {
			t.Errorf("pb_backends[%d] keeps %d probe grants", id, g)
		}
	}

	// Freed after the cooldown; their port goes with them.
	clk.Step(testCooldown)
	r.Sweep(InUse{}, r.BeginSweep())
	r.Sweep(InUse{}, r.BeginSweep())
	for _, id := range []uint32{8, 9, 10} {
		if kb := f.PbBackends[id]; kb.Family != 0 {
			t.Errorf("backend %d not freed", id)
		}
	}
	if _, ok := f.PbPorts[7070]; ok {
		t.Errorf("port 7070 kept: %v", f.PbPorts)
	}
	if kb := f.PbBackends[7]; kb.Family == 0 {
		t.Error("adopted backend 7 freed")
	}
}

func mustAP(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

func adoptedEqual(a, b map[desired.Key]map[netip.AddrPort]uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for k, am := range a {
		bm, ok := b[k]
		if !ok || len(am) != len(bm) {
			return false
		}
		for ap, id := range am {
			if bm[ap] != id {
				return false
			}
		}
	}
	return true
}

// Adoption reads both tables' sizes. Where the previous agent left only
// the live table (no Apply ran after it went live), the new agent's first
// Apply installs the missing spares in one batch; where the configured
// maximum changed, the spares are installed at the new size while the
// old tables keep serving, and ProgramService flips to them.
func TestAdoptionPreparesSpares(t *testing.T) {
	for _, tc := range []struct {
		name    string
		spares  bool   // the previous agent prepared the spare tables
		maxSize uint32 // the new agent's maximum
	}{
		{name: "both tables, same size", spares: true, maxSize: testTableSize},
		{name: "live table only", spares: false, maxSize: testTableSize},
		{name: "both tables, new maximum", spares: true, maxSize: 13},
		{name: "live table only, new maximum", spares: false, maxSize: 61},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			web := svc("web", vip1, 80, ep(beA), ep(beB), ep(beC))
			api := svc("api", vip2, 443, ep("198.19.2.1:8443"))
			empty := svc("empty", vip3, 80)
			e.apply(web, api, empty)
			e.programAll()
			if tc.spares {
				e.apply(web, api, empty)
			}
			lives := map[uint32][]uint32{}
			for _, s := range e.r.Services() {
				if len(s.Backends) > 0 {
					lives[s.ID] = slices.Clone(e.liveTable(s.Spec.Key))
				}
			}
			values := maps.Clone(e.f.PbServices)
			e.f.TakeOps()

			e.opts.TableSize = tc.maxSize
			e.restart()
			if ops := e.f.TakeOps(); len(ops) != 0 {
				t.Errorf("New wrote %s", opsString(ops))
			}
			for id := range lives {
				s, _ := e.r.Service(id)
				if got, _ := e.f.TableSizes(id); s.sizes != got {
					t.Errorf("service %d adopted with sizes %v, kernel %v", id, s.sizes, got)
				}
			}

			e.apply(web, api, empty)
			ops := e.f.TakeOps()
			wantInstall := !tc.spares || tc.maxSize != testTableSize
			switch {
			case !wantInstall && len(ops) != 0:
				t.Errorf("first Apply after the restart wrote %s", opsString(ops))
			case wantInstall:
				if len(ops) != 1 || ops[0].Kind != opInstallTables || len(ops[0].Reqs) != len(lives) {
					t.Errorf("first Apply after the restart wrote %s, want one batch of %d spare tables", opsString(ops), len(lives))
				}
				for _, r := range installed(ops) {
					if r.N != 1 || r.Size != tc.maxSize {
						t.Errorf("installed %+v, want spare table 1 of %d slots", r, tc.maxSize)
					}
				}
			}
			// The live tables kept serving through all this.
			if !maps.Equal(values, e.f.PbServices) {
				t.Errorf("pb_services changed before ProgramService")
			}
			for id, live := range lives {
				if got, _ := e.f.Installed(id, 0); !slices.Equal(got, live) {
					t.Errorf("service %d: live table written before ProgramService", id)
				}
			}

			for _, s := range e.r.Services() {
				e.program(s.ID, s.Backends, nil, false)
				ops := e.f.TakeOps()
				if c := count(ops, kindIs(opInstallTables, opSetBackend)); c != 0 {
					t.Errorf("service %s: programming after the restart wrote %s", s.Spec.Name, opsString(ops))
				}
				if len(s.Backends) == 0 {
					continue
				}
				inOrder(t, ops, "flip", fill(s.ID, 1), flip(s.ID, 1, tc.maxSize))
				if tc.maxSize == testTableSize {
					if got := e.liveTable(s.Spec.Key); !slices.Equal(got, lives[s.ID]) {
						t.Errorf("service %s: table rebuilt differently after the restart", s.Spec.Name)
					}
				}
				e.wantProgrammed(s.ID, s.Backends, nil, nil)
			}
		})
	}
}

// A pinned map the new agent cannot read fails New, rather than leaving
// it blind to tables it might then replace while live.
func TestAdoptionReadFailures(t *testing.T) {
	for _, kind := range []string{opServices, opBackends, opPorts, opTableSizes} {
		t.Run(kind, func(t *testing.T) {
			e := newEnv(t)
			e.apply(svc("web", vip1, 80, ep(beA)))
			e.programAll()
			e.f.Fail[kind] = 1
			if _, err := New(e.f, e.opts); err == nil {
				t.Errorf("New: no error with %s failing", kind)
			}
		})
	}
}

// A service removed before a restart is unknown to the new agent; the
// conntrack sweep it starts with reports flows to its VIP, which keeps the
// VIP's port and address slot marked until a sweep finds none.
func TestRestartKeepsPrefiltersOfLiveFlows(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep("198.19.1.1:8080"))
	gone := svc("gone", vip3, 9000, ep("198.19.3.1:9090"))
	e.apply(web, gone)
	e.apply(web)

	goneVIP := netip.AddrPortFrom(gone.Key.VIP, gone.Key.Port)
	e.opts.InUse = InUse{Services: map[uint32]bool{}, Backends: map[uint32]bool{}, VIPs: map[netip.AddrPort]bool{goneVIP: true}}
	e.restart()
	e.apply(web)
	e.programAll()
	slot := pbmaps.VIPSlot(gone.Key.VIP)
	if !e.f.PbVIPSlots[slot] || e.f.PbPorts[9000]&pbmaps.PortVIP == 0 {
		t.Fatalf("after the restart: slot marked %v, pb_ports[9000] = %#x; want both kept for the live flows",
			e.f.PbVIPSlots[slot], e.f.PbPorts[9000])
	}
	e.checkKernel()

	// The flows ended: the first walk to miss them keeps the VIP (see
	// free), the second unmarks it.
	e.sweep(InUse{})
	if !e.f.PbVIPSlots[slot] || e.f.PbPorts[9000]&pbmaps.PortVIP == 0 {
		t.Errorf("after one walk missed the flows: slot marked %v, pb_ports[9000] = %#x; want both kept",
			e.f.PbVIPSlots[slot], e.f.PbPorts[9000])
	}
	e.sweep(InUse{})
	if slot != pbmaps.VIPSlot(web.Key.VIP) && e.f.PbVIPSlots[slot] {
		t.Error("slot still marked after two sweeps found no flows")
	}
	if e.f.PbPorts[9000] != 0 {
		t.Errorf("pb_ports[9000] = %#x after two sweeps found no flows", e.f.PbPorts[9000])
	}
	e.checkKernel()
}

// An agent that adds pb_vip_slots adopts services a previous version
// wrote without it: its first Apply marks their slots (before the agent
// attaches the program that reads them), and a failed write is read back
// and retried rather than trusted.
func TestPrefiltersAfterUpgradeAndFailedWrites(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep("198.19.1.1:8080"))
	e.apply(web)
	e.programAll()
	// The previous version had no pb_vip_slots: an empty map.
	e.f.PbVIPSlots = map[uint32]bool{}
	e.f.Check = nil // its state breaks the invariant until the first Apply
	e.restart()
	e.apply(web)
	e.f.Check = mapsfake.KernelInvariants
	if !e.f.PbVIPSlots[pbmaps.VIPSlot(web.Key.VIP)] {
		t.Fatal("the adopted service's slot is not marked after the first Apply")
	}
	e.checkKernel()

	// A write that fails part way: the record is read back, not trusted.
	api := svc("api", vip2, 443, ep("198.19.2.1:8443"))
	e.f.FailAfter = errInjected
	if _, err := e.r.Apply(state(web, api), e.acc); !errors.Is(err, errInjected) {
		t.Fatalf("Apply: %v, want the injected error", err)
	}
	// (The write had landed: read back, the record matches and nothing is
	// left to retry.)
	if !maps.Equal(e.r.vipSlots, e.f.PbVIPSlots) || !e.f.PbVIPSlots[pbmaps.VIPSlot(api.Key.VIP)] {
		t.Fatalf("after a failed write: record %v, kernel %v", e.r.vipSlots, e.f.PbVIPSlots)
	}
	// An outright failure, then the retry PrepareTables makes: api goes,
	// and once its id is freed its slot should be cleared.
	e.apply(web)
	e.clk.Step(testCooldown)
	e.sweep(InUse{})
	e.f.Fail[opSetVIPSlots] = 1
	e.sweep(InUse{})
	if !e.r.PrefiltersDirty() || !e.f.PbVIPSlots[pbmaps.VIPSlot(api.Key.VIP)] {
		t.Fatalf("the failed clear: dirty %v, api's slot %v", e.r.PrefiltersDirty(), e.f.PbVIPSlots[pbmaps.VIPSlot(api.Key.VIP)])
	}
	if err := e.r.PrepareTables(); err != nil {
		t.Fatal(err)
	}
	if e.r.PrefiltersDirty() || e.f.PbVIPSlots[pbmaps.VIPSlot(api.Key.VIP)] {
		t.Errorf("after the retry: dirty %v, api's slot %v", e.r.PrefiltersDirty(), e.f.PbVIPSlots[pbmaps.VIPSlot(api.Key.VIP)])
	}
	e.programAll()
	e.checkKernel()
}

// Over maps created empty (Options.Fresh) nothing is read back, and an id
// is zeroed only when it is used again: a cold start's ids all come fresh.
// Over maps that may hold anything, every id is zeroed at its first use.
func TestFreshMapsNeitherReadNorZeroed(t *testing.T) {
	resets := func(ops []op) (svcs, bes []uint32) {
		for _, o := range ops {
			switch o.Kind {
			case opResetSvcStats:
				svcs = append(svcs, o.ID)
			case opResetBeStats:
				bes = append(bes, o.ID)
			}
		}
		return svcs, bes
	}
	web := svc("web", vip1, 80, ep("198.19.1.1:8080"), ep("198.19.1.2:8080"))
	api := svc("api", vip2, 80, ep("198.19.2.1:8080"))
	db := svc("db", vip3, 5432, ep("198.19.3.1:5432"), ep("198.19.3.2:5432"))
	for _, fresh := range []bool{true, false} {
		t.Run(fmt.Sprintf("fresh=%v", fresh), func(t *testing.T) {
			e := newEnv(t, func(o *Options) { o.Fresh = fresh })
			for _, kind := range []string{opServices, opBackends, opPorts, opVIPSlots} {
				if got, want := e.f.Calls[kind] > 0, !fresh; got != want {
					t.Errorf("%s read: %v, want %v", kind, got, want)
				}
			}
			e.apply(web, api)
			svcs, bes := resets(e.f.TakeOps())
			if fresh && (len(svcs) != 0 || len(bes) != 0) {
				t.Errorf("first use of fresh ids zeroed services %v, backends %v", svcs, bes)
			}
			if !fresh && (len(svcs) != 2 || len(bes) != 3) {
				t.Errorf("first use zeroed services %v, backends %v; want 2 and 3", svcs, bes)
			}
			apiID := e.service(api.Key).ID
			apiBe := e.bid(api.Key, "198.19.2.1:8080")
			e.apply(web)
			e.clk.Step(testCooldown)
			e.sweep(InUse{})
			e.sweep(InUse{})
			e.f.TakeOps()
			// db takes api's freed ids, used before, and one never used.
			e.apply(web, db)
			svcs, bes = resets(e.f.TakeOps())
			dbBes := e.bids(db.Key, "198.19.3.1:5432", "198.19.3.2:5432")
			wantBes := dbBes
			if fresh {
				wantBes = []uint32{apiBe}
			}
			slices.Sort(bes)
			slices.Sort(wantBes)
			if !slices.Equal(svcs, []uint32{apiID}) || !slices.Equal(bes, wantBes) || !slices.Contains(dbBes, apiBe) {
				t.Errorf("reuse zeroed services %v, backends %v; want [%d] and %v (db has %v)", svcs, bes, apiID, wantBes, dbBes)
			}
		})
	}
}

// Two pinned services under one id (no agent writes that, but pins can be
// anything): one is kept, the other dropped alone, leaving the id's tables
// to the one kept, which is written again, so that the id's key in
// pb_svc_keys, which the datapath checks a service's value against, is the
// kept one's and not the dropped one's.
func TestAdoptionOfADuplicatedID(t *testing.T) {
	f := mapsfake.New(t)
	kA := pbmaps.ServiceKey(netip.MustParseAddr(vip1), 80, uint8(desired.TCP))
	kB := pbmaps.ServiceKey(netip.MustParseAddr(vip2), 80, uint8(desired.TCP))
	f.PbServices[kA] = bpf.LbSvcValue{Id: 5, TableSize: testTableSize}
	f.PbServices[kB] = bpf.LbSvcValue{Id: 5, TableSize: testTableSize}
	f.PbBackends[7] = pbmaps.NewBackend(mustAP(beA), 5, pbmaps.BackendActive, 0)
	f.PbMaglev[pbmaps.TableKey(5, 0)] = slices.Repeat([]uint32{7}, testTableSize)
	f.PbMaglev[pbmaps.TableKey(5, 1)] = slices.Repeat([]uint32{7}, testTableSize)
	f.PbPorts = map[uint16]uint8{80: pbmaps.PortVIP, 8080: pbmaps.PortBackend}
	f.Check = nil
	if _, err := New(f, Options{MaxServices: 64, MaxBackends: 256, TableSize: testTableSize,
		Cooldown: testCooldown, Clock: testingclock.NewFakeClock(t0), Logger: testLogger(t)}); err != nil {
		t.Fatal(err)
	}
	ops := f.TakeOps()
	del := index(ops, is(opDeleteService, 0))
	if del < 0 || index(ops, is(opDeleteService, 5)) >= 0 {
		t.Fatalf("want one service of id 5 dropped alone (id 0), its tables kept: %s", opsString(ops))
	}
	if index(ops[del:], is(opUpsertService, 5)) < 0 {
		t.Errorf("the service kept under id 5 not written again after the other's drop: %s", opsString(ops))
	}
	if len(f.PbServices) != 1 {
		t.Errorf("pb_services holds %d entries after adoption, want the kept one: %v", len(f.PbServices), f.PbServices)
	}
	for n := range uint32(2) {
		if _, ok := f.Installed(5, n); !ok {
			t.Errorf("table %d of id 5 deleted with the dropped service: it is the kept one's", n)
		}
	}
}

// Backend ids live flows refer to at start, with no pinned backend to hold
// them (pb_backends recreated at a new --max-backends beside a kept
// conntrack table), are not handed out until their cooldown passed and no
// flow refers to them: a new endpoint under such an id would take the old
// flows' outcome events. A reused id's counters and streak start afresh.
func TestRestartKeepsBackendIDsOfLiveFlows(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep("198.19.1.1:8080"), ep("198.19.1.2:8080"))
	e.apply(web)
	e.programAll()
	ids := func(d desired.Service) []uint32 {
		t.Helper()
		s, ok := e.r.ServiceByKey(d.Key)
		if !ok {
			t.Fatalf("service %s not programmed", d.Name)
		}
		return slices.Sorted(slices.Values(s.Backends))
	}
	if got := ids(web); !slices.Equal(got, []uint32{1, 2}) {
		t.Fatalf("web's backends %v, want [1 2]", got)
	}

	// The restart: the service is pinned, its backends and lists are not;
	// web's flows still live on ids 1 and 2.
	clear(e.f.PbBackends)
	clear(e.f.PbSvcBackends)
	e.opts.InUse = InUse{Services: map[uint32]bool{}, Backends: map[uint32]bool{1: true, 2: true}}
	e.restart()
	// Until the first Apply is done, the pinned tables name ids the new
	// pb_backends does not hold; the program before this agent's serves
	// from its own maps until the new one is attached, after that Apply.
	check := e.f.Check
	e.f.Check = func(*mapsfake.Maps, mapsfake.Op) {}
	e.apply(web)
	e.programAll()
	e.f.Check = check
	e.checkKernel()
	if got := ids(web); !slices.Equal(got, []uint32{3, 4}) {
		t.Fatalf("web's backends after the restart %v, want [3 4]: ids 1 and 2 are its old flows'", got)
	}

	// Within the cooldown no id is freed, and past it only one no flow uses.
	e.sweep(InUse{Backends: map[uint32]bool{}})
	api := svc("api", vip2, 80, ep("198.19.2.1:8080"))
	e.apply(web, api)
	if got := ids(api); !slices.Equal(got, []uint32{5}) {
		t.Fatalf("api's backends %v, want [5]: ids 1 and 2 are in their cooldown", got)
	}
	e.clk.Step(testCooldown)
	e.sweep(InUse{Backends: map[uint32]bool{1: true}})
	e.f.TakeOps()
	db := svc("db", vip3, 5432, ep("198.19.3.1:5432"), ep("198.19.3.2:5432"))
	e.apply(web, api, db)
	if got := ids(db); !slices.Equal(got, []uint32{2, 6}) {
		t.Fatalf("db's backends %v, want [2 6]: id 1 still has a flow", got)
	}
	e.sweep(InUse{})
	if !e.r.beIDs.isUsed(1) {
		t.Fatal("id 1 freed by the first walk that missed its flow")
	}
	e.sweep(InUse{})
	dns := svc("dns", "198.18.0.13", 53, ep("198.19.4.1:53"))
	e.apply(web, api, db, dns)
	if got := ids(dns); !slices.Equal(got, []uint32{1}) {
		t.Fatalf("dns's backends %v, want [1]: freed once its last flow ended", got)
	}
	reset := map[uint32]bool{}
	for _, op := range e.f.TakeOps() {
		if op.Kind == mapsfake.OpResetBeStats {
			reset[op.ID] = true
		}
	}
	for _, id := range []uint32{1, 2} {
		if !reset[id] || e.f.TripResets[id] == 0 {
			t.Errorf("reused id %d: counters reset %v, streak reset %d times; want both", id, reset[id], e.f.TripResets[id])
		}
	}
	e.programAll()
	e.checkKernel()
}
