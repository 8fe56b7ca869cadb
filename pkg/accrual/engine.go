package accrual

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// State is an endpoint's accrual state.
type State uint8

const (
	Ready     State = iota // in the table, taking new flows
	Ejected                // out of the table until its penalty ends
	Probation              // back in the table for exactly one probe flow

	numStates
)

var stateNames = [numStates]string{"ready", "ejected", "probation"}

func (s State) String() string {
	if s < numStates {
		return stateNames[s]
	}
	return fmt.Sprintf("state(%d)", uint8(s))
}

// MarshalText makes states readable in JSON (admin API, persisted records).
func (s State) MarshalText() ([]byte, error) {
	if s >= numStates {
		return nil, fmt.Errorf("invalid state %d", uint8(s))
	}
	return []byte(stateNames[s]), nil
}

// UnmarshalText parses the spelling MarshalText produces.
func (s *State) UnmarshalText(b []byte) error {
	for i, name := range stateNames {
		if string(b) == name {
			*s = State(i)
			return nil
		}
	}
	return fmt.Errorf("unknown state %q (want ready, ejected or probation)", b)
}

// Outcome is the classified L4 outcome of one flow to an endpoint.
type Outcome struct {
	Endpoint uint32
	Success  bool      // SYN-ACK seen; Kind is then ignored
	Kind     Kind      // failure kind when !Success
	Probe    bool      // the flow was the probe admitted to an endpoint in probation
	At       time.Time // when the datapath saw it; zero means "now"
}

// Reason says why a transition happened. The set is closed: the constants
// below are all the values the engine produces, so consumers may switch on
// them and use them as metric label values.
type Reason string

const (
	// ready → ejected: MaxFailures consecutive counted failures.
	// Failures and Kind give the streak length and the last failure's kind.
	ReasonConsecutiveFailures Reason = "consecutive-failures"
	// probation → ejected: the probe failed with a counted kind.
	ReasonProbeFailed Reason = "probe-failed"
	// ejected → probation: the penalty ended (Advance).
	ReasonPenaltyOver Reason = "penalty-over"
	// probation → ready: the probe succeeded.
	ReasonProbeSucceeded Reason = "probe-succeeded"
	// ejected|probation → ready: a success while the service failed open.
	ReasonFailOpenSuccess Reason = "fail-open-success"
	// ejected|probation → ready: the service's mode was set to none.
	ReasonAccrualDisabled Reason = "accrual-disabled"
	// any → any: state adopted from a Record by Restore.
	ReasonRestored Reason = "restored"
	// ready → ready: an ejection was due but MaxEjectionPercent was full.
	// Not a state change; emitted once per failure streak.
	ReasonEjectionSuppressed Reason = "ejection-suppressed"
	// probation → probation: the probe failed with a kind that does not
	// count; the agent should grant the endpoint a fresh probe.
	ReasonProbeInconclusive Reason = "probe-inconclusive"
	// Service-level: no endpoint is ready, the table holds all endpoints.
	// From and To are meaningless (zero).
	ReasonFailOpenStart Reason = "fail-open-start"
	// Service-level: an endpoint is ready again (or none is left).
	ReasonFailOpenEnd Reason = "fail-open-end"
)

// NoEndpoint is Transition.Endpoint for a service-level transition that no
// single endpoint's state change caused (a change of the endpoint set).
const NoEndpoint = ^uint32(0)

// Transition reports a state change of one endpoint or, for
// ReasonFailOpenStart/End, of a service's fail-open status.
type Transition struct {
	Service  uint32
	Endpoint uint32 // for fail-open events: the endpoint that caused it, or NoEndpoint
	From, To State
	Reason   Reason
	Kind     Kind   // failure kind behind an ejection, suppression or inconclusive probe
	Failures uint32 // the endpoint's consecutive counted failures at the decision
	// Penalty and ProbationAt describe the penalty drawn on entering
	// ejected (also set for restored ejected/probation endpoints).
	Penalty     time.Duration
	ProbationAt time.Time
	At          time.Time // engine clock time of the decision
	// FailureAt is the failure that caused an ejection or suppression (the
	// N-th failure's or the failed probe's own timestamp), so At-FailureAt
	// is the reaction time.
	FailureAt time.Time
}

// ServiceLevel reports whether t is a fail-open start or end rather than an
// endpoint's state change.
func (t Transition) ServiceLevel() bool {
	return t.Reason == ReasonFailOpenStart || t.Reason == ReasonFailOpenEnd
}

// String renders t for logs, e.g. "svc 3 ep 7: ready → ejected (7
// consecutive failures (refused), penalty 1.2s)". It allocates; the engine
// never calls it.
func (t Transition) String() string {
	switch t.Reason {
	case ReasonFailOpenStart:
		return fmt.Sprintf("svc %d: fail-open started (no endpoint ready)", t.Service)
	case ReasonFailOpenEnd:
		return fmt.Sprintf("svc %d: fail-open ended", t.Service)
	}
	var why string
	switch t.Reason {
	case ReasonConsecutiveFailures:
		why = fmt.Sprintf("%d consecutive failures (%v)", t.Failures, t.Kind)
	case ReasonProbeFailed:
		why = fmt.Sprintf("probe failed (%v)", t.Kind)
	case ReasonEjectionSuppressed:
		why = fmt.Sprintf("ejection suppressed: max-ejection-percent (%d consecutive failures (%v))", t.Failures, t.Kind)
	case ReasonProbeInconclusive:
		why = fmt.Sprintf("probe inconclusive (%v does not count)", t.Kind)
	default:
		why = string(t.Reason)
	}
	if t.To == Ejected {
		why += fmt.Sprintf(", penalty %v", t.Penalty)
	}
	return fmt.Sprintf("svc %d ep %d: %v → %v (%s)", t.Service, t.Endpoint, t.From, t.To, why)
}

// EjectionCap is how many of a service's n endpoints may be ejected or in
// probation at once: floor(n·pct/100).
//
// Envoy documents max_ejection_percent as "will eject at least one host
// regardless of the value", but its implementation (ejectHost in
// outlier_detection_impl.cc) ejects only while 100·(ejected+1)/n ≤ pct —
// this same floor — and Envoy 1.31 added the opt-in always_eject_one_host
// (default false) for the at-least-one behaviour. We follow the
// implementation and do not eject a floor of one: the cap is a safety limit
// an operator sets to protect capacity, so 0 must mean never eject and 10%
// of 5 endpoints ejects none; silently exceeding the cap for small services
// is the surprise Envoy's users hit. The default is 100, so services get
// ejection unless the operator asks for a cap. Endpoints in probation count
// because they take at most one flow.
func EjectionCap(n, pct int) int {
	if n <= 0 || pct <= 0 {
		return 0
	}
	if pct >= 100 {
		return n
	}
	return n * pct / 100
}

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
	c           counters
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

// basePenalty is MinPenalty doubled level times, capped at MaxPenalty.
func basePenalty(s *Settings, level uint8) time.Duration {
	p := s.MinPenalty
	for range level {
		if p >= s.MaxPenalty/2 {
			return s.MaxPenalty
		}
		p *= 2
	}
	return min(p, s.MaxPenalty)
}

// clampLevel lowers level to the first one whose base penalty reaches
// MaxPenalty: levels are only ever incremented below the cap, so a higher
// one (kept across a settings change or read from a record) would otherwise
// show a doubling count the settings cannot produce.
func clampLevel(s *Settings, level uint8) uint8 {
	for level > 0 && basePenalty(s, level-1) >= s.MaxPenalty {
		level--
	}
	return level
}

// maxDrawn is the longest penalty the settings can draw; used to clamp
// penalties drawn under other settings or restored from disk.
func maxDrawn(s *Settings) time.Duration {
	f := float64(s.MaxPenalty) * (1 + s.JitterRatio)
	if f >= math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(f)
}

// drawPenalty jitters p uniformly within [p·(1−j), p·(1+j)].
func (e *Engine) drawPenalty(p time.Duration, j float64) time.Duration {
	if j == 0 {
		return p
	}
	r := e.rnd()
	if !(r >= 0) { // NaN or negative from a broken source
		r = 0
	} else if r > 1 {
		r = 1
	}
	return time.Duration(float64(p) * (1 + j*(2*r-1)))
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
	counted := false
	if o.Success {
		ep.c.successes++
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

// SetService creates or updates service id: its name, settings and exact
// endpoint set (endpoints not listed are removed, duplicates ignored).
// The result is valid until the next mutating call.
func (e *Engine) SetService(id uint32, name string, st Settings, endpoints []uint32) []Transition {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.out = e.out[:0]
	now := e.clk.Now()
	st = sanitize(st)
	s := e.svcs[id]
	isNew := s == nil
	if isNew {
		s = &service{id: id}
		e.svcs[id] = s
	}
	s.name = name
	old := s.st
	s.st = st

	e.gen++
	cause := NoEndpoint
	members := make([]uint32, 0, len(endpoints))
	for _, epID := range endpoints {
		e.grow(epID)
		ep := &e.eps[epID]
		if ep.svc == s && ep.mark == e.gen {
			continue // duplicate
		}
		if ep.svc != s {
			if ep.svc != nil {
				e.detach(ep.svc, epID, now)
			}
			*ep = endpoint{svc: s, heapIdx: -1}
			s.count[Ready]++
		}
		ep.mark = e.gen
		members = append(members, epID)
	}
	for _, epID := range s.members {
		ep := &e.eps[epID]
		if ep.svc == s && ep.mark != e.gen {
			e.drop(s, epID, ep)
		}
	}
	slices.Sort(members)
	s.members = members

	if !isNew && old != st {
		e.applySettings(s, now)
	}
	e.updateFailOpen(s, cause, now)
	return e.result()
}

// drop forgets ep's state; the caller fixes s.members.
func (e *Engine) drop(s *service, id uint32, ep *endpoint) {
	s.count[ep.state]--
	if ep.state == Ejected {
		e.heapRemove(ep.heapIdx)
	}
	*ep = endpoint{heapIdx: -1}
}

// detach removes endpoint id from its current service s because another
// service lists it.
func (e *Engine) detach(s *service, id uint32, now time.Time) {
	e.drop(s, id, &e.eps[id])
	s.members = slices.DeleteFunc(s.members, func(m uint32) bool { return m == id })
	e.updateFailOpen(s, NoEndpoint, now)
}

// applySettings makes in-flight state agree with changed settings; see the
// package documentation ("Settings change").
func (e *Engine) applySettings(s *service, now time.Time) {
	if s.st.Mode != ModeConsecutive {
		for _, id := range s.members {
			ep := &e.eps[id]
			if ep.state != Ready {
				e.toReady(s, id, ep, ReasonAccrualDisabled, now)
			}
		}
		return
	}
	limit := maxDrawn(&s.st)
	for _, id := range s.members {
		ep := &e.eps[id]
		ep.level = clampLevel(&s.st, ep.level)
		if ep.state != Ejected {
			continue
		}
		if end := ep.ejectedAt.Add(limit); ep.probationAt.After(end) {
			ep.probationAt = end
			ep.penalty = limit
			e.heapFix(int(ep.heapIdx))
		}
	}
}

// RemoveService forgets service id and all its endpoints' state. If it was
// failing open, the result holds its ReasonFailOpenEnd (Endpoint
// NoEndpoint) so a consumer tracking episodes sees every one end; no
// endpoint transitions are emitted, as for endpoints SetService removes.
// The result is valid until the next mutating call.
func (e *Engine) RemoveService(id uint32) []Transition {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.out = e.out[:0]
	s := e.svcs[id]
	if s == nil {
		return nil
	}
	for _, epID := range s.members {
		e.drop(s, epID, &e.eps[epID])
	}
	s.members = nil
	e.updateFailOpen(s, NoEndpoint, e.clk.Now())
	delete(e.svcs, id)
	return e.result()
}

// Admitted returns what service's table must hold, in endpoint-id order:
// ready endpoints as active and probation endpoints as probation (each
// granted one probe flow), or every endpoint as active while the service
// fails open. An unknown service yields nothing. The slices are the
// caller's.
func (e *Engine) Admitted(service uint32) (active, probation []uint32, failOpen bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := e.svcs[service]
	if s == nil {
		return nil, nil, false
	}
	if s.failOpen {
		return slices.Clone(s.members), nil, true
	}
	active = make([]uint32, 0, s.count[Ready])
	for _, id := range s.members {
		switch e.eps[id].state {
		case Ready:
			active = append(active, id)
		case Probation:
			probation = append(probation, id)
		}
	}
	return active, probation, false
}

// UnknownOutcomes counts outcomes for endpoint ids that belong to no
// service (typically flows of endpoints removed since).
func (e *Engine) UnknownOutcomes() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.unknown
}
