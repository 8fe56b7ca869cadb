package accrual

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// kindSlots indexes per-kind failure counters: slot 0 collects kinds the
// engine does not know, so a bad event cannot index out of range.
const kindSlots = int(KindResetAfterData) + 1

func kindSlot(k Kind) int {
	if int(k) < kindSlots {
		return int(k)
	}
	return 0
}

type counters struct {
	successes          uint64
	failures           [kindSlots]uint64
	ignored            uint64
	stragglers         uint64
	overtaken          uint64
	ejections          uint64
	probeSuccesses     uint64
	probeFailures      uint64
	probeInconclusive  uint64
	suppressed         uint64
	failOpenRecoveries uint64
}

type endpoint struct {
	svc         *service // nil: not part of any service
	mark        uint64   // SetService generation that listed it
	heapIdx     int32    // position in the deadline heap, -1 when not ejected
	consecutive uint32
	state       State
	level       uint8 // failed probes since last ready: penalty doublings
	lastKind    Kind
	suppressed  bool // this streak's ejection was suppressed (and counted)
	penalty     time.Duration
	ejectedAt   time.Time
	probationAt time.Time
	lastFailAt  time.Time
	// newestOK: when the newest connection that succeeded began.
	newestOK time.Time
	c        counters
}

type service struct {
	id            uint32
	name          string
	st            Settings
	members       []uint32 // sorted endpoint ids
	count         [numStates]int
	failOpen      bool
	failOpenSince time.Time
	episodes      uint64
}

// maxEndpointID bounds the dense endpoint-id space: ids index a slice, and
// an id far beyond the kernel's backend map size is an agent bug that must
// not turn into a multi-gigabyte allocation.
const maxEndpointID = 1<<24 - 1

// Engine is the failure-accrual state of all services. See the package
// documentation for its semantics and concurrency rules.
type Engine struct {
	mu      sync.Mutex
	clk     clock.PassiveClock
	rnd     func() float64
	eps     []endpoint // indexed by endpoint id
	svcs    map[uint32]*service
	heap    []uint32 // ejected endpoint ids, min-heap on probationAt
	out     []Transition
	gen     uint64
	unknown uint64
}

// New returns an empty Engine. rnd must return values in [0, 1) (for
// example rand.New(src).Float64); nil uses math/rand/v2. It is called once
// per ejection, never concurrently.
func New(clk clock.PassiveClock, rnd func() float64) *Engine {
	if rnd == nil {
		rnd = rand.Float64
	}
	return &Engine{
		clk:  clk,
		rnd:  rnd,
		svcs: make(map[uint32]*service),
		out:  make([]Transition, 0, 8),
	}
}

// sanitize clamps settings that Validate would reject. The config layers
// validate before they get here; clamping instead of failing keeps a bad
// value from taking down the agent's event loop.
func sanitize(s Settings) Settings {
	if s.MaxFailures < 1 {
		s.MaxFailures = 1
	}
	if s.MaxFailures > math.MaxUint32 {
		s.MaxFailures = math.MaxUint32
	}
	if s.MinPenalty <= 0 {
		s.MinPenalty = Defaults().MinPenalty
	}
	if s.MaxPenalty < s.MinPenalty {
		s.MaxPenalty = s.MinPenalty
	}
	if !(s.JitterRatio >= 0) { // also NaN
		s.JitterRatio = 0
	}
	if s.JitterRatio > 1 {
		s.JitterRatio = 1
	}
	s.MaxEjectionPercent = min(max(s.MaxEjectionPercent, 0), 100)
	return s
}

// grow makes id a valid index into e.eps.
func (e *Engine) grow(id uint32) {
	if id > maxEndpointID {
		panic(fmt.Sprintf("accrual: endpoint id %d exceeds %d; ids must be dense", id, maxEndpointID))
	}
	if int(id) < len(e.eps) {
		return
	}
	n := max(int(id)+1, 2*len(e.eps), 64)
	n = min(n, maxEndpointID+1)
	grown := make([]endpoint, n)
	copy(grown, e.eps)
	for i := len(e.eps); i < n; i++ {
		grown[i].heapIdx = -1
	}
	e.eps = grown
}

// result returns the transitions gathered by the current call.
func (e *Engine) result() []Transition {
	if len(e.out) == 0 {
		return nil
	}
	return e.out
}

// setState moves ep to state to, keeping the service's counts and the
// deadline heap in step. Callers set probationAt before entering Ejected.
func (e *Engine) setState(s *service, id uint32, ep *endpoint, to State) {
	from := ep.state
	if from == to {
		return
	}
	s.count[from]--
	s.count[to]++
	ep.state = to
	if from == Ejected {
		e.heapRemove(ep.heapIdx)
	}
	if to == Ejected {
		e.heapPush(id)
	}
}

// updateFailOpen starts or ends fail-open when the service's ready count
// says so, emitting the event exactly once per edge.
func (e *Engine) updateFailOpen(s *service, cause uint32, now time.Time) {
	want := len(s.members) > 0 && s.count[Ready] == 0
	if want == s.failOpen {
		return
	}
	s.failOpen = want
	r := ReasonFailOpenEnd
	if want {
		r = ReasonFailOpenStart
		s.episodes++
		s.failOpenSince = now
	} else {
		s.failOpenSince = time.Time{}
	}
	e.out = append(e.out, Transition{Service: s.id, Endpoint: cause, Reason: r, At: now})
}

func (e *Engine) emit(s *service, id uint32, ep *endpoint, from State, r Reason, kind Kind, now, failAt time.Time) {
	t := Transition{
		Service: s.id, Endpoint: id, From: from, To: ep.state, Reason: r,
		Kind: kind, Failures: ep.consecutive, At: now, FailureAt: failAt,
	}
	if ep.state != Ready {
		t.Penalty, t.ProbationAt = ep.penalty, ep.probationAt
	}
	e.out = append(e.out, t)
}

// eject draws the penalty for ep's current level and moves it to ejected.
func (e *Engine) eject(s *service, id uint32, ep *endpoint, r Reason, kind Kind, now, failAt time.Time) {
	from := ep.state
	ep.penalty = e.drawPenalty(basePenalty(&s.st, ep.level), s.st.JitterRatio)
	ep.ejectedAt = now
	ep.probationAt = now.Add(ep.penalty)
	ep.suppressed = false
	ep.c.ejections++
	e.setState(s, id, ep, Ejected)
	e.emit(s, id, ep, from, r, kind, now, failAt)
	e.updateFailOpen(s, id, now)
}

// toReady returns ep to ready with a fresh streak and penalty level.
func (e *Engine) toReady(s *service, id uint32, ep *endpoint, r Reason, now time.Time) {
	from := ep.state
	ep.consecutive = 0
	ep.level = 0
	ep.penalty = 0
	ep.ejectedAt, ep.probationAt = time.Time{}, time.Time{}
	ep.suppressed = false
	e.setState(s, id, ep, Ready)
	e.emit(s, id, ep, from, r, 0, now, time.Time{})
	e.updateFailOpen(s, id, now)
}

// Observe applies one outcome. The result (often nil) is valid until the
// next mutating call. Outcomes for endpoints in no service are counted
// (UnknownOutcomes) and otherwise ignored: they are stragglers of removed
// endpoints. Observe does not allocate unless it appends transitions beyond
// the reused buffer's capacity.
func (e *Engine) Observe(o Outcome) []Transition {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.out = e.out[:0]
	if int(o.Endpoint) >= len(e.eps) {
		e.unknown++
		return nil
	}
	id := o.Endpoint
	ep := &e.eps[id]
	s := ep.svc
	if s == nil {
		e.unknown++
		return nil
	}
	if o.Inconclusive {
		if ep.state == Probation && o.Probe {
			ep.c.probeInconclusive++
			e.emit(s, id, ep, Probation, ReasonProbeInconclusive, 0, e.clk.Now(), o.At)
			return e.result()
		}
		return nil
	}
	counted := false
	if o.Success {
		ep.c.successes++
		if o.Started.After(ep.newestOK) {
			ep.newestOK = o.Started
		}
	} else {
		ep.c.failures[kindSlot(o.Kind)]++
		ep.lastKind, ep.lastFailAt = o.Kind, o.At
		if s.st.FailureKinds.Has(o.Kind) {
			counted = true
		} else {
			ep.c.ignored++
		}
	}

	switch ep.state {
	case Ready:
		if o.Success {
			ep.consecutive = 0
			ep.suppressed = false
			return nil
		}
		if !counted {
			return nil
		}
		// A connection that began before the newest one that succeeded is
		// no part of a streak of failures: the endpoint has served since.
		// (A timeout is decided a connect timeout after its SYN, after the
		// successes of connections that began later.)
		if !o.Started.IsZero() && o.Started.Before(ep.newestOK) {
			ep.c.overtaken++
			return nil
		}
		if ep.consecutive < math.MaxUint32 { // saturate: mode none counts forever
			ep.consecutive++
		}
		if s.st.Mode != ModeConsecutive || ep.consecutive < uint32(s.st.MaxFailures) {
			return nil
		}
		// Due. Everything below runs at most once per failure of an
		// endpoint whose streak reached MaxFailures, so the clock is read here
		// and not on the common path.
		now := e.clk.Now()
		failAt := o.At
		if failAt.IsZero() {
			failAt = now
		}
		if s.count[Ejected]+s.count[Probation]+1 > EjectionCap(len(s.members), s.st.MaxEjectionPercent) {
			if !ep.suppressed {
				ep.suppressed = true
				ep.c.suppressed++
				e.emit(s, id, ep, Ready, ReasonEjectionSuppressed, o.Kind, now, failAt)
			}
			return e.result()
		}
		e.eject(s, id, ep, ReasonConsecutiveFailures, o.Kind, now, failAt)

	case Probation:
		switch {
		case o.Probe && o.Success:
			ep.c.probeSuccesses++
			e.toReady(s, id, ep, ReasonProbeSucceeded, e.clk.Now())
		case o.Probe && counted:
			ep.c.probeFailures++
			if ep.consecutive < math.MaxUint32 {
				ep.consecutive++
			}
			if basePenalty(&s.st, ep.level) < s.st.MaxPenalty {
				ep.level++
			}
			now := e.clk.Now()
			failAt := o.At
			if failAt.IsZero() {
				failAt = now
			}
			e.eject(s, id, ep, ReasonProbeFailed, o.Kind, now, failAt)
		case o.Probe:
			ep.c.probeInconclusive++
			now := e.clk.Now()
			e.emit(s, id, ep, Probation, ReasonProbeInconclusive, o.Kind, now, o.At)
		case o.Success && s.failOpen:
			ep.c.failOpenRecoveries++
			e.toReady(s, id, ep, ReasonFailOpenSuccess, e.clk.Now())
		default:
			ep.c.stragglers++
		}

	case Ejected:
		// A Probe flag here is a stale probe (the endpoint already failed
		// its one probe), so it is a straggler like any other.
		if o.Success && s.failOpen {
			ep.c.failOpenRecoveries++
			e.toReady(s, id, ep, ReasonFailOpenSuccess, e.clk.Now())
		} else {
			ep.c.stragglers++
		}
	}
	return e.result()
}

// Advance moves every ejected endpoint whose penalty has ended by the
// clock's now to probation. The result is valid until the next mutating call.
func (e *Engine) Advance() []Transition {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.out = e.out[:0]
	now := e.clk.Now()
	for len(e.heap) > 0 {
		id := e.heap[0]
		ep := &e.eps[id]
		if ep.probationAt.After(now) {
			break
		}
		e.setState(ep.svc, id, ep, Probation)
		e.emit(ep.svc, id, ep, Ejected, ReasonPenaltyOver, 0, now, time.Time{})
		// Probation is not ready: fail-open cannot change here.
	}
	return e.result()
}

// NextDeadline returns the earliest time at which Advance has work: the
// soonest probation time of an ejected endpoint. ok is false when no
// endpoint is ejected. The time may be in the past (call Advance now).
func (e *Engine) NextDeadline() (t time.Time, ok bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.heap) == 0 {
		return time.Time{}, false
	}
	return e.eps[e.heap[0]].probationAt, true
}

// UnknownOutcomes counts outcomes for endpoint ids that belong to no
// service (typically flows of endpoints removed since).
func (e *Engine) UnknownOutcomes() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.unknown
}
