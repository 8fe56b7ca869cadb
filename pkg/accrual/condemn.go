// SPDX-License-Identifier: Apache-2.0

package accrual

import "time"

// FleetWindow is what one ready endpoint's window holds, for the fleet's
// evidence (pkg/fleet).
type FleetWindow struct {
	Service, Endpoint uint32
	Calls, Failures   uint32
	MinCalls          int
}

// FleetWindows returns the windows of the ready endpoints, with calls in
// them, of the services that judge failure rates on the fleet's evidence
// (Settings.Fleet), as of the clock's now.
func (e *Engine) FleetWindows() []FleetWindow {
	e.mu.Lock()
	defer e.mu.Unlock()
	now := e.clk.Now()
	var out []FleetWindow
	for _, s := range e.svcs {
		if !s.st.Fleet() {
			continue
		}
		for _, id := range s.members {
			ep := e.eps.at(id)
			if ep.state != Ready || ep.win == nil {
				continue
			}
			t := ep.win.view(s.st, now)
			if t.calls == 0 {
				continue
			}
			out = append(out, FleetWindow{Service: s.id, Endpoint: id, Calls: t.calls, Failures: t.failures, MinCalls: s.st.MinCalls})
		}
	}
	return out
}

// Condemn ejects endpoint id, with ReasonFleet, on the fleet's evidence:
// calls and failures summed over every node's window. It does so only if
// the endpoint is ready and its service judges failure rates on the fleet's
// evidence; the ejection cap, penalty and probation are those of any
// ejection. level is the fleet's count of condemnations in a row: the
// penalty has at least that many doublings (a relapse soon after a probe
// returned it doubles it as the window rule's does). The result is valid
// until the next mutating call.
func (e *Engine) Condemn(id uint32, calls, failures uint32, level int) []Transition {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.out = e.out[:0]
	s, ep := e.ready(id)
	if s == nil || !s.st.Fleet() {
		return nil
	}
	ready := ep.level // 0 in ready, but kept exact
	ep.level = max(ep.level, clampLevel(s.st, uint8(min(max(level, 0), 255))))
	// Each condemnation is its own spell of the rule being due: one the
	// cap suppresses is reported, as the first was.
	ep.suppressed &^= ruleBit(ReasonFleet)
	i := len(e.out)
	// No local failure decided it: the reaction is measured from now.
	e.trip(s, id, ep, ReasonFleet, ep.lastKind, e.clk.Now(), time.Time{}, s.st.FailureRateThreshold)
	if ep.state == Ready {
		ep.level = ready // suppressed by the cap: no penalty was drawn
	}
	if i < len(e.out) {
		e.out[i].Window = tally{calls: calls, failures: failures}.snapshot()
	}
	return e.result()
}
