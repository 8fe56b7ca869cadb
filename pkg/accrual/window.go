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

func (t *tally) sub(o tally) {
	t.calls -= o.calls
	t.failures -= o.failures
	t.slow -= o.slow
}

// window holds an endpoint's recent connections in WindowBuckets buckets.
// Time-based, each bucket covers a tenth of Settings.Window and the oldest
// is dropped as time passes it; count-based, each holds a tenth of
// Settings.WindowCalls (rounded up) and the oldest is dropped when the
// newest is full. Either way the window forgets a tenth at a time, so it
// holds between nine tenths and all of its span.
type window struct {
	b     [WindowBuckets]tally
	sum   tally
	cur   uint8
	start time.Time // time-based: when bucket cur began
}

func (w *window) clear() { *w = window{} }

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
		per := uint32((s.WindowCalls + WindowBuckets - 1) / WindowBuckets)
		if w.b[w.cur].calls >= per {
			w.cur = (w.cur + 1) % WindowBuckets
			w.sum.sub(w.b[w.cur])
			w.b[w.cur] = tally{}
		}
	} else {
		w.roll(s, now)
	}
	t := tally{calls: 1}
	if failed {
		t.failures = 1
	} else if slow {
		t.slow = 1
	}
	b := &w.b[w.cur]
	if b.calls == math.MaxUint32 {
		return // saturated: a bucket cannot overflow into nonsense
	}
	b.calls += t.calls
	b.failures += t.failures
	b.slow += t.slow
	w.sum.calls += t.calls
	w.sum.failures += t.failures
	w.sum.slow += t.slow
}

// over reports whether n of calls is a share above threshold. The
// comparison is in counts, so 1 failure in 5 is not above 0.2.
func over(n, calls uint32, threshold float64) bool {
	return float64(n) > threshold*float64(calls)*(1+1e-12)
}

// rateDue returns the window rule that ejects ep now, if any: the failure
// rate first (modes failure-rate and unified), then slow connects.
func rateDue(s *Settings, w *window) Reason {
	if w == nil || w.sum.calls < uint32(s.MinCalls) {
		return ""
	}
	if s.Mode.rate() && over(w.sum.failures, w.sum.calls, s.FailureRateThreshold) {
		return ReasonFailureRate
	}
	if s.SlowConnectThreshold > 0 && over(w.sum.slow, w.sum.calls, s.SlowConnectRateThreshold) {
		return ReasonSlowConnects
	}
	return ""
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
	if s.WindowCalls > 0 || w.start.IsZero() {
		return w.sum
	}
	gone := now.Sub(w.start) / width(s)
	if gone <= 0 {
		return w.sum
	}
	if gone >= WindowBuckets {
		return tally{}
	}
	t := w.sum
	for i := 1; i <= int(gone); i++ {
		t.sub(w.b[(int(w.cur)+i)%WindowBuckets])
	}
	return t
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
		t    tally
	}
	var hosts []host
	for _, id := range s.members {
		ep := &e.eps[id]
		if ep.state != Ready || ep.win == nil {
			continue
		}
		ep.win.roll(&s.st, now)
		t := ep.win.sum
		if t.calls < uint32(s.st.OutlierMinCalls) {
			continue
		}
		hosts = append(hosts, host{id, float64(t.calls-t.failures) / float64(t.calls), t})
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
		if h.rate < limit {
			ep := &e.eps[h.id]
			e.trip(s, h.id, ep, ReasonOutlier, ep.lastKind, now, ep.lastFailAt, limit)
		}
	}
}
