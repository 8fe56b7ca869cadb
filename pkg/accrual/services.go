// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"slices"
	"time"
)

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
	var old Settings
	if s.st != nil {
		old = *s.st
	}
	if e.lastSt == nil || *e.lastSt != st {
		e.lastSt = &st
	}
	s.st = e.lastSt

	e.gen++
	cause := NoEndpoint
	members := make([]uint32, 0, len(endpoints))
	for _, epID := range endpoints {
		e.grow(epID)
		ep := e.eps.at(epID)
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
		ep := e.eps.at(epID)
		if ep.svc == s && ep.mark != e.gen {
			e.drop(s, epID, ep)
		}
	}
	slices.Sort(members)
	s.members = members

	if !isNew && old != st {
		e.applySettings(s, now)
	}
	e.fitWindows(s, old, now)
	e.updateFailOpen(s, cause, now)
	return e.result()
}

// fitWindows gives s's endpoints a window when its settings judge one and
// takes them away when not; a window of another shape (time- or
// count-based, length) than old's starts empty, since what it holds was
// gathered under other rules. It schedules the outlier rule.
func (e *Engine) fitWindows(s *service, old Settings, now time.Time) {
	want := s.st.Windowed()
	reshaped := old.Window != s.st.Window || old.WindowCalls != s.st.WindowCalls
	for _, id := range s.members {
		ep := e.eps.at(id)
		switch {
		case !want:
			ep.win = nil
		case ep.win == nil:
			ep.win = &window{}
		case reshaped:
			ep.win.clear()
		}
	}
	if want && s.st.Outliers {
		if _, ok := e.outliers[s.id]; !ok || reshaped {
			s.nextOutliers = now.Add(width(s.st))
		}
		e.outliers[s.id] = s
	} else {
		delete(e.outliers, s.id)
	}
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
	e.drop(s, id, e.eps.at(id))
	s.members = slices.DeleteFunc(s.members, func(m uint32) bool { return m == id })
	e.updateFailOpen(s, NoEndpoint, now)
}

// applySettings makes in-flight state agree with changed settings; see the
// package documentation ("Settings change").
func (e *Engine) applySettings(s *service, now time.Time) {
	if s.st.Mode == ModeNone {
		for _, id := range s.members {
			ep := e.eps.at(id)
			if ep.state != Ready {
				e.toReady(s, id, ep, ReasonAccrualDisabled, now)
			}
		}
		return
	}
	limit := maxDrawn(s.st)
	for _, id := range s.members {
		ep := e.eps.at(id)
		ep.level = clampLevel(s.st, ep.level)
		if ep.state != Ejected {
			continue
		}
		a := ep.acts() // it has one: it was ejected
		if end := a.ejectedAt.Add(limit); a.probationAt.After(end) {
			a.probationAt = end
			a.penalty = limit
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
		e.drop(s, epID, e.eps.at(epID))
	}
	s.members = nil
	e.updateFailOpen(s, NoEndpoint, e.clk.Now())
	delete(e.svcs, id)
	delete(e.outliers, id)
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
		switch e.eps.at(id).state {
		case Ready:
			active = append(active, id)
		case Probation:
			probation = append(probation, id)
		}
	}
	return active, probation, false
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

// KernelTripRoom is how many more of a service's endpoints the datapath may
// eject on its own (kernel trips) before the agent has seen them: what the
// max-ejection cap leaves now; 0 while the service fails open or when its
// mode has no consecutive rule.
func (e *Engine) KernelTripRoom(service uint32) int64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := e.svcs[service]
	if s == nil || s.failOpen || !s.st.Mode.Consecutive() {
		return 0
	}
	room := EjectionCap(len(s.members), s.st.MaxEjectionPercent) - s.count[Ejected] - s.count[Probation]
	return int64(max(room, 0))
}

// KernelTripped adopts an ejection the datapath made on its own at a
// failure of kind seen at at: an endpoint still ready is ejected for its
// consecutive failures (the datapath counted MaxFailures of them), under
// the same max-ejection cap and with the same penalty as one decided here.
// Nothing happens when the endpoint is already out; the caller reads the
// endpoint's state after this to know whether the trip stands.
func (e *Engine) KernelTripped(id uint32, kind Kind, at time.Time) []Transition {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.out = e.out[:0]
	s, ep := e.ready(id)
	if s == nil || !s.st.Mode.Consecutive() {
		return nil
	}
	e.trip(s, id, ep, ReasonConsecutiveFailures, kind, e.clk.Now(), at, 0)
	return e.result()
}

// ready returns endpoint id and its service if it is in one and ready
// (nil otherwise). Called with mu held.
func (e *Engine) ready(id uint32) (*service, *endpoint) {
	if int(id) >= e.eps.len() {
		return nil, nil
	}
	ep := e.eps.at(id)
	if ep.svc == nil || ep.state != Ready {
		return nil, nil
	}
	return ep.svc, ep
}

// Excluded tells whether accrual keeps new flows from endpoint id now: it
// is ejected and its service is not failing open.
func (e *Engine) Excluded(id uint32) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if int(id) >= e.eps.len() {
		return false
	}
	ep := e.eps.at(id)
	return ep.svc != nil && ep.state == Ejected && !ep.svc.failOpen
}

// StateOf is an endpoint's accrual state (Ready for an unknown one).
func (e *Engine) StateOf(id uint32) State {
	e.mu.Lock()
	defer e.mu.Unlock()
	if int(id) >= e.eps.len() {
		return Ready
	}
	if ep := e.eps.at(id); ep.svc != nil {
		return ep.state
	}
	return Ready
}
