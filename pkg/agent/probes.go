// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"time"

	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
)

// probes keep probation from stalling: when each backend's last probe
// flow started, or its probe was granted.
type probes struct {
	*core
	seen map[uint32]time.Time
}

// watch keeps probation from stalling. An endpoint in probation must
// either hold an unused grant or have a probe whose verdict is on its way;
// if the kernel's entry disagrees with the agent (state drifted) or the
// grant is spent and no verdict came within the connect timeout (its
// events were lost), the endpoint gets a fresh grant. Without this, one
// lost probe would keep a healed endpoint out for good. Called with mu
// held.
func (p *probes) watch(now time.Time) {
	probing := p.rec.ServicesWhere(func(s *reconcile.Service) bool { return len(s.Probation) > 0 })
	for _, s := range probing {
		for _, id := range s.Probation {
			state, grants, err := p.rec.KernelState(id)
			if err != nil {
				continue
			}
			reason, label := "", ""
			switch {
			case state != maps.BackendProbation:
				reason, label = "the datapath's entry is "+state.String(), "state_drift"
			case grants <= 0:
				seen, ok := p.seen[id]
				wait := p.policyOf(id).ConnectTimeout*2 + time.Second
				if !ok || now.Sub(seen) > wait {
					reason, label = "its probe was admitted but no verdict came", "no_verdict"
				}
			}
			if reason == "" {
				continue
			}
			// The probe is inconclusive: said here, counted, and retried.
			p.metrics.ProbeRegrants.WithLabelValues(s.Spec.Name, label).Inc()
			p.log.Warn("probation stalled, granting a new probe", "service", s.Spec.Name,
				"endpoint", p.endpointName(id), "reason", reason)
			if err := p.rec.Regrant(id); err != nil {
				p.log.Error("grant a new probe", "endpoint", p.endpointName(id), "err", err)
			}
			p.seen[id] = now
		}
	}
}
