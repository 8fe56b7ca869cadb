// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"math"
	"time"
)

// tally counts connections: all of them, the counted failures among them,
// and the slow connects among the successes.
type tally struct {
	calls, failures, slow uint32
}

func (t *tally) add(o tally) {
	t.calls += o.calls
	t.failures += o.failures
	t.slow += o.slow
}

func (t *tally) sub(o tally) {
	t.calls -= o.calls
	t.failures -= o.failures
	t.slow -= o.slow
}

// window holds an endpoint's recent connections. Time-based, in
// WindowBuckets buckets of a tenth of Settings.Window each, the oldest
// dropped as time passes it: the window holds between nine tenths and all
// of its span. Count-based, exactly the last Settings.WindowCalls
// connections, one bit each in two rings (failed, slow).
type window struct {
	b     [WindowBuckets]tally
	sum   tally
	cur   uint8
	start time.Time // time-based: when bucket cur began
	// Count-based: the rings, the next position and how many are held.
	failed, slowed []uint64
	next, held     uint32
}

// clear empties w, keeping a count window's rings for reuse.
func (w *window) clear() {
	f, sl := w.failed, w.slowed
	clear(f)
	clear(sl)
	*w = window{failed: f, slowed: sl}
}

// width is a time-based window's bucket length.
func width(s *Settings) time.Duration { return s.Window / WindowBuckets }

// roll drops the buckets that time has passed by now. An outcome older than
// the newest bucket (a timeout is decided after connections that began
// later) goes into the newest: the window is about recent connections, not
// an exact history.
func (w *window) roll(s *Settings, now time.Time) {
	if s.WindowCalls > 0 {
		return
	}
	wd := width(s)
	if w.start.IsZero() {
		w.start = now
		return
	}
	gone := now.Sub(w.start) / wd
	if gone <= 0 {
		return
	}
	if gone >= WindowBuckets {
		w.clear()
		w.start = now
		return
	}
	for range gone {
		w.cur = (w.cur + 1) % WindowBuckets
		w.sum.sub(w.b[w.cur])
		w.b[w.cur] = tally{}
	}
	w.start = w.start.Add(gone * wd)
}

// add counts one connection decided at now.
func (w *window) add(s *Settings, now time.Time, failed, slow bool) {
	if s.WindowCalls > 0 {
		w.addCounted(uint32(s.WindowCalls), failed, slow)
		return
	}
	w.roll(s, now)
	t := tally{calls: 1}
	if failed {
		t.failures = 1
	} else if slow {
		t.slow = 1
	}
	if w.b[w.cur].calls == math.MaxUint32 {
		return // saturated: a bucket cannot overflow into nonsense
	}
	w.b[w.cur].add(t)
	w.sum.add(t)
}

// addCounted puts one connection into a count window of n, pushing out
// the oldest when it holds n.
func (w *window) addCounted(n uint32, failed, slow bool) {
	words := int(n+63) / 64
	if len(w.failed) != words {
		w.failed, w.slowed = make([]uint64, words), make([]uint64, words)
		w.next, w.held, w.sum = 0, 0, tally{}
	}
	i, bit := w.next/64, uint64(1)<<(w.next%64)
	if w.held == n {
		w.sum.calls--
		if w.failed[i]&bit != 0 {
			w.sum.failures--
		}
		if w.slowed[i]&bit != 0 {
			w.sum.slow--
		}
	} else {
		w.held++
	}
	w.failed[i] &^= bit
	w.slowed[i] &^= bit
	w.sum.calls++
	if failed {
		w.failed[i] |= bit
		w.sum.failures++
	} else if slow {
		w.slowed[i] |= bit
		w.sum.slow++
	}
	if w.next++; w.next == n {
		w.next = 0
	}
}

// over reports whether n of calls is a share above threshold. The
// comparison is in counts, so 1 failure in 5 is not above 0.2.
func over(n, calls uint32, threshold float64) bool {
	return float64(n) > threshold*float64(calls)*(1+1e-12)
}

// windowDue reports which window rules w passes now: the failure rate
// (modes failure-rate and unified) and slow connects.
func windowDue(s *Settings, w *window) (rate, slow bool) {
	if w == nil || w.sum.calls < uint32(s.MinCalls) {
		return false, false
	}
	rate = s.Mode.RatesFailures() && over(w.sum.failures, w.sum.calls, s.FailureRateThreshold)
	slow = s.SlowConnectThreshold > 0 && over(w.sum.slow, w.sum.calls, s.SlowConnectRateThreshold)
	return rate, slow
}

// WindowSnapshot is what an endpoint's window holds, as its rules judge it.
type WindowSnapshot struct {
	Calls       uint32  `json:"calls"`
	Failures    uint32  `json:"failures"`
	Slow        uint32  `json:"slow"`
	FailureRate float64 `json:"failureRate"`
	SlowRate    float64 `json:"slowRate"`
}

func (t tally) snapshot() WindowSnapshot {
	ws := WindowSnapshot{Calls: t.calls, Failures: t.failures, Slow: t.slow}
	if t.calls > 0 {
		ws.FailureRate = float64(t.failures) / float64(t.calls)
		ws.SlowRate = float64(t.slow) / float64(t.calls)
	}
	return ws
}

// view is w's tally as of now, without changing w: what roll would leave.
func (w *window) view(s *Settings, now time.Time) tally {
	c := *w
	c.failed, c.slowed = nil, nil // roll never reads them; the copy must not clear w's
	c.roll(s, now)
	return c.sum
}

// judgeOutliers applies the outlier rule to service s at now: among its
// ready endpoints whose windows hold OutlierMinCalls connections, if there
// are OutlierMinHosts of them, it ejects those whose success rate is below
// the mean by more than OutlierStdevFactor standard deviations. When all
// degrade together the deviation stays small and nobody is an outlier.
func (e *Engine) judgeOutliers(s *service, now time.Time) {
	type host struct {
		id   uint32
		rate float64
	}
	var hosts []host
	for _, id := range s.members {
		ep := e.eps.at(id)
		if ep.state != Ready || ep.win == nil {
			continue
		}
		ep.win.roll(s.st, now)
		t := ep.win.sum
		if t.calls < uint32(s.st.OutlierMinCalls) {
			continue
		}
		hosts = append(hosts, host{id, float64(t.calls-t.failures) / float64(t.calls)})
	}
	if len(hosts) < s.st.OutlierMinHosts {
		return
	}
	var mean float64
	for _, h := range hosts {
		mean += h.rate
	}
	mean /= float64(len(hosts))
	var sq float64
	for _, h := range hosts {
		sq += (h.rate - mean) * (h.rate - mean)
	}
	limit := mean - s.st.OutlierStdevFactor*math.Sqrt(sq/float64(len(hosts)))
	for _, h := range hosts {
		ep := e.eps.at(h.id)
		if h.rate < limit {
			e.trip(s, h.id, ep, ReasonOutlier, ep.lastKind, now, ep.seen().lastFailAt, limit)
		} else {
			ep.suppressed &^= ruleBit(ReasonOutlier) // its spell of being an outlier is over
		}
	}
}
