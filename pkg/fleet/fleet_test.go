// SPDX-License-Identifier: Apache-2.0

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
	// The dilution case: 20 calls a window judge an endpoint.
	judges = map[string]Judge{svc: {Window: 10 * time.Second, MinCalls: 20, Threshold: 0.2,
		Endpoints: map[netip.AddrPort]bool{ep.Addr: true}}}
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

// reportsAt is every node's report, written at now, as Select makes it.
func reportsAt(now time.Time, ws [][]Window, suspects map[Key]bool) []Report {
	var rs []Report
	for i, w := range ws {
		rs = append(rs, Report{Node: fmt.Sprint("node-", i), At: now, Expires: now.Add(time.Minute), Counts: Select(w, suspects)})
	}
	return rs
}

// round has every node report at now and the aggregator judge them all.
func round(a *Aggregator, now time.Time, ws [][]Window, v Verdicts) Verdicts {
	return a.Judge(now, reportsAt(now, ws, asSet(v.Suspects)), judges)
}

func asSet(ks []Key) map[Key]bool {
	m := map[Key]bool{}
	for _, k := range ks {
		m[k] = true
	}
	return m
}

// diluted: 50 nodes, 2 calls each, 30 of the 100 failed (on 30 nodes). No
// node reaches minCalls alone.
func diluted(failed int) [][]Window {
	ws := nodeWindows(nil, 50, 2, 0)
	for i := range failed {
		ws[i][0].Failures = 1
	}
	return ws
}

// after marks every window as begun after condemnation gen (the nodes
// ejected the endpoint for it).
func after(ws [][]Window, gen int64) [][]Window {
	for _, w := range ws {
		for i := range w {
			w[i].Acted = gen
		}
	}
	return ws
}

func TestDilutedEndpointIsCondemnedOnTheSecondRound(t *testing.T) {
	a := NewAggregator()
	ws := diluted(30)
	v := round(a, t0, ws, Verdicts{})
	if len(v.Condemned) != 0 || len(v.Suspects) != 1 || v.Suspects[0] != ep {
		t.Fatalf("first round (failures only, no suspect counts) = %+v, want ep a suspect and nothing condemned", v)
	}
	v = round(a, t0.Add(5*time.Second), ws, v)
	if len(v.Condemned) != 1 || v.Condemned[0].Key != ep {
		t.Fatalf("second round (every node's calls to the suspect) = %+v, want ep condemned", v)
	}
	c := v.Condemned[0]
	if c.Calls != 100 || c.Failures != 30 || c.Nodes != 50 || c.Level != 0 || c.Generation != t0.Add(5*time.Second).UnixNano() {
		t.Errorf("condemned = %+v, want the 50 nodes' 30 of 100, level 0, generation of the second round", c)
	}
}

// A rate judged on failure reports alone would condemn an endpoint that
// fails 1% of the fleet's calls: the nodes that saw one failure in two
// calls read 50%. The suspect's full counts acquit it, once it has been
// a suspect for a window; then a failure does not suspect it again for a
// window.
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
	v := round(a, t0, ws, Verdicts{})
	if len(v.Suspects) != 1 {
		t.Fatalf("first round = %+v, want a suspect", v)
	}
	v = round(a, t0.Add(5*time.Second), ws, v)
	if len(v.Condemned) != 0 || len(v.Suspects) != 1 {
		t.Fatalf("with full counts, half a window on = %+v, want nothing condemned, still a suspect", v)
	}
	v = round(a, t0.Add(10*time.Second), ws, v)
	if len(v.Condemned) != 0 || len(v.Suspects) != 0 {
		t.Fatalf("with full counts, a window on = %+v, want acquitted: no suspect, nothing condemned", v)
	}
	// The same failures do not suspect it again at once...
	for i := 11; i < 20; i++ {
		if v = round(a, t0.Add(time.Duration(i)*time.Second), ws, v); len(v.Suspects) != 0 {
			t.Fatalf("%ds, within a window of the acquittal: %+v, want no suspect", i, v)
		}
	}
	// ...but a window later they do.
	if v = round(a, t0.Add(20*time.Second), ws, v); len(v.Suspects) != 1 {
		t.Fatalf("a window after the acquittal: %+v, want a suspect again", v)
	}
}

// One node, buggy or hostile, cannot condemn an endpoint: not with a huge
// count, not by listing it twice, not by marking counts suspect before
// the aggregator published the suspect, not by tipping a healthy fleet's
// rate over the threshold.
func TestOneNodeCannotCondemn(t *testing.T) {
	huge := Count{Key: ep, Calls: 1000, Failures: 1000, Suspect: true}
	for name, reports := range map[string]func(now time.Time) []Report{
		"alone": func(now time.Time) []Report {
			return []Report{{Node: "evil", At: now, Expires: now.Add(time.Minute), Counts: []Count{huge, huge}}}
		},
		"among healthy nodes": func(now time.Time) []Report {
			rs := reportsAt(now, diluted(0), map[Key]bool{ep: true})
			return append(rs, Report{Node: "evil", At: now, Expires: now.Add(time.Minute), Counts: []Count{huge}})
		},
		// Two honest nodes at 45% against a 50% threshold; the liar's 100%
		// is not the most failures, but the most over the threshold.
		"tipping the rate": func(now time.Time) []Report {
			return []Report{
				{Node: "a", At: now, Expires: now.Add(time.Minute), Counts: []Count{{Key: ep, Calls: 100, Failures: 45, Suspect: true}}},
				{Node: "b", At: now, Expires: now.Add(time.Minute), Counts: []Count{{Key: ep, Calls: 100, Failures: 45, Suspect: true}}},
				{Node: "evil", At: now, Expires: now.Add(time.Minute), Counts: []Count{{Key: ep, Calls: 44, Failures: 44, Suspect: true}}},
			}
		},
	} {
		t.Run(name, func(t *testing.T) {
			a := NewAggregator()
			js := judges
			if name == "tipping the rate" {
				js = map[string]Judge{svc: {Window: 10 * time.Second, MinCalls: 60, Threshold: 0.5, Endpoints: judges[svc].Endpoints}}
			}
			for i := range 30 {
				now := t0.Add(time.Duration(i) * time.Second)
				if v := a.Judge(now, reports(now), js); len(v.Condemned) != 0 {
					t.Fatalf("round %d: %+v, want nothing condemned", i, v)
				}
			}
		})
	}
}

// Nor can one node hide a failing endpoint with a flood of successes.
func TestOneNodeCannotAcquit(t *testing.T) {
	a := NewAggregator()
	ws := [][]Window{}
	for range 4 {
		ws = append(ws, []Window{{Key: ep, Calls: 40, Failures: 12, MinCalls: 50}})
	}
	liar := Report{Node: "evil", Counts: []Count{{Key: ep, Calls: 1_000_000, Suspect: true}}}
	judge := func(now time.Time, v Verdicts) Verdicts {
		rs := reportsAt(now, ws, asSet(v.Suspects))
		liar.At, liar.Expires = now, now.Add(time.Minute)
		return a.Judge(now, append(rs, liar), judges)
	}
	v := judge(t0, Verdicts{})
	v = judge(t0.Add(time.Second), v)
	if len(v.Condemned) != 1 {
		t.Fatalf("= %+v, want ep condemned despite the liar's million successes", v)
	}
}

func TestJudgeIgnoresWhatItCannotTrust(t *testing.T) {
	other := Key{Service: "default/other:80", Addr: ep.Addr}
	stranger := Key{Service: svc, Addr: netip.MustParseAddrPort("198.18.9.9:8080")}
	bad := Count{Key: ep, Calls: 10, Failures: 10, Suspect: true}
	for name, r := range map[string]Report{
		"expired":            {At: t0, Expires: t0, Counts: []Count{bad}},
		"stale":              {At: t0.Add(-21 * time.Second), Expires: t0.Add(time.Hour), Counts: []Count{bad}},
		"from the future":    {At: t0.Add(2 * time.Minute), Expires: t0.Add(time.Hour), Counts: []Count{bad}},
		"unknown service":    {At: t0, Expires: t0.Add(time.Minute), Counts: []Count{{Key: other, Calls: 10, Failures: 10}}},
		"not an endpoint":    {At: t0, Expires: t0.Add(time.Minute), Counts: []Count{{Key: stranger, Calls: 10, Failures: 10}}},
		"more failures":      {At: t0, Expires: t0.Add(time.Minute), Counts: []Count{{Key: ep, Calls: 1, Failures: 10}}},
		"no calls":           {At: t0, Expires: t0.Add(time.Minute), Counts: []Count{{Key: ep}}},
		"healthy, a failure": {At: t0, Expires: t0.Add(time.Minute), Counts: []Count{{Key: ep, Calls: 5}}},
	} {
		t.Run(name, func(t *testing.T) {
			a := NewAggregator()
			var reports []Report
			for i := range 5 {
				r.Node = fmt.Sprint(i)
				reports = append(reports, r)
			}
			if v := a.Judge(t0, reports, judges); len(v.Suspects)+len(v.Condemned) != 0 {
				t.Fatalf("= %+v, want nothing", v)
			}
		})
	}
}

// A condemnation stands while the nodes eject the endpoint; only the
// counts of windows begun after it (the nodes ejected it) judge it again.
// Failing again after its probe: renewed, a level up. Held out by every
// node: dropped, its level remembered for the relapse. Serving again:
// acquitted, level forgotten.
func TestCondemnationLifecycle(t *testing.T) {
	a := NewAggregator()
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	v := round(a, at(0), diluted(30), Verdicts{})
	v = round(a, at(1), diluted(30), v)
	if len(v.Condemned) != 1 {
		t.Fatalf("= %+v, want ep condemned", v)
	}
	gen := v.Condemned[0].Generation
	// Nodes that have not ejected it yet (the verdict is slow to reach
	// them, or the ejection cap held it back) still hold the old calls:
	// they keep it condemned, they do not renew it.
	for s := 2.0; s < 9; s++ {
		if v = round(a, at(s), diluted(30), v); len(v.Condemned) != 1 || v.Condemned[0].Generation != gen {
			t.Fatalf("%vs, no node acted yet: %+v, want the same condemnation", s, v)
		}
	}
	// The nodes ejected it, its probe returned it, and it fails as before.
	v = round(a, at(9), after(diluted(30), gen), v)
	if len(v.Condemned) != 1 || v.Condemned[0].Generation == gen || v.Condemned[0].Level != 1 {
		t.Fatalf("failing again after the ejection: %+v, want renewed at level 1", v)
	}
	renewed := v.Condemned[0].Generation
	// Every node holds it out: nothing reported. Dropped two windows on.
	for s := 10.0; s <= 29; s++ {
		v = round(a, at(s), nil, v)
	}
	if len(v.Condemned)+len(v.Suspects) != 0 {
		t.Fatalf("held out everywhere for two windows since %d: %+v, want dropped", renewed, v)
	}
	// It relapses after its penalty: condemned at level 2.
	v = round(a, at(40), diluted(30), v)
	v = round(a, at(41), diluted(30), v)
	if len(v.Condemned) != 1 || v.Condemned[0].Level != 2 {
		t.Fatalf("relapse: %+v, want condemned at level 2", v)
	}
	gen = v.Condemned[0].Generation
	// It serves again: a window on, acquitted.
	for s := 42.0; s <= 51; s++ {
		v = round(a, at(s), after(diluted(0), gen), v)
	}
	if len(v.Condemned)+len(v.Suspects) != 0 {
		t.Fatalf("serving for a window: %+v, want acquitted", v)
	}
	// A later failure starts from level 0 again.
	v = round(a, at(70), diluted(30), v)
	if v = round(a, at(71), diluted(30), v); len(v.Condemned) != 1 || v.Condemned[0].Level != 0 {
		t.Fatalf("after an acquittal: %+v, want level 0", v)
	}
}

// A condemnation no node acted on (the cap held every ejection back: the
// nodes keep calling it, none says it acted) leaves no level behind.
func TestCondemnationNobodyActedOnLeavesNoLevel(t *testing.T) {
	a := NewAggregator()
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	v := round(a, at(0), diluted(30), Verdicts{})
	for s := 1.0; s <= 21; s++ {
		v = round(a, at(s), diluted(30), v)
	}
	if len(v.Condemned) != 0 {
		t.Fatalf("two windows on, no node acted: %+v, want dropped", v)
	}
	for s := 32.0; s <= 33; s++ {
		v = round(a, at(s), diluted(30), v)
	}
	if len(v.Condemned) != 1 || v.Condemned[0].Level != 0 {
		t.Fatalf("condemned again: %+v, want level 0", v)
	}
}

func TestSuspectWithoutVolumeIsDropped(t *testing.T) {
	a := NewAggregator()
	few := [][]Window{{{Key: ep, Calls: 2, Failures: 1, MinCalls: 20}}, {{Key: ep, Calls: 2, MinCalls: 20}}}
	v := round(a, t0, few, Verdicts{})
	for i := 1; i <= 20; i++ {
		v = round(a, t0.Add(time.Duration(i)*time.Second), few, v)
		if len(v.Condemned) != 0 {
			t.Fatalf("condemned on %d calls, below minCalls", v.Condemned[0].Calls)
		}
		if i < 20 && len(v.Suspects) != 1 {
			t.Fatalf("after %ds = %+v, want still a suspect", i, v)
		}
	}
	if len(v.Suspects) != 0 {
		t.Fatalf("after two windows = %+v, want the suspect dropped", v)
	}
}

// A new aggregator seeded with the verdicts in force keeps their
// generations: the nodes do not eject again because the Lease moved; and
// it renews them on the nodes' fresh counts as the old one would have.
func TestSeedKeepsGenerations(t *testing.T) {
	a := NewAggregator()
	v := round(a, t0, diluted(30), Verdicts{})
	v = round(a, t0.Add(time.Second), diluted(30), v)
	gen := v.Condemned[0].Generation
	b := NewAggregator()
	b.Seed(t0.Add(2*time.Second), v)
	if w := b.Judge(t0.Add(2*time.Second), reportsAt(t0.Add(2*time.Second), diluted(30), asSet(v.Suspects)), judges); len(w.Condemned) != 1 || w.Condemned[0].Generation != gen {
		t.Fatalf("seeded, the nodes not acted yet = %+v, want the same generation %d", w, gen)
	}
	w := b.Judge(t0.Add(5*time.Second), reportsAt(t0.Add(5*time.Second), after(diluted(30), gen), asSet(v.Suspects)), judges)
	if len(w.Condemned) != 1 || w.Condemned[0].Level != 1 {
		t.Fatalf("seeded, failing again after the nodes acted = %+v, want renewed at level 1", w)
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
	suspects := map[Key]bool{}
	for i := range MaxCounts + 200 {
		k := Key{Service: svc, Addr: netip.AddrPortFrom(netip.MustParseAddr("198.18.4.1"), uint16(1000+i))}
		many = append(many, Window{Key: k, Calls: 5, Failures: uint32(i % 2), MinCalls: 20})
		suspects[k] = true
	}
	got = Select(many, suspects)
	healthyKept := 0
	for _, c := range got {
		if c.Failures == 0 {
			healthyKept++
		}
	}
	if len(got) != MaxCounts || healthyKept < MaxCounts*2/5 {
		t.Fatalf("Select of %d suspects = %d entries, %d healthy; want %d, the cut independent of failures (about half healthy)",
			len(many), len(got), healthyKept, MaxCounts)
	}
	var nonSuspects []Window
	for i := range MaxCounts + 10 {
		nonSuspects = append(nonSuspects, Window{Key: Key{Service: svc, Addr: netip.AddrPortFrom(netip.MustParseAddr("198.18.4.2"), uint16(1000+i))},
			Calls: 5, Failures: uint32(1 + i%4), MinCalls: 20})
	}
	if got = Select(nonSuspects, nil); got[0].Failures != 4 || got[len(got)-1].Failures != 1 {
		t.Fatalf("Select of failing non-suspects: first %d failures, last %d; want the most failures first", got[0].Failures, got[len(got)-1].Failures)
	}
}

func TestConsumerActsOncePerGeneration(t *testing.T) {
	c := NewConsumer()
	now := t0
	g1 := t0.UnixNano()
	first := []Condemned{{Key: ep, Generation: g1}}
	got := c.Fresh(now, first)
	if len(got) != 1 {
		t.Fatalf("first = %v, want it", got)
	}
	if got := c.Fresh(now, first); len(got) != 1 {
		t.Fatalf("not done yet = %v, want it again (not acted on)", got)
	}
	c.Done(now, got[0], true)
	if got := c.Fresh(now, first); len(got) != 0 {
		t.Fatalf("done = %v, want nothing", got)
	}
	if out := c.Out(); out[ep] != g1 {
		t.Fatalf("Out = %v, want ep out for generation %d", out, g1)
	}
	if got := c.Fresh(now, []Condemned{{Key: ep, Generation: g1 + 1}}); len(got) != 1 {
		t.Fatalf("new generation = %v, want it", got)
	}
	c.Done(now, Condemned{Key: ep, Generation: g1 + 1}, false)
	if out := c.Out(); len(out) != 0 {
		t.Fatalf("Out after an ejection the cap held back = %v, want nothing: its window predates the condemnation", out)
	}
	// A stale verdict (an older generation) read after the newer one, even
	// after a gap without any: nothing.
	c.Fresh(now.Add(time.Minute), nil)
	if got := c.Fresh(now.Add(2*time.Minute), first); len(got) != 0 {
		t.Fatalf("older generation after a newer = %v, want nothing", got)
	}
	// A malformed verdict naming a key twice does not flip between them.
	c = NewConsumer()
	dup := []Condemned{{Key: ep, Generation: g1}, {Key: ep, Generation: g1 + 5}}
	for _, x := range c.Fresh(now, dup) {
		c.Done(now, x, true)
	}
	if got := c.Fresh(now, dup); len(got) != 0 {
		t.Fatalf("duplicates = %v, want nothing the second time", got)
	}
}

// Generations only grow for an endpoint, even if the aggregator's clock
// is behind the one that stamped the verdicts it took over: nodes act on
// none older than their last.
func TestGenerationsGrow(t *testing.T) {
	ahead := t0.Add(2 * time.Minute)
	a := NewAggregator()
	a.Seed(t0, Verdicts{Suspects: []Key{ep}, Condemned: []Condemned{{Key: ep, Generation: ahead.UnixNano()}}})
	v := a.Judge(t0, reportsAt(t0, after(diluted(30), ahead.UnixNano()), map[Key]bool{ep: true}), judges)
	if len(v.Condemned) != 1 || v.Condemned[0].Generation <= ahead.UnixNano() {
		t.Fatalf("renewed behind the seeded clock = %+v, want a generation past %d", v, ahead.UnixNano())
	}
}
