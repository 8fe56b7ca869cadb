package reconcile

import (
	"testing"

	"github.com/penaltybox/penaltybox/pkg/desired"
)

func TestSetTableSize(t *testing.T) {
	for _, tc := range []struct {
		name string
		size uint32
	}{
		{name: "shrink", size: 13},
		{name: "shrink to the minimum", size: 7},
		{name: "grow", size: 61},
		{name: "same", size: testTableSize},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			web := svc("web", vip1, 80, ep(beA), ep(beB), ep(beC))
			api := svc("api", vip2, 443, ep("198.19.2.1:8443"))
			empty := svc("empty", vip3, 80)
			e.apply(web, api, empty)
			w, a, em := e.service(web.Key), e.service(api.Key), e.service(empty.Key)
			wa, wp := w.Backends[:2], w.Backends[2:] // a probe: a fallback table too
			e.program(w.ID, wa, wp, false)
			e.program(a.ID, a.Backends, nil, false)
			e.program(em.ID, nil, nil, false)
			e.spendGrants(wp...)
			e.f.takeOps()

			if err := e.r.SetTableSize(tc.size); err != nil {
				t.Fatal(err)
			}
			if ops := e.f.takeOps(); len(ops) != 0 {
				t.Errorf("SetTableSize wrote %s; tables follow with ProgramService", opsString(ops))
			}
			if got := e.r.TableSize(); got != tc.size {
				t.Errorf("TableSize() = %d", got)
			}

			// The same admissions again: every table is rebuilt at the new size.
			for _, p := range []struct {
				s                 *Service
				active, probation []uint32
			}{{w, wa, wp}, {a, a.Backends, nil}} {
				e.f.takeOps()
				e.program(p.s.ID, p.active, p.probation, false)
				ops := e.f.takeOps()
				switch {
				case tc.size < testTableSize:
					// Shrinking: table_size first, so the kernel never
					// computes a slot past the end of the old table...
					inOrder(t, ops, "shrink", upsertSize(p.s.ID, tc.size), is(opSwapTable, p.s.ID))
				case tc.size > testTableSize:
					// ...growing: the table first.
					inOrder(t, ops, "grow", is(opSwapTable, p.s.ID), upsertSize(p.s.ID, tc.size))
				default:
					if n := count(ops, kindIs(opUpsertService)); n != 0 {
						t.Errorf("same size rewrote the service: %s", opsString(ops))
					}
				}
				if n := count(ops, kindIs(opUpsertService)); n > 1 {
					t.Errorf("service written %d times: %s", n, opsString(ops))
				}
				if n := count(ops, kindIs(opSetBackend)); n != 0 {
					t.Errorf("backend states rewritten (a grant re-issued?): %s", opsString(ops))
				}
				v := e.f.services[keyOf(p.s.Spec.Key)]
				if v.TableSize != tc.size || len(e.f.tables[p.s.ID]) != int(tc.size) {
					t.Errorf("service %s: table_size %d, table %d slots, want %d", p.s.Spec.Name, v.TableSize, len(e.f.tables[p.s.ID]), tc.size)
				}
				if fb, ok := e.f.fallbacks[p.s.ID]; ok && len(fb) != int(tc.size) {
					t.Errorf("service %s: fallback has %d slots, want %d", p.s.Spec.Name, len(fb), tc.size)
				}
				e.wantProgrammed(p.s.ID, p.active, p.probation, map[uint32]int32{wp[0]: 0})

				// Rebuilt once, then quiet.
				e.program(p.s.ID, p.active, p.probation, false)
				if ops := e.f.takeOps(); len(ops) != 0 {
					t.Errorf("second call wrote %s", opsString(ops))
				}
			}

			// The service without endpoints has no table; when it gets
			// one, table_size follows the table.
			e.program(em.ID, nil, nil, false)
			empty.Endpoints = []desired.Endpoint{ep("198.19.3.1:8080")}
			e.apply(web, api, empty)
			e.f.takeOps()
			e.program(em.ID, em.Backends, nil, false)
			ops := e.f.takeOps()
			switch {
			case tc.size < testTableSize:
				inOrder(t, ops, "shrink", upsertSize(em.ID, tc.size), is(opSwapTable, em.ID))
			case tc.size > testTableSize:
				inOrder(t, ops, "grow", is(opSwapTable, em.ID), upsertSize(em.ID, tc.size))
			}

			// A new service starts at the new size.
			fresh := svc("fresh", "198.18.0.20", 80, ep("198.19.4.1:8080"))
			e.apply(web, api, empty, fresh)
			fs := e.service(fresh.Key)
			if v := e.f.services[keyOf(fresh.Key)]; v.TableSize != tc.size {
				t.Errorf("new service table_size %d, want %d", v.TableSize, tc.size)
			}
			e.f.takeOps()
			e.program(fs.ID, fs.Backends, nil, false)
			// Rewritten once, for its backend count; the size stays.
			if n := count(e.f.takeOps(), kindIs(opUpsertService)); n > 1 {
				t.Errorf("new service rewritten %d times after its first table", n)
			}
			if v := e.f.services[keyOf(fresh.Key)]; v.TableSize != tc.size || v.BackendCount != 1 {
				t.Errorf("new service value %+v, want table_size %d, backend_count 1", v, tc.size)
			}
			e.checkKernel()
		})
	}
}

// Table size changes several times before a service is reprogrammed:
// the service's table_size still follows the table it gets.
func TestSetTableSizeRepeated(t *testing.T) {
	e, web, id := webEnv(t)
	bes := e.bids(web.Key, beA, beB)
	e.program(id, bes, nil, false)
	for _, sizes := range [][]uint32{{61}, {61}, {13, 101}, {7, 7}, {101, 13, 61}} {
		for _, n := range sizes {
			if err := e.r.SetTableSize(n); err != nil {
				t.Fatal(err)
			}
		}
		e.program(id, bes, nil, false)
		e.wantProgrammed(id, bes, nil, nil)
		if got, want := len(e.f.tables[id]), int(sizes[len(sizes)-1]); got != want {
			t.Errorf("after %v: table has %d slots, want %d", sizes, got, want)
		}
	}
}

func TestSetTableSizeInvalid(t *testing.T) {
	e, web, id := webEnv(t)
	bes := e.bids(web.Key, beA, beB)
	e.program(id, bes, nil, false)
	e.f.takeOps()
	for _, n := range []uint32{0, 30, 6} {
		if err := e.r.SetTableSize(n); err == nil {
			t.Errorf("SetTableSize(%d): no error", n)
		}
	}
	if e.r.TableSize() != testTableSize {
		t.Errorf("TableSize() = %d after invalid sizes", e.r.TableSize())
	}
	// Nothing was forced either.
	e.program(id, bes, nil, false)
	if ops := e.f.takeOps(); len(ops) != 0 {
		t.Errorf("wrote %s", opsString(ops))
	}
}
