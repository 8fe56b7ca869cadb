// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maglev"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/maps/mapsfake"
)

func TestNewRejectsInvalidTableSize(t *testing.T) {
	for _, n := range []uint32{0, 30, maglev.MinTableSize - 2, maglev.MaxTableSize + 1} {
		_, err := New(mapsfake.New(t), Options{MaxServices: 8, MaxBackends: 8, TableSize: n})
		if err == nil {
			t.Errorf("New with table size %d: no error", n)
		}
	}
}

func TestApplyNewServices(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, epn("198.19.1.1:8080", "ns/web-0"), epn("198.19.1.2:8080", "ns/web-1"))
	dns := svc("dns", vip2, 53, ep("198.19.2.1:5353"))
	dns.Key.Protocol = desired.UDP
	dns.MaxInflight, dns.MaxInflightPerEndpoint = 100, 10
	// Port 8080 is a VIP port here and a backend port of web; port 80 a
	// backend port here and web's VIP port.
	alt := svc("alt", vip3, 8080, ep("198.19.3.1:80"))

	changes := e.apply(web, dns, alt)
	ops := e.f.TakeOps()
	calls := e.f.TakeCalls()

	if len(changes) != 3 {
		t.Fatalf("%d changes, want 3: %+v", len(changes), changes)
	}
	seenSvc := map[uint32]bool{}
	seenBe := map[uint32]bool{}
	for i, spec := range []desired.Service{web, dns, alt} {
		s := e.service(spec.Key)
		if s.ID < 1 || s.ID >= e.opts.MaxServices || seenSvc[s.ID] {
			t.Errorf("service %s: id %d not fresh in [1, %d)", spec.Name, s.ID, e.opts.MaxServices)
		}
		seenSvc[s.ID] = true
		if s.Spec.Name != spec.Name {
			t.Errorf("service %d: spec name %q, want %q", s.ID, s.Spec.Name, spec.Name)
		}
		// A service with endpoints gets its first pb_services entry from
		// its first ProgramService, with its table (one write, not two):
		// none yet.
		if got, ok := e.f.PbServices[keyOf(spec.Key)]; ok {
			t.Errorf("pb_services[%s] = %+v written by Apply, want it first written by ProgramService", spec.Key, got)
		}
		if n := count(ops, is(opUpsertService, s.ID)); n != 0 {
			t.Errorf("service %s written %d times by Apply: %s", spec.Name, n, opsString(ops))
		}
		// Its first table is installed, empty, for ProgramService to fill;
		// no entry points at it yet.
		if tbl, ok := e.f.Installed(s.ID, 0); !ok || len(tbl) != testTableSize || slices.ContainsFunc(tbl, func(id uint32) bool { return id != 0 }) {
			t.Errorf("service %s: table 0 = %v (present %v), want %d empty slots", spec.Name, tbl, ok, testTableSize)
		}
		if _, ok := e.f.Installed(s.ID, 1); ok {
			t.Errorf("service %s: table 1 installed before table 0 was ever live", spec.Name)
		}
		if count(ops, is(opResetSvcStats, s.ID)) != 1 {
			t.Errorf("service %s: stats of new id %d not reset once", spec.Name, s.ID)
		}
		if len(s.Backends) != len(spec.Endpoints) {
			t.Fatalf("service %s: %d backends, want %d", spec.Name, len(s.Backends), len(spec.Endpoints))
		}
		for j, id := range s.Backends {
			epAddr := spec.Endpoints[j].Addr
			if id < 1 || id >= e.opts.MaxBackends || seenBe[id] {
				t.Errorf("endpoint %s: backend id %d not fresh in [1, %d)", epAddr, id, e.opts.MaxBackends)
			}
			seenBe[id] = true
			b, ok := e.r.Backend(id)
			if !ok || b.Addr != epAddr || b.Name != spec.Endpoints[j].Name || b.Service != s.ID {
				t.Errorf("Backend(%d) = %+v, want %s %q of service %d", id, b, epAddr, spec.Endpoints[j].Name, s.ID)
			}
			// New endpoints start active, as accrual starts them ready; no
			// table holds them until ProgramService, so no flow reaches them.
			if kb := e.f.PbBackends[id]; kb != pbmaps.NewBackend(epAddr, s.ID, pbmaps.BackendActive, 0) {
				t.Errorf("pb_backends[%d] = %+v, want %s active in service %d", id, kb, epAddr, s.ID)
			}
			e.wantUnreachable(id)
			inOrder(t, ops, "backend stats reset before the entry is written", is(opResetBeStats, id), is(opSetBackend, id))
			if n := count(ops, is(opSetBackend, id)); n != 1 {
				t.Errorf("backend %d written %d times, want once", id, n)
			}
		}
		if changes[i].Service != s {
			// Changes are ordered by id, and ids are handed out in order.
			t.Errorf("change %d is service %d, want %d", i, changes[i].Service.ID, s.ID)
		}
		if changes[i].Removed || len(changes[i].Retired) != 0 {
			t.Errorf("change for new service %s: %+v", spec.Name, changes[i])
		}
	}
	wantPorts := map[uint16]uint8{
		80:   pbmaps.PortVIP | pbmaps.PortBackend,
		8080: pbmaps.PortVIP | pbmaps.PortBackend,
		53:   pbmaps.PortVIP,
		5353: pbmaps.PortBackend,
	}
	if got := e.f.NonZeroPorts(); !mapsEqual(got, wantPorts) {
		t.Errorf("pb_ports = %v, want %v", got, wantPorts)
	}
	if n := count(ops, kindIs(opSetPorts)); n != 1 {
		t.Errorf("%d SetPorts, want 1", n)
	}
	if n := count(ops, kindIs(opFillTable, opSetFallback)); n != 0 {
		t.Errorf("Apply wrote %d tables; tables are ProgramService's", n)
	}
	// One InstallTables for the three services: one RCU grace period.
	if n := count(ops, kindIs(opInstallTables)); n != 1 {
		t.Errorf("%d InstallTables, want 1 batch: %s", n, opsString(ops))
	}
	if got := installed(ops); len(got) != 3 {
		t.Errorf("installed %v, want one table for each of 3 services", got)
	}
	// The four backends in one batch of stats resets and one of entries.
	if calls[opResetBeStats] != 1 || calls[opSetBackends] != 1 || calls[opSetBackend] != 0 {
		t.Errorf("calls %v, want one ResetBackendStats, one SetBackends, no SetBackend", calls)
	}
	// Every write: 3 service stats resets, 4 backend stats resets, 4
	// backend entries, 1 InstallTables, 1 SetPorts, 1 SetVIPSlots.
	if len(ops) != 14 {
		t.Errorf("%d writes, want 14: %s", len(ops), opsString(ops))
	}

	// The first ProgramService of each writes its entry once: the flip to
	// its filled table, limits and backend count with it. Nothing else:
	// the admitted backends are active already, the table installed.
	for i, spec := range []desired.Service{web, dns, alt} {
		s := e.service(spec.Key)
		e.program(s.ID, s.Backends, nil, false)
		ops := e.f.TakeOps()
		want := []string{opSetSvcBes, opFillTable, opUpsertService}
		if got := opKinds(ops); !slices.Equal(got, want) {
			t.Errorf("service %s: first ProgramService wrote %s, want %v", spec.Name, opsString(ops), want)
		}
		inOrder(t, ops, "fill, then the first entry", fill(s.ID, 0), flip(s.ID, 0, testTableSize))
		want2 := bpf.LbSvcValue{Id: s.ID, Table: 0, TableSize: testTableSize, MaxInflight: spec.MaxInflight,
			MaxInflightPerBackend: spec.MaxInflightPerEndpoint, BackendCount: uint32(len(s.Backends)), Flags: quietFlags(&spec)}
		if got := e.f.PbServices[keyOf(spec.Key)]; got != want2 {
			t.Errorf("pb_services[%s] = %+v, want %+v", spec.Key, got, want2)
		}
		// The services not programmed yet still have no entry.
		for _, other := range []desired.Service{web, dns, alt}[i+1:] {
			if _, ok := e.f.PbServices[keyOf(other.Key)]; ok {
				t.Errorf("service %s has an entry before its ProgramService", other.Name)
			}
		}
	}
	for _, s := range e.r.Services() {
		e.wantProgrammed(s.ID, s.Backends, nil, nil) // checks the kernel too
	}
}

// opKinds lists the kinds of ops, in order.
func opKinds(ops []op) []string {
	out := make([]string, len(ops))
	for i, o := range ops {
		out[i] = o.Kind
	}
	return out
}

func mapsEqual(a, b map[uint16]uint8) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// programAll admits every endpoint of every service.
func (e *env) programAll() {
	for _, s := range e.r.Services() {
		e.program(s.ID, s.Backends, nil, false)
	}
}

// admitAll is failure accrual with every endpoint ready: Apply programs
// each service with all its backends active.
type admitAll struct {
	r       *Reconciler
	adopted []Change
}

func (a *admitAll) Adopt(changes []Change, _ []*Service) { a.adopted = append(a.adopted, changes...) }

func (a *admitAll) Program(id uint32) {
	s, _ := a.r.Service(id)
	if err := a.r.ProgramService(id, s.Backends, nil, false, 0); err != nil {
		panic(err)
	}
}

// One Apply leaves the maps complete: accrual hears of every change
// before any table is written, then every service is live with its table,
// which a new flow can use at once; nothing is left for a later call.
func TestApplyLeavesTheMapsComplete(t *testing.T) {
	e := newEnv(t)
	acc := &admitAll{r: e.r}
	web := svc("web", vip1, 80, ep("198.19.1.1:8080"), ep("198.19.1.2:8080"))
	dns := svc("dns", vip2, 53, ep("198.19.2.1:5353"))
	dns.Key.Protocol = desired.UDP
	if _, err := e.r.Apply(state(web, dns), acc); err != nil {
		t.Fatal(err)
	}
	if len(acc.adopted) != 2 {
		t.Fatalf("accrual heard of %d changes, want 2", len(acc.adopted))
	}
	ops := e.f.TakeOps()
	for _, spec := range []desired.Service{web, dns} {
		s := e.service(spec.Key)
		if got := e.wantTable(e.r.sizeFor(len(s.Backends)), s.Backends); !slices.Equal(e.liveTable(spec.Key), got) {
			t.Errorf("service %s: live table is not the table of its endpoints", spec.Name)
		}
		inOrder(t, ops, "its backends written before its table goes live", is(opSetBackend, s.Backends[0]), is(opUpsertService, s.ID))
	}
	e.checkKernel()

	// An endpoint more: one Apply, and the table holds it.
	web.Endpoints = append(web.Endpoints, ep("198.19.1.3:8080"))
	if _, err := e.r.Apply(state(web, dns), acc); err != nil {
		t.Fatal(err)
	}
	s := e.service(web.Key)
	if got := e.wantTable(e.r.sizeFor(3), s.Backends); !slices.Equal(e.liveTable(web.Key), got) {
		t.Errorf("after adding an endpoint, the live table is not the table of the three")
	}
	e.checkKernel()
}

func TestApplyTwiceWritesNothing(t *testing.T) {
	web := svc("web", vip1, 80, ep("198.19.1.1:8080"), ep("198.19.1.2:8080"))
	api := svc("api", vip2, 443, ep("198.19.2.1:8443"))
	api.MaxInflight, api.MaxInflightPerEndpoint = 1000, 50
	udp := svc("dns", vip2, 53, ep("198.19.3.1:53"), ep("198.19.3.2:53"))
	udp.Key.Protocol = desired.UDP
	empty := svc("empty", vip3, 80)

	for _, tc := range []struct {
		name  string
		setup func(e *env)
		st    []desired.Service
	}{
		{name: "one service", st: []desired.Service{web}},
		{name: "several, limits, udp", st: []desired.Service{web, api, udp}},
		{name: "no endpoints", st: []desired.Service{empty}},
		{name: "nothing", st: nil},
		{name: "after programming tables", st: []desired.Service{web, api},
			setup: func(e *env) { e.apply(web, api); e.programAll() }},
		{name: "after a service removal", st: []desired.Service{web},
			setup: func(e *env) { e.apply(web, api); e.programAll() }},
		{name: "after an endpoint removal", st: []desired.Service{svc("web", vip1, 80, ep("198.19.1.1:8080"))},
			setup: func(e *env) { e.apply(web); e.programAll() }},
		{name: "after a sweep", st: []desired.Service{svc("web", vip1, 80, ep("198.19.1.1:8080"))},
			setup: func(e *env) {
				e.apply(web)
				e.apply(svc("web", vip1, 80, ep("198.19.1.1:8080")))
				e.clk.Step(testCooldown)
				e.sweep(InUse{})
				e.sweep(InUse{})
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			if tc.setup != nil {
				tc.setup(e)
			}
			e.apply(tc.st...)
			e.f.TakeOps()
			changes := e.apply(tc.st...)
			if ops := e.f.TakeOps(); len(ops) != 0 {
				t.Errorf("second Apply wrote %s", opsString(ops))
			}
			if len(changes) != 0 {
				t.Errorf("second Apply reported changes %+v", changes)
			}
		})
	}
}

func TestApplyRenameOnlyWritesNothing(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, epn("198.19.1.1:8080", "ns/a"), epn("198.19.1.2:8080", "ns/b"))
	e.apply(web)
	e.programAll()
	e.apply(web) // prepares the spare table
	e.f.TakeOps()

	renamed := svc("web-renamed", vip1, 80, epn("198.19.1.1:8080", "ns/a2"), epn("198.19.1.2:8080", ""))
	changes := e.apply(renamed)
	if ops := e.f.TakeOps(); len(ops) != 0 {
		t.Errorf("renaming wrote %s", opsString(ops))
	}
	if len(changes) != 0 {
		t.Errorf("renaming reported changes %+v", changes)
	}
	s := e.service(web.Key)
	if s.Spec.Name != "web-renamed" {
		t.Errorf("service name %q, want web-renamed", s.Spec.Name)
	}
	for i, id := range s.Backends {
		if b, _ := e.r.Backend(id); b.Name != renamed.Endpoints[i].Name {
			t.Errorf("backend %d name %q, want %q", id, b.Name, renamed.Endpoints[i].Name)
		}
	}
	e.checkKernel()
}

func TestApplyLimitsChange(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep("198.19.1.1:8080"))
	e.apply(web)
	id := e.service(web.Key).ID
	e.programAll()
	e.apply(web) // prepares the spare table
	e.f.TakeOps()

	live := e.f.PbServices[keyOf(web.Key)]
	web.MaxInflight, web.MaxInflightPerEndpoint = 10, 2
	changes := e.apply(web)
	ops := e.f.TakeOps()
	if len(ops) != 1 || !flip(id, live.Table, testTableSize)(ops[0]) {
		t.Errorf("limits change wrote %s, want one UpsertService keeping table %d and table_size", opsString(ops), live.Table)
	}
	if len(changes) != 0 {
		t.Errorf("limits change reported endpoint changes %+v", changes)
	}
	e.checkKernel()
}

func TestApplyEndpointChanges(t *testing.T) {
	const (
		a = "198.19.1.1:8080"
		b = "198.19.1.2:8080"
		c = "198.19.1.3:8080"
		d = "198.19.1.4:8080"
	)
	for _, tc := range []struct {
		name      string
		from, to  []string
		retired   []string // endpoints whose backends are retired
		added     []string // endpoints that get new ids
		kernelOps int      // exact number of kernel writes, -1: don't check
	}{
		{name: "add", from: []string{a, b}, to: []string{a, b, c}, added: []string{c}, kernelOps: 2},
		{name: "add several", from: []string{a}, to: []string{d, a, c}, added: []string{d, c}, kernelOps: 4},
		{name: "remove", from: []string{a, b, c}, to: []string{a, c}, retired: []string{b}, kernelOps: 1},
		{name: "replace", from: []string{a, b}, to: []string{a, c}, retired: []string{b}, added: []string{c}, kernelOps: 3},
		// Without endpoints, the service gets its entry from Apply (its
		// first: it never had a table), so its VIP's flows are dropped.
		{name: "remove all", from: []string{a, b}, to: nil, retired: []string{a, b}, kernelOps: 3},
		{name: "from none", from: nil, to: []string{a, b}, added: []string{a, b}, kernelOps: 6}, // + SetPorts, InstallTables
		{name: "reorder", from: []string{a, b, c}, to: []string{c, a, b}, kernelOps: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			mk := func(addrs []string) desired.Service {
				s := svc("web", vip1, 80)
				for _, x := range addrs {
					s.Endpoints = append(s.Endpoints, ep(x))
				}
				return s
			}
			e.apply(mk(tc.from))
			e.f.TakeCalls()
			s := e.service(mk(nil).Key)
			before := map[string]uint32{}
			var allBefore []uint32
			for _, x := range tc.from {
				before[x] = e.bid(s.Spec.Key, x)
				allBefore = append(allBefore, before[x])
			}
			e.f.TakeOps()

			changes := e.apply(mk(tc.to))
			ops := e.f.TakeOps()

			if n := len(ops); tc.kernelOps >= 0 && n != tc.kernelOps {
				t.Errorf("%d writes, want %d: %s", n, tc.kernelOps, opsString(ops))
			}
			// Endpoints kept keep their ids.
			for _, x := range tc.to {
				id := e.bid(s.Spec.Key, x)
				old, had := before[x]
				switch {
				case had && id != old:
					t.Errorf("endpoint %s kept but its id changed %d -> %d", x, old, id)
				case !had && slices.Contains(allBefore, id):
					t.Errorf("new endpoint %s got id %d, still held by a removed one", x, id)
				case !had:
					// Active, but in no table until ProgramService.
					e.wantKernelState(id, pbmaps.BackendActive, 0)
					inOrder(t, ops, "new backend", is(opResetBeStats, id), setState(id, pbmaps.BackendActive))
					if n := count(ops, is(opSetBackend, id)); n != 1 {
						t.Errorf("new backend %d written %d times: %s", id, n, opsString(ops))
					}
					e.wantUnreachable(id)
				}
			}
			if got := s.Backends; len(got) != len(tc.to) {
				t.Errorf("service has backends %v for endpoints %v", got, tc.to)
			}
			var wantRetired []uint32
			for _, x := range tc.retired {
				id := before[x]
				wantRetired = append(wantRetired, id)
				// Marked removed, not cleared: live flows still use it.
				e.wantKernelState(id, pbmaps.BackendRemoved, 0)
				if kb := e.f.PbBackends[id]; pbmaps.AddrFrom16(kb.Addr.Bytes) != netip.MustParseAddrPort(x).Addr() || kb.SvcId != s.ID {
					t.Errorf("removed backend %d lost its address or service: %+v", id, kb)
				}
				if got := e.r.removedAt[id].at; got != t0 {
					t.Errorf("backend %d removed at %v, want %v", id, got, t0)
				}
			}
			slices.Sort(wantRetired)
			if len(changes) != 1 || changes[0].Service != s || changes[0].Removed ||
				!slices.Equal(changes[0].Retired, wantRetired) {
				t.Errorf("changes %+v, want one for service %d retiring %v", changes, s.ID, wantRetired)
			}
			// Port roles are unchanged: every address uses port 8080.
			if n := count(ops, kindIs(opSetPorts)); n != 0 && len(tc.from) > 0 {
				t.Errorf("%d SetPorts, want none", n)
			}
			// The service got its entry from Apply only if it has no
			// endpoints: otherwise it is ProgramService's.
			if _, ok := e.f.PbServices[keyOf(s.Spec.Key)]; ok != (len(tc.to) == 0 || len(tc.from) == 0) {
				t.Errorf("pb_services entry present %v with endpoints %v then %v", ok, tc.from, tc.to)
			}
			// New backends in one batch, whatever their number.
			calls := e.f.TakeCalls()
			if wantBatch := min(len(tc.added), 1); calls[opResetBeStats] != wantBatch || calls[opSetBackends] != wantBatch {
				t.Errorf("calls %v, want %d ResetBackendStats and SetBackends", calls, wantBatch)
			}
			if calls[opSetBackend] != len(tc.retired) {
				t.Errorf("%d SetBackend calls, want one per retired endpoint (%d)", calls[opSetBackend], len(tc.retired))
			}
			e.programAll()
			e.checkKernel()
		})
	}
}

// A retired id (a removed endpoint's backend, a removed service's,
// deleted at once or handed back to kube-proxy first) is freed only after
// two conntrack walks in a row that began after it retired found no flow
// on it: a walk begun before may have passed the bucket of a flow made
// since, a walk can lose the rest of a bucket (see free), and an
// incomplete one proves nothing.
func TestRetiredIDWaitsForTwoWalksThatMissIt(t *testing.T) {
	kinds := []struct {
		name   string
		opts   func(*Options)
		retire func(e *env) (id uint32, used InUse, early SweepMark, freed func() bool)
	}{
		{name: "backend", retire: func(e *env) (uint32, InUse, SweepMark, func() bool) {
			web := svc("web", vip1, 80, ep("198.19.1.1:8080"), ep("198.19.1.2:8080"))
			e.apply(web)
			e.programAll()
			id := e.bid(web.Key, "198.19.1.2:8080")
			early := e.r.BeginSweep()
			web.Endpoints = web.Endpoints[:1]
			e.apply(web)
			e.programAll()
			return id, InUse{Backends: map[uint32]bool{id: true}}, early, func() bool { _, known := e.r.Backend(id); return !known }
		}},
		{name: "service deleted", retire: func(e *env) (uint32, InUse, SweepMark, func() bool) {
			web, api := svc("web", vip1, 80, ep("198.19.1.1:8080")), svc("api", vip2, 80, ep("198.19.2.1:8080"))
			e.apply(web, api)
			e.programAll()
			id := e.service(api.Key).ID
			early := e.r.BeginSweep()
			e.apply(web)
			e.programAll()
			return id, InUse{Services: map[uint32]bool{id: true}}, early, func() bool { return e.svcFreed(id) }
		}},
		{name: "service handed back", opts: func(o *Options) { o.TakeoverGrace = time.Hour; o.HandBack = time.Minute },
			retire: func(e *env) (uint32, InUse, SweepMark, func() bool) {
				web, api := svc("web", vip1, 80, ep("198.19.1.1:8080")), svc("api", vip2, 80, ep("198.19.2.1:8080"))
				e.apply(web, api)
				e.programAll()
				id := e.service(api.Key).ID
				e.clk.Step(2 * time.Hour)
				e.r.EndTakeovers()
				e.applyBack([]desired.Key{api.Key}, web)
				// The hand-back ends at the first walk a minute after the
				// last flow: the id retires during that walk, which counts
				// for nothing.
				e.clk.Step(2 * time.Minute)
				early := e.r.BeginSweep()
				e.r.Sweep(InUse{}, early)
				if e.r.HandingBack() != 0 {
					e.t.Fatal("the hand-back did not end")
				}
				return id, InUse{Services: map[uint32]bool{id: true}}, early, func() bool { return e.svcFreed(id) }
			}},
	}
	walks := []struct {
		name  string
		walks func(e *env, used InUse, early SweepMark)
		freed bool
	}{
		{name: "two misses", freed: true, walks: func(e *env, _ InUse, _ SweepMark) {
			e.sweep(InUse{})
			e.sweep(InUse{})
		}},
		{name: "one miss", walks: func(e *env, _ InUse, _ SweepMark) {
			e.sweep(InUse{})
		}},
		{name: "a walk begun before it retired does not count", walks: func(e *env, _ InUse, early SweepMark) {
			e.r.Sweep(InUse{}, early)
			e.sweep(InUse{})
		}},
		{name: "a flow seen between the misses", walks: func(e *env, used InUse, _ SweepMark) {
			e.sweep(InUse{})
			e.sweep(used)
			e.sweep(InUse{})
		}},
		{name: "seen, then two misses", freed: true, walks: func(e *env, used InUse, _ SweepMark) {
			e.sweep(used)
			e.sweep(InUse{})
			e.sweep(InUse{})
		}},
		{name: "an incomplete walk between the misses", freed: true, walks: func(e *env, _ InUse, _ SweepMark) {
			// Skipped: it neither counts nor breaks the row.
			e.sweep(InUse{})
			e.sweep(InUse{Incomplete: true})
			e.sweep(InUse{})
		}},
		{name: "an incomplete walk is no miss", walks: func(e *env, _ InUse, _ SweepMark) {
			e.sweep(InUse{})
			e.sweep(InUse{Incomplete: true})
		}},
	}
	for _, k := range kinds {
		for _, w := range walks {
			t.Run(k.name+"/"+w.name, func(t *testing.T) {
				var opts []func(*Options)
				if k.opts != nil {
					opts = append(opts, k.opts)
				}
				e := newEnv(t, opts...)
				id, used, early, freed := k.retire(e)
				if freed() {
					t.Fatalf("id %d freed at its retirement", id)
				}
				e.clk.Step(testCooldown)
				w.walks(e, used, early)
				if got := freed(); got != w.freed {
					t.Errorf("id %d freed %v, want %v", id, got, w.freed)
				}
				e.checkKernel()
			})
		}
	}
}

// A removed endpoint's backend goes from "removed" to freed by Sweep.
func TestRemovedBackendLifecycle(t *testing.T) {
	for _, tc := range []struct {
		name     string
		gone     string // the endpoint removed
		keptPort uint8  // pb_ports role of its port once it is freed
	}{
		{name: "own port", gone: "198.19.1.2:9090", keptPort: 0},
		{name: "port shared with another backend", gone: "198.19.1.2:8080", keptPort: pbmaps.PortBackend},
		{name: "port that is also a VIP port", gone: "198.19.1.2:80", keptPort: pbmaps.PortVIP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			web := svc("web", vip1, 80, ep("198.19.1.1:8080"), ep(tc.gone))
			e.apply(web)
			id := e.bid(web.Key, tc.gone)
			port := netip.MustParseAddrPort(tc.gone).Port()
			e.program(e.service(web.Key).ID, e.service(web.Key).Backends, nil, false)

			e.clk.Step(time.Second)
			removedAt := e.clk.Now()
			web.Endpoints = web.Endpoints[:1]
			e.apply(web)
			e.program(e.service(web.Key).ID, e.service(web.Key).Backends, nil, false)
			e.wantKernelState(id, pbmaps.BackendRemoved, 0)
			if got := e.f.PbPorts[port]; got&pbmaps.PortBackend == 0 {
				t.Errorf("port %d lost its backend role while its backend is only removed: %#x", port, got)
			}
			e.checkKernel()
			e.f.TakeOps()

			// Not yet: the cooldown is not over.
			e.clk.SetTime(removedAt.Add(testCooldown - time.Nanosecond))
			e.sweep(InUse{})
			if ops := e.f.TakeOps(); len(ops) != 0 {
				t.Errorf("Sweep before the cooldown wrote %s", opsString(ops))
			}
			if _, ok := e.r.Backend(id); !ok {
				t.Errorf("backend %d freed before its cooldown", id)
			}

			// Cooldown over, but a flow still refers to it.
			e.clk.SetTime(removedAt.Add(testCooldown))
			e.sweep(InUse{Backends: map[uint32]bool{id: true}})
			if ops := e.f.TakeOps(); len(ops) != 0 {
				t.Errorf("Sweep of an id in use wrote %s", opsString(ops))
			}
			e.wantKernelState(id, pbmaps.BackendRemoved, 0)

			// One walk that finds no flow on it is not enough (it may have
			// lost the rest of a bucket: see free).
			e.sweep(InUse{Backends: map[uint32]bool{id + 1000: true}})
			if ops := e.f.TakeOps(); len(ops) != 0 {
				t.Errorf("Sweep after one miss wrote %s", opsString(ops))
			}
			e.wantKernelState(id, pbmaps.BackendRemoved, 0)

			// Free: the second miss in a row.
			e.sweep(InUse{Backends: map[uint32]bool{id + 1000: true}})
			ops := e.f.TakeOps()
			if index(ops, is(opClearBackend, id)) < 0 {
				t.Errorf("Sweep did not clear backend %d: %s", id, opsString(ops))
			}
			if _, ok := e.r.Backend(id); ok {
				t.Errorf("backend %d still known after Sweep", id)
			}
			if at, ok := e.r.removedAt[id]; ok {
				t.Errorf("backend %d's removal time (%v) kept after Sweep freed it", id, at)
			}
			if kb := e.f.PbBackends[id]; kb != (bpf.LbBackend{}) {
				t.Errorf("pb_backends[%d] = %+v after Sweep, want zeroed", id, kb)
			}
			if got := e.f.PbPorts[port]; got != tc.keptPort {
				t.Errorf("pb_ports[%d] = %#x after freeing, want %#x", port, got, tc.keptPort)
			}
			e.checkKernel()

			// Sweeping again does nothing.
			e.sweep(InUse{})
			if ops := e.f.TakeOps(); len(ops) != 0 {
				t.Errorf("second Sweep wrote %s", opsString(ops))
			}

			// The id is reusable.
			web.Endpoints = append(web.Endpoints, ep("198.19.1.9:8080"))
			e.apply(web)
			if got := e.bid(web.Key, "198.19.1.9:8080"); got != id {
				t.Errorf("new endpoint got id %d, want freed id %d", got, id)
			}
			// Active, as every new backend, and reachable by no flow: no
			// table holds the reused id (the live table lost it when the
			// old endpoint left) until ProgramService admits it.
			e.wantKernelState(id, pbmaps.BackendActive, 0)
			e.wantUnreachable(id)
			if kb := e.f.PbBackends[id]; pbmaps.Port(kb.Port) != 8080 {
				t.Errorf("reused id %d holds port %d", id, pbmaps.Port(kb.Port))
			}
			e.programAll()
			if !slices.Contains(e.liveTable(web.Key), id) {
				t.Errorf("reused id %d not in the table once admitted", id)
			}
			e.checkKernel()
		})
	}
}

// Re-adding an endpoint before its old backend is freed gives it a new id:
// a late event for the old id must not count against the new one.
func TestReaddedEndpointGetsNewID(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep("198.19.1.1:8080"), ep("198.19.1.2:8080"))
	e.apply(web)
	old := e.bid(web.Key, "198.19.1.2:8080")
	e.apply(svc("web", vip1, 80, ep("198.19.1.1:8080")))
	changes := e.apply(web)
	id := e.bid(web.Key, "198.19.1.2:8080")
	if id == old {
		t.Fatalf("re-added endpoint reuses id %d before its cooldown", id)
	}
	if len(changes) != 1 || len(changes[0].Retired) != 0 {
		t.Errorf("changes %+v", changes)
	}
	e.wantKernelState(old, pbmaps.BackendRemoved, 0)
	e.wantKernelState(id, pbmaps.BackendActive, 0)
	e.wantUnreachable(id)
	e.programAll()
	if got := idsIn(e.liveTable(web.Key)); slices.Contains(got, old) || !slices.Contains(got, id) {
		t.Errorf("table holds %v, want the new id %d, not the old %d", got, id, old)
	}
	e.checkKernel()
}

func TestRemoveService(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep("198.19.1.1:8080"), ep("198.19.1.2:8080"), ep("198.19.1.3:8080"))
	api := svc("api", vip2, 443, ep("198.19.2.1:8443"))
	e.apply(web, api)
	s := e.service(web.Key)
	id := s.ID
	bes := slices.Clone(s.Backends)
	// A probe in flight, so there is a fallback table too.
	e.program(id, bes[:2], bes[2:], false)
	e.program(e.service(api.Key).ID, e.service(api.Key).Backends, nil, false)
	e.apply(web, api) // both tables of each service exist now
	if _, ok := e.f.PbMaglevFb[id]; !ok {
		t.Fatal("setup: no fallback table")
	}
	for n := range uint32(2) {
		if _, ok := e.f.Installed(id, n); !ok {
			t.Fatalf("setup: no table %d", n)
		}
	}
	e.f.TakeOps()

	changes := e.apply(api)
	ops := e.f.TakeOps()

	if _, ok := e.f.PbServices[keyOf(web.Key)]; ok {
		t.Error("pb_services entry still there")
	}
	for n := range uint32(2) {
		if _, ok := e.f.Installed(id, n); ok {
			t.Errorf("Maglev table %d still there", n)
		}
	}
	if _, ok := e.f.PbMaglevFb[id]; ok {
		t.Error("fallback table still there")
	}
	for _, b := range bes {
		e.wantKernelState(b, pbmaps.BackendRemoved, 0)
	}
	if len(changes) != 1 || changes[0].Service.ID != id || !changes[0].Removed ||
		!slices.Equal(sorted(changes[0].Retired), sorted(bes)) {
		t.Errorf("changes %+v, want service %d removed retiring %v", changes, id, bes)
	}
	if changes[0].Service.Spec.Name != "web" {
		t.Errorf("removed service's spec name %q", changes[0].Service.Spec.Name)
	}
	if _, ok := e.r.Service(id); ok {
		t.Error("Service(id) still finds the removed service")
	}
	if _, ok := e.r.ServiceByKey(web.Key); ok {
		t.Error("ServiceByKey still finds the removed service")
	}
	if err := e.r.ProgramService(id, bes, nil, false, 0); err == nil {
		t.Error("ProgramService of a removed service: no error")
	}
	// Both ports stay while the service's flows may live on: the VIP port
	// until its id is freed, the backend port until its backends are.
	if got := e.f.PbPorts[80]; got != pbmaps.PortVIP {
		t.Errorf("pb_ports[80] = %#x, want VIP while the removed service's flows may live", got)
	}
	if got := e.f.PbPorts[8080]; got != pbmaps.PortBackend {
		t.Errorf("pb_ports[8080] = %#x, want backend while removed backends remain", got)
	}
	inOrder(t, ops, "delete", is(opDeleteService, id))
	e.checkKernel()

	slot := pbmaps.VIPSlot(web.Key.VIP)
	if !e.f.PbVIPSlots[slot] {
		t.Errorf("pb_vip_slots[%d] cleared while the removed service's flows may live", slot)
	}

	// Past the cooldown, a flow still in conntrack keeps the VIP port and
	// address (the sweep reports the service's id and its VIP).
	e.clk.Step(testCooldown)
	vipAP := netip.AddrPortFrom(web.Key.VIP, web.Key.Port)
	e.sweep(InUse{Services: map[uint32]bool{id: true}, Backends: map[uint32]bool{bes[0]: true},
		VIPs: map[netip.AddrPort]bool{vipAP: true}})
	if got := e.f.PbPorts[80]; got != pbmaps.PortVIP || !e.f.PbVIPSlots[slot] {
		t.Errorf("pb_ports[80] = %#x, slot marked %v: want both while conntrack holds a flow of the service", got, e.f.PbVIPSlots[slot])
	}
	// The first walk that misses the flow keeps all (see free), the second
	// frees the ids and the VIP.
	e.sweep(InUse{})
	if got := e.f.PbPorts[80]; got != pbmaps.PortVIP || !e.f.PbVIPSlots[slot] {
		t.Errorf("pb_ports[80] = %#x, slot marked %v after one walk missed the flow: want both", got, e.f.PbVIPSlots[slot])
	}
	if kb := e.f.PbBackends[bes[0]]; kb.Family == 0 {
		t.Errorf("backend %d freed after one walk missed its flow", bes[0])
	}
	e.sweep(InUse{})
	if e.f.PbVIPSlots[slot] {
		t.Errorf("pb_vip_slots[%d] still marked after the service's id was freed", slot)
	}
	for _, b := range bes {
		if kb := e.f.PbBackends[b]; kb.Family != 0 {
			t.Errorf("backend %d not freed: %+v", b, kb)
		}
	}
	if _, ok := e.f.PbPorts[80]; ok {
		t.Errorf("pb_ports[80] still set after the service's id was freed")
	}
	if _, ok := e.f.PbPorts[8080]; ok {
		t.Errorf("pb_ports[8080] still set after its backends were freed")
	}
	e.checkKernel()
}

func TestServiceIDReuseAfterCooldown(t *testing.T) {
	for _, tc := range []struct {
		name   string
		after  time.Duration
		reused bool
	}{
		{name: "before cooldown", after: testCooldown - time.Second, reused: false},
		{name: "at cooldown", after: testCooldown, reused: true},
		{name: "long after", after: 10 * testCooldown, reused: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			web := svc("web", vip1, 80, ep("198.19.1.1:8080"))
			e.apply(web)
			old := e.service(web.Key).ID
			e.apply()
			e.clk.Step(tc.after)
			e.sweep(InUse{})
			e.sweep(InUse{})
			// The same key comes back, and so does another one.
			e.apply(web, svc("api", vip2, 443, ep("198.19.2.1:8443")))
			got := []uint32{e.service(web.Key).ID, e.service(desired.Key{VIP: netip.MustParseAddr(vip2), Port: 443, Protocol: desired.TCP}).ID}
			if slices.Contains(got, old) != tc.reused {
				t.Errorf("old id %d, new ids %v: reused = %v, want %v", old, got, !tc.reused, tc.reused)
			}
			// Both have endpoints: their entries come with their tables.
			e.programAll()
			if v := e.f.PbServices[keyOf(web.Key)]; v.Id != got[0] {
				t.Errorf("pb_services id %d, want %d", v.Id, got[0])
			}
			e.checkKernel()
		})
	}
}

// Backend ids run out: the endpoint without an id is reported, the rest is
// programmed, and a later Apply completes the service once ids are freed.
func TestBackendIDExhaustion(t *testing.T) {
	// Ids are 1..MaxBackends-1: three of them.
	e := newEnv(t, func(o *Options) { o.MaxBackends = 4 })
	a := svc("alpha", vip1, 80, ep("198.19.1.1:8080"), ep("198.19.1.2:8080"))
	b := svc("bravo", vip2, 80, ep("198.19.2.1:8080"), ep("198.19.2.2:8080"))
	c := svc("charlie", vip3, 80)

	changes, err := e.r.Apply(state(a, b, c), e.acc)
	if err == nil {
		t.Fatal("Apply: no error")
	}
	if msg := err.Error(); !strings.Contains(msg, "bravo") || !strings.Contains(msg, "198.19.2.2:8080") {
		t.Errorf("error %q does not name the service and the endpoint", msg)
	}
	if strings.Contains(err.Error(), "alpha") || strings.Contains(err.Error(), "198.19.2.1:8080") {
		t.Errorf("error %q names what was programmed", err)
	}
	if len(changes) != 3 {
		t.Errorf("%d changes, want 3 (every service was programmed)", len(changes))
	}
	// Only charlie, without endpoints, has its entry from Apply; the
	// others get theirs from their first ProgramService (below).
	for _, k := range []desired.Key{a.Key, b.Key, c.Key} {
		s := e.service(k)
		if _, ok := e.f.PbServices[keyOf(k)]; ok != (len(s.Backends) == 0) {
			t.Errorf("service %s with %d backends: in pb_services %v after Apply", s.Spec.Name, len(s.Backends), ok)
		}
	}
	if got := len(e.service(a.Key).Backends); got != 2 {
		t.Errorf("alpha has %d backends, want 2", got)
	}
	bs := e.service(b.Key)
	if len(bs.Backends) != 1 || len(bs.Spec.Endpoints) != 1 || bs.Spec.Endpoints[0].Addr != b.Endpoints[0].Addr {
		t.Errorf("bravo: backends %v endpoints %v, want only its first endpoint", bs.Backends, bs.Spec.Endpoints)
	}
	e.programAll()
	for _, k := range []desired.Key{a.Key, b.Key, c.Key} {
		if _, ok := e.f.PbServices[keyOf(k)]; !ok {
			t.Errorf("service %s not in pb_services once programmed", e.service(k).Spec.Name)
		}
	}
	e.checkKernel()
	if got := idsIn(e.liveTable(b.Key)); !slices.Equal(got, bs.Backends) {
		t.Errorf("bravo's table holds %v, want %v", got, bs.Backends)
	}

	// Retrying without freeing fails the same way, and writes nothing new.
	e.f.TakeOps()
	if _, err := e.r.Apply(state(a, b, c), e.acc); err == nil || !strings.Contains(err.Error(), "198.19.2.2:8080") {
		t.Errorf("retry: err = %v", err)
	}
	if ops := e.f.TakeOps(); count(ops, kindIs(opSetBackend, opUpsertService)) != 0 {
		t.Errorf("retry wrote %s", opsString(ops))
	}

	// Free one of alpha's ids: bravo gets its endpoint.
	a.Endpoints = a.Endpoints[:1]
	if _, err := e.r.Apply(state(a, b, c), e.acc); err == nil {
		t.Error("no error while the removed backend still holds its id")
	}
	// As the agent does after every Apply: alpha's table loses the
	// removed backend long before its id can be reused.
	e.programAll()
	e.clk.Step(testCooldown)
	e.sweep(InUse{})
	e.sweep(InUse{})
	changes, err = e.r.Apply(state(a, b, c), e.acc)
	if err != nil {
		t.Fatalf("Apply after freeing an id: %v", err)
	}
	if got := len(e.service(b.Key).Backends); got != 2 {
		t.Errorf("bravo has %d backends, want 2", got)
	}
	if len(changes) != 1 || changes[0].Service.ID != bs.ID {
		t.Errorf("changes %+v, want bravo's", changes)
	}
	e.programAll()
	e.checkKernel()
}

func TestServiceIDExhaustion(t *testing.T) {
	// Service ids are 1..MaxServices-1: two of them.
	e := newEnv(t, func(o *Options) { o.MaxServices = 3 })
	a := svc("alpha", vip1, 80, ep("198.19.1.1:8080"))
	b := svc("bravo", vip2, 80, ep("198.19.2.1:8080"))
	c := svc("charlie", vip3, 80, ep("198.19.3.1:8080"))
	changes, err := e.r.Apply(state(a, b, c), e.acc)
	if err == nil || !strings.Contains(err.Error(), "charlie") {
		t.Fatalf("err = %v, want one naming charlie", err)
	}
	if len(changes) != 2 {
		t.Errorf("%d changes, want 2", len(changes))
	}
	if _, ok := e.r.ServiceByKey(c.Key); ok {
		t.Error("charlie programmed without an id")
	}
	e.programAll()
	e.checkKernel()
	// Once an id is freed, charlie gets it.
	e.apply(a)
	e.clk.Step(testCooldown)
	e.sweep(InUse{})
	e.sweep(InUse{})
	e.apply(a, c)
	e.programAll()
	e.checkKernel()
}

// A failed backend write is reported with its endpoint and retried by the
// next Apply; the id is not lost. (The batch fails, then the first entry
// written on its own: see TestApplyBackendBatchFallback for more.)
func TestApplyBackendWriteFailure(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.MaxBackends = 3 })
	// A fresh desired state for each Apply (see
	// TestKnownBugBackendFallbackMutatesDesiredState).
	web := func() desired.Service {
		return svc("web", vip1, 80, ep("198.19.1.1:8080"), ep("198.19.1.2:8080"))
	}
	e.f.Fail[opSetBackends] = 1
	e.f.Fail[opSetBackend] = 1
	changes, err := e.r.Apply(state(web()), e.acc)
	if err == nil || !strings.Contains(err.Error(), "198.19.1.1:8080") {
		t.Fatalf("err = %v, want one naming the endpoint", err)
	}
	if strings.Contains(err.Error(), "198.19.1.2:8080") {
		t.Errorf("err = %v names the endpoint that was written", err)
	}
	if e.f.Fail[opSetBackend] > 0 {
		t.Fatal("no per-entry write after the batch failed")
	}
	s := e.service(web().Key)
	if len(changes) != 1 || len(s.Backends) != 1 || len(s.Spec.Endpoints) != 1 || s.Spec.Endpoints[0] != ep("198.19.1.2:8080") {
		t.Fatalf("changes %+v, backends %v, endpoints %v", changes, s.Backends, s.Spec.Endpoints)
	}
	e.wantKernelState(s.Backends[0], pbmaps.BackendActive, 0)
	// Both ids are still available (MaxBackends 3: ids 1 and 2).
	if _, err := e.r.Apply(state(web()), e.acc); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if got := e.service(web().Key).Spec.Endpoints; !slices.Equal(got, web().Endpoints) {
		t.Errorf("endpoints %v after retry, want %v", got, web().Endpoints)
	}
	e.programAll()
	e.checkKernel()
}

// A failed pb_services write must not hide the endpoints the same Apply
// retired: the caller resets their accrual state and health by Change.
func TestApplyServiceWriteFailureStillReportsRetired(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep(beA), ep(beB))
	e.apply(web)
	e.programAll()
	b := e.bid(web.Key, beB)

	web.Endpoints = web.Endpoints[:1]
	web.MaxInflight = 7 // the service value changes too, and its write fails
	e.f.Fail[opUpsertService] = 1
	changes, err := e.r.Apply(state(web), e.acc)
	if err == nil {
		t.Fatal("no error")
	}
	if len(changes) != 1 || !slices.Equal(changes[0].Retired, []uint32{b}) {
		t.Errorf("changes %+v, want one retiring %d", changes, b)
	}
	e.wantKernelState(b, pbmaps.BackendRemoved, 0)

	// The next Apply writes the service value.
	e.f.TakeOps()
	if _, err := e.r.Apply(state(web), e.acc); err != nil {
		t.Fatal(err)
	}
	if ops := e.f.TakeOps(); len(ops) != 1 || ops[0].Kind != opUpsertService {
		t.Errorf("retry wrote %s", opsString(ops))
	}
	e.programAll()
	e.checkKernel()
}

// Apply installs the tables of every service that needs one in a single
// InstallTables call (one RCU grace period in the kernel, however many
// services), so that ProgramService installs none: new services get
// table 0; once it is live, the next Apply prepares every spare table 1
// in one batch too; with both tables in place, Apply installs nothing.
func TestApplyBatchesInstalls(t *testing.T) {
	const n = 20
	e := newEnv(t)
	var svcs []desired.Service
	for i := range n {
		svcs = append(svcs, svc(fmt.Sprintf("s%d", i), fmt.Sprintf("198.18.1.%d", i+1), 80,
			ep(fmt.Sprintf("198.19.1.%d:8080", i+1)), ep(fmt.Sprintf("198.19.2.%d:8080", i+1))))
	}
	svcs = append(svcs, svc("empty", vip1, 80)) // no endpoints: no table
	e.apply(svcs...)
	ops := e.f.TakeOps()
	if c := count(ops, kindIs(opInstallTables)); c != 1 {
		t.Fatalf("%d InstallTables for %d new services, want 1: %s", c, n, opsString(ops))
	}
	got := installed(ops)
	if len(got) != n {
		t.Errorf("installed %d tables, want %d", len(got), n)
	}
	seen := map[uint32]bool{}
	for _, r := range got {
		if r.N != 0 || r.Size != testTableSize || seen[r.SvcID] {
			t.Errorf("installed %+v", r)
		}
		seen[r.SvcID] = true
	}
	// Services with endpoints get their entries from ProgramService, with
	// their tables; only the one without endpoints is written here, with
	// no table (table_size 0).
	emptyID := e.service(svcs[n].Key).ID
	if ups := count(ops, kindIs(opUpsertService)); ups != 1 || index(ops, upsertSize(emptyID, 0)) < 0 {
		t.Errorf("Apply wrote %d service entries, want only the one of the service without endpoints: %s", ups, opsString(ops))
	}
	if seen[emptyID] {
		t.Error("table installed for a service without endpoints")
	}
	// The batch is the last table work: after every backend it serves.
	if i, j := index(ops, kindIs(opInstallTables)), lastIndex(ops, kindIs(opSetBackend)); i < 0 || j < 0 || i < j {
		t.Errorf("tables installed before the backends: %s", opsString(ops))
	}

	for _, s := range e.r.Services() {
		e.program(s.ID, s.Backends, nil, false)
		ops := e.f.TakeOps()
		if c := count(ops, kindIs(opInstallTables)); c != 0 {
			t.Errorf("service %s: ProgramService installed a table Apply prepared: %s", s.Spec.Name, opsString(ops))
		}
		if len(s.Backends) > 0 {
			inOrder(t, ops, "fill, then flip", fill(s.ID, 0), flip(s.ID, 0, testTableSize))
		}
	}
	e.checkKernel()

	// The spares: one batch.
	e.apply(svcs...)
	ops = e.f.TakeOps()
	if len(ops) != 1 || ops[0].Kind != opInstallTables || len(ops[0].Reqs) != n {
		t.Fatalf("second Apply wrote %s, want one InstallTables of %d spare tables", opsString(ops), n)
	}
	for _, r := range ops[0].Reqs {
		if r.N != 1 || r.Size != testTableSize {
			t.Errorf("installed %+v, want the spare table 1", r)
		}
	}
	e.checkKernel()

	// Both tables in place: nothing more, ever, at this size.
	e.apply(svcs...)
	if ops := e.f.TakeOps(); len(ops) != 0 {
		t.Errorf("third Apply wrote %s", opsString(ops))
	}
	for _, s := range e.r.Services() {
		if len(s.Backends) == 0 {
			continue
		}
		e.program(s.ID, s.Backends[:1], nil, false)
		e.program(s.ID, s.Backends, nil, false)
	}
	if c := count(e.f.TakeOps(), kindIs(opInstallTables)); c != 0 {
		t.Errorf("%d InstallTables with every table in place", c)
	}
	e.checkKernel()
}

// Adding services to running ones: the batch holds the new services'
// tables and only those; running services' live tables are never
// replaced (the fake asserts it).
func TestApplyBatchWithRunningServices(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep(beA), ep(beB))
	e.apply(web)
	e.programAll()
	e.apply(web)
	e.f.TakeOps()

	api := svc("api", vip2, 443, ep("198.19.2.1:8443"))
	dns := svc("dns", vip3, 53, ep("198.19.3.1:53"))
	e.apply(web, api, dns)
	ops := e.f.TakeOps()
	got := installed(ops)
	if count(ops, kindIs(opInstallTables)) != 1 || len(got) != 2 ||
		slices.ContainsFunc(got, func(r pbmaps.TableInstall) bool { return r.SvcID == e.service(web.Key).ID }) {
		t.Errorf("installed %v: %s", got, opsString(ops))
	}
	e.programAll()
	e.checkKernel()
}
