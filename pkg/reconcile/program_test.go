package reconcile

import (
	"slices"
	"testing"

	"github.com/penaltybox/penaltybox/pkg/desired"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
)

const (
	beA = "198.19.1.1:8080"
	beB = "198.19.1.2:8080"
	beC = "198.19.1.3:8080"
	beD = "198.19.1.4:8080"
)

// webEnv is a reconciler with one service "web" of endpoints a, b, c, d,
// applied but not programmed (every backend ejected, no table).
func webEnv(t *testing.T, mut ...func(*Options)) (*env, desired.Service, uint32) {
	e := newEnv(t, mut...)
	web := svc("web", vip1, 80, ep(beA), ep(beB), ep(beC), ep(beD))
	e.apply(web)
	e.f.takeOps()
	return e, web, e.service(web.Key).ID
}

// wantProgrammed asserts the kernel holds the admission: the table is the
// Maglev table over active+probation, the fallback the one over active
// (present only when both are non-empty), states and grants as admitted.
func (e *env) wantProgrammed(id uint32, active, probation []uint32, grants map[uint32]int32) {
	t := e.t
	t.Helper()
	s, _ := e.r.Service(id)
	all := append(slices.Clone(active), probation...)
	v := e.f.services[keyOf(s.Spec.Key)]
	tbl, ok := e.f.tables[id]
	switch {
	case len(all) == 0 && ok:
		t.Errorf("service %d: table %v with nothing admitted", id, idsIn(tbl))
	case len(all) > 0 && !ok:
		t.Errorf("service %d: no table", id)
	case len(all) > 0:
		if want := e.wantTable(v.TableSize, all); !slices.Equal(tbl, want) {
			t.Errorf("service %d: table is not the Maglev table over %v: holds %v", id, all, idsIn(tbl))
		}
		if got := idsIn(tbl); !slices.Equal(got, sorted(all)) {
			t.Errorf("service %d: table holds %v, want exactly %v", id, got, sorted(all))
		}
	}
	fb, ok := e.f.fallbacks[id]
	if wantFb := len(active) > 0 && len(probation) > 0; wantFb != ok {
		t.Errorf("service %d: fallback present %v, want %v", id, ok, wantFb)
	} else if ok {
		if want := e.wantTable(v.TableSize, active); !slices.Equal(fb, want) {
			t.Errorf("service %d: fallback is not the Maglev table over %v: holds %v", id, active, idsIn(fb))
		}
	}
	for _, b := range s.Backends {
		switch {
		case slices.Contains(probation, b):
			g, ok := grants[b]
			if !ok {
				g = ProbeGrants
			}
			e.wantKernelState(b, pbmaps.BackendProbation, g)
		case slices.Contains(active, b):
			e.wantKernelState(b, pbmaps.BackendActive, 0)
		default:
			e.wantKernelState(b, pbmaps.BackendEjected, 0)
		}
	}
	if !slices.Equal(s.Active, active) || !slices.Equal(s.Probation, probation) {
		t.Errorf("service %d: recorded admission %v/%v, want %v/%v", id, s.Active, s.Probation, active, probation)
	}
	e.checkKernel()
}

func TestProgramServiceTable(t *testing.T) {
	for _, tc := range []struct {
		name   string
		active []string
	}{
		{name: "two of four", active: []string{beA, beB}},
		{name: "one", active: []string{beC}},
		{name: "all", active: []string{beA, beB, beC, beD}},
		{name: "order does not matter", active: []string{beD, beB, beA}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, web, id := webEnv(t)
			active := e.bids(web.Key, tc.active...)
			e.program(id, active, nil, false)
			ops := e.f.takeOps()
			e.wantProgrammed(id, active, nil, nil)
			for _, b := range active {
				inOrder(t, ops, "admitted before the table", setState(b, pbmaps.BackendActive), is(opSwapTable, id))
			}
			// Ejected backends were ejected already: not rewritten.
			if n := count(ops, func(o op) bool { return o.Kind == opSetBackend && o.State != pbmaps.BackendActive }); n != 0 {
				t.Errorf("%d needless state writes: %s", n, opsString(ops))
			}
			// The service is rewritten once: for its backend count, not its
			// table size.
			if n := count(ops, kindIs(opUpsertService)); n > 1 {
				t.Errorf("service rewritten %d times: %s", n, opsString(ops))
			}
			if v := e.f.services[keyOf(web.Key)]; v.BackendCount != uint32(len(active)) || v.TableSize != 31 {
				t.Errorf("service value %+v, want backend_count %d, table_size 31", v, len(active))
			}
			// Same admission again: nothing.
			e.program(id, active, nil, false)
			if ops := e.f.takeOps(); len(ops) != 0 {
				t.Errorf("same admission wrote %s", opsString(ops))
			}
		})
	}
}

// Tables depend on the set of backends, not on their ids or order: the
// table over {a, b} is the same whichever ids a and b have.
func TestProgramServiceTableIndependentOfIDs(t *testing.T) {
	e1, web1, id1 := webEnv(t)
	e1.program(id1, e1.bids(web1.Key, beA, beB), nil, false)

	e2 := newEnv(t)
	// Different ids: other backends were created first.
	e2.apply(svc("other", vip2, 80, ep("198.19.9.1:80"), ep("198.19.9.2:80"), ep("198.19.9.3:80")))
	web2 := svc("web", vip1, 80, ep(beB), ep(beA))
	e2.apply(svc("other", vip2, 80, ep("198.19.9.1:80"), ep("198.19.9.2:80"), ep("198.19.9.3:80")), web2)
	id2 := e2.service(web2.Key).ID
	e2.program(id2, e2.bids(web2.Key, beB, beA), nil, false)

	t1, t2 := e1.f.tables[id1], e2.f.tables[id2]
	if len(t1) != len(t2) {
		t.Fatalf("sizes %d, %d", len(t1), len(t2))
	}
	for i := range t1 {
		b1, _ := e1.r.Backend(t1[i])
		b2, _ := e2.r.Backend(t2[i])
		if b1.Addr != b2.Addr {
			t.Fatalf("slot %d: %s vs %s", i, b1.Addr, b2.Addr)
		}
	}
}

// Every way an admission can change, with the write order ProgramService
// documents: leaving endpoints ejected first, fallback before probation,
// table last.
func TestProgramServiceTransitions(t *testing.T) {
	type adm struct{ active, probation []string }
	for _, tc := range []struct {
		name     string
		from, to adm
		// order lists write sequences that must appear in this order;
		// "table" and "fallback"/"clear-fallback"/"clear-table" name the
		// table writes, "eject:X", "probe:X", "active:X" the state writes.
		order [][]string
		// never lists writes that must not happen.
		never []string
	}{
		{
			name: "eject an active backend",
			from: adm{active: []string{beA, beB, beC}}, to: adm{active: []string{beA, beB}},
			order: [][]string{{"eject:c", "table", "clear-fallback"}},
			never: []string{"active:a", "active:b", "fallback"},
		},
		{
			name: "eject several",
			from: adm{active: []string{beA, beB, beC, beD}}, to: adm{active: []string{beB}},
			order: [][]string{{"eject:a", "table"}, {"eject:c", "table"}, {"eject:d", "table"}},
			never: []string{"active:b"},
		},
		{
			name: "enter probation",
			from: adm{active: []string{beA, beB}}, to: adm{active: []string{beA, beB}, probation: []string{beC}},
			order: [][]string{{"fallback", "probe:c", "table"}},
			never: []string{"clear-fallback", "active:a", "active:b", "eject:d"},
		},
		{
			name: "enter probation straight from active",
			from: adm{active: []string{beA, beB, beC}}, to: adm{active: []string{beA, beB}, probation: []string{beC}},
			order: [][]string{{"fallback", "probe:c", "table"}},
			never: []string{"clear-fallback", "eject:c"},
		},
		{
			name: "probe succeeds",
			from: adm{active: []string{beA, beB}, probation: []string{beC}}, to: adm{active: []string{beA, beB, beC}},
			order: [][]string{{"active:c", "table", "clear-fallback"}},
			never: []string{"fallback"},
		},
		{
			name: "probe fails",
			from: adm{active: []string{beA, beB}, probation: []string{beC}}, to: adm{active: []string{beA, beB}},
			order: [][]string{{"eject:c", "table", "clear-fallback"}},
			never: []string{"fallback", "probe:c"},
		},
		{
			name: "one out, one on probation",
			from: adm{active: []string{beA, beB}}, to: adm{active: []string{beA}, probation: []string{beC}},
			order: [][]string{{"eject:b", "fallback", "probe:c", "table"}},
		},
		{
			name: "second probe while the first is running",
			from: adm{active: []string{beA, beB}, probation: []string{beC}}, to: adm{active: []string{beA, beB}, probation: []string{beC, beD}},
			order: [][]string{{"fallback", "probe:d", "table"}},
			never: []string{"probe:c", "clear-fallback"},
		},
		{
			name: "active set changes under a probe",
			from: adm{active: []string{beA, beB}, probation: []string{beC}}, to: adm{active: []string{beA}, probation: []string{beC}},
			order: [][]string{{"eject:b", "fallback", "table"}},
			never: []string{"probe:c", "clear-fallback"},
		},
		{
			name: "only a probe left",
			from: adm{active: []string{beA}, probation: []string{beC}}, to: adm{probation: []string{beC}},
			order: [][]string{{"eject:a", "table", "clear-fallback"}},
			never: []string{"probe:c", "fallback"},
		},
		{
			name: "everything out",
			from: adm{active: []string{beA, beB}}, to: adm{},
			order: [][]string{{"eject:a", "clear-table"}, {"eject:b", "clear-table"}},
			never: []string{"table"},
		},
		{
			name: "back from nothing",
			from: adm{}, to: adm{active: []string{beA, beB}},
			order: [][]string{{"active:a", "table"}, {"active:b", "table"}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, web, id := webEnv(t)
			ids := func(xs []string) []uint32 { return e.bids(web.Key, xs...) }
			e.program(id, ids(tc.from.active), ids(tc.from.probation), false)
			e.wantProgrammed(id, ids(tc.from.active), ids(tc.from.probation), nil)
			e.f.takeOps()

			e.program(id, ids(tc.to.active), ids(tc.to.probation), false)
			ops := e.f.takeOps()
			e.wantProgrammed(id, ids(tc.to.active), ids(tc.to.probation), nil)

			name := map[string]string{"a": beA, "b": beB, "c": beC, "d": beD}
			match := func(w string) opMatch {
				switch w {
				case "table":
					return is(opSwapTable, id)
				case "fallback":
					return is(opSetFallback, id)
				case "clear-fallback":
					return is(opClearFallback, id)
				case "clear-table":
					return is(opClearTable, id)
				}
				kind, who, _ := cut(w)
				b := e.bid(web.Key, name[who])
				switch kind {
				case "eject":
					return setState(b, pbmaps.BackendEjected)
				case "probe":
					return func(o op) bool {
						return setState(b, pbmaps.BackendProbation)(o) && o.Grants == ProbeGrants
					}
				case "active":
					return setState(b, pbmaps.BackendActive)
				}
				t.Fatalf("bad step %q", w)
				return nil
			}
			for _, seq := range tc.order {
				ms := make([]opMatch, len(seq))
				for i, w := range seq {
					ms[i] = match(w)
				}
				inOrder(t, ops, tc.name, ms...)
			}
			for _, w := range tc.never {
				if i := index(ops, match(w)); i >= 0 {
					t.Errorf("unexpected %s: %s", w, opsString(ops))
				}
			}
			// Every backend state written at most once.
			for _, b := range e.service(web.Key).Backends {
				if n := count(ops, is(opSetBackend, b)); n > 1 {
					t.Errorf("backend %d written %d times: %s", b, n, opsString(ops))
				}
			}
		})
	}
}

func cut(s string) (string, string, bool) {
	for i := range s {
		if s[i] == ':' {
			return s[:i], s[i+1:], true
		}
	}
	return s, "", false
}

func TestProgramServiceProbation(t *testing.T) {
	e, web, id := webEnv(t)
	a, b, c := e.bid(web.Key, beA), e.bid(web.Key, beB), e.bid(web.Key, beC)
	e.program(id, []uint32{a, b, c}, nil, false)
	e.f.takeOps()

	// c goes through ejection to probation.
	e.program(id, []uint32{a, b}, nil, false)
	e.f.takeOps()
	e.program(id, []uint32{a, b}, []uint32{c}, false)
	ops := e.f.takeOps()
	e.wantProgrammed(id, []uint32{a, b}, []uint32{c}, nil)
	if got := idsIn(e.f.fallbacks[id]); !slices.Equal(got, sorted([]uint32{a, b})) {
		t.Errorf("fallback holds %v, want only the active %v", got, []uint32{a, b})
	}
	inOrder(t, ops, "probation", is(opSetFallback, id), setState(c, pbmaps.BackendProbation), is(opSwapTable, id))

	// Staying in probation with the same sets: nothing written, the grant
	// is not re-issued even though the kernel used it.
	e.spendGrants(c)
	for range 2 {
		e.program(id, []uint32{a, b}, []uint32{c}, false)
		if ops := e.f.takeOps(); len(ops) != 0 {
			t.Errorf("unchanged admission wrote %s", opsString(ops))
		}
	}
	e.wantKernelState(c, pbmaps.BackendProbation, 0)

	// Staying in probation while the rest changes: c is not rewritten.
	e.program(id, []uint32{a}, []uint32{c}, false)
	if ops := e.f.takeOps(); index(ops, is(opSetBackend, c)) >= 0 {
		t.Errorf("backend in probation rewritten: %s", opsString(ops))
	}
	e.wantProgrammed(id, []uint32{a}, []uint32{c}, map[uint32]int32{c: 0})

	// The probe succeeded: active, no fallback.
	e.program(id, []uint32{a, c}, nil, false)
	e.wantProgrammed(id, []uint32{a, c}, nil, nil)
}

// spendGrants does what the kernel does when it admits probes.
func (e *env) spendGrants(ids ...uint32) {
	for _, id := range ids {
		b := e.f.backends[id]
		b.ProbeGrants = 0
		e.f.backends[id] = b
	}
}

// The datapath, reading the maps ProgramService wrote, admits exactly
// ProbeGrants new flows to a backend in probation and sends every other
// flow to an active backend.
func TestProgramServiceProbationDatapath(t *testing.T) {
	e, web, id := webEnv(t)
	a, b, c := e.bid(web.Key, beA), e.bid(web.Key, beB), e.bid(web.Key, beC)
	e.program(id, []uint32{a, b}, []uint32{c}, false)
	k := keyOf(web.Key)
	got := map[uint32]int{}
	probes := 0
	for h := range uint32(10 * testTableSize) {
		be, probe, ok := e.f.pick(k, h*2654435761, true)
		if !ok {
			t.Fatalf("flow %d dropped", h)
		}
		got[be]++
		if probe {
			probes++
		}
	}
	if got[c] != ProbeGrants || probes != ProbeGrants {
		t.Errorf("backend in probation got %d flows (%d probes), want %d", got[c], probes, ProbeGrants)
	}
	if got[a] == 0 || got[b] == 0 || len(got) != 3 {
		t.Errorf("flows per backend %v", got)
	}
	// A regrant admits one more.
	if err := e.r.Regrant(c); err != nil {
		t.Fatal(err)
	}
	probes = 0
	for h := range uint32(10 * testTableSize) {
		if _, probe, _ := e.f.pick(k, h*2654435761+7, true); probe {
			probes++
		}
	}
	if probes != ProbeGrants {
		t.Errorf("%d probes after a regrant, want %d", probes, ProbeGrants)
	}
}

func TestProgramServiceFailOpen(t *testing.T) {
	e, web, id := webEnv(t)
	a, b, c, d := e.bid(web.Key, beA), e.bid(web.Key, beB), e.bid(web.Key, beC), e.bid(web.Key, beD)
	e.program(id, []uint32{a}, []uint32{b}, false)
	e.f.takeOps()

	// Fail open: whatever accrual passes, every endpoint is admitted as
	// active, none in probation.
	e.program(id, nil, []uint32{c}, true)
	all := []uint32{a, b, c, d}
	e.wantProgrammed(id, all, nil, nil)
	if !e.service(web.Key).FailOpen {
		t.Error("FailOpen not recorded")
	}
	e.f.takeOps()
	e.program(id, []uint32{a}, nil, true)
	if ops := e.f.takeOps(); len(ops) != 0 {
		t.Errorf("still failing open wrote %s", opsString(ops))
	}

	// Leaving fail-open: back to what accrual says.
	e.program(id, []uint32{a, d}, nil, false)
	ops := e.f.takeOps()
	e.wantProgrammed(id, []uint32{a, d}, nil, nil)
	if e.service(web.Key).FailOpen {
		t.Error("FailOpen still recorded")
	}
	inOrder(t, ops, "leave fail-open", setState(b, pbmaps.BackendEjected), setState(c, pbmaps.BackendEjected), is(opSwapTable, id))
}

func TestProgramServiceNoEndpoints(t *testing.T) {
	t.Run("service without endpoints", func(t *testing.T) {
		e := newEnv(t)
		empty := svc("empty", vip1, 80)
		e.apply(empty)
		id := e.service(empty.Key).ID
		for _, failOpen := range []bool{false, true} {
			e.program(id, nil, nil, failOpen)
			if _, ok := e.f.tables[id]; ok {
				t.Error("table for a service without endpoints")
			}
			if _, ok := e.f.services[keyOf(empty.Key)]; !ok {
				t.Error("service entry gone: new flows to it must be dropped, not passed")
			}
			e.checkKernel()
		}
	})
	t.Run("endpoints all removed", func(t *testing.T) {
		e, web, id := webEnv(t)
		bes := e.bids(web.Key, beA, beB, beC)
		e.program(id, bes[:2], bes[2:], false)
		web.Endpoints = nil
		e.apply(web)
		e.f.takeOps()
		e.program(id, nil, nil, false)
		ops := e.f.takeOps()
		if _, ok := e.f.tables[id]; ok {
			t.Error("table still there")
		}
		if _, ok := e.f.fallbacks[id]; ok {
			t.Error("fallback still there")
		}
		if index(ops, is(opClearTable, id)) < 0 || index(ops, is(opClearFallback, id)) < 0 {
			t.Errorf("ops %s", opsString(ops))
		}
		if n := count(ops, kindIs(opSetBackend)); n != 0 {
			t.Errorf("removed backends rewritten: %s", opsString(ops))
		}
		e.checkKernel()
	})
	t.Run("every endpoint ejected", func(t *testing.T) {
		e, web, id := webEnv(t)
		bes := e.bids(web.Key, beA, beB)
		e.program(id, bes, nil, false)
		e.program(id, []uint32{}, nil, false)
		e.wantProgrammed(id, []uint32{}, nil, nil)
		// Dropped, not sent to an ejected backend.
		if _, _, ok := e.f.pick(keyOf(web.Key), 12345, true); ok {
			t.Error("flow picked a backend with no table")
		}
		e.f.takeOps()
		e.program(id, nil, nil, false)
		if n := count(e.f.takeOps(), kindIs(opSetBackend, opSwapTable, opSetFallback, opUpsertService)); n != 0 {
			t.Errorf("unchanged empty admission wrote %d entries", n)
		}
	})
}

func TestProgramServiceUnknown(t *testing.T) {
	e, _, id := webEnv(t)
	if err := e.r.ProgramService(id+1, nil, nil, false); err == nil {
		t.Error("no error for an unknown service")
	}
	if err := e.r.ProgramService(0, nil, nil, false); err == nil {
		t.Error("no error for service 0")
	}
	if ops := e.f.takeOps(); len(ops) != 0 {
		t.Errorf("wrote %s", opsString(ops))
	}
}

// A failed table write leaves the admission unrecorded, so the next
// identical call writes it.
func TestProgramServiceRetriesAfterFailure(t *testing.T) {
	e, web, id := webEnv(t)
	bes := e.bids(web.Key, beA, beB)
	e.f.fail[opSwapTable] = errInjected
	if err := e.r.ProgramService(id, bes, nil, false); err == nil {
		t.Fatal("no error")
	}
	if _, ok := e.f.tables[id]; ok {
		t.Fatal("table written despite the failure")
	}
	e.program(id, bes, nil, false)
	e.wantProgrammed(id, bes, nil, nil)
}

func TestRegrant(t *testing.T) {
	for _, tc := range []struct {
		name  string
		who   string // "" = unknown id
		write bool
	}{
		{name: "probation", who: beC, write: true},
		{name: "active", who: beA},
		{name: "ejected", who: beD},
		{name: "removed", who: beB},
		{name: "unknown", who: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, web, id := webEnv(t)
			a, b, c := e.bid(web.Key, beA), e.bid(web.Key, beB), e.bid(web.Key, beC)
			e.program(id, []uint32{a, b}, []uint32{c}, false)
			target := uint32(999)
			if tc.who != "" {
				target = e.bid(web.Key, tc.who)
			}
			web.Endpoints = []desired.Endpoint{ep(beA), ep(beC), ep(beD)}
			e.apply(web)
			e.program(id, []uint32{a}, []uint32{c}, false)
			e.spendGrants(c)
			before := e.f.snapshot()
			e.f.takeOps()

			if err := e.r.Regrant(target); err != nil {
				t.Fatal(err)
			}
			ops := e.f.takeOps()
			if !tc.write {
				if len(ops) != 0 {
					t.Errorf("wrote %s", opsString(ops))
				}
				before.diff(t, e.f.snapshot())
				return
			}
			if len(ops) != 1 || ops[0].Kind != opSetBackend || ops[0].ID != target ||
				ops[0].State != pbmaps.BackendProbation || ops[0].Grants != ProbeGrants {
				t.Errorf("wrote %s, want one fresh grant", opsString(ops))
			}
			e.wantKernelState(target, pbmaps.BackendProbation, ProbeGrants)
			e.checkKernel()
		})
	}
}
