// SPDX-License-Identifier: Apache-2.0

// Package fleet judges endpoints on the evidence of every node, for the
// endpoints that each node alone sees too little of to judge (the
// distributed pod dilemma: fifty client nodes each see a fiftieth of an
// endpoint's failures, and none reaches the window's minimum volume).
//
// It is the decision logic only, with no Kubernetes types: a node selects
// what it reports (Select), the one aggregator sums every node's reports
// and condemns endpoints (Aggregator), and every node acts once on each
// condemnation (Consumer). pkg/k8s carries reports and verdicts through the
// API; docs/fleet-evidence.md gives the design and its costs.
//
// Reports must not bias the rate they are judged on: a node that reported
// only endpoints it saw fail would leave out the nodes that saw only
// successes, and five nodes each reporting one call and one failure would
// read as 100% for an endpoint that fails 1% of the fleet's calls. So a
// failure only makes an endpoint a suspect; once the aggregator lists it as
// one, every node reports all its calls to it, failed or not, and only
// those counts are judged.
package fleet

import (
	"cmp"
	"hash/fnv"
	"math"
	"net/netip"
	"slices"
	"time"
)

// Key names one endpoint of one service.
type Key struct {
	Service string // the agent's service name, "ns/svc:port"
	Addr    netip.AddrPort
}

func (k Key) String() string { return k.Service + " " + k.Addr.String() }

// Count is what one node saw of an endpoint over its window.
type Count struct {
	Key
	Calls, Failures uint32
	// Suspect: reported because the fleet lists the endpoint as a suspect,
	// so the node reports it whether or not any call failed. Only such
	// counts are judged.
	Suspect bool
	// Acted is the condemnation (its generation) after which this node's
	// window began: it ejected the endpoint for it, or held it out already,
	// so the window holds only calls made since. 0: none.
	Acted int64
}

// Report is one node's counts, written at At and valid until Expires.
type Report struct {
	Node    string
	At      time.Time
	Expires time.Time
	Counts  []Count
}

// Judge is how a service's endpoints are judged: its window rule's
// settings and its endpoints as the aggregator's node knows them (counts
// for any other address are ignored). A service absent from the
// aggregator's judges is not judged (not windowed, or fleet evidence off).
type Judge struct {
	Window    time.Duration
	MinCalls  int
	Threshold float64 // the failure rate over which an endpoint is condemned
	Endpoints map[netip.AddrPort]bool
}

// Condemned is an endpoint the fleet's evidence ejects.
type Condemned struct {
	Key
	// Generation tells condemnations apart: a node acts on each once. It is
	// the time of the condemnation in Unix nanoseconds, so that a new
	// aggregator never reuses one of its predecessor's.
	Generation int64
	// Level counts the condemnations of the endpoint in a row (0 the
	// first): a node ejects it with the penalty of that many doublings at
	// least, as it would a local relapse.
	Level           int
	Calls, Failures uint32 // the fleet's sum over one window
	Nodes           int    // how many nodes' counts the sum holds
}

// Verdicts are the aggregator's conclusions.
type Verdicts struct {
	Suspects  []Key
	Condemned []Condemned
}

// MaxCounts caps one report: 1,000 entries of about 100 bytes each keep it
// near 100 kB, far below etcd's 1.5 MiB object limit.
const MaxCounts = 1000

// Window is a node's view of one endpoint it can report: its window's
// tally and the minimum volume its service judges on.
type Window struct {
	Key
	Calls, Failures uint32
	MinCalls        int
	Acted           int64 // see Count.Acted
}

// Select picks what a node reports: every endpoint the fleet suspects that
// it called, and the endpoints it saw fail but cannot judge alone (fewer
// calls than MinCalls). An endpoint a node can judge alone is judged
// alone. At most MaxCounts entries: suspects first, in an order that does
// not depend on their counts (cutting the healthiest would bias the
// fleet's rate), then the most failures.
func Select(ws []Window, suspects map[Key]bool) []Count {
	var out []Count
	for _, w := range ws {
		switch {
		case w.Calls == 0:
		case suspects[w.Key]:
			out = append(out, Count{Key: w.Key, Calls: w.Calls, Failures: w.Failures, Suspect: true, Acted: w.Acted})
		case w.Failures > 0 && int(w.Calls) < w.MinCalls:
			out = append(out, Count{Key: w.Key, Calls: w.Calls, Failures: w.Failures})
		}
	}
	slices.SortFunc(out, func(a, b Count) int {
		if a.Suspect != b.Suspect {
			if a.Suspect {
				return -1
			}
			return 1
		}
		if a.Suspect {
			return cmp.Or(cmp.Compare(keyHash(a.Key), keyHash(b.Key)), compareKeys(a.Key, b.Key))
		}
		return cmp.Or(cmp.Compare(b.Failures, a.Failures), compareKeys(a.Key, b.Key))
	})
	if len(out) > MaxCounts {
		out = out[:MaxCounts]
	}
	return out
}

func keyHash(k Key) uint64 {
	h := fnv.New64a()
	h.Write([]byte(k.Service))
	b, _ := k.Addr.MarshalBinary()
	h.Write(b)
	return h.Sum64()
}

// Timings of the aggregator's judgement.
const (
	// clockSkew: a report claiming to be written further in the future is
	// not believed.
	clockSkew = time.Minute
	// levelMemory is how long the aggregator remembers an endpoint's
	// condemnations in a row after the last one ended.
	levelMemory = 10 * time.Minute
	// MaxLevel bounds Condemned.Level: 2^16 times minPenalty is past any
	// maxPenalty.
	MaxLevel = 16
	// weightCap: one node's calls count at most this many times the median
	// node's, so one node's flood of successes cannot hide a failing
	// endpoint, nor its flood of failures condemn one.
	weightCap = 4
)

// suspect is what the aggregator holds of one suspect.
type suspect struct {
	since     time.Time
	condemned *Condemned
	// acted: some node reported counts taken after the condemnation (it
	// took the endpoint out), or none calls it any more (all hold it out):
	// only then is a drop a relapse to remember.
	acted bool
}

// Aggregator sums every node's reports. Only one agent runs it (the holder
// of a Lease); it keeps suspects between calls, and a new holder seeds it
// from the verdicts in force (Seed).
type Aggregator struct {
	suspects map[Key]*suspect
	// cooling: endpoints acquitted or dropped, and when: no failure makes
	// them suspects again until a window later, or a failing background
	// would keep an endpoint suspected (and reported by every node) for
	// ever.
	cooling map[Key]time.Time
	// levels: the last condemnation's level and when it ended, so that a
	// relapse after a penalty doubles it.
	levels map[Key]memory
	// gens: the last generation given each endpoint, so that the next one
	// exceeds it whatever the clock (nodes act on none older than the last
	// they acted on), kept as long as the nodes remember theirs.
	gens map[Key]memory
}

type memory struct {
	level int
	gen   int64
	at    time.Time
}

// generation is the next generation for k at now: now, or one past the
// last one k was given.
func (a *Aggregator) generation(k Key, now time.Time) int64 {
	g := max(now.UnixNano(), a.gens[k].gen+1)
	a.gens[k] = memory{gen: g, at: now}
	return g
}

// NewAggregator returns an aggregator with no suspects.
func NewAggregator() *Aggregator {
	return &Aggregator{suspects: map[Key]*suspect{}, cooling: map[Key]time.Time{}, levels: map[Key]memory{}, gens: map[Key]memory{}}
}

// Seed takes over the verdicts in force (a predecessor's), so that a
// change of aggregator neither re-condemns what stands nor forgets it.
func (a *Aggregator) Seed(now time.Time, v Verdicts) {
	for _, k := range v.Suspects {
		if a.suspects[k] == nil {
			a.suspects[k] = &suspect{since: now}
		}
	}
	for _, c := range v.Condemned {
		c := c
		c.Level = min(max(c.Level, 0), MaxLevel)
		a.suspects[c.Key] = &suspect{since: now, condemned: &c}
		if c.Generation > a.gens[c.Key].gen {
			a.gens[c.Key] = memory{gen: c.Generation, at: now}
		}
	}
}

// tally holds one endpoint's counts, one per node, for a judgement that
// no single node decides.
type tally struct {
	counts []Count
}

func (t *tally) add(c Count) { t.counts = append(t.counts, c) }

// verdict is what a tally says under j. No single node's report condemns
// an endpoint, and with four nodes or more none acquits one either: the
// rate judged leaves out the node whose failures exceed the threshold's
// share of its calls the most (the strongest accusation) and, with four
// nodes or more, the node whose successes pull the rate down the most (the
// strongest defence); each node's calls count at most weightCap times the
// median node's (its failures scaled alike), with three nodes or more.
// Enough: the nodes judged hold MinCalls calls. calls, failures and nodes
// are the sum's after the weight cap, for the record.
func (t *tally) verdict(j Judge) (condemns, acquits bool, calls, failures uint32, nodes int) {
	if t == nil || len(t.counts) < 2 {
		return false, false, 0, 0, 0
	}
	cs := slices.Clone(t.counts)
	if len(cs) >= 3 {
		all := make([]uint32, len(cs))
		for i, c := range cs {
			all[i] = c.Calls
		}
		slices.Sort(all)
		limit := uint64(all[len(all)/2]) * weightCap
		for i, c := range cs {
			if uint64(c.Calls) > limit {
				cs[i].Failures = uint32(uint64(c.Failures) * limit / uint64(c.Calls))
				cs[i].Calls = uint32(limit)
			}
		}
	}
	excess := func(c Count) float64 { return float64(c.Failures) - j.Threshold*float64(c.Calls) }
	accuser, defender := 0, -1
	var sumC, sumF uint64 // exact: a uint32 sum of many nodes could saturate
	for i, c := range cs {
		sumC += uint64(c.Calls)
		sumF += uint64(c.Failures)
		if excess(c) > excess(cs[accuser]) {
			accuser = i
		}
	}
	calls, failures = uint32(min(sumC, math.MaxUint32)), uint32(min(sumF, math.MaxUint32))
	if len(cs) >= 4 {
		for i, c := range cs {
			if i != accuser && (defender < 0 || excess(c) < excess(cs[defender])) {
				defender = i
			}
		}
	}
	jc, jf := sumC-uint64(cs[accuser].Calls), sumF-uint64(cs[accuser].Failures)
	if defender >= 0 {
		jc, jf = jc-uint64(cs[defender].Calls), jf-uint64(cs[defender].Failures)
	}
	if jc < uint64(j.MinCalls) {
		return false, false, calls, failures, len(cs)
	}
	rate := jc > 0 && float64(jf) > j.Threshold*float64(jc)
	return rate, !rate, calls, failures, len(cs)
}

// Judge judges reports at now with each service's judge. Counts are
// judged while their report is unexpired and at most two windows old, one
// per node and endpoint.
//   - A failure makes its endpoint a suspect (unless it was acquitted or
//     dropped less than a window ago).
//   - A suspect is judged on the counts nodes reported because it is one
//     (tally.verdict: no single node condemns): condemned when they condemn
//     it, acquitted when they acquit it once it has been a suspect for a
//     window (an endpoint that just began to fail still has a window full
//     of its healthy past), dropped after two windows undecided.
//   - A condemnation stands while nodes eject the endpoint; it is judged
//     on the counts of nodes whose windows began after it (Count.Acted:
//     they ejected it for it, so they hold only calls made since its probe
//     returned it): renewed (a new generation, one level up: the nodes
//     eject it again with a doubled penalty) when they condemn it,
//     acquitted when they acquit it a window on, dropped two windows on
//     undecided (its level remembered only if the nodes hold it out).
func (a *Aggregator) Judge(now time.Time, reports []Report, judges map[string]Judge) Verdicts {
	sums := map[Key]*tally{}
	fresh := map[Key]*tally{} // condemned endpoints: counts from windows begun after the condemnation
	add := func(m map[Key]*tally, c Count) {
		t := m[c.Key]
		if t == nil {
			t = &tally{}
			m[c.Key] = t
		}
		t.add(c)
	}
	var failed []Key
	for _, r := range reports {
		if !r.Expires.After(now) || r.At.After(now.Add(clockSkew)) {
			continue
		}
		seen := make(map[Key]bool, len(r.Counts))
		for _, c := range r.Counts {
			j, ok := judges[c.Service]
			if !ok || !j.Endpoints[c.Addr] || c.Calls == 0 || c.Failures > c.Calls || seen[c.Key] || now.Sub(r.At) > 2*j.Window {
				continue
			}
			seen[c.Key] = true
			sp := a.suspects[c.Key]
			if sp == nil {
				if c.Failures > 0 {
					failed = append(failed, c.Key)
				}
				continue
			}
			// Only a published suspect's marked counts: a node cannot make
			// its counts judged by marking them.
			if !c.Suspect {
				continue
			}
			add(sums, c)
			if sp.condemned != nil && c.Acted == sp.condemned.Generation {
				add(fresh, c)
			}
		}
	}
	for k, at := range a.cooling {
		if j, ok := judges[k.Service]; !ok || now.Sub(at) >= j.Window {
			delete(a.cooling, k)
		}
	}
	for k, m := range a.levels {
		if now.Sub(m.at) >= levelMemory {
			delete(a.levels, k)
		}
	}
	for k, m := range a.gens {
		if _, live := a.suspects[k]; !live && now.Sub(m.at) >= levelMemory {
			delete(a.gens, k)
		}
	}
	for _, k := range failed {
		if _, cool := a.cooling[k]; !cool && a.suspects[k] == nil {
			a.suspects[k] = &suspect{since: now}
		}
	}
	var v Verdicts
	for k, sp := range a.suspects {
		j, ok := judges[k.Service]
		if !ok || !j.Endpoints[k.Addr] {
			delete(a.suspects, k)
			continue
		}
		if c := sp.condemned; c != nil {
			at := time.Unix(0, c.Generation)
			if fresh[k] != nil {
				sp.acted = true
			}
			condemns, acquits, calls, failures, nodes := fresh[k].verdict(j)
			switch {
			case condemns:
				*c = Condemned{Key: k, Generation: a.generation(k, now), Level: min(c.Level+1, MaxLevel),
					Calls: calls, Failures: failures, Nodes: nodes}
				sp.acted = false
			case acquits && now.Sub(at) >= j.Window:
				a.end(k, sp, now, true)
				continue
			case now.Sub(at) >= 2*j.Window:
				// Nobody calls it: the nodes hold it out. Calls, but none
				// from a node that acted: the cap held every ejection back.
				sp.acted = sp.acted || sums[k] == nil
				a.end(k, sp, now, false)
				continue
			}
		} else {
			condemns, acquits, calls, failures, nodes := sums[k].verdict(j)
			switch {
			case condemns:
				level := 0
				if m, ok := a.levels[k]; ok {
					level = min(m.level+1, MaxLevel)
				}
				sp.condemned = &Condemned{Key: k, Generation: a.generation(k, now), Level: level,
					Calls: calls, Failures: failures, Nodes: nodes}
			case acquits && now.Sub(sp.since) >= j.Window:
				delete(a.suspects, k) // acquitted
				a.cooling[k] = now
				continue
			case now.Sub(sp.since) >= 2*j.Window:
				delete(a.suspects, k) // too little traffic fleet-wide to judge
				a.cooling[k] = now
				continue
			}
		}
		v.Suspects = append(v.Suspects, k)
		if sp.condemned != nil {
			v.Condemned = append(v.Condemned, *sp.condemned)
		}
	}
	slices.SortFunc(v.Suspects, compareKeys)
	slices.SortFunc(v.Condemned, func(a, b Condemned) int { return compareKeys(a.Key, b.Key) })
	return v
}

// end closes a condemnation: acquitted (its level is forgotten) or dropped
// undecided. A drop with the nodes holding the endpoint out (some reported
// counts taken after it, or no node reports it any more) remembers the
// level, so that a relapse doubles the penalty; otherwise (nodes kept
// calling it without having acted: the cap held their ejections back) the
// level stays as it was.
func (a *Aggregator) end(k Key, sp *suspect, now time.Time, acquitted bool) {
	delete(a.suspects, k)
	a.cooling[k] = now
	switch {
	case acquitted:
		delete(a.levels, k)
	case sp.acted:
		a.levels[k] = memory{level: sp.condemned.Level, at: now}
	}
}

func compareKeys(a, b Key) int {
	return cmp.Or(cmp.Compare(a.Service, b.Service), a.Addr.Compare(b.Addr))
}

// Consumer remembers which condemnations a node has acted on, so that each
// generation ejects at most once: a probe that succeeds locally returns the
// endpoint even while the verdict that ejected it still stands (a renewal,
// with a new generation, ejects it again). It also remembers whether acting
// took the endpoint out, which the node's counts then say (Count.Acted).
// Not safe for concurrent use.
type Consumer struct {
	acted map[Key]acted
}

type acted struct {
	gen  int64
	out  bool      // the endpoint was out of the table once acted on
	seen time.Time // last in a verdict
}

// actedMemory: how long a key no verdict names is remembered, so that a
// stale verdict read after a newer one (a new aggregator's cache behind
// by a write) is not acted on again.
const actedMemory = 10 * time.Minute

// NewConsumer returns a consumer that has acted on nothing.
func NewConsumer() *Consumer { return &Consumer{acted: map[Key]acted{}} }

// Fresh returns the condemnations in cs newer than the last one acted on
// for their key, one per key (a verdict naming a key twice is malformed:
// the first stands). Mark each one acted on with Done once it is.
func (c *Consumer) Fresh(now time.Time, cs []Condemned) []Condemned {
	var out []Condemned
	seen := make(map[Key]bool, len(cs))
	for _, x := range cs {
		if seen[x.Key] {
			continue
		}
		seen[x.Key] = true
		a, ok := c.acted[x.Key]
		if ok {
			a.seen = now
			c.acted[x.Key] = a
			if x.Generation <= a.gen {
				continue
			}
		}
		out = append(out, x)
	}
	for k, a := range c.acted {
		if !seen[k] && now.Sub(a.seen) >= actedMemory {
			delete(c.acted, k)
		}
	}
	return out
}

// Done marks x acted on at now; out: the endpoint is out of the node's
// table (ejected for it, or already), so its window holds only calls made
// since.
func (c *Consumer) Done(now time.Time, x Condemned, out bool) {
	c.acted[x.Key] = acted{gen: x.Generation, out: out, seen: now}
}

// Out returns, for each endpoint the node took out for a condemnation, that
// condemnation's generation: what its counts carry as Count.Acted.
func (c *Consumer) Out() map[Key]int64 {
	m := make(map[Key]int64, len(c.acted))
	for k, a := range c.acted {
		if a.out {
			m[k] = a.gen
		}
	}
	return m
}
