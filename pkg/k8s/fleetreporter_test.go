package k8s

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/penaltybox/penaltybox/pkg/fleet"
)

// fakeSource is the agent as the reporter sees it.
type fakeSource struct {
	windows   []fleet.Window
	condemned []fleet.Condemned
	unknown   map[fleet.Key]bool
}

func (s *fakeSource) FleetWindows() []fleet.Window        { return s.windows }
func (s *fakeSource) FleetJudges() map[string]fleet.Judge { return nil }
func (s *fakeSource) Condemn(c fleet.Condemned) (known, out bool) {
	if s.unknown[c.Key] {
		return false, false
	}
	s.condemned = append(s.condemned, c)
	return true, true
}

// A report is written when there is something to say and the interval
// allows, not rewritten unchanged until it needs refreshing, deleted once
// there is nothing to say; a failing API server is counted, logged once,
// and not retried before the next interval.
func TestReporterWritesAndFails(t *testing.T) {
	gvrs := map[schema.GroupVersionResource]string{ReportGVR: "EndpointReportList", VerdictGVR: "EndpointVerdictList"}
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), gvrs)
	var writes, deletes int
	var failing error
	dyn.PrependReactor("patch", ReportResource, func(a k8stesting.Action) (bool, runtime.Object, error) {
		if failing != nil {
			return true, nil, failing
		}
		writes++
		if p := a.(k8stesting.PatchAction); p.GetName() != "node1" || !bytes.Contains(p.GetPatch(), []byte(`"198.18.3.10:8080"`)) {
			t.Errorf("wrote %s: %s", p.GetName(), p.GetPatch())
		}
		return true, nil, nil
	})
	dyn.PrependReactor("delete", ReportResource, func(k8stesting.Action) (bool, runtime.Object, error) {
		deletes++
		return true, nil, nil
	})
	clk := testingclock.NewFakeClock(time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC))
	var logs bytes.Buffer
	src := &fakeSource{}
	writesVec := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "w"}, []string{"result"})
	r := &reporter{o: FleetOptions{Dynamic: dyn, Node: "node1", Interval: 5 * time.Second, Source: src, Clock: clk, ReportWrites: writesVec},
		log: slog.New(slog.NewTextHandler(&logs, nil)), consumer: fleet.NewConsumer(), suspects: map[fleet.Key]bool{}}
	ctx := context.Background()
	step := func(d time.Duration) { clk.SetTime(clk.Now().Add(d)) }

	r.report(ctx)
	if writes+deletes != 0 {
		t.Fatalf("nothing to say: %d writes, %d deletes", writes, deletes)
	}
	ep := fleet.Key{Service: "shop/web:http", Addr: netip.MustParseAddrPort("198.18.3.10:8080")}
	src.windows = []fleet.Window{{Key: ep, Calls: 3, Failures: 1, MinCalls: 20}}
	r.report(ctx)
	if writes != 1 {
		t.Fatalf("after a failure: %d writes, want 1", writes)
	}
	step(time.Second)
	src.windows[0].Calls = 4
	r.report(ctx)
	if writes != 1 {
		t.Fatalf("a second later: %d writes, want still 1 (the interval)", writes)
	}
	step(5 * time.Second)
	r.report(ctx)
	if writes != 2 {
		t.Fatalf("an interval later, changed: %d writes, want 2", writes)
	}
	step(5 * time.Second)
	r.report(ctx)
	if writes != 2 {
		t.Fatalf("unchanged: %d writes, want still 2", writes)
	}
	step(3 * time.Second)
	r.report(ctx)
	if writes != 3 {
		t.Fatalf("unchanged for 1.5 intervals: %d writes, want a refresh (3)", writes)
	}

	failing = errors.New("connection refused")
	src.windows[0].Calls = 9
	for range 10 {
		step(time.Second)
		r.report(ctx)
	}
	if got := testutil.ToFloat64(writesVec.WithLabelValues("error")); got != 2 {
		t.Errorf("10 s of a failing API server: %v failed writes, want 2 (one per interval)", got)
	}
	if n := strings.Count(logs.String(), "EndpointReport write failed"); n != 1 {
		t.Errorf("logged the failure %d times, want once:\n%s", n, logs.String())
	}
	failing = nil
	step(5 * time.Second)
	r.report(ctx)
	if writes != 4 || !strings.Contains(logs.String(), "writes succeed again") {
		t.Errorf("after the API server is back: %d writes, want 4, and a log line:\n%s", writes, logs.String())
	}

	src.windows = nil
	r.report(ctx)
	r.report(ctx)
	if deletes != 1 {
		t.Errorf("nothing left to say: %d deletes, want 1", deletes)
	}
}

// Verdicts: an unexpired condemnation is acted on once, an expired one
// not at all, and a malformed object changes nothing else.
func TestReporterReadsVerdicts(t *testing.T) {
	clk := testingclock.NewFakeClock(time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC))
	store := cache.NewStore(cache.MetaNamespaceKeyFunc)
	src := &fakeSource{unknown: map[fleet.Key]bool{}}
	var logs bytes.Buffer
	r := &reporter{o: FleetOptions{Node: "node1", Source: src, Clock: clk}, log: slog.New(slog.NewTextHandler(&logs, nil)),
		verdicts: store, consumer: fleet.NewConsumer(), suspects: map[fleet.Key]bool{}, badVerdicts: onceLog{}}
	web := fleet.Key{Service: "shop/web:http", Addr: netip.MustParseAddrPort("198.18.3.10:8080")}
	db := fleet.Key{Service: "shop/db:5432", Addr: netip.MustParseAddrPort("198.18.3.11:5432")}
	add := func(name string, k fleet.Key, expires time.Time) {
		specs := EncodeVerdicts(fleet.Verdicts{Suspects: []fleet.Key{k}, Condemned: []fleet.Condemned{{Key: k, Generation: 7}}}, expires)
		spec := specs["shop/"+name]
		u, err := fleetObject("EndpointVerdict", "shop", name, &spec)
		if err != nil {
			t.Fatal(err)
		}
		if err := store.Add(u); err != nil {
			t.Fatal(err)
		}
	}
	add("web", web, clk.Now().Add(time.Minute))
	add("db", db, clk.Now()) // expired
	broken, _ := fleetObject("EndpointVerdict", "shop", "broken", &VerdictSpec{})
	broken.Object["spec"] = "not an object"
	_ = store.Add(broken)

	src.unknown[web] = true // this node's EndpointSlices lag
	r.readVerdicts()
	if len(src.condemned) != 0 {
		t.Fatalf("condemned %+v before the node knew the endpoint", src.condemned)
	}
	delete(src.unknown, web)
	r.readVerdicts()
	r.readVerdicts()
	if len(src.condemned) != 1 || src.condemned[0].Key != web {
		t.Fatalf("condemned %+v, want web once (db's verdict expired)", src.condemned)
	}
	// Its next report says its counts were taken after the condemnation.
	src.windows = []fleet.Window{{Key: web, Calls: 3, MinCalls: 20}}
	gvrs := map[schema.GroupVersionResource]string{ReportGVR: "EndpointReportList", VerdictGVR: "EndpointVerdictList"}
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), gvrs)
	var patch []byte
	dyn.PrependReactor("patch", ReportResource, func(a k8stesting.Action) (bool, runtime.Object, error) {
		patch = a.(k8stesting.PatchAction).GetPatch()
		return true, nil, nil
	})
	r.o.Dynamic, r.o.Interval = dyn, 5*time.Second
	r.report(context.Background())
	if !bytes.Contains(patch, []byte(`"acted":7`)) || !bytes.Contains(patch, []byte(`"suspect":true`)) {
		t.Errorf("report %s, want web's count as a suspect's, acted on generation 7", patch)
	}
	if !r.suspects[web] || r.suspects[db] {
		t.Errorf("suspects %v, want web only", r.suspects)
	}
	if n := strings.Count(logs.String(), "unreadable EndpointVerdict"); n != 1 {
		t.Errorf("the broken verdict was logged %d times over two reads, want once:\n%s", n, logs.String())
	}
}
