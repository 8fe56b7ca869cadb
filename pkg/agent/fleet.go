package agent

import (
	"github.com/penaltybox/penaltybox/pkg/fleet"
)

// FleetWindows returns what this node can report to the fleet: the windows
// of its ready endpoints in services that judge failure rates on the
// fleet's evidence, named as every node names them.
func (a *Agent) FleetWindows() []fleet.Window {
	ws := a.engine.FleetWindows()
	if len(ws) == 0 {
		return nil
	}
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := make([]fleet.Window, 0, len(ws))
	for _, w := range ws {
		s, ok := a.rec.Service(w.Service)
		b, bok := a.rec.Backend(w.Endpoint)
		if !ok || !bok || !b.RemovedAt.IsZero() {
			continue
		}
		out = append(out, fleet.Window{
			Key:   fleet.Key{Service: s.Spec.Name, Addr: b.Addr},
			Calls: w.Calls, Failures: w.Failures, MinCalls: w.MinCalls,
		})
	}
	return out
}

// FleetJudges returns how the fleet's evidence is judged for each service
// that takes it: every agent has the same Services, so the aggregator's
// judges are every node's.
func (a *Agent) FleetJudges() map[string]fleet.Judge {
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := map[string]fleet.Judge{}
	for _, s := range a.rec.Services() {
		st := &s.Spec.Accrual
		if st.Fleet() {
			out[s.Spec.Name] = fleet.Judge{Window: st.Window, MinCalls: st.MinCalls, Threshold: st.FailureRateThreshold}
		}
	}
	return out
}

// Condemn ejects, with reason fleet, the endpoints the fleet's evidence
// condemns that this node still holds ready. Endpoints it does not know
// (another node's Service view is ahead of or behind its own) are skipped:
// the verdict stands, and a later one names them again if need be.
func (a *Agent) Condemn(cs []fleet.Condemned) {
	if len(cs) == 0 {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	byName := map[string]uint32{}
	for _, s := range a.rec.Services() {
		byName[s.Spec.Name] = s.ID
	}
	for _, c := range cs {
		sid, ok := byName[c.Service]
		if !ok {
			continue
		}
		s, _ := a.rec.Service(sid)
		for _, bid := range s.Backends {
			if b, ok := a.rec.Backend(bid); ok && b.Addr == c.Addr {
				a.handleTransitions(a.engine.Condemn(bid, c.Calls, c.Failures))
				break
			}
		}
	}
}
