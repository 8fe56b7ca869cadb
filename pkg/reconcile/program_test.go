package reconcile

import (
	"fmt"
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
// applied but not programmed: every backend active but in no table (table
// 0 installed, empty), and no pb_services entry yet.
func webEnv(t *testing.T, mut ...func(*Options)) (*env, desired.Service, uint32) {
	e := newEnv(t, mut...)
	web := svc("web", vip1, 80, ep(beA), ep(beB), ep(beC), ep(beD))
	e.apply(web)
	e.f.TakeOps()
	return e, web, e.service(web.Key).ID
}

// wantProgrammed asserts the kernel holds the admission: the live table
// is the Maglev table over active+probation at the size the endpoint
// count calls for (no table, table_size 0, when nothing is admitted), the
// fallback the one over active when both are non-empty, states and grants
// as admitted; and that the datapath, reading these maps, sends new flows
// only to admitted backends, to active ones whenever there are some.
func (e *env) wantProgrammed(id uint32, active, probation []uint32, grants map[uint32]int32) {
	t := e.t
	t.Helper()
	s, _ := e.r.Service(id)
	all := append(slices.Clone(active), probation...)
	k := keyOf(s.Spec.Key)
	v := e.f.PbServices[k]
	tbl, ok := e.f.Live(k)
	switch {
	case len(all) == 0 && (ok || v.TableSize != 0):
		t.Errorf("service %d: live table %v (table_size %d) with nothing admitted", id, idsIn(tbl), v.TableSize)
	case len(all) > 0 && !ok:
		t.Errorf("service %d: no live table: %+v", id, v)
	case len(all) > 0:
		if want := e.r.sizeFor(len(s.Backends)); v.TableSize != want {
			t.Errorf("service %d: table_size %d, want %d for %d endpoints", id, v.TableSize, want, len(s.Backends))
		}
		if want := e.wantTable(v.TableSize, all); !slices.Equal(tbl, want) {
			t.Errorf("service %d: table is not the Maglev table over %v: holds %v", id, all, idsIn(tbl))
		}
		if got := idsIn(tbl); !slices.Equal(got, sorted(all)) {
			t.Errorf("service %d: table holds %v, want exactly %v", id, got, sorted(all))
		}
	}
	if len(active) > 0 && len(probation) > 0 {
		// (A fallback left from an earlier probation may stay when there
		// is none now: the datapath only needs it while one is running.)
		fb, ok := e.f.PbMaglevFb[id]
		if !ok {
			t.Errorf("service %d: no fallback table", id)
		} else if want := e.wantTable(v.TableSize, active); !slices.Equal(fb, want) {
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
	// New flows, as the datapath picks them (without taking a probe).
	for h := range 4 * uint32(max(v.TableSize, 1)) {
		be, _, ok := e.f.Pick(k, h*2654435761+12345, false)
		switch {
		case len(all) == 0:
			if ok {
				t.Errorf("service %d: flow %d picked backend %d with nothing admitted", id, h, be)
			}
		case !ok:
			t.Errorf("service %d: flow %d dropped", id, h)
		case len(active) > 0 && !slices.Contains(active, be):
			t.Errorf("service %d: flow %d sent to backend %d, not one of the active %v", id, h, be, active)
		case !slices.Contains(all, be):
			t.Errorf("service %d: flow %d sent to backend %d, not admitted", id, h, be)
		default:
			continue
		}
		break
	}
	e.checkKernel()
}

// spare is the table of service id that is not live: the one its next
// ProgramService fills (either, while it has no live table: then the one
// last live, or 0).
func (e *env) spare(id uint32) uint32 {
	e.t.Helper()
	s, ok := e.r.Service(id)
	if !ok {
		e.t.Fatalf("no service %d", id)
	}
	v := e.f.PbServices[keyOf(s.Spec.Key)]
	if v.TableSize == 0 {
		return v.Table
	}
	return 1 - v.Table
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
			// Before: every backend active, none reachable, no entry.
			if _, ok := e.f.PbServices[keyOf(web.Key)]; ok {
				t.Fatalf("service written before its first ProgramService")
			}
			for _, b := range e.service(web.Key).Backends {
				e.wantKernelState(b, pbmaps.BackendActive, 0)
				e.wantUnreachable(b)
			}
			e.program(id, active, nil, false)
			ops := e.f.TakeOps()
			e.wantProgrammed(id, active, nil, nil)
			// Those not admitted are ejected first (out first), then the
			// table is filled and the service flipped to it.
			for _, b := range e.service(web.Key).Backends {
				if !slices.Contains(active, b) {
					inOrder(t, ops, "not admitted: ejected, then table filled, then flipped to",
						setState(b, pbmaps.BackendEjected), fill(id, 0), flip(id, 0, testTableSize))
				}
			}
			inOrder(t, ops, "table filled, then flipped to", fill(id, 0), flip(id, 0, testTableSize))
			// Apply installed the table: programming does not.
			if n := count(ops, kindIs(opInstallTables)); n != 0 {
				t.Errorf("ProgramService installed tables Apply prepared: %s", opsString(ops))
			}
			if n := count(ops, kindIs(opFillTable)); n != 1 {
				t.Errorf("%d tables filled, want 1: %s", n, opsString(ops))
			}
			// Admitted backends were active already: not rewritten; each
			// of the others ejected once.
			if n := count(ops, kindIs(opSetBackend)); n != 4-len(active) {
				t.Errorf("%d state writes, want %d ejections: %s", n, 4-len(active), opsString(ops))
			}
			if n := count(ops, func(o op) bool { return o.Kind == opSetBackend && o.State != pbmaps.BackendEjected }); n != 0 {
				t.Errorf("active backends rewritten: %s", opsString(ops))
			}
			// The service is written once, its first entry: the flip, with
			// the backend count.
			if n := count(ops, kindIs(opUpsertService)); n != 1 {
				t.Errorf("service written %d times: %s", n, opsString(ops))
			}
			if v := e.f.PbServices[keyOf(web.Key)]; v.BackendCount != uint32(len(active)) || v.TableSize != 31 || v.Table != 0 {
				t.Errorf("service value %+v, want backend_count %d, table 0, table_size 31", v, len(active))
			}
			// Same admission again: nothing.
			e.program(id, active, nil, false)
			if ops := e.f.TakeOps(); len(ops) != 0 {
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

	t1, t2 := e1.liveTable(web1.Key), e2.liveTable(web2.Key)
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
// documents: leaving endpoints ejected first, the fallback before any
// probation, the spare table filled, and the flip to it last; the flip is
// the only pb_services write, and the spare table was prepared (no
// InstallTables on the way).
func TestProgramServiceTransitions(t *testing.T) {
	type adm struct{ active, probation []string }
	for _, tc := range []struct {
		name     string
		from, to adm
		// order lists write sequences that must appear in this order:
		// "fill" is the FillTable of the spare table, "flip" the
		// pb_services write making it live, "flip-none" the one setting
		// table_size 0, "fallback" the SetFallback; "eject:X", "probe:X",
		// "active:X" the state writes.
		order [][]string
		// never lists writes that must not happen.
		never []string
	}{
		{
			name: "eject an active backend",
			from: adm{active: []string{beA, beB, beC}}, to: adm{active: []string{beA, beB}},
			order: [][]string{{"eject:c", "fill", "flip"}},
			never: []string{"active:a", "active:b", "fallback"},
		},
		{
			name: "eject several",
			from: adm{active: []string{beA, beB, beC, beD}}, to: adm{active: []string{beB}},
			order: [][]string{{"eject:a", "fill"}, {"eject:c", "fill"}, {"eject:d", "fill", "flip"}},
			never: []string{"active:b"},
		},
		{
			name: "enter probation",
			from: adm{active: []string{beA, beB}}, to: adm{active: []string{beA, beB}, probation: []string{beC}},
			order: [][]string{{"fallback", "probe:c", "fill", "flip"}},
			never: []string{"active:a", "active:b", "eject:d"},
		},
		{
			name: "enter probation straight from active",
			from: adm{active: []string{beA, beB, beC}}, to: adm{active: []string{beA, beB}, probation: []string{beC}},
			order: [][]string{{"fallback", "probe:c", "fill", "flip"}},
			never: []string{"eject:c"},
		},
		{
			// The fallback is kept current: it must never hold a backend the
			// service's active set no longer has.
			name: "probe succeeds",
			from: adm{active: []string{beA, beB}, probation: []string{beC}}, to: adm{active: []string{beA, beB, beC}},
			order: [][]string{{"fallback", "active:c", "fill", "flip"}},
		},
		{
			name: "probe succeeds while another starts",
			from: adm{active: []string{beA, beB}, probation: []string{beC}}, to: adm{active: []string{beA, beB, beC}, probation: []string{beD}},
			order: [][]string{{"fallback", "probe:d", "fill", "flip"}, {"active:c", "fill"}},
		},
		{
			name: "probe fails",
			from: adm{active: []string{beA, beB}, probation: []string{beC}}, to: adm{active: []string{beA, beB}},
			order: [][]string{{"eject:c", "fill", "flip"}},
			never: []string{"fallback", "probe:c"},
		},
		{
			name: "one out, one on probation",
			from: adm{active: []string{beA, beB}}, to: adm{active: []string{beA}, probation: []string{beC}},
			order: [][]string{{"eject:b", "fallback", "probe:c", "fill", "flip"}},
		},
		{
			// The active set is unchanged: the fallback over it stands.
			name: "second probe while the first is running",
			from: adm{active: []string{beA, beB}, probation: []string{beC}}, to: adm{active: []string{beA, beB}, probation: []string{beC, beD}},
			order: [][]string{{"probe:d", "fill", "flip"}},
			never: []string{"probe:c", "fallback"},
		},
		{
			name: "active set changes under a probe",
			from: adm{active: []string{beA, beB}, probation: []string{beC}}, to: adm{active: []string{beA}, probation: []string{beC}},
			order: [][]string{{"eject:b", "fallback", "fill", "flip"}},
			never: []string{"probe:c"},
		},
		{
			name: "only a probe left",
			from: adm{active: []string{beA}, probation: []string{beC}}, to: adm{probation: []string{beC}},
			order: [][]string{{"eject:a", "fill", "flip"}},
			never: []string{"probe:c", "fallback"},
		},
		{
			name: "everything out",
			from: adm{active: []string{beA, beB}}, to: adm{},
			order: [][]string{{"eject:a", "flip-none"}, {"eject:b", "flip-none"}},
			never: []string{"fill", "flip", "fallback"},
		},
		{
			name: "back from nothing",
			from: adm{}, to: adm{active: []string{beA, beB}},
			order: [][]string{{"active:a", "fill", "flip"}, {"active:b", "fill"}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, web, id := webEnv(t)
			ids := func(xs []string) []uint32 { return e.bids(web.Key, xs...) }
			e.program(id, ids(tc.from.active), ids(tc.from.probation), false)
			e.wantProgrammed(id, ids(tc.from.active), ids(tc.from.probation), nil)
			// The agent's next Apply prepares the spare table.
			e.apply(web)
			e.f.TakeOps()
			before := e.f.PbServices[keyOf(web.Key)]
			n := e.spare(id)

			e.program(id, ids(tc.to.active), ids(tc.to.probation), false)
			ops := e.f.TakeOps()
			e.wantProgrammed(id, ids(tc.to.active), ids(tc.to.probation), nil)

			name := map[string]string{"a": beA, "b": beB, "c": beC, "d": beD}
			match := func(w string) opMatch {
				switch w {
				case "fill":
					return fill(id, n)
				case "flip":
					return flip(id, n, testTableSize)
				case "flip-none":
					return upsertSize(id, 0)
				case "fallback":
					return is(opSetFallback, id)
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
				m := match(w)
				if w == "fill" {
					m = is(opFillTable, id) // either table
				}
				if i := index(ops, m); i >= 0 {
					t.Errorf("unexpected %s: %s", w, opsString(ops))
				}
			}
			// Every backend state written at most once.
			for _, b := range e.service(web.Key).Backends {
				if n := count(ops, is(opSetBackend, b)); n > 1 {
					t.Errorf("backend %d written %d times: %s", b, n, opsString(ops))
				}
			}
			// One pb_services write: the flip (or table_size 0).
			if n := count(ops, kindIs(opUpsertService)); n != 1 {
				t.Errorf("%d pb_services writes, want the flip only: %s", n, opsString(ops))
			}
			// At most one table filled, never the live one (the fake
			// asserts that too), and nothing installed: the spare was
			// prepared.
			if n := count(ops, kindIs(opFillTable)); n > 1 {
				t.Errorf("%d tables filled: %s", n, opsString(ops))
			}
			if before.TableSize != 0 && index(ops, fill(id, before.Table)) >= 0 {
				t.Errorf("live table %d filled: %s", before.Table, opsString(ops))
			}
			if i := index(ops, kindIs(opInstallTables)); i >= 0 {
				t.Errorf("InstallTables on an admission change with the spare prepared: %s", opsString(ops))
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
	e.f.TakeOps()

	// c goes through ejection to probation.
	e.program(id, []uint32{a, b}, nil, false)
	e.f.TakeOps()
	n := e.spare(id)
	e.program(id, []uint32{a, b}, []uint32{c}, false)
	ops := e.f.TakeOps()
	e.wantProgrammed(id, []uint32{a, b}, []uint32{c}, nil)
	if got := idsIn(e.f.PbMaglevFb[id]); !slices.Equal(got, sorted([]uint32{a, b})) {
		t.Errorf("fallback holds %v, want only the active %v", got, []uint32{a, b})
	}
	// The fallback is the size of the table it backs.
	if got := len(e.f.PbMaglevFb[id]); got != testTableSize {
		t.Errorf("fallback has %d slots, want %d", got, testTableSize)
	}
	inOrder(t, ops, "probation", is(opSetFallback, id), setState(c, pbmaps.BackendProbation), fill(id, n), flip(id, n, testTableSize))

	// Staying in probation with the same sets: nothing written, the grant
	// is not re-issued even though the kernel used it.
	e.spendGrants(c)
	for range 2 {
		e.program(id, []uint32{a, b}, []uint32{c}, false)
		if ops := e.f.TakeOps(); len(ops) != 0 {
			t.Errorf("unchanged admission wrote %s", opsString(ops))
		}
	}
	e.wantKernelState(c, pbmaps.BackendProbation, 0)

	// Staying in probation while the rest changes: c is not rewritten.
	e.program(id, []uint32{a}, []uint32{c}, false)
	if ops := e.f.TakeOps(); index(ops, is(opSetBackend, c)) >= 0 {
		t.Errorf("backend in probation rewritten: %s", opsString(ops))
	}
	e.wantProgrammed(id, []uint32{a}, []uint32{c}, map[uint32]int32{c: 0})

	// The probe succeeded: active. The fallback stays (no map-in-map
	// update: no InstallTables) and is rewritten in place over the new
	// active set, so it never holds a backend the service may lose.
	e.program(id, []uint32{a, c}, nil, false)
	ops = e.f.TakeOps()
	e.wantProgrammed(id, []uint32{a, c}, nil, nil)
	if n := count(ops, kindIs(opInstallTables)); n != 0 {
		t.Errorf("end of probation installed a table: %s", opsString(ops))
	}
	if n := count(ops, kindIs(opSetFallback)); n != 1 {
		t.Errorf("end of probation: %d fallback writes, want 1: %s", n, opsString(ops))
	}
	if got, want := e.f.PbMaglevFb[id], e.wantTable(testTableSize, []uint32{a, c}); !slices.Equal(got, want) {
		t.Errorf("fallback not over the new active set")
	}
}

// spendGrants does what the kernel does when it admits probes.
func (e *env) spendGrants(ids ...uint32) {
	for _, id := range ids {
		b := e.f.PbBackends[id]
		b.ProbeGrants = 0
		e.f.PbBackends[id] = b
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
		be, probe, ok := e.f.Pick(k, h*2654435761, true)
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
		if _, probe, _ := e.f.Pick(k, h*2654435761+7, true); probe {
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
	e.f.TakeOps()

	// Fail open: whatever accrual passes, every endpoint is admitted as
	// active, none in probation.
	e.program(id, nil, []uint32{c}, true)
	all := []uint32{a, b, c, d}
	e.wantProgrammed(id, all, nil, nil)
	if !e.service(web.Key).FailOpen {
		t.Error("FailOpen not recorded")
	}
	e.f.TakeOps()
	e.program(id, []uint32{a}, nil, true)
	if ops := e.f.TakeOps(); len(ops) != 0 {
		t.Errorf("still failing open wrote %s", opsString(ops))
	}

	// Leaving fail-open: back to what accrual says.
	n := e.spare(id)
	e.program(id, []uint32{a, d}, nil, false)
	ops := e.f.TakeOps()
	e.wantProgrammed(id, []uint32{a, d}, nil, nil)
	if e.service(web.Key).FailOpen {
		t.Error("FailOpen still recorded")
	}
	inOrder(t, ops, "leave fail-open", setState(b, pbmaps.BackendEjected), setState(c, pbmaps.BackendEjected),
		fill(id, n), flip(id, n, testTableSize))
}

func TestProgramServiceNoEndpoints(t *testing.T) {
	t.Run("service without endpoints", func(t *testing.T) {
		e := newEnv(t)
		empty := svc("empty", vip1, 80)
		e.apply(empty)
		id := e.service(empty.Key).ID
		for _, failOpen := range []bool{false, true} {
			e.program(id, nil, nil, failOpen)
			for n := range uint32(2) {
				if _, ok := e.f.Installed(id, n); ok {
					t.Errorf("table %d for a service without endpoints", n)
				}
			}
			v, ok := e.f.PbServices[keyOf(empty.Key)]
			if !ok {
				t.Error("service entry gone: new flows to it must be dropped, not passed")
			}
			if v.TableSize != 0 {
				t.Errorf("table_size %d without endpoints", v.TableSize)
			}
			if _, _, ok := e.f.Pick(keyOf(empty.Key), 12345, true); ok {
				t.Error("flow to a service without endpoints not dropped")
			}
			e.checkKernel()
		}
		if ops := e.f.TakeOps(); count(ops, kindIs(opInstallTables, opFillTable, opSetFallback)) != 0 {
			t.Errorf("tables for a service without endpoints: %s", opsString(ops))
		}
	})
	t.Run("endpoints all removed", func(t *testing.T) {
		e, web, id := webEnv(t)
		bes := e.bids(web.Key, beA, beB, beC)
		e.program(id, bes[:2], bes[2:], false)
		web.Endpoints = nil
		e.apply(web)
		e.f.TakeOps()
		e.program(id, nil, nil, false)
		ops := e.f.TakeOps()
		// No table: table_size 0, new flows dropped. The tables stay
		// (DeleteService removes them with the service), unused.
		if v := e.f.PbServices[keyOf(web.Key)]; v.TableSize != 0 || v.BackendCount != 0 {
			t.Errorf("service value %+v, want table_size 0, backend_count 0", v)
		}
		if _, _, ok := e.f.Pick(keyOf(web.Key), 12345, true); ok {
			t.Error("flow picked a backend of a service without endpoints")
		}
		if len(ops) != 2 || !upsertSize(id, 0)(ops[1]) || ops[0].Kind != opSetSvcBes {
			t.Errorf("ops %s, want the backend list emptied, then table_size 0", opsString(ops))
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
		if _, _, ok := e.f.Pick(keyOf(web.Key), 12345, true); ok {
			t.Error("flow picked a backend with no table")
		}
		e.f.TakeOps()
		e.program(id, nil, nil, false)
		if n := count(e.f.TakeOps(), kindIs(opSetBackend, opFillTable, opInstallTables, opSetFallback, opUpsertService)); n != 0 {
			t.Errorf("unchanged empty admission wrote %d entries", n)
		}
	})
}

func TestProgramServiceUnknown(t *testing.T) {
	e, _, id := webEnv(t)
	if err := e.r.ProgramService(id+1, nil, nil, false, 0); err == nil {
		t.Error("no error for an unknown service")
	}
	if err := e.r.ProgramService(0, nil, nil, false, 0); err == nil {
		t.Error("no error for service 0")
	}
	if ops := e.f.TakeOps(); len(ops) != 0 {
		t.Errorf("wrote %s", opsString(ops))
	}
}

// A failed table write leaves the admission unrecorded, so the next
// identical call writes it; the live table is never the one written.
func TestProgramServiceRetriesAfterFailure(t *testing.T) {
	// (A failed SetFallback: see TestKnownBugFailedFallbackStillEntersProbation.)
	for _, kind := range []string{opFillTable, opUpsertService, opInstallTables} {
		t.Run(kind, func(t *testing.T) {
			e, web, id := webEnv(t)
			a, b, c := e.bid(web.Key, beA), e.bid(web.Key, beB), e.bid(web.Key, beC)
			e.program(id, []uint32{a, b, c}, nil, false)
			if kind != opInstallTables {
				e.apply(web) // spare prepared: ProgramService installs nothing
			}
			before := e.f.PbServices[keyOf(web.Key)]
			live := slices.Clone(e.liveTable(web.Key))
			e.f.TakeOps()

			e.f.Fail[kind] = 1
			if err := e.r.ProgramService(id, []uint32{a}, []uint32{c}, false, 0); err == nil {
				t.Fatal("no error")
			}
			ops := e.f.TakeOps()
			if e.f.Fail[kind] > 0 {
				t.Fatalf("%s not called: %s", kind, opsString(ops))
			}
			// Whatever failed, b is out (ejected first) and the flows the
			// kernel picks avoid it; the old table stays live.
			e.wantKernelState(b, pbmaps.BackendEjected, 0)
			if v := e.f.PbServices[keyOf(web.Key)]; v != before {
				t.Errorf("service value %+v after a failed %s, want %+v", v, kind, before)
			}
			if got := e.liveTable(web.Key); !slices.Equal(got, live) {
				t.Errorf("live table changed after a failed %s", kind)
			}
			for h := range uint32(4 * testTableSize) {
				if be, _, ok := e.f.Pick(keyOf(web.Key), h*2654435761, false); !ok || be == b {
					t.Fatalf("flow %d: backend %d (picked %v) after a failed %s", h, be, ok, kind)
				}
			}

			e.program(id, []uint32{a}, []uint32{c}, false)
			ops = e.f.TakeOps()
			e.wantProgrammed(id, []uint32{a}, []uint32{c}, nil)
			if index(ops, flipAny(id)) < 0 {
				t.Errorf("retry did not flip: %s", opsString(ops))
			}
		})
	}
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
			before := snapshotOf(e.f)
			e.f.TakeOps()

			if err := e.r.Regrant(target); err != nil {
				t.Fatal(err)
			}
			ops := e.f.TakeOps()
			if !tc.write {
				if len(ops) != 0 {
					t.Errorf("wrote %s", opsString(ops))
				}
				before.diff(t, snapshotOf(e.f))
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

// Successive admission changes alternate between the two tables: each
// fills the table that is not live and flips to it; the table that was
// live is left untouched (it is the next one filled).
func TestProgramServiceAlternatesTables(t *testing.T) {
	e, web, id := webEnv(t)
	a, b, c, d := e.bid(web.Key, beA), e.bid(web.Key, beB), e.bid(web.Key, beC), e.bid(web.Key, beD)
	steps := []struct{ active, probation []uint32 }{
		{[]uint32{a, b, c, d}, nil},
		{[]uint32{a, b, c}, nil},
		{[]uint32{a, b}, []uint32{c}},
		{[]uint32{a, b, c}, nil},
		{[]uint32{b, c}, nil},
		{[]uint32{a, b, c, d}, nil},
	}
	for i, st := range steps {
		before := e.f.PbServices[keyOf(web.Key)]
		var old []uint32
		if before.TableSize != 0 {
			old = slices.Clone(e.liveTable(web.Key))
		}
		e.program(id, st.active, st.probation, false)
		ops := e.f.TakeOps()
		want := uint32(i % 2) // 0, 1, 0, 1, ...
		v := e.f.PbServices[keyOf(web.Key)]
		if v.Table != want || v.TableSize != testTableSize {
			t.Errorf("step %d: live table %d of %d slots, want table %d", i, v.Table, v.TableSize, want)
		}
		inOrder(t, ops, fmt.Sprintf("step %d", i), fill(id, want), flip(id, want, testTableSize))
		if n := count(ops, kindIs(opFillTable)); n != 1 {
			t.Errorf("step %d: %d tables filled: %s", i, n, opsString(ops))
		}
		if n := count(ops, kindIs(opUpsertService)); n != 1 {
			t.Errorf("step %d: %d pb_services writes, want the flip only: %s", i, n, opsString(ops))
		}
		if old != nil {
			if got, _ := e.f.Installed(id, 1-want); !slices.Equal(got, old) {
				t.Errorf("step %d: the table that was live was written", i)
			}
		}
		// Only the flip after the first one may need a table installed
		// (no Apply ran in between to prepare table 1); never after.
		if i >= 2 && count(ops, kindIs(opInstallTables)) != 0 {
			t.Errorf("step %d: table installed with both tables in place: %s", i, opsString(ops))
		}
		e.wantProgrammed(id, st.active, st.probation, nil)
	}
	if got, _ := e.f.TableSizes(id); got != [2]uint32{testTableSize, testTableSize} {
		t.Errorf("table sizes %v", got)
	}
}

// An ejection, once the spare table is prepared (by any Apply after the
// service's first table went live), installs nothing: no RCU grace period
// on the path of an ejection. The ejected state is written before the
// spare is filled, which is before the flip, the only pb_services write.
func TestEjectionUsesPreparedSpare(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep(beA), ep(beB), ep(beC))
	api := svc("api", vip2, 443, ep("198.19.2.1:8443"), ep("198.19.2.2:8443"))
	e.apply(web, api)
	e.programAll()
	e.apply(web, api)
	for _, s := range []desired.Service{web, api} {
		id := e.service(s.Key).ID
		if got, _ := e.f.TableSizes(id); got != [2]uint32{testTableSize, testTableSize} {
			t.Fatalf("service %s: tables %v, want both prepared", s.Name, got)
		}
	}
	for round := range 3 {
		for _, s := range e.r.Services() {
			bes := slices.Clone(s.Backends)
			out := bes[round%len(bes)]
			var keep []uint32
			for _, b := range bes {
				if b != out {
					keep = append(keep, b)
				}
			}
			// Back to all, then eject one.
			e.program(s.ID, bes, nil, false)
			e.f.TakeOps()
			n := e.spare(s.ID)
			e.program(s.ID, keep, nil, false)
			ops := e.f.TakeOps()
			if i := index(ops, kindIs(opInstallTables)); i >= 0 {
				t.Errorf("service %s: ejection installed a table: %s", s.Spec.Name, opsString(ops))
			}
			inOrder(t, ops, "ejection", setState(out, pbmaps.BackendEjected), fill(s.ID, n), flip(s.ID, n, testTableSize))
			if ops[0].Kind != opSetBackend || ops[0].ID != out {
				t.Errorf("service %s: first write %s, want the ejection", s.Spec.Name, ops[0])
			}
			if n := count(ops, kindIs(opUpsertService)); n != 1 {
				t.Errorf("%d pb_services writes: %s", n, opsString(ops))
			}
			e.wantProgrammed(s.ID, keep, nil, nil)
		}
	}
}
