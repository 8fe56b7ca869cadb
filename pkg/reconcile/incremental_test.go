// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"slices"
	"testing"

	"github.com/penaltybox/penaltybox/pkg/desired"
)

// recorder is accrual that admits every endpoint and records which
// services Apply handed it.
type recorder struct {
	e                 *env
	adopted, programs []uint32
}

func (a *recorder) Adopt(_ []Change, services []*Service) {
	for _, s := range services {
		a.adopted = append(a.adopted, s.ID)
	}
}

func (a *recorder) Program(id uint32) {
	a.programs = append(a.programs, id)
	s, _ := a.e.r.Service(id)
	if err := a.e.r.ProgramService(id, s.Backends, nil, false, 0); err != nil {
		a.e.t.Fatal(err)
	}
}

// The first Apply hands accrual every service; later ones only the
// services that are new or changed in any way, and a state asked for
// again unchanged hands it none and writes nothing.
func TestApplyTouchesOnlyChanged(t *testing.T) {
	e := newEnv(t)
	acc := &recorder{e: e}
	web := svc("web", vip1, 80, ep("198.19.0.1:80"), ep("198.19.0.2:80"))
	api := svc("api", vip2, 80, ep("198.19.0.3:80"))
	db := svc("db", vip3, 5432, ep("198.19.0.4:5432"))
	apply := func(svcs ...desired.Service) (adopted, programs []uint32) {
		t.Helper()
		acc.adopted, acc.programs = nil, nil
		if _, err := e.r.Apply(state(svcs...), acc); err != nil {
			t.Fatal(err)
		}
		e.checkKernel()
		return acc.adopted, acc.programs
	}
	idOf := func(s desired.Service) uint32 { return e.service(s.Key).ID }

	if ad, pr := apply(web, api); len(ad) != 2 || len(pr) != 2 {
		t.Fatalf("first Apply: adopted %v, programmed %v; want both services", ad, pr)
	}
	e.prepare() // the spare tables, as the agent installs them after an Apply
	e.f.TakeOps()
	if ad, pr := apply(web, api); len(ad) != 0 || len(pr) != 0 {
		t.Fatalf("unchanged Apply: adopted %v, programmed %v; want none", ad, pr)
	}
	if ops := e.f.TakeOps(); len(ops) != 0 {
		t.Fatalf("unchanged Apply wrote %s", opsString(ops))
	}
	// An endpoint replaced in one service, a new service, a setting
	// changed in another: each of those, and only those.
	web2 := svc("web", vip1, 80, ep("198.19.0.1:80"), ep("198.19.0.9:80"))
	if ad, pr := apply(web2, api, db); !slices.Equal(ad, sortedIDs(idOf(web2), idOf(db))) || !slices.Equal(pr, ad) {
		t.Fatalf("adopted %v, programmed %v; want web and db", ad, pr)
	}
	if !slices.Contains(e.liveTable(web2.Key), e.bid(web2.Key, "198.19.0.9:80")) {
		t.Fatal("web's new endpoint is not in its table")
	}
	api2 := api
	api2.MaxInflight = 7
	if ad, _ := apply(web2, api2, db); !slices.Equal(ad, []uint32{idOf(api2)}) {
		t.Fatalf("adopted %v; want api alone (its setting changed)", ad)
	}
	// A service removed is heard of through the changes; the rest stay.
	if ad, _ := apply(web2, db); len(ad) != 0 {
		t.Fatalf("adopted %v after a removal; want none", ad)
	}
	if _, ok := e.r.ServiceByKey(api.Key); ok {
		t.Fatal("api still programmed")
	}
}

func sortedIDs(ids ...uint32) []uint32 { slices.Sort(ids); return ids }
