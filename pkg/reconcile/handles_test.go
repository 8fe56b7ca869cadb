// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"fmt"
	"slices"
	"testing"

	"github.com/penaltybox/penaltybox/pkg/desired"
)

// tableHandles leaves a reserve of an eighth of the open files, at least
// 256 and at most 4096, for everything else the agent opens.
func TestTableHandlesFromLimit(t *testing.T) {
	for _, tc := range []struct {
		nofile uint64
		want   int
	}{
		{0, 0},
		{256, 0},
		{1024, 768},
		{20000, 17500},
		{1 << 20, 1<<20 - 4096},
	} {
		if got := tableHandles(tc.nofile); got != tc.want {
			t.Errorf("tableHandles(%d) = %d, want %d", tc.nofile, got, tc.want)
		}
	}
}

// With handles short, the services all get their tables, live tables'
// handles are released to make room (spares keep theirs), and every
// service still changes, each flip with a table filled whole.
func TestTableHandlesBounded(t *testing.T) {
	const n, budget = 8, 10 // two per service would be 16
	e := newEnv(t, func(o *Options) { o.MaxTableHandles = budget })
	var svcs []svcAt
	for i := range n {
		svcs = append(svcs, svcAt{vip: fmt.Sprintf("198.18.1.%d", i+1), eps: []string{"198.19.0.1:80", "198.19.0.2:80"}})
	}
	apply := func() {
		var ds []desired.Service
		for i, s := range svcs {
			ds = append(ds, s.desired(fmt.Sprintf("s%d", i)))
		}
		e.apply(ds...)
		for i := range svcs {
			s := e.service(svcs[i].desired("").Key)
			e.program(s.ID, s.Backends, nil, false)
		}
		e.prepare()
		if got := e.f.TableHandles(); got > budget {
			t.Fatalf("%d table handles held, want at most %d", got, budget)
		}
		for i, sv := range svcs {
			k := sv.desired("").Key
			s := e.service(k)
			if got, want := e.liveTable(k), e.wantTable(e.r.sizeFor(len(s.Backends)), s.Backends); !slices.Equal(got, want) {
				t.Fatalf("service %d: live table is not its backends' table", i)
			}
		}
		e.checkKernel()
	}
	apply()
	if len(e.f.Released) == 0 {
		t.Fatal("no handle released with room for fewer than two tables per service")
	}
	// Each service changes, twice: the second change needs the table whose
	// handle was released, installed afresh.
	for round := range 2 {
		for i := range svcs {
			svcs[i].eps[0] = fmt.Sprintf("198.19.%d.%d:80", round+1, i+1)
			apply()
		}
	}
}

// Below the bound, nothing is released: two tables per service, the spare
// filled in place at a change.
func TestTableHandlesRoom(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.MaxTableHandles = 100 })
	s := svcAt{vip: vip1, eps: []string{"198.19.0.1:80"}}
	for i := range 3 {
		s.eps[0] = fmt.Sprintf("198.19.0.%d:80", i+1)
		e.apply(s.desired("web"))
		sv := e.service(s.desired("").Key)
		e.program(sv.ID, sv.Backends, nil, false)
		e.prepare()
	}
	if len(e.f.Released) != 0 || e.f.TableHandles() != 2 {
		t.Fatalf("released %v, %d handles; want none released, 2 handles", e.f.Released, e.f.TableHandles())
	}
}

type svcAt struct {
	vip string
	eps []string
}

func (s svcAt) desired(name string) desired.Service {
	var eps []desired.Endpoint
	for _, a := range s.eps {
		eps = append(eps, ep(a))
	}
	return svc(name, s.vip, 80, eps...)
}
