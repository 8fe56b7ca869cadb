package fleet

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"
)

var (
	t0  = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	svc = "default/web:http"
	ep  = Key{Service: svc, Addr: netip.MustParseAddrPort("198.18.3.10:8080")}
	// The dilution case: 20 calls a window judge an endpoint, each node
	// makes 2.
	judges = map[string]Judge{svc: {Window: 10 * time.Second, MinCalls: 20, Threshold: 0.2}}
)

// nodeWindows is what each of n nodes holds of ep after calls calls each,
// every one failing with probability p.
func nodeWindows(rnd *rand.Rand, n int, calls uint32, p float64) [][]Window {
	out := make([][]Window, n)
	for i := range out {
		w := Window{Key: ep, Calls: calls, MinCalls: 20}
		for range calls {
			if p > 0 && rnd.Float64() < p {
				w.Failures++
			}
		}
		out[i] = []Window{w}
	}
	return out
}

// round has every node select its report with the suspects and the
// aggregator judge them all.
func round(a *Aggregator, now time.Time, ws [][]Window, suspects map[Key]bool) Verdicts {
	var reports []Report
	for i, w := range ws {
		reports = append(reports, Report{Node: fmt.Sprint("node-", i), Expires: now.Add(time.Minute), Counts: Select(w, suspects)})
	}
	return a.Judge(now, reports, judges)
}

func asSet(ks []Key) map[Key]bool {
	m := map[Key]bool{}
	for _, k := range ks {
		m[k] = true
	}
	return m
}

func TestDilutedEndpointIsCondemnedOnTheSecondRound(t *testing.T) {
	a := NewAggregator()
	// 50 nodes, 2 calls each, 30 of the 100 failed (on 30 nodes).
	ws := nodeWindows(nil, 50, 2, 0)
	for i := range 30 {
		ws[i][0].Failures = 1
	}
	// No node reaches minCalls alone, so none could eject it.
	v := round(a, t0, ws, nil)
	if len(v.Condemned) != 0 || len(v.Suspects) != 1 || v.Suspects[0] != ep {
		t.Fatalf("first round (failures only, no suspect counts) = %+v, want ep a suspect and nothing condemned", v)
	}
	v = round(a, t0.Add(5*time.Second), ws, asSet(v.Suspects))
	if len(v.Condemned) != 1 || v.Condemned[0].Key != ep {
		t.Fatalf("second round (every node's calls to the suspect) = %+v, want ep condemned", v)
	}
	c := v.Condemned[0]
	if c.Calls != 100 || c.Nodes != 50 || c.Generation != t0.Add(5*time.Second).UnixNano() {
		t.Errorf("condemned = %+v, want the 50 nodes' 100 calls, generation of the second round", c)
	}
}

// A rate judged on failure reports alone would condemn an endpoint that
// fails 1% of the fleet's calls: the nodes that saw one failure in two
// calls read 50%. The suspect's full counts acquit it.
func TestSuspectCountsAreUnbiased(t *testing.T) {
	rnd := rand.New(rand.NewPCG(3, 4))
	a := NewAggregator()
	ws := nodeWindows(rnd, 500, 2, 0.01)
	var calls, failures uint32
	for _, w := range ws {
		for _, c := range Select(w, nil) {
			calls += c.Calls
			failures += c.Failures
		}
	}
	if calls == 0 || float64(failures)/float64(calls) < 0.4 {
		t.Fatalf("failure reports alone read %d of %d; the test needs them to look bad", failures, calls)
	}
	v := round(a, t0, ws, nil)
	if len(v.Suspects) != 1 {
		t.Fatalf("first round = %+v, want a suspect", v)
	}
	v = round(a, t0.Add(5*time.Second), ws, asSet(v.Suspects))
	if len(v.Condemned) != 0 || len(v.Suspects) != 1 {
		t.Fatalf("with full counts, half a window on = %+v, want nothing condemned, still a suspect", v)
	}
	v = round(a, t0.Add(10*time.Second), ws, asSet(v.Suspects))
	if len(v.Condemned) != 0 || len(v.Suspects) != 0 {
		t.Fatalf("with full counts, a window on = %+v, want acquitted: no suspect, nothing condemned", v)
	}
}

func TestCondemnationLastsWhileTheSumCondemnsAndRelapsesAnew(t *testing.T) {
	a := NewAggregator()
	bad := [][]Window{{{Key: ep, Calls: 10, Failures: 5, MinCalls: 20}}, {{Key: ep, Calls: 10, Failures: 5, MinCalls: 20}}}
	v := round(a, t0, bad, nil)
	v = round(a, t0.Add(time.Second), bad, asSet(v.Suspects))
	if len(v.Condemned) != 1 {
		t.Fatalf("= %+v, want ep condemned", v)
	}
	gen := v.Condemned[0].Generation
	v = round(a, t0.Add(2*time.Second), bad, asSet(v.Suspects))
	if len(v.Condemned) != 1 || v.Condemned[0].Generation != gen {
		t.Fatalf("still condemning: %+v, want the same generation %d", v, gen)
	}
	// The nodes ejected it: their windows emptied, they report nothing.
	v = round(a, t0.Add(3*time.Second), [][]Window{nil, nil}, asSet(v.Suspects))
	if len(v.Condemned) != 0 || len(v.Suspects) != 0 {
		t.Fatalf("after the ejection = %+v, want nothing", v)
	}
	// Its probe returned it and it fails again: a new condemnation.
	v = round(a, t0.Add(20*time.Second), bad, nil)
	v = round(a, t0.Add(21*time.Second), bad, asSet(v.Suspects))
	if len(v.Condemned) != 1 || v.Condemned[0].Generation == gen {
		t.Fatalf("relapse = %+v, want a condemnation with a new generation", v)
	}
}

func TestSuspectWithoutVolumeIsDropped(t *testing.T) {
	a := NewAggregator()
	few := [][]Window{{{Key: ep, Calls: 2, Failures: 1, MinCalls: 20}}}
	v := round(a, t0, few, nil)
	for i := 1; i <= 20; i++ {
		v = round(a, t0.Add(time.Duration(i)*time.Second), few, asSet(v.Suspects))
		if len(v.Condemned) != 0 {
			t.Fatalf("condemned on %d calls, below minCalls", v.Condemned[0].Calls)
		}
		if i < 20 && len(v.Suspects) != 1 {
			t.Fatalf("after %ds = %+v, want still a suspect", i, v)
		}
	}
	// Two windows on: dropped (a failure in a later report makes it a
	// suspect again, judged afresh).
	if len(v.Suspects) != 0 {
		t.Fatalf("after two windows = %+v, want the suspect dropped", v)
	}
}

func TestJudgeIgnoresExpiredUnknownAndImpossible(t *testing.T) {
	a := NewAggregator()
	other := Key{Service: "default/other:80", Addr: ep.Addr}
	reports := []Report{
		{Node: "expired", Expires: t0, Counts: []Count{{Key: ep, Calls: 50, Failures: 50, Suspect: true}}},
		{Node: "unknown", Expires: t0.Add(time.Minute), Counts: []Count{{Key: other, Calls: 50, Failures: 50, Suspect: true}}},
		{Node: "impossible", Expires: t0.Add(time.Minute), Counts: []Count{{Key: ep, Calls: 5, Failures: 50, Suspect: true}}},
	}
	for i := range 3 {
		if v := a.Judge(t0.Add(time.Duration(i)*time.Second), reports, judges); len(v.Suspects)+len(v.Condemned) != 0 {
			t.Fatalf("round %d = %+v, want nothing", i, v)
		}
	}
}

func TestSelect(t *testing.T) {
	judged := Window{Key: Key{Service: svc, Addr: netip.MustParseAddrPort("198.18.3.11:8080")}, Calls: 30, Failures: 3, MinCalls: 20}
	idle := Window{Key: Key{Service: svc, Addr: netip.MustParseAddrPort("198.18.3.12:8080")}, MinCalls: 20}
	healthy := Window{Key: Key{Service: svc, Addr: netip.MustParseAddrPort("198.18.3.13:8080")}, Calls: 3, MinCalls: 20}
	failing := Window{Key: ep, Calls: 3, Failures: 1, MinCalls: 20}
	got := Select([]Window{judged, idle, healthy, failing}, nil)
	if len(got) != 1 || got[0].Key != ep || got[0].Suspect {
		t.Fatalf("Select = %+v, want only the failing endpoint this node cannot judge", got)
	}
	got = Select([]Window{judged, idle, healthy, failing}, map[Key]bool{healthy.Key: true, judged.Key: true})
	if len(got) != 3 || !got[0].Suspect || !got[1].Suspect || got[2].Key != ep {
		t.Fatalf("Select with suspects = %+v, want both suspects (even without failures, even judged) first, then ep", got)
	}
	var many []Window
	for i := range MaxCounts + 10 {
		many = append(many, Window{Key: Key{Service: svc, Addr: netip.AddrPortFrom(netip.MustParseAddr("198.18.4.1"), uint16(1000+i))},
			Calls: 5, Failures: uint32(1 + i%4), MinCalls: 20})
	}
	got = Select(many, nil)
	if len(got) != MaxCounts || got[0].Failures != 4 || got[len(got)-1].Failures != 1 {
		t.Fatalf("Select of %d = %d entries, first %d failures, last %d; want %d, most failures first",
			len(many), len(got), got[0].Failures, got[len(got)-1].Failures, MaxCounts)
	}
}

func TestConsumerActsOncePerGeneration(t *testing.T) {
	c := NewConsumer()
	first := []Condemned{{Key: ep, Generation: 1}}
	if got := c.Fresh(first); len(got) != 1 {
		t.Fatalf("first = %v, want it", got)
	}
	if got := c.Fresh(first); len(got) != 0 {
		t.Fatalf("again = %v, want nothing: acted on already", got)
	}
	if got := c.Fresh([]Condemned{{Key: ep, Generation: 2}}); len(got) != 1 {
		t.Fatalf("new generation = %v, want it", got)
	}
	c.Fresh(nil)
	if got := c.Fresh([]Condemned{{Key: ep, Generation: 2}}); len(got) != 1 {
		t.Fatalf("after the verdict was gone = %v, want it again (forgotten)", got)
	}
}
