package reconcile

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/desired"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
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
			// left removed, not yet freed.
			e.apply(web, api)
			e.spendGrants(c) // the kernel admitted the probe
			webID, apiID := w.ID, apiS.ID
			e.checkKernel()
			before := e.f.snapshot()
			e.f.takeOps()

			// Restart.
			e.clk.Step(time.Hour)
			restartAt := e.clk.Now()
			e.restart()
			if ops := e.f.takeOps(); len(ops) != 0 {
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
			ops := e.f.takeOps()
			if len(ops) != 0 {
				t.Errorf("first Apply after a restart wrote %s", opsString(ops))
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
			e.program(webID, []uint32{a, b}, []uint32{c}, false)
			e.program(apiID, apiIDs, nil, false)
			ops = e.f.takeOps()
			if n := count(ops, kindIs(opSetBackend, opClearBackend, opUpsertService, opDeleteService,
				opResetBeStats, opResetSvcStats, opSetPorts)); n != 0 {
				t.Errorf("programming adopted services wrote entries: %s", opsString(ops))
			}
			// The probe's grant was spent before the restart and stays spent.
			e.wantKernelState(c, pbmaps.BackendProbation, 0)
			// Tables are rebuilt byte for byte.
			before.diff(t, e.f.snapshot())
			e.checkKernel()

			// Removed backends are freed a cooldown after the restart.
			e.r.Sweep(InUse{})
			if _, ok := e.r.Backend(goneID); !ok {
				t.Error("removed backend freed right at restart")
			}
			e.clk.SetTime(restartAt.Add(testCooldown))
			e.r.Sweep(InUse{})
			if _, ok := e.r.Backend(goneID); ok {
				t.Error("removed backend not freed after the cooldown")
			}
			if kb := e.f.backend(goneID); kb.Family != 0 {
				t.Errorf("pb_backends[%d] = %+v", goneID, kb)
			}
			if _, ok := e.f.ports[9090]; ok {
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
	e.f.takeOps()
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
	if _, ok := e.f.services[keyOf(api.Key)]; ok {
		t.Error("api still in pb_services")
	}
	if _, ok := e.f.tables[apiID]; ok {
		t.Error("api's table still there")
	}
	e.program(e.service(web.Key).ID, []uint32{a}, nil, false)
	e.checkKernel()
}

// Entries a previous agent could not have left consistently: a service
// with an id the new agent cannot use, a backend of a service that is not
// in pb_services, a removed backend.
func TestAdoptionOfInconsistentMaps(t *testing.T) {
	f := newFakeWriter(t)
	kWeb := pbmaps.ServiceKey(netip.MustParseAddr(vip1), 80, uint8(desired.TCP))
	kBad := pbmaps.ServiceKey(netip.MustParseAddr(vip2), 80, uint8(desired.TCP))
	kZero := pbmaps.ServiceKey(netip.MustParseAddr(vip3), 80, uint8(desired.TCP))
	f.services[kWeb] = bpf.LbSvcValue{Id: 5, TableSize: testTableSize}
	f.services[kBad] = bpf.LbSvcValue{Id: 100, TableSize: testTableSize} // >= MaxServices
	f.services[kZero] = bpf.LbSvcValue{Id: 0, TableSize: testTableSize}
	f.backends[7] = pbmaps.NewBackend(mustAP(beA), 5, pbmaps.BackendActive, 0)
	f.backends[8] = pbmaps.NewBackend(mustAP(beB), 5, pbmaps.BackendRemoved, 0)
	f.backends[9] = pbmaps.NewBackend(mustAP("198.19.9.1:7070"), 42, pbmaps.BackendActive, 0)      // no service 42
	f.backends[10] = pbmaps.NewBackend(mustAP("198.19.9.2:7070"), 100, pbmaps.BackendProbation, 1) // service dropped
	f.tables[5] = slices.Repeat([]uint32{7}, testTableSize)
	f.tables[100] = slices.Repeat([]uint32{10}, testTableSize)
	f.ports = map[uint16]uint8{80: pbmaps.PortVIP, 8080: pbmaps.PortBackend, 7070: pbmaps.PortBackend}
	// The kernel checks below need every table to hold only ids that exist.
	f.check = nil

	clk := testingclock.NewFakeClock(t0)
	r, err := New(f, Options{MaxServices: 64, MaxBackends: 256, TableSize: testTableSize,
		Cooldown: testCooldown, Clock: clk, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ops := f.takeOps()
	for _, id := range []uint32{0, 100} {
		if index(ops, is(opDeleteService, id)) < 0 {
			t.Errorf("service with unusable id %d not deleted: %s", id, opsString(ops))
		}
	}
	if _, ok := f.services[kBad]; ok {
		t.Error("service with an unusable id kept in pb_services")
	}
	if _, ok := f.tables[100]; ok {
		t.Error("table of the dropped service kept")
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
		if st := pbmaps.BackendState(f.backend(id).State); st != pbmaps.BackendRemoved {
			t.Errorf("pb_backends[%d] state %s, want removed", id, st)
		}
		if g := f.backend(id).ProbeGrants; g != 0 {
			t.Errorf("pb_backends[%d] keeps %d probe grants", id, g)
		}
	}

	// Freed after the cooldown; their port goes with them.
	clk.Step(testCooldown)
	r.Sweep(InUse{})
	for _, id := range []uint32{8, 9, 10} {
		if kb := f.backend(id); kb.Family != 0 {
			t.Errorf("backend %d not freed", id)
		}
	}
	if _, ok := f.ports[7070]; ok {
		t.Errorf("port 7070 kept: %v", f.ports)
	}
	if kb := f.backend(7); kb.Family == 0 {
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
