// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// persist writes an endpoint's accrual state to the maps, so a restarted
// agent keeps its penalty. Called with mu held, on state changes only.
func (a *Agent) persist(t accrual.Transition) {
	r, ok := a.engine.ExportEndpoint(t.Endpoint)
	if !ok {
		return
	}
	if err := a.rec.PersistEndpoint(r); err != nil {
		a.log.Error("persist endpoint state", "endpoint", a.endpointName(t.Endpoint), "err", err)
	}
}

// restoreHealth adopts the accrual state a previous agent persisted, once
// the first desired state made the services known again and before their
// tables are written. Called with mu held.
func (a *Agent) restoreHealth() {
	recs, err := a.rec.PersistedEndpoints()
	if err != nil {
		a.log.Error("read persisted endpoint state", "err", err)
		return
	}
	if len(recs) == 0 {
		return
	}
	trs, skipped := a.engine.Restore(recs)
	a.log.Info("restored endpoint state", "endpoints", len(recs)-skipped, "stale", skipped)
	a.handleTransitions(trs)
	// Stale records belong to endpoints that are gone.
	a.rec.PruneEndpoints(recs)
}
