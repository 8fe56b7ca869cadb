package reconcile

import (
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
)

// An endpoint's accrual record survives a restart field for field, and a
// record whose endpoint left its service is pruned.
func TestPersistedEndpointsRoundTrip(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep("198.19.0.1:8080"), ep("198.19.0.2:8080"))
	e.apply(web)
	s := e.service(web.Key)
	a, b := e.bid(web.Key, "198.19.0.1:8080"), e.bid(web.Key, "198.19.0.2:8080")
	e.program(s.ID, []uint32{b}, nil, false)
	want := accrual.Record{Service: s.ID, Endpoint: a, State: accrual.Ejected, ConsecutiveFailures: 7,
		PenaltyLevel: 2, Penalty: 3 * time.Second, EjectedAt: t0, ProbationAt: t0.Add(3 * time.Second),
		LastFailureKind: accrual.KindRefused, LastFailureAt: t0.Add(-time.Millisecond), Ejections: 3}
	if err := e.r.PersistEndpoint(want); err != nil {
		t.Fatal(err)
	}
	// A record for b that names another service: stale.
	if err := e.r.PersistEndpoint(accrual.Record{Service: s.ID + 1, Endpoint: b, State: accrual.Ejected}); err != nil {
		t.Fatal(err)
	}
	e.restart()
	recs, err := e.r.PersistedEndpoints()
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 2 {
		t.Fatalf("read %d records, want 2", len(recs))
	}
	var got accrual.Record
	for _, r := range recs {
		if r.Endpoint == a {
			got = r
		}
	}
	if !got.EjectedAt.Equal(want.EjectedAt) || !got.ProbationAt.Equal(want.ProbationAt) || !got.LastFailureAt.Equal(want.LastFailureAt) {
		t.Fatalf("times: got %+v, want %+v", got, want)
	}
	got.EjectedAt, got.ProbationAt, got.LastFailureAt = want.EjectedAt, want.ProbationAt, want.LastFailureAt
	if got != want {
		t.Fatalf("record: got %+v, want %+v", got, want)
	}
	e.apply(web)
	e.r.PruneEndpoints(recs)
	if _, ok := e.f.PbHealth[a]; !ok {
		t.Error("a live endpoint's record was pruned")
	}
	if _, ok := e.f.PbHealth[b]; ok {
		t.Error("a record naming another service survived the prune")
	}
	// The endpoint leaves: its record goes with it, so a recycled id does
	// not inherit the penalty.
	e.apply(svc("web", vip1, 80, ep("198.19.0.2:8080")))
	if _, ok := e.f.PbHealth[a]; ok {
		t.Error("a retired endpoint's record survived")
	}
}

func TestRedirectInterfacesSetTheConfigFlag(t *testing.T) {
	e := newEnv(t)
	if err := e.r.SetRedirectInterfaces([]uint32{4, 7}); err != nil {
		t.Fatal(err)
	}
	if !e.f.PbConfig.Redirect || len(e.f.PbRedirect) != 2 {
		t.Fatalf("redirect %v, config %+v", e.f.PbRedirect, e.f.PbConfig)
	}
	// The other settings stay as they were set, whatever the interfaces.
	set := pbmaps.Config{ReversePath: true, HashSeed: 7, SYNRetransMinAge: time.Second}
	if err := e.r.SetDatapathConfig(set); err != nil {
		t.Fatal(err)
	}
	if want := (pbmaps.Config{Redirect: true, ReversePath: true, HashSeed: 7, SYNRetransMinAge: time.Second}); e.f.PbConfig != want {
		t.Fatalf("config %+v after the settings, want %+v", e.f.PbConfig, want)
	}
	if err := e.r.SetRedirectInterfaces(nil); err != nil {
		t.Fatal(err)
	}
	if want := (pbmaps.Config{ReversePath: true, HashSeed: 7, SYNRetransMinAge: time.Second}); e.f.PbConfig != want || len(e.f.PbRedirect) != 0 {
		t.Fatalf("redirect %v, config %+v after clearing, want %+v", e.f.PbRedirect, e.f.PbConfig, want)
	}
	if err := e.r.SetInterfaces([]pbmaps.Iface{{Index: 9, Partial: true}, {Index: 10, Master: 3}}); err != nil ||
		len(e.f.Partial) != 1 || e.f.Masters[10] != 3 {
		t.Fatalf("partial %v, masters %v, err %v", e.f.Partial, e.f.Masters, err)
	}
}
