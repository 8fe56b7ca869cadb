// SPDX-License-Identifier: Apache-2.0

package agent

import "time"

// shedding follows the spells in which a service's new flows go
// untracked (the tracker's caps): counted, and logged when a spell starts
// and ends.
type shedding struct {
	*core
	spells map[shedKey]*shedSpell
}

// shedKey is a service and the reason its flows went untracked.
type shedKey struct {
	svc    uint32
	reason string
}

// shedSpell is a time a service's new flows were not all tracked.
type shedSpell struct {
	name        string
	since, last time.Time
	flows       uint64
}

// count counts a service's flows the tracker left untracked, and logs
// when a spell of it starts (end logs its end).
func (sh *shedding) count(svc uint32, overCap, overMemory uint64) {
	name := sh.serviceName(svc)
	now := sh.clk.Now()
	for _, r := range []struct {
		n      uint64
		reason string
	}{{overCap, "service_cap"}, {overMemory, "memory_limit"}} {
		if r.n == 0 {
			continue
		}
		sh.metrics.UntrackedFlows.WithLabelValues(name, r.reason).Add(float64(r.n))
		key := shedKey{svc, r.reason}
		sp := sh.spells[key]
		if sp == nil {
			sp = &shedSpell{name: name, since: now}
			sh.spells[key] = sp
			sh.log.Warn("not tracking some new flows of a service: the kernel's signals (RST, retransmitted SYN) still judge them, connect deadlines and settling do not",
				"service", name, "reason", r.reason, "tracked_flows", sh.tracker.Pending(),
				"per_service_cap", sh.tracker.MaxPendingPerService, "limit", sh.tracker.MaxPending)
		}
		sp.last = now
		sp.flows += r.n
	}
}

// end ends the spells with no untracked flow for floodQuiet, one log line
// each. Called with mu held.
func (sh *shedding) end(now time.Time) {
	for key, sp := range sh.spells {
		if now.Sub(sp.last) <= floodQuiet {
			continue
		}
		delete(sh.spells, key)
		sh.log.Info("tracking every new flow of a service again", "service", sp.name, "reason", key.reason,
			"lasted", sp.last.Sub(sp.since).Round(time.Millisecond).String(), "untracked_flows", sp.flows)
	}
}
