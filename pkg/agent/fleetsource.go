// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"net/netip"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/fleet"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// FleetWindows returns what this node can report to the fleet: the windows
// of its ready endpoints in services that judge failure rates on the
// fleet's evidence, named as every node names them.
func (a *Agent) FleetWindows() []fleet.Window {
	// mu before the engine's lock, as everywhere: ids read under mu name
	// the same endpoints as the engine's windows.
	a.mu.RLock()
	defer a.mu.RUnlock()
	ws := a.engine.FleetWindows()
	out := make([]fleet.Window, 0, len(ws))
	for _, w := range ws {
		s, ok := a.rec.Service(w.Service)
		b, bok := a.rec.Backend(w.Endpoint)
		if !ok || !bok || b.State == maps.BackendRemoved {
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
// that takes it, with its endpoints: every agent has the same Services
// (but those a node leaves to kube-proxy, see README), so the
// aggregator's judges are every node's.
func (a *Agent) FleetJudges() map[string]fleet.Judge {
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := map[string]fleet.Judge{}
	for _, s := range a.rec.Services() {
		st := &s.Spec.Accrual
		if !st.Fleet() {
			continue
		}
		eps := make(map[netip.AddrPort]bool, len(s.Spec.Endpoints))
		for _, e := range s.Spec.Endpoints {
			eps[e.Addr] = true
		}
		out[s.Spec.Name] = fleet.Judge{Window: st.Window, MinCalls: st.MinCalls, Threshold: st.FailureRateThreshold, Endpoints: eps}
	}
	return out
}

// Condemn ejects, with reason fleet, an endpoint the fleet's evidence
// condemns, if this node still holds it ready. known is false when this
// node does not know the endpoint yet (its EndpointSlices lag the
// aggregator's): the caller tries again later. out is whether the
// endpoint is now out of the table here (ejected now, or already): its
// window then holds no call made before the condemnation. An ejection the
// cap suppressed leaves it in.
func (a *Agent) Condemn(c fleet.Condemned) (known, out bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, s := range a.rec.Services() {
		if s.Spec.Name != c.Service {
			continue
		}
		for _, bid := range s.Backends {
			if b, ok := a.rec.Backend(bid); ok && b.Addr == c.Addr {
				a.trans.handle(a.engine.Condemn(bid, c.Calls, c.Failures, c.Level))
				// The penalty's end is a new deadline: wake the loop if
				// its timer would be late for it.
				a.wake()
				return true, a.engine.StateOf(bid) != accrual.Ready
			}
		}
		return false, false
	}
	return false, false
}
