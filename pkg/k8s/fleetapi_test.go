// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"net/netip"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/penaltybox/penaltybox/pkg/fleet"
)

func TestFleetObjectsRoundTrip(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	web := fleet.Key{Service: "shop/web:http", Addr: netip.MustParseAddrPort("198.18.3.10:8080")}
	db := fleet.Key{Service: "shop/db:5432", Addr: netip.MustParseAddrPort("[2001:2::5]:5432")}
	counts := []fleet.Count{{Key: web, Calls: 4, Failures: 1}, {Key: db, Calls: 9, Failures: 0, Suspect: true, Acted: now.UnixNano()}}
	obj, err := fleetObject("EndpointReport", "", "node-1", new(EncodeReport(counts, now.Add(-1500*time.Microsecond), now)))
	if err != nil {
		t.Fatal(err)
	}
	// An entry a buggy or hostile writer made must not hide the others.
	eps, _, _ := unstructured.NestedSlice(obj.Object, "spec", "endpoints")
	eps = append(eps, map[string]any{"service": "shop/web:http", "address": "not-an-address", "calls": int64(1), "failures": int64(1)},
		map[string]any{"service": "shop/web:http", "address": "198.18.3.11:8080", "calls": int64(1), "failures": int64(5)})
	_ = unstructured.SetNestedSlice(obj.Object, eps, "spec", "endpoints")
	r, bad, err := DecodeReport(obj)
	if err != nil || bad != 2 {
		t.Fatalf("DecodeReport: %d bad, %v; want the 2 broken entries counted", bad, err)
	}
	if r.Node != "node-1" || !r.Expires.Equal(now) || !r.At.Equal(now.Add(-1500*time.Microsecond)) || len(r.Counts) != 2 || r.Counts[0] != counts[0] || r.Counts[1] != counts[1] {
		t.Fatalf("DecodeReport = %+v, want %+v", r, counts)
	}

	v := fleet.Verdicts{Suspects: []fleet.Key{db, web}, Condemned: []fleet.Condemned{{Key: web, Generation: now.UnixNano(), Level: 2, Calls: 60, Failures: 18, Nodes: 3}}}
	specs := EncodeVerdicts(v, now)
	if len(specs) != 2 || len(specs["shop/web"].Condemned) != 1 || len(specs["shop/db"].Suspects) != 1 {
		t.Fatalf("EncodeVerdicts = %+v, want one verdict per Service", specs)
	}
	web1 := specs["shop/web"]
	vo, err := fleetObject("EndpointVerdict", "shop", "web", &web1)
	if err != nil {
		t.Fatal(err)
	}
	got, expires, bad, err := DecodeVerdict(vo)
	if err != nil || bad != 0 || !expires.Equal(now) || len(got.Condemned) != 1 || got.Condemned[0] != v.Condemned[0] || got.Suspects[0] != web {
		t.Fatalf("DecodeVerdict = %+v, %v, %d bad, %v; want web condemned", got, expires, bad, err)
	}
	// A verdict names only its own Service's endpoints.
	vo.SetName("other")
	if got, _, bad, _ := DecodeVerdict(vo); bad != 2 || len(got.Condemned)+len(got.Suspects) != 0 {
		t.Fatalf("verdict for another Service = %+v (%d bad), want its entries refused", got, bad)
	}
}

func TestServiceObject(t *testing.T) {
	for in, want := range map[string][2]string{"shop/web:http": {"shop", "web"}, "shop/web:8080": {"shop", "web"}} {
		if ns, name, ok := ServiceObject(in); !ok || ns != want[0] || name != want[1] {
			t.Errorf("ServiceObject(%q) = %q %q %v", in, ns, name, ok)
		}
	}
	for _, in := range []string{"web", "/web:80", "shop/:80", "shop/web"} {
		if _, _, ok := ServiceObject(in); ok {
			t.Errorf("ServiceObject(%q) ok, want not a Kubernetes service name", in)
		}
	}
}

// A condemnation is renewed on counts that went through the API: the
// acted generation survives encoding.
func TestRenewalThroughTheWireFormat(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	web := fleet.Key{Service: "shop/web:http", Addr: netip.MustParseAddrPort("198.18.3.10:8080")}
	gen := now.Add(-3 * time.Second).UnixNano()
	agg := fleet.NewAggregator()
	agg.Seed(now, fleet.Verdicts{Suspects: []fleet.Key{web}, Condemned: []fleet.Condemned{{Key: web, Generation: gen}}})
	var reports []fleet.Report
	for _, node := range []string{"node1", "node2", "node3"} {
		spec := EncodeReport([]fleet.Count{{Key: web, Calls: 40, Failures: 12, Suspect: true, Acted: gen}}, now, now.Add(time.Minute))
		u, err := fleetObject("EndpointReport", "", node, &spec)
		if err != nil {
			t.Fatal(err)
		}
		r, bad, err := DecodeReport(u)
		if err != nil || bad != 0 {
			t.Fatalf("DecodeReport: %d bad, %v", bad, err)
		}
		reports = append(reports, r)
	}
	judges := map[string]fleet.Judge{web.Service: {Window: 10 * time.Second, MinCalls: 60, Threshold: 0.2,
		Endpoints: map[netip.AddrPort]bool{web.Addr: true}}}
	v := agg.Judge(now, reports, judges)
	if len(v.Condemned) != 1 || v.Condemned[0].Generation == gen || v.Condemned[0].Level != 1 {
		t.Fatalf("= %+v, want the condemnation renewed at level 1", v)
	}
}
