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
}

// Report is one node's counts, valid until Expires.
type Report struct {
	Node    string
	Expires time.Time
	Counts  []Count
}

// Judge is how a service's endpoints are judged: its window rule's
// settings. A service absent from the aggregator's judges is not judged
// (not windowed, or fleet evidence off).
type Judge struct {
	Window    time.Duration
	MinCalls  int
	Threshold float64 // the failure rate over which an endpoint is condemned
}

// Condemned is an endpoint the fleet's evidence ejects.
type Condemned struct {
	Key
	// Generation tells condemnations apart: a node acts on each once. It is
	// the time of the condemnation in Unix nanoseconds, so that a new
	// aggregator never reuses one of its predecessor's.
	Generation      int64
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
}

// Select picks what a node reports: every endpoint the fleet suspects that
// it called, and the endpoints it saw fail but cannot judge alone (fewer
// calls than MinCalls). An endpoint a node can judge alone is judged
// alone. At most MaxCounts entries, suspects first, then the most failures.
func Select(ws []Window, suspects map[Key]bool) []Count {
	var out []Count
	for _, w := range ws {
		switch {
		case w.Calls == 0:
		case suspects[w.Key]:
			out = append(out, Count{Key: w.Key, Calls: w.Calls, Failures: w.Failures, Suspect: true})
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
		if c := cmp.Compare(b.Failures, a.Failures); c != 0 {
			return c
		}
		return cmp.Or(cmp.Compare(a.Service, b.Service), a.Addr.Compare(b.Addr))
	})
	if len(out) > MaxCounts {
		out = out[:MaxCounts]
	}
	return out
}

// suspect is what the aggregator holds of one suspect.
type suspect struct {
	since     time.Time
	condemned *Condemned
}

// Aggregator sums every node's reports. Only one agent runs it (the holder
// of a Lease); it keeps suspects between calls, and a new holder rebuilds
// them from the reports within a window.
type Aggregator struct {
	suspects map[Key]*suspect
}

// NewAggregator returns an aggregator with no suspects.
func NewAggregator() *Aggregator { return &Aggregator{suspects: map[Key]*suspect{}} }

type sum struct {
	calls, failures uint32
	nodes           int
}

// Judge judges reports at now with each service's judge:
//   - a failure in any unexpired report makes its endpoint a suspect;
//   - a suspect whose suspect-marked counts sum to MinCalls is condemned if
//     its failure rate exceeds Threshold, and acquitted (no longer a
//     suspect) if not, once it has been a suspect for a window;
//   - a suspect that reaches neither within two windows is dropped: the
//     fleet does not call it enough to judge;
//   - a condemned endpoint stays condemned, with its generation, while the
//     sum still condemns it; once it does not (the nodes ejected it and
//     their windows emptied), it is dropped, and a relapse after its probe
//     is a new condemnation.
func (a *Aggregator) Judge(now time.Time, reports []Report, judges map[string]Judge) Verdicts {
	sums := map[Key]*sum{}
	for _, r := range reports {
		if !r.Expires.After(now) {
			continue
		}
		for _, c := range r.Counts {
			if _, ok := judges[c.Service]; !ok || c.Calls == 0 || c.Failures > c.Calls {
				continue
			}
			if c.Failures > 0 && a.suspects[c.Key] == nil {
				a.suspects[c.Key] = &suspect{since: now}
			}
			if !c.Suspect {
				continue
			}
			s := sums[c.Key]
			if s == nil {
				s = &sum{}
				sums[c.Key] = s
			}
			s.calls = satAdd(s.calls, c.Calls)
			s.failures = satAdd(s.failures, c.Failures)
			s.nodes++
		}
	}
	var v Verdicts
	for k, sp := range a.suspects {
		j, ok := judges[k.Service]
		if !ok {
			delete(a.suspects, k)
			continue
		}
		s := sums[k]
		switch {
		case s != nil && int(s.calls) >= j.MinCalls && over(s.failures, s.calls, j.Threshold):
			if sp.condemned == nil {
				sp.condemned = &Condemned{Key: k, Generation: now.UnixNano()}
			}
			sp.condemned.Calls, sp.condemned.Failures, sp.condemned.Nodes = s.calls, s.failures, s.nodes
		case sp.condemned != nil:
			delete(a.suspects, k) // served its purpose: the nodes ejected it
			continue
		case s != nil && int(s.calls) >= j.MinCalls && now.Sub(sp.since) >= j.Window:
			// Acquitted, but only once the nodes' windows hold a whole
			// window of the time it has been suspected: an endpoint that
			// just began to fail still has a window full of its healthy
			// past, and acquitting it then would only make the next
			// failure suspect it again, a report interval later.
			delete(a.suspects, k)
			continue
		case now.Sub(sp.since) >= 2*j.Window:
			delete(a.suspects, k) // too little traffic fleet-wide to judge
			continue
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

func compareKeys(a, b Key) int {
	return cmp.Or(cmp.Compare(a.Service, b.Service), a.Addr.Compare(b.Addr))
}

// over reports failures/calls > threshold, as the engine's window rule
// judges it.
func over(failures, calls uint32, threshold float64) bool {
	return calls > 0 && float64(failures) > threshold*float64(calls)
}

func satAdd(a, b uint32) uint32 {
	if s := a + b; s >= a {
		return s
	}
	return ^uint32(0)
}

// Consumer remembers which condemnations a node has acted on, so that each
// generation ejects at most once: a probe that succeeds locally returns the
// endpoint even while the verdict that ejected it still stands.
type Consumer struct {
	acted map[Key]int64
}

// NewConsumer returns a consumer that has acted on nothing.
func NewConsumer() *Consumer { return &Consumer{acted: map[Key]int64{}} }

// Fresh returns the condemnations in cs not acted on yet and marks them
// acted on. Keys no longer condemned are forgotten: their next
// condemnation has a new generation anyway.
func (c *Consumer) Fresh(cs []Condemned) []Condemned {
	var out []Condemned
	seen := make(map[Key]bool, len(cs))
	for _, x := range cs {
		seen[x.Key] = true
		if c.acted[x.Key] == x.Generation {
			continue
		}
		c.acted[x.Key] = x.Generation
		out = append(out, x)
	}
	for k := range c.acted {
		if !seen[k] {
			delete(c.acted, k)
		}
	}
	return out
}
