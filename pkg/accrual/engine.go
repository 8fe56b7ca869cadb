// SPDX-License-Identifier: Apache-2.0

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

// counters are an endpoint's totals. Per-connection counts are 64-bit
// (suppressed too: a cap that stays full counts one per streak, which can
// be every other connection); those bounded by ejections and probes (at
// most one per penalty) are 32-bit: at one a second they would wrap after
// 136 years, and the narrower struct saves 40 bytes for each of 100,000
// endpoints.
type counters struct {
	successes          uint64
	failures           [kindSlots]uint64
	ignored            uint64
	stragglers         uint64
	overtaken          uint64
	slow               uint64
	suppressed         uint64
	ejections          uint32
	probeSuccesses     uint32
	probeFailures      uint32
	probeInconclusive  uint32
	failOpenRecoveries uint32
	byReason           [numEjectReasons]uint32
}

// endpoint is what every endpoint of a service holds, traffic or not: its
// place, state and streak. What it gathers once it sees traffic (counters,
// its last failure, penalty times) is in act, allocated at its first
// outcome or ejection: at 100,000 endpoints of 10,000 services the table
// holds 48 bytes each, not the 280 it took with everything inline (25 MB
// while no endpoint had seen a connection).
type endpoint struct {
	svc         *service // nil: not part of any service
	mark        uint64   // SetService generation that listed it
	heapIdx     int32    // position in the deadline heap, -1 when not ejected
	consecutive uint32
	state       State
	level       uint8 // failed probes since last ready: penalty doublings
	lastKind    Kind
	// suppressed: rules (bits by ejectReasonIndex) whose due ejection the
	// cap suppressed (and counted) in their current spell of being due.
	suppressed uint8
	// relapse: the penalty level it had when a probe last returned it to
	// ready (activity.returnedAt).
	relapse uint8
	// win: recent connections, for services whose settings judge a window
	// (nil otherwise, so services that do not pay no memory for it).
	win *window
	// act: nil until the endpoint sees an outcome or is ejected; reads go
	// through seen, writes through acts.
	act *activity
}

// activity is what an endpoint gathers once it takes part: counters,
// times, the penalty. Zero is what an endpoint without one has.
type activity struct {
	penalty time.Duration
	// ejectedAt and probationAt leave the engine (transitions, snapshots,
	// pb_health), so they stay times: a live one keeps the wall reading it
	// was decided at and the clock's monotonic one for the deadline heap,
	// a restored one is the record's wall time, as persisted.
	ejectedAt   time.Time
	probationAt time.Time
	lastFailAt  time.Time
	// newestOK: when the newest connection that succeeded began.
	newestOK stamp
	// returnedAt: when a probe last returned the endpoint to ready (its
	// level then is endpoint.relapse). A window rule that ejects it again
	// within a window is a relapse and doubles the penalty: a probe of an
	// endpoint failing 30% of connections succeeds 70% of the time, so
	// without this it would be back every minPenalty.
	returnedAt stamp
	c          counters
}

// idle is the activity of an endpoint that has none: seen's answer, never
// written.
var idle activity

// seen returns ep's activity for reading (idle when it has none). Never
// write through it: acts is for that.
func (ep *endpoint) seen() *activity {
	if ep.act == nil {
		return &idle
	}
	return ep.act
}

// acts returns ep's activity for writing, allocating it the first time.
func (ep *endpoint) acts() *activity {
	if ep.act == nil {
		ep.act = new(activity)
	}
	return ep.act
}

type service struct {
	id   uint32
	name string
	// st: shared with the services whose settings are the same as far as
	// SetService saw (Engine.lastSt); never changed in place. At 10,000
	// services, a copy each took the record from 144 to 320 bytes.
	st            *Settings
	nextOutliers  time.Time // when Advance next judges outliers (Settings.Outliers)
	members       []uint32  // sorted endpoint ids
	count         [numStates]int
	failOpen      bool
	failOpenSince time.Time
	episodes      uint64
}

// maxEndpointID bounds the dense endpoint-id space: ids index a table, and
// an id far beyond the kernel's backend map size is an agent bug that must
// not turn into a multi-gigabyte allocation.
const maxEndpointID = 1<<24 - 1

// Engine is the failure-accrual state of all services. See the package
// documentation for its semantics and concurrency rules.
type Engine struct {
	mu    sync.Mutex
	clk   clock.PassiveClock
	epoch time.Time // what stamps count from
	rnd   func() float64
	eps   endpoints // indexed by endpoint id
	svcs  map[uint32]*service
	heap  []uint32 // ejected endpoint ids, min-heap on probationAt
	// outliers: services whose settings have the outlier rule, judged on
	// their own schedule by Advance.
	outliers map[uint32]*service
	out      []Transition
	gen      uint64
	unknown  uint64
	// lastSt are the settings SetService last gave a service: the next
	// service with the same shares them.
	lastSt *Settings
}

// New returns an empty Engine. rnd must return values in [0, 1) (for
// example rand.New(src).Float64); nil uses math/rand/v2. It is called once
// per ejection, never concurrently.
func New(clk clock.PassiveClock, rnd func() float64) *Engine {
	if rnd == nil {
		rnd = rand.Float64
	}
	return &Engine{
		clk:      clk,
		epoch:    clk.Now(),
		rnd:      rnd,
		svcs:     make(map[uint32]*service),
		outliers: make(map[uint32]*service),
		out:      make([]Transition, 0, 8),
	}
}

// sanitize clamps settings that Validate would reject. The config layers
// validate before they get here; clamping instead of failing keeps a bad
// value from taking down the agent's event loop.
func sanitize(s Settings) Settings {
	s.MaxFailures = min(max(s.MaxFailures, 1), MaxFailuresLimit)
	if s.MinPenalty <= 0 {
		s.MinPenalty = Defaults().MinPenalty
	}
	s.MinPenalty = min(s.MinPenalty, MaxPenaltyLimit)
	s.MaxPenalty = min(max(s.MaxPenalty, s.MinPenalty), MaxPenaltyLimit)
	if s.ConnectTimeout <= 0 {
		s.ConnectTimeout = Defaults().ConnectTimeout
	}
	s.ConnectTimeout = min(s.ConnectTimeout, ConnectTimeoutLimit)
	if !(s.JitterRatio >= 0) { // also NaN
		s.JitterRatio = 0
	}
	if s.JitterRatio > 1 {
		s.JitterRatio = 1
	}
	s.MaxEjectionPercent = min(max(s.MaxEjectionPercent, 0), 100)
	d := Defaults()
	if s.Window < WindowBuckets*time.Millisecond {
		s.Window = d.Window
	}
	s.Window = min(s.Window, WindowLimit)
	s.WindowCalls = min(max(s.WindowCalls, 0), maxWindowCalls)
	s.MinCalls = min(max(s.MinCalls, 1), maxWindowCalls)
	if !(s.FailureRateThreshold > 0 && s.FailureRateThreshold < 1) {
		s.FailureRateThreshold = d.FailureRateThreshold
	}
	s.SlowConnectThreshold = max(s.SlowConnectThreshold, 0)
	if !(s.SlowConnectRateThreshold > 0 && s.SlowConnectRateThreshold < 1) {
		s.SlowConnectRateThreshold = d.SlowConnectRateThreshold
	}
	if !(s.OutlierStdevFactor > 0) || math.IsInf(s.OutlierStdevFactor, 0) {
		s.OutlierStdevFactor = d.OutlierStdevFactor
	}
	s.OutlierMinHosts = min(max(s.OutlierMinHosts, 2), maxWindowCalls)
	s.OutlierMinCalls = min(max(s.OutlierMinCalls, 1), maxWindowCalls)
	return s
}

// grow makes id a valid index into e.eps.
func (e *Engine) grow(id uint32) {
	if id > maxEndpointID {
		panic(fmt.Sprintf("accrual: endpoint id %d exceeds %d; ids must be dense", id, maxEndpointID))
	}
	e.eps.grow(id)
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
		a := ep.seen()
		t.Penalty, t.ProbationAt = a.penalty, a.probationAt
	}
	e.out = append(e.out, t)
}

// eject draws the penalty for ep's current level and moves it to ejected.
func (e *Engine) eject(s *service, id uint32, ep *endpoint, r Reason, kind Kind, now, failAt time.Time) {
	from := ep.state
	a := ep.acts()
	a.penalty = e.drawPenalty(basePenalty(s.st, ep.level), s.st.JitterRatio)
	a.ejectedAt = now
	a.probationAt = now.Add(a.penalty)
	ep.suppressed = 0
	a.returnedAt, ep.relapse = 0, 0 // trip has used them
	a.c.ejections++
	a.c.byReason[ejectReasonIndex(r)]++
	var seen tally
	if ep.win != nil {
		seen = ep.win.sum
		ep.win.clear() // what it held led here; the next judgement starts afresh
	}
	e.setState(s, id, ep, Ejected)
	e.emit(s, id, ep, from, r, kind, now, failAt)
	e.out[len(e.out)-1].Window = seen.snapshot()
	e.updateFailOpen(s, id, now)
}

// trip ejects ep for reason r, unless the max-ejection cap is full: then it
// stays ready and one ReasonEjectionSuppressed is emitted per streak (or
// per spell of a window rule being due). threshold is the window rule's
// limit the endpoint passed (0 for the consecutive rule), for the record.
func (e *Engine) trip(s *service, id uint32, ep *endpoint, r Reason, kind Kind, now, failAt time.Time, threshold float64) {
	if failAt.IsZero() {
		failAt = now
	}
	if s.count[Ejected]+s.count[Probation]+1 > EjectionCap(len(s.members), s.st.MaxEjectionPercent) {
		if bit := ruleBit(r); ep.suppressed&bit == 0 {
			ep.suppressed |= bit
			ep.acts().c.suppressed++
			e.emit(s, id, ep, Ready, ReasonEjectionSuppressed, kind, now, failAt)
			t := &e.out[len(e.out)-1]
			t.Cause, t.Threshold = r, threshold
			if ep.win != nil {
				t.Window = ep.win.sum.snapshot()
			}
		}
		return
	}
	if ret := ep.seen().returnedAt; r != ReasonConsecutiveFailures && ret != 0 && time.Duration(e.stamp(now)-ret) < s.st.Window {
		l := clampLevel(s.st, ep.relapse)
		if basePenalty(s.st, l) < s.st.MaxPenalty {
			l++
		}
		// Condemn may have set a level already: the fleet's count of
		// condemnations in a row is one of relapses too, not on top.
		ep.level = max(ep.level, l)
	}
	i := len(e.out) // eject may append a fail-open start after it
	e.eject(s, id, ep, r, kind, now, failAt)
	e.out[i].Threshold = threshold
}

// ruleBit is rule r's bit in endpoint.suppressed.
func ruleBit(r Reason) uint8 { return 1 << ejectReasonIndex(r) }

// threshold is the limit of window rule r under s.
func threshold(s *Settings, r Reason) float64 {
	switch r {
	case ReasonFailureRate:
		return s.FailureRateThreshold
	case ReasonSlowConnects:
		return s.SlowConnectRateThreshold
	}
	return 0
}

// toReady returns ep to ready with a fresh streak and penalty level.
func (e *Engine) toReady(s *service, id uint32, ep *endpoint, r Reason, now time.Time) {
	from := ep.state
	ep.consecutive = 0
	ep.level = 0
	if a := ep.act; a != nil { // one that was ejected or in probation has one
		a.penalty = 0
		a.ejectedAt, a.probationAt = time.Time{}, time.Time{}
		a.returnedAt = 0 // a probe's success sets it after this
	}
	ep.suppressed = 0
	ep.relapse = 0
	// The window needs no clearing: it was cleared on ejection and takes
	// nothing while out, so the endpoint is judged afresh from its return.
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
	if int(o.Endpoint) >= e.eps.len() {
		e.unknown++
		return nil
	}
	id := o.Endpoint
	ep := e.eps.at(id)
	s := ep.svc
	if s == nil {
		e.unknown++
		return nil
	}
	if o.Inconclusive {
		if ep.state == Probation && o.Probe {
			ep.acts().c.probeInconclusive++
			e.emit(s, id, ep, Probation, ReasonProbeInconclusive, 0, e.clk.Now(), o.At)
			return e.result()
		}
		return nil
	}
	slow := o.Success && s.st.SlowConnectThreshold > 0 && o.Handshake >= s.st.SlowConnectThreshold
	counted := false
	a := ep.acts() // its first outcome allocates it, once
	if o.Success {
		a.c.successes++
		if slow {
			a.c.slow++
		}
		if st := e.stamp(o.Started); st > a.newestOK {
			a.newestOK = st
		}
	} else {
		a.c.failures[kindSlot(o.Kind)]++
		ep.lastKind, a.lastFailAt = o.Kind, o.At
		if s.st.FailureKinds.Has(o.Kind) {
			counted = true
		} else {
			a.c.ignored++
		}
	}

	switch ep.state {
	case Ready:
		if !o.Success && !counted {
			return nil
		}
		streak := false
		if o.Success {
			ep.consecutive = 0
		} else if !o.Started.IsZero() && e.stamp(o.Started) < a.newestOK {
			// A connection that began before the newest one that succeeded is
			// no part of a streak of failures: the endpoint has served since.
			// (A timeout is decided a connect timeout after its SYN, after the
			// successes of connections that began later.) It is still one of
			// the window's failures.
			a.c.overtaken++
		} else {
			if ep.consecutive < math.MaxUint32 { // saturate: mode none counts forever
				ep.consecutive++
			}
			streak = s.st.Mode.Consecutive() && ep.consecutive >= uint32(s.st.MaxFailures)
		}
		rateOver, slowOver := false, false
		if ep.win != nil {
			// The window reads the clock only when the outcome has no time.
			at := o.At
			if at.IsZero() {
				at = e.clk.Now()
			}
			ep.win.add(s.st, at, !o.Success, slow)
			rateOver, slowOver = windowDue(s.st, ep.win)
		}
		// A rule's spell of being due, and so its one suppression, ends
		// when it is no longer due: a streak at a success, a window rule
		// when its share falls back.
		if o.Success {
			ep.suppressed &^= ruleBit(ReasonConsecutiveFailures)
		}
		if !rateOver {
			ep.suppressed &^= ruleBit(ReasonFailureRate)
		}
		if !slowOver {
			ep.suppressed &^= ruleBit(ReasonSlowConnects)
		}
		var r Reason
		switch {
		case streak:
			r = ReasonConsecutiveFailures
		case rateOver:
			r = ReasonFailureRate
		case slowOver:
			r = ReasonSlowConnects
		default:
			return nil
		}
		// Due. Everything below runs at most once per outcome of an
		// endpoint that a rule ejects, so the clock is read here and not on
		// the common path.
		kind := o.Kind
		if o.Success {
			kind = 0
		}
		e.trip(s, id, ep, r, kind, e.clk.Now(), o.At, threshold(s.st, r))

	case Probation:
		switch {
		case o.Probe && o.Success:
			a.c.probeSuccesses++
			now := e.clk.Now()
			level := ep.level
			e.toReady(s, id, ep, ReasonProbeSucceeded, now)
			if ep.win != nil {
				a.returnedAt, ep.relapse = e.stamp(now), level
			}
		case o.Probe && counted:
			a.c.probeFailures++
			if ep.consecutive < math.MaxUint32 {
				ep.consecutive++
			}
			if basePenalty(s.st, ep.level) < s.st.MaxPenalty {
				ep.level++
			}
			now := e.clk.Now()
			failAt := o.At
			if failAt.IsZero() {
				failAt = now
			}
			e.eject(s, id, ep, ReasonProbeFailed, o.Kind, now, failAt)
		case o.Probe:
			a.c.probeInconclusive++
			now := e.clk.Now()
			e.emit(s, id, ep, Probation, ReasonProbeInconclusive, o.Kind, now, o.At)
		case o.Success && s.failOpen:
			a.c.failOpenRecoveries++
			e.toReady(s, id, ep, ReasonFailOpenSuccess, e.clk.Now())
		default:
			a.c.stragglers++
		}

	case Ejected:
		// A Probe flag here is a stale probe (the endpoint already failed
		// its one probe), so it is a straggler like any other.
		if o.Success && s.failOpen {
			a.c.failOpenRecoveries++
			e.toReady(s, id, ep, ReasonFailOpenSuccess, e.clk.Now())
		} else {
			a.c.stragglers++
		}
	}
	return e.result()
}

// Advance moves every ejected endpoint whose penalty has ended by the
// clock's now to probation, and judges the outliers of the services whose
// turn it is. The result is valid until the next mutating call.
func (e *Engine) Advance() []Transition {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.out = e.out[:0]
	now := e.clk.Now()
	for len(e.heap) > 0 {
		id := e.heap[0]
		ep := e.eps.at(id)
		if ep.seen().probationAt.After(now) {
			break
		}
		e.setState(ep.svc, id, ep, Probation)
		e.emit(ep.svc, id, ep, Ejected, ReasonPenaltyOver, 0, now, time.Time{})
		// Probation is not ready: fail-open cannot change here.
	}
	for _, s := range e.outliers {
		if s.nextOutliers.After(now) {
			continue
		}
		e.judgeOutliers(s, now)
		s.nextOutliers = now.Add(width(s.st))
	}
	return e.result()
}

// NextDeadline returns the earliest time at which Advance has work: the
// soonest probation time of an ejected endpoint, or the next judgement of
// a service's outliers. ok is false when there is neither. The time may be in the past (call Advance now).
func (e *Engine) NextDeadline() (t time.Time, ok bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.heap) > 0 {
		t, ok = e.eps.at(e.heap[0]).seen().probationAt, true
	}
	for _, s := range e.outliers {
		if !ok || s.nextOutliers.Before(t) {
			t, ok = s.nextOutliers, true
		}
	}
	return t, ok
}

// UnknownOutcomes counts outcomes for endpoint ids that belong to no
// service (typically flows of endpoints removed since).
func (e *Engine) UnknownOutcomes() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.unknown
}
