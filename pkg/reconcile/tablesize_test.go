package reconcile

import (
	"fmt"
	"slices"
	"testing"

	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maglev"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
)

// sizeFor: the smallest size of the ladder with 100 slots per endpoint,
// capped at the configured maximum; the maximum itself below 1021.
func TestSizeFor(t *testing.T) {
	for _, tc := range []struct {
		max       uint32
		endpoints int
		want      uint32
	}{
		// The ladder, with the largest maximum.
		{maglev.MaxTableSize, 0, 1021},
		{maglev.MaxTableSize, 1, 1021},
		{maglev.MaxTableSize, 10, 1021},
		{maglev.MaxTableSize, 11, 2039},
		{maglev.MaxTableSize, 20, 2039},
		{maglev.MaxTableSize, 21, 4093},
		{maglev.MaxTableSize, 40, 4093},
		{maglev.MaxTableSize, 41, 8191},
		{maglev.MaxTableSize, 81, 8191},
		{maglev.MaxTableSize, 82, 16381},
		{maglev.MaxTableSize, 163, 16381},
		{maglev.MaxTableSize, 164, 32749},
		{maglev.MaxTableSize, 327, 32749},
		{maglev.MaxTableSize, 328, 65521},
		{maglev.MaxTableSize, 656, 131071},
		{maglev.MaxTableSize, 1311, 262139},
		{maglev.MaxTableSize, 2622, 524287},
		{maglev.MaxTableSize, 5243, 1048573},
		{maglev.MaxTableSize, 100000, 1048573},
		// Capped at the maximum: a ladder size...
		{16381, 10, 1021},
		{16381, 11, 2039},
		{16381, 163, 16381},
		{16381, 164, 16381},
		{16381, 5000, 16381},
		{1021, 0, 1021},
		{1021, 11, 1021},
		// ...or a prime between two (the maximum, not the size below it).
		{65537, 200, 32749},
		{65537, 400, 65521},
		{65537, 700, 65537},
		{2029, 10, 1021},
		{2029, 11, 2029},
		{40009, 2000, 40009},
		// Below the ladder: always the maximum.
		{1019, 0, 1019},
		{1019, 1, 1019},
		{1019, 500, 1019},
		{testTableSize, 0, testTableSize},
		{testTableSize, 4, testTableSize},
		{testTableSize, 1000, testTableSize},
		{13, 3, 13},
		{maglev.MinTableSize, 2, maglev.MinTableSize},
	} {
		t.Run(fmt.Sprintf("max %d, %d endpoints", tc.max, tc.endpoints), func(t *testing.T) {
			if err := maglev.ValidateTableSize(tc.max); err != nil {
				t.Fatalf("bad test: %v", err)
			}
			e := newEnv(t, func(o *Options) { o.TableSize = tc.max })
			if got := e.r.sizeFor(tc.endpoints); got != tc.want {
				t.Errorf("sizeFor(%d) with maximum %d = %d, want %d", tc.endpoints, tc.max, got, tc.want)
			}
			if err := maglev.ValidateTableSize(tc.want); err != nil {
				t.Errorf("bad size: %v", err)
			}
		})
	}
	// Every ladder size is a valid (prime) table size.
	for _, p := range sizeLadder {
		if err := maglev.ValidateTableSize(p); err != nil {
			t.Errorf("ladder size %d: %v", p, err)
		}
	}
	// The size is monotonic in the endpoint count, whatever the maximum.
	for _, max := range []uint32{7, 1019, 1021, 2029, 16381, 65537, maglev.MaxTableSize} {
		e := newEnv(t, func(o *Options) { o.TableSize = max })
		prev := uint32(0)
		for n := range 12000 {
			got := e.r.sizeFor(n)
			if got < prev || got > max {
				t.Fatalf("maximum %d: sizeFor(%d) = %d after %d", max, n, got, prev)
			}
			if got < max && uint64(got) < 100*uint64(n) {
				t.Fatalf("maximum %d: sizeFor(%d) = %d, fewer than 100 slots per endpoint below the maximum", max, n, got)
			}
			prev = got
		}
	}
}

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
			e.apply(web, api, empty) // the spare tables, at the old size
			e.spendGrants(wp...)
			before := snapshotOf(e.f)
			e.f.TakeOps()

			if err := e.r.SetTableSize(tc.size); err != nil {
				t.Fatal(err)
			}
			ops := e.f.TakeOps()
			if got := e.r.TableSize(); got != tc.size {
				t.Errorf("TableSize() = %d", got)
			}
			// One batch installs the spare tables at the new size, for the
			// services with endpoints; nothing else is written, the live
			// tables keep serving.
			if tc.size == testTableSize {
				if len(ops) != 0 {
					t.Errorf("SetTableSize to the same size wrote %s", opsString(ops))
				}
			} else {
				if len(ops) != 1 || ops[0].Kind != opInstallTables {
					t.Fatalf("SetTableSize wrote %s, want one InstallTables", opsString(ops))
				}
				got := slices.Clone(ops[0].Reqs)
				slices.SortFunc(got, func(x, y pbmaps.TableInstall) int { return int(x.SvcID) - int(y.SvcID) })
				want := []pbmaps.TableInstall{{SvcID: w.ID, N: 1, Size: tc.size}, {SvcID: a.ID, N: 1, Size: tc.size}}
				slices.SortFunc(want, func(x, y pbmaps.TableInstall) int { return int(x.SvcID) - int(y.SvcID) })
				if !slices.Equal(got, want) {
					t.Errorf("installed %v, want %v", got, want)
				}
			}
			after := snapshotOf(e.f)
			before.tables, after.tables = nil, nil
			before.diff(t, after)
			for _, s := range []*Service{w, a} {
				if tbl := e.liveTable(s.Spec.Key); len(tbl) != testTableSize {
					t.Errorf("service %s: live table resized by SetTableSize", s.Spec.Name)
				}
			}

			// The same admissions again: every table is rebuilt at the new
			// size, on the spare table, and flipped to.
			for _, p := range []struct {
				s                 *Service
				active, probation []uint32
			}{{w, wa, wp}, {a, a.Backends, nil}} {
				e.f.TakeOps()
				e.program(p.s.ID, p.active, p.probation, false)
				ops := e.f.TakeOps()
				inOrder(t, ops, "fill, then flip", fill(p.s.ID, 1), flip(p.s.ID, 1, tc.size))
				if n := count(ops, kindIs(opInstallTables)); n != 0 {
					t.Errorf("ProgramService installed a table SetTableSize prepared: %s", opsString(ops))
				}
				if n := count(ops, kindIs(opUpsertService)); n != 1 {
					t.Errorf("service written %d times, want the flip only: %s", n, opsString(ops))
				}
				if n := count(ops, kindIs(opSetBackend)); n != 0 {
					t.Errorf("backend states rewritten (a grant re-issued?): %s", opsString(ops))
				}
				v := e.f.PbServices[keyOf(p.s.Spec.Key)]
				if tbl := e.liveTable(p.s.Spec.Key); v.TableSize != tc.size || len(tbl) != int(tc.size) || v.Table != 1 {
					t.Errorf("service %s: table %d, table_size %d, %d slots, want table 1 of %d", p.s.Spec.Name, v.Table, v.TableSize, len(tbl), tc.size)
				}
				if len(p.probation) > 0 {
					if fb := e.f.PbMaglevFb[p.s.ID]; len(fb) != int(tc.size) {
						t.Errorf("service %s: fallback has %d slots, want %d", p.s.Spec.Name, len(fb), tc.size)
					}
					if tc.size != testTableSize { // a new size needs a new fallback first
						inOrder(t, ops, "fallback before the flip", is(opSetFallback, p.s.ID), flip(p.s.ID, 1, tc.size))
					}
				}
				e.wantProgrammed(p.s.ID, p.active, p.probation, map[uint32]int32{wp[0]: 0})

				// Rebuilt once, then quiet.
				e.program(p.s.ID, p.active, p.probation, false)
				if ops := e.f.TakeOps(); len(ops) != 0 {
					t.Errorf("second call wrote %s", opsString(ops))
				}
			}

			// The service without endpoints has no table; when it gets
			// one, Apply installs it at the new size.
			e.program(em.ID, nil, nil, false)
			empty.Endpoints = []desired.Endpoint{ep("198.19.3.1:8080")}
			e.f.TakeOps()
			e.apply(web, api, empty)
			ops = e.f.TakeOps()
			if got := installed(ops); !slices.Contains(got, pbmaps.TableInstall{SvcID: em.ID, N: 0, Size: tc.size}) {
				t.Errorf("Apply installed %v, want table 0 of service %d at %d", got, em.ID, tc.size)
			}
			if n := count(ops, kindIs(opInstallTables)); n != 1 {
				t.Errorf("%d InstallTables, want one batch: %s", n, opsString(ops))
			}
			e.program(em.ID, em.Backends, nil, false)
			ops = e.f.TakeOps()
			inOrder(t, ops, "new table", fill(em.ID, 0), flip(em.ID, 0, tc.size))
			if n := count(ops, kindIs(opInstallTables)); n != 0 {
				t.Errorf("ProgramService installed a table: %s", opsString(ops))
			}

			// A new service starts at the new size.
			fresh := svc("fresh", "198.18.0.20", 80, ep("198.19.4.1:8080"))
			e.apply(web, api, empty, fresh)
			fs := e.service(fresh.Key)
			if tbl, ok := e.f.Installed(fs.ID, 0); !ok || len(tbl) != int(tc.size) {
				t.Errorf("new service's table 0 has %d slots (present %v), want %d", len(tbl), ok, tc.size)
			}
			e.f.TakeOps()
			e.program(fs.ID, fs.Backends, nil, false)
			// Written once: the flip, with its backend count.
			if n := count(e.f.TakeOps(), kindIs(opUpsertService)); n != 1 {
				t.Errorf("new service written %d times for its first table", n)
			}
			if v := e.f.PbServices[keyOf(fresh.Key)]; v.TableSize != tc.size || v.BackendCount != 1 {
				t.Errorf("new service value %+v, want table_size %d, backend_count 1", v, tc.size)
			}
			e.checkKernel()
		})
	}
}

// Table size changes several times before a service is reprogrammed:
// the service's table_size still follows the table it gets, and no
// table is installed outside SetTableSize's batches.
func TestSetTableSizeRepeated(t *testing.T) {
	e, web, id := webEnv(t)
	bes := e.bids(web.Key, beA, beB)
	e.program(id, bes, nil, false)
	for _, sizes := range [][]uint32{{61}, {61}, {13, 101}, {7, 7}, {101, 13, 61}} {
		e.f.TakeOps()
		for _, n := range sizes {
			if err := e.r.SetTableSize(n); err != nil {
				t.Fatal(err)
			}
		}
		if n := count(e.f.TakeOps(), func(o op) bool { return o.Kind != opInstallTables }); n != 0 {
			t.Errorf("SetTableSize wrote more than tables")
		}
		n := e.spare(id)
		e.program(id, bes, nil, false)
		ops := e.f.TakeOps()
		e.wantProgrammed(id, bes, nil, nil)
		want := sizes[len(sizes)-1]
		if got := len(e.liveTable(web.Key)); got != int(want) {
			t.Errorf("after %v: table has %d slots, want %d", sizes, got, want)
		}
		inOrder(t, ops, "flip", fill(id, n), flip(id, n, want))
		if i := index(ops, kindIs(opInstallTables)); i >= 0 {
			t.Errorf("after %v: ProgramService installed a table: %s", sizes, opsString(ops))
		}
	}
}

func TestSetTableSizeInvalid(t *testing.T) {
	e, web, id := webEnv(t)
	bes := e.bids(web.Key, beA, beB)
	e.program(id, bes, nil, false)
	e.f.TakeOps()
	for _, n := range []uint32{0, 30, 6, maglev.MaxTableSize + 2} {
		if err := e.r.SetTableSize(n); err == nil {
			t.Errorf("SetTableSize(%d): no error", n)
		}
	}
	if e.r.TableSize() != testTableSize {
		t.Errorf("TableSize() = %d after invalid sizes", e.r.TableSize())
	}
	// Nothing was written or forced either.
	e.program(id, bes, nil, false)
	if ops := e.f.TakeOps(); len(ops) != 0 {
		t.Errorf("wrote %s", opsString(ops))
	}
}

// A failed batch leaves the spare tables as they were; ProgramService then
// installs the one it needs itself (never the live one), and the service
// still ends at the new size.
func TestSetTableSizeInstallFailure(t *testing.T) {
	e, web, id := webEnv(t)
	bes := e.bids(web.Key, beA, beB)
	e.program(id, bes, nil, false)
	e.apply(web)
	e.f.TakeOps()
	e.f.Fail[opInstallTables] = 1
	if err := e.r.SetTableSize(13); err == nil {
		t.Error("no error")
	}
	if tbl, _ := e.f.Installed(id, 1); len(tbl) != testTableSize {
		t.Errorf("spare table has %d slots after the failed batch", len(tbl))
	}
	e.program(id, bes, nil, false)
	ops := e.f.TakeOps()
	inOrder(t, ops, "install, fill, flip", installs(id), fill(id, 1), flip(id, 1, 13))
	e.wantProgrammed(id, bes, nil, nil)
}

// A service's table grows with its endpoints: 10 endpoints fit 1021 slots
// (100 per endpoint), the 11th needs 2039. The bigger table is installed
// by Apply on the spare table while the live one keeps serving, then
// filled and flipped to by ProgramService; the fallback follows.
func TestResizeOnSpareTable(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.TableSize = 16381 })
	var eps []desired.Endpoint
	for i := range 10 {
		eps = append(eps, ep(fmt.Sprintf("198.19.1.%d:8080", i+1)))
	}
	web := svc("web", vip1, 80, eps...)
	e.apply(web)
	s := e.service(web.Key)
	id := s.ID
	e.program(id, s.Backends, nil, false)
	e.apply(web) // the spare table
	if v := e.f.PbServices[keyOf(web.Key)]; v.TableSize != 1021 || v.Table != 0 {
		t.Fatalf("10 endpoints: %+v, want table 0 of 1021 slots", v)
	}
	if got, _ := e.f.TableSizes(id); got != [2]uint32{1021, 1021} {
		t.Fatalf("table sizes %v", got)
	}
	live := slices.Clone(e.liveTable(web.Key))
	e.f.TakeOps()

	// The 11th endpoint.
	web.Endpoints = append(slices.Clone(web.Endpoints), ep("198.19.1.11:8080"))
	e.apply(web)
	ops := e.f.TakeOps()
	if got := installed(ops); !slices.Equal(got, []pbmaps.TableInstall{{SvcID: id, N: 1, Size: 2039}}) {
		t.Errorf("Apply installed %v, want table 1 of 2039 slots: %s", got, opsString(ops))
	}
	v := e.f.PbServices[keyOf(web.Key)]
	if v.TableSize != 1021 || v.Table != 0 || !slices.Equal(e.liveTable(web.Key), live) {
		t.Errorf("live table changed by Apply: %+v", v)
	}
	// The old table keeps serving the old endpoints.
	for h := range uint32(3 * 2039) {
		be, _, ok := e.f.Pick(keyOf(web.Key), h*2654435761, false)
		if !ok || !slices.Contains(s.Backends[:10], be) {
			t.Fatalf("flow %d during the resize: backend %d (picked %v)", h, be, ok)
		}
	}

	// Admission of all 11, with the last one on probation.
	all := slices.Clone(s.Backends)
	e.program(id, all[:10], all[10:], false)
	ops = e.f.TakeOps()
	inOrder(t, ops, "resize", is(opSetFallback, id), setState(all[10], pbmaps.BackendProbation), fill(id, 1), flip(id, 1, 2039))
	if n := count(ops, kindIs(opInstallTables)); n != 0 {
		t.Errorf("ProgramService installed a table Apply prepared: %s", opsString(ops))
	}
	if n := count(ops, kindIs(opUpsertService)); n != 1 {
		t.Errorf("%d pb_services writes, want the flip only: %s", n, opsString(ops))
	}
	e.wantProgrammed(id, all[:10], all[10:], nil)
	if fb := e.f.PbMaglevFb[id]; len(fb) != 2039 {
		t.Errorf("fallback has %d slots, want 2039", len(fb))
	}
	// The old table, now the spare, is untouched until the next flip.
	if tbl, _ := e.f.Installed(id, 0); !slices.Equal(tbl, live) {
		t.Error("the previously live table was written")
	}

	// Back to 10 endpoints: 1021 again.
	web.Endpoints = web.Endpoints[:10]
	e.apply(web)
	ops = e.f.TakeOps()
	// (The spare, table 0, has the right size already.)
	if got := installed(ops); len(got) != 0 {
		t.Errorf("Apply installed %v", got)
	}
	e.program(id, all[:10], nil, false)
	ops = e.f.TakeOps()
	inOrder(t, ops, "shrink", fill(id, 0), flip(id, 0, 1021))
	e.wantProgrammed(id, all[:10], nil, nil)
}
