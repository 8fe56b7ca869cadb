package reconcile

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/desired"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
)

// Tests of the batched start: Apply creates every new backend of every
// service in one batch (one ResetBackendStats, one SetBackends), writes
// them active (no table holds them until ProgramService), and leaves a
// service with endpoints without a pb_services entry until its first
// ProgramService writes it with its table.

// freshIDs are the backend ids whose stats ops reset: the backends the
// Apply that wrote ops created.
func freshIDs(ops []op) []uint32 {
	var out []uint32
	for _, o := range ops {
		if o.Kind == opResetBeStats {
			out = append(out, o.ID)
		}
	}
	return out
}

// One Apply creating many endpoints across several services, new and
// running, makes one ResetBackendStats call and one SetBackends call;
// only retirements are written one by one. The batch comes after the
// services loop (every service's stats reset, every retirement) and
// before the removals; the tables' batch comes after it.
func TestApplyBatchesBackendWrites(t *testing.T) {
	const nSvc, nEp = 8, 6
	e := newEnv(t)
	run := svc("run", vip1, 80, ep(beA), ep(beB))
	gone := svc("gone", vip2, 80, ep("198.19.9.1:8080"))
	e.apply(run, gone)
	e.programAll()
	e.apply(run, gone) // spare tables: nothing to install for run below
	goneID := e.service(gone.Key).ID
	goneBe := e.service(gone.Key).Backends[0]
	b := e.bid(run.Key, beB)
	e.f.TakeOps()
	e.f.TakeCalls()

	// run loses b and gains c and d; nSvc new services of nEp endpoints;
	// one new service without endpoints; gone is removed.
	run.Endpoints = []desired.Endpoint{ep(beA), ep(beC), ep(beD)}
	svcs := []desired.Service{run}
	for i := range nSvc {
		s := svc(fmt.Sprintf("s%d", i), fmt.Sprintf("198.18.2.%d", i+1), 80)
		for j := range nEp {
			s.Endpoints = append(s.Endpoints, ep(fmt.Sprintf("198.19.%d.%d:8080", 10+i, j+1)))
		}
		svcs = append(svcs, s)
	}
	svcs = append(svcs, svc("empty", vip3, 80))
	changes := e.apply(svcs...)
	ops, calls := e.f.TakeOps(), e.f.TakeCalls()
	const n = 2 + nSvc*nEp

	if len(changes) != nSvc+3 {
		t.Errorf("%d changes, want %d", len(changes), nSvc+3)
	}
	if calls[opResetBeStats] != 1 || calls[opSetBackends] != 1 {
		t.Errorf("%d ResetBackendStats and %d SetBackends calls for %d new backends, want one batch each",
			calls[opResetBeStats], calls[opSetBackends], n)
	}
	if calls[opSetBackend] != 2 {
		t.Errorf("%d SetBackend calls, want the 2 retirements only", calls[opSetBackend])
	}

	fresh := freshIDs(ops)
	var want []uint32
	want = append(want, e.bids(run.Key, beC, beD)...)
	for _, s := range svcs[1 : 1+nSvc] {
		want = append(want, e.service(s.Key).Backends...)
	}
	if !slices.Equal(sorted(fresh), sorted(want)) || len(fresh) != n {
		t.Fatalf("stats reset for %v, want the %d new backends %v", fresh, n, want)
	}
	// One batch of resets, then one of entries, each new backend once and
	// active; the entries in one run of ops.
	first := index(ops, func(o op) bool { return o.Kind == opSetBackend && slices.Contains(fresh, o.ID) })
	if first < 0 || lastIndex(ops, kindIs(opResetBeStats)) > first {
		t.Errorf("stats not all reset before the first entry: %s", opsString(ops))
	}
	for i, id := range fresh {
		if at := first + i; at >= len(ops) || !setState(id, pbmaps.BackendActive)(ops[at]) {
			t.Errorf("new backends not written in one batch, in order: %s", opsString(ops))
			break
		}
		if c := count(ops, is(opSetBackend, id)); c != 1 {
			t.Errorf("backend %d written %d times", id, c)
		}
		e.wantKernelState(id, pbmaps.BackendActive, 0)
		e.wantUnreachable(id)
	}
	// After the services loop, before the removals, before the tables.
	for _, s := range svcs[1:] {
		inOrder(t, ops, "service's stats reset before the batch", is(opResetSvcStats, e.service(s.Key).ID), setState(fresh[0], pbmaps.BackendActive))
	}
	inOrder(t, ops, "retirement, batch, removal, tables",
		setState(b, pbmaps.BackendRemoved), setState(fresh[0], pbmaps.BackendActive),
		is(opDeleteService, goneID), setState(goneBe, pbmaps.BackendRemoved), kindIs(opInstallTables))
	// Only the new service without endpoints is written: run's value is
	// unchanged, the new ones with endpoints are ProgramService's.
	emptyID := e.service(svcs[len(svcs)-1].Key).ID
	if c := count(ops, kindIs(opUpsertService)); c != 1 || index(ops, upsertSize(emptyID, 0)) < 0 {
		t.Errorf("Apply wrote %d service entries, want only the empty service's: %s", c, opsString(ops))
	}
	// Every write, exactly: stats of the nSvc+1 new services, then per new
	// backend a stats reset and an entry, b's and gone's backend's
	// removal, the empty service's entry, gone's deletion, one batch of
	// tables (the ports do not change), one batch of VIP slots.
	if wantOps := (nSvc + 1) + 2*n + 2 + 1 + 1 + 1 + 1; len(ops) != wantOps {
		t.Errorf("%d writes, want %d: %s", len(ops), wantOps, opsString(ops))
	}
	if got := installed(ops); len(got) != nSvc || count(ops, kindIs(opInstallTables)) != 1 {
		t.Errorf("installed %v, want the %d new services' tables in one batch", got, nSvc)
	}

	// Each new service's first ProgramService writes its entry, once.
	for _, s := range e.r.Services() {
		e.program(s.ID, s.Backends, nil, false)
		if c := count(e.f.TakeOps(), is(opUpsertService, s.ID)); c > 1 {
			t.Errorf("service %s written %d times by ProgramService", s.Spec.Name, c)
		}
		if _, ok := e.f.PbServices[keyOf(s.Spec.Key)]; !ok {
			t.Errorf("service %s: no entry once programmed", s.Spec.Name)
		}
	}
	e.checkKernel()

	// Nothing new: no batch at all.
	e.f.TakeCalls()
	e.apply(svcs...)
	if calls := e.f.TakeCalls(); calls[opResetBeStats] != 0 || calls[opSetBackends] != 0 || calls[opSetBackend] != 0 {
		t.Errorf("Apply with no new endpoint made calls %v", calls)
	}
}

// The batch of entries fails: each entry is written on its own. An entry
// that still fails leaves its service (its id freed, the error naming its
// endpoint); the other endpoints, of its service and of the others, are
// programmed. The next Apply retries the endpoint.
func TestApplyBackendBatchFallback(t *testing.T) {
	const bad = "198.19.2.2:9999" // its own port: pb_ports must not keep it
	mk := func() []desired.Service {
		return []desired.Service{
			svc("run", vip1, 80, ep(beA), ep(beB), ep(beC)),
			svc("alpha", vip2, 80, ep("198.19.3.1:8080"), ep("198.19.3.2:8080")),
			svc("bravo", vip3, 80, ep("198.19.2.1:8080"), ep(bad), ep("198.19.2.3:8080")),
		}
	}
	setup := func(t *testing.T) *env {
		e := newEnv(t)
		run := mk()[0]
		run.Endpoints = run.Endpoints[:2]
		e.apply(run)
		e.programAll()
		e.apply(run)
		e.f.TakeOps()
		e.f.TakeCalls()
		return e
	}

	t.Run("batch fails, every entry written on its own", func(t *testing.T) {
		e := setup(t)
		e.f.Fail[opSetBackends] = 1
		svcs := mk()
		changes := e.apply(svcs...) // every endpoint programmed: no error
		ops, calls := e.f.TakeOps(), e.f.TakeCalls()
		if e.f.Fail[opSetBackends] > 0 {
			t.Fatal("SetBackends not called")
		}
		fresh := freshIDs(ops)
		if len(fresh) != 6 || calls[opResetBeStats] != 1 || calls[opSetBackends] != 1 || calls[opSetBackend] != len(fresh) {
			t.Errorf("calls %v for %d new backends, want one batch, then one SetBackend each", calls, len(fresh))
		}
		for _, id := range fresh {
			inOrder(t, ops, "stats reset, then the entry", is(opResetBeStats, id), setState(id, pbmaps.BackendActive))
			if c := count(ops, is(opSetBackend, id)); c != 1 {
				t.Errorf("backend %d written %d times", id, c)
			}
			e.wantKernelState(id, pbmaps.BackendActive, 0)
			e.wantUnreachable(id)
		}
		if len(changes) != 3 {
			t.Errorf("%d changes, want 3", len(changes))
		}
		for _, s := range svcs {
			if got := e.service(s.Key).Spec.Endpoints; !slices.Equal(got, s.Endpoints) {
				t.Errorf("service %s: endpoints %v, want %v", s.Name, got, s.Endpoints)
			}
		}
		e.programAll()
		e.checkKernel()
	})

	t.Run("an entry still fails", func(t *testing.T) {
		e := setup(t)
		rejectAddrs(e.f, bad) // the batch fails at it, then its own write
		// (Expectations use fresh mk() states: see
		// TestKnownBugBackendFallbackMutatesDesiredState.)
		changes, err := e.r.Apply(state(mk()...), e.acc)
		ops, calls := e.f.TakeOps(), e.f.TakeCalls()
		if err == nil || !strings.Contains(err.Error(), bad) {
			t.Fatalf("err = %v, want one naming %s", err, bad)
		}
		for _, s := range mk() {
			for _, x := range s.Endpoints {
				if x.Addr.String() != bad && strings.Contains(err.Error(), x.Addr.String()) {
					t.Errorf("err = %v names %s, which was written", err, x.Addr)
				}
			}
		}
		fresh := freshIDs(ops)
		if len(fresh) != 6 || calls[opResetBeStats] != 1 || calls[opSetBackends] != 1 || calls[opSetBackend] != len(fresh) {
			t.Errorf("calls %v for %d new backends, want one batch, then one SetBackend each", calls, len(fresh))
		}
		if len(changes) != 3 {
			t.Errorf("%d changes, want 3", len(changes))
		}
		// bravo keeps its other two endpoints, its spec aligned with its
		// backends; the others are whole.
		br := e.service(mk()[2].Key)
		wantEps := []desired.Endpoint{mk()[2].Endpoints[0], mk()[2].Endpoints[2]}
		if !slices.Equal(br.Spec.Endpoints, wantEps) || len(br.Backends) != 2 {
			t.Errorf("bravo: endpoints %v, backends %v; want %v", br.Spec.Endpoints, br.Backends, wantEps)
		}
		for _, s := range mk()[:2] {
			if got := e.service(s.Key).Backends; len(got) != len(s.Endpoints) {
				t.Errorf("service %s: backends %v for %d endpoints", s.Name, got, len(s.Endpoints))
			}
		}
		// The dropped id: reset with the batch, then freed; the kernel
		// never got its entry.
		var dropped []uint32
		for _, id := range fresh {
			if _, ok := e.r.Backend(id); !ok {
				dropped = append(dropped, id)
				continue
			}
			e.wantKernelState(id, pbmaps.BackendActive, 0)
			e.wantUnreachable(id)
		}
		if len(dropped) != 1 {
			t.Fatalf("dropped %v, want the one id of %s", dropped, bad)
		}
		if kb := e.f.PbBackends[dropped[0]]; kb != (bpf.LbBackend{}) {
			t.Errorf("pb_backends[%d] = %+v, want never written", dropped[0], kb)
		}
		if got := e.f.PbPorts[9999]; got != 0 {
			t.Errorf("pb_ports[9999] = %#x for an endpoint without a backend", got)
		}
		// The others are programmed.
		for _, s := range e.r.Services() {
			e.program(s.ID, s.Backends, nil, false)
			if got := idsIn(e.liveTable(s.Spec.Key)); !slices.Equal(got, sorted(s.Backends)) {
				t.Errorf("service %s: table holds %v, want %v", s.Spec.Name, got, s.Backends)
			}
		}
		e.checkKernel()

		// Retried by the next Apply, with the freed id.
		e.f.RejectBackend = nil
		e.f.TakeOps()
		changes = e.apply(mk()...)
		if len(changes) != 1 || changes[0].Service != br || len(changes[0].Retired) != 0 {
			t.Errorf("retry: changes %+v, want bravo's, retiring nothing", changes)
		}
		if got := e.bid(br.Spec.Key, bad); got != dropped[0] {
			t.Errorf("retry: %s got id %d, want the freed %d", bad, got, dropped[0])
		}
		if !slices.Equal(br.Spec.Endpoints, mk()[2].Endpoints) {
			t.Errorf("retry: bravo's endpoints %v", br.Spec.Endpoints)
		}
		e.wantKernelState(dropped[0], pbmaps.BackendActive, 0)
		e.wantUnreachable(dropped[0])
		e.program(br.ID, br.Backends, nil, false)
		e.wantProgrammed(br.ID, br.Backends, nil, nil)
	})
}

// A new service with endpoints gets its pb_services entry from its first
// ProgramService, together with its table: none from Apply, even when its
// limits change before it is programmed. A new service without endpoints
// is written by Apply with table_size 0: its VIP's new flows are dropped
// (and counted) rather than passed.
func TestFirstServiceEntry(t *testing.T) {
	t.Run("with endpoints", func(t *testing.T) {
		for _, admit := range []string{"all", "none"} {
			t.Run(admit, func(t *testing.T) {
				e := newEnv(t)
				web := svc("web", vip1, 80, ep(beA), ep(beB), ep(beC))
				web.MaxInflight, web.MaxInflightPerEndpoint = 100, 10
				e.apply(web)
				ops := e.f.TakeOps()
				if c := count(ops, kindIs(opUpsertService)); c != 0 {
					t.Errorf("Apply wrote the entry of a new service with endpoints: %s", opsString(ops))
				}
				if _, ok := e.f.PbServices[keyOf(web.Key)]; ok {
					t.Error("pb_services entry before ProgramService")
				}
				// Limits change before the first ProgramService: still not
				// Apply's to write.
				web.MaxInflight, web.MaxInflightPerEndpoint = 200, 20
				e.apply(web)
				if ops := e.f.TakeOps(); len(ops) != 0 {
					t.Errorf("limits change of a service not yet written wrote %s", opsString(ops))
				}
				s := e.service(web.Key)
				var active []uint32
				if admit == "all" {
					active = s.Backends
				}
				e.program(s.ID, active, nil, false)
				ops = e.f.TakeOps()
				if c := count(ops, kindIs(opUpsertService)); c != 1 || ops[len(ops)-1].Kind != opUpsertService {
					t.Errorf("first ProgramService: %d pb_services writes, want exactly one, last: %s", c, opsString(ops))
				}
				want := bpf.LbSvcValue{Id: s.ID, MaxInflight: 200, MaxInflightPerBackend: 20, Flags: quietFlags(&web)}
				if admit == "all" {
					want.TableSize, want.BackendCount = testTableSize, 3
					inOrder(t, ops, "fill, then the entry", fill(s.ID, 0), flip(s.ID, 0, testTableSize))
				} else {
					// Out first: every backend ejected before the entry
					// (table_size 0: the VIP's flows dropped).
					for _, b := range s.Backends {
						inOrder(t, ops, "ejected, then the entry", setState(b, pbmaps.BackendEjected), upsertSize(s.ID, 0))
					}
					if _, _, ok := e.f.Pick(keyOf(web.Key), 12345, true); ok {
						t.Error("flow picked a backend with nothing admitted")
					}
				}
				if got := e.f.PbServices[keyOf(web.Key)]; got != want {
					t.Errorf("pb_services = %+v, want %+v", got, want)
				}
				e.wantProgrammed(s.ID, active, nil, nil)
				// Later limit changes are Apply's: the entry exists.
				web.MaxInflight = 300
				e.apply(web)
				if c := count(e.f.TakeOps(), kindIs(opUpsertService)); c != 1 {
					t.Errorf("limits change of a written service: %d pb_services writes, want 1", c)
				}
				e.checkKernel()
			})
		}
	})

	t.Run("without endpoints", func(t *testing.T) {
		e := newEnv(t)
		empty := svc("empty", vip1, 80)
		empty.MaxInflight = 5
		e.apply(empty)
		ops := e.f.TakeOps()
		s := e.service(empty.Key)
		want := bpf.LbSvcValue{Id: s.ID, Table: 0, TableSize: 0, MaxInflight: 5, Flags: quietFlags(&empty)}
		if got, ok := e.f.PbServices[keyOf(empty.Key)]; !ok || got != want {
			t.Errorf("pb_services = %+v (present %v), want %+v", got, ok, want)
		}
		if got := opKinds(ops); !slices.Equal(got, []string{opSetPorts, opSetVIPSlots, opResetSvcStats, opUpsertService}) {
			t.Errorf("Apply wrote %s, want the VIP port and address slot, then the stats reset and the entry", opsString(ops))
		}
		if _, _, ok := e.f.Pick(keyOf(empty.Key), 12345, true); ok {
			t.Error("flow to a service without endpoints not dropped")
		}
		// Its ProgramService has nothing to add.
		e.program(s.ID, nil, nil, false)
		if ops := e.f.TakeOps(); len(ops) != 0 {
			t.Errorf("ProgramService of the empty service wrote %s", opsString(ops))
		}
		e.checkKernel()

		// Endpoints arrive: the entry, written already, is the flip's to
		// change; Apply writes the backends and installs the table only.
		empty.Endpoints = []desired.Endpoint{ep(beA), ep(beB)}
		e.apply(empty)
		ops = e.f.TakeOps()
		if c := count(ops, kindIs(opUpsertService)); c != 0 {
			t.Errorf("Apply rewrote the entry: %s", opsString(ops))
		}
		for _, b := range s.Backends {
			e.wantKernelState(b, pbmaps.BackendActive, 0)
			e.wantUnreachable(b)
		}
		e.program(s.ID, s.Backends, nil, false)
		ops = e.f.TakeOps()
		if c := count(ops, kindIs(opUpsertService)); c != 1 {
			t.Errorf("%d pb_services writes, want the flip: %s", c, opsString(ops))
		}
		inOrder(t, ops, "fill, flip", fill(s.ID, 0), flip(s.ID, 0, testTableSize))
		e.wantProgrammed(s.ID, s.Backends, nil, nil)
	})
}

// New backends of a running service are active from Apply on, yet no new
// flow reaches them before ProgramService puts them in a table; one that
// ProgramService does not admit is ejected before the table changes (out
// first), and one entering probation gets the fallback first.
func TestNewBackendsActiveUntilProgrammed(t *testing.T) {
	for _, tc := range []struct {
		name      string
		active    []string
		probation []string
	}{
		{name: "c admitted, d not", active: []string{beA, beB, beC}},
		{name: "c on probation, d not", active: []string{beA, beB}, probation: []string{beC}},
		{name: "neither, b out too", active: []string{beA}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			web := svc("web", vip1, 80, ep(beA), ep(beB))
			e.apply(web)
			e.programAll()
			e.apply(web)
			old := slices.Clone(e.service(web.Key).Backends)
			live := slices.Clone(e.liveTable(web.Key))

			web.Endpoints = []desired.Endpoint{ep(beA), ep(beB), ep(beC), ep(beD)}
			e.apply(web)
			c, d := e.bid(web.Key, beC), e.bid(web.Key, beD)
			for _, id := range []uint32{c, d} {
				e.wantKernelState(id, pbmaps.BackendActive, 0)
				e.wantUnreachable(id)
			}
			if !slices.Equal(e.liveTable(web.Key), live) {
				t.Error("Apply changed the live table")
			}
			for h := range uint32(8 * testTableSize) {
				if be, _, ok := e.f.Pick(keyOf(web.Key), h*2654435761, true); !ok || !slices.Contains(old, be) {
					t.Fatalf("flow %d: backend %d (picked %v) before ProgramService, want one of %v", h, be, ok, old)
				}
			}
			e.f.TakeOps()

			active, probation := e.bids(web.Key, tc.active...), e.bids(web.Key, tc.probation...)
			n := e.spare(e.service(web.Key).ID)
			id := e.service(web.Key).ID
			e.program(id, active, probation, false)
			ops := e.f.TakeOps()
			e.wantProgrammed(id, active, probation, nil)
			inOrder(t, ops, "d out first", setState(d, pbmaps.BackendEjected), fill(id, n), flip(id, n, testTableSize))
			switch {
			case len(probation) > 0:
				inOrder(t, ops, "c: fallback, probation, table", is(opSetFallback, id),
					setState(c, pbmaps.BackendProbation), fill(id, n), flip(id, n, testTableSize))
			case slices.Contains(active, c):
				if i := index(ops, is(opSetBackend, c)); i >= 0 {
					t.Errorf("c, active already, rewritten: %s", opsString(ops))
				}
			default:
				inOrder(t, ops, "c out first", setState(c, pbmaps.BackendEjected), fill(id, n))
			}
			if k := count(ops, kindIs(opUpsertService)); k != 1 {
				t.Errorf("%d pb_services writes, want the flip: %s", k, opsString(ops))
			}
		})
	}
}

// Regression: dropping an endpoint whose entry cannot be written used to
// edit the caller's desired state in place (Apply copied the
// desired.Service but not its Endpoints slice): the controller's cache
// lost the endpoint and gained a zero one, which the next Apply turned
// into a backend (a panic in maps.Addr16).
func TestBackendFallbackLeavesDesiredStateAlone(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep(beA), ep(beB), ep(beC))
	st := state(web)
	want := slices.Clone(web.Endpoints)
	rejectAddrs(e.f, beA)
	if _, err := e.r.Apply(st, e.acc); err == nil {
		t.Fatal("no error")
	}
	if got := st.Services[0].Endpoints; !slices.Equal(got, want) {
		t.Errorf("Apply changed the caller's desired state: endpoints %v, were %v", got, want)
	}

	// The next Apply of that state (the controller's next snapshot holds
	// the same slice) must give web its three endpoints.
	e.f.RejectBackend = nil
	defer func() {
		if p := recover(); p != nil {
			t.Errorf("Apply of the same desired state again panicked: %v", p)
		}
	}()
	if _, err := e.r.Apply(st, e.acc); err != nil {
		t.Errorf("retry: %v", err)
	}
	s := e.service(web.Key)
	if !slices.Equal(s.Spec.Endpoints, want) || slices.Contains(s.Spec.Endpoints, desired.Endpoint{}) {
		t.Errorf("web's endpoints after the retry: %v, want %v", s.Spec.Endpoints, want)
	}
	for _, id := range s.Backends {
		if b, _ := e.r.Backend(id); b.Addr == (netip.AddrPort{}) {
			t.Errorf("backend %d for the zero address", id)
		}
	}
}
