// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// persisted keeps each endpoint's accrual state in the maps (pb_health),
// so a restarted agent keeps its penalties.
type persisted struct {
	*core
	// restored: the first Apply adopted the persisted accrual state.
	restored bool
}

// save writes an endpoint's accrual state to the maps. Called with mu
// held, on state changes only.
func (p *persisted) save(t accrual.Transition) {
	r, ok := p.engine.ExportEndpoint(t.Endpoint)
	if !ok {
		return
	}
	if err := p.rec.PersistEndpoint(r); err != nil {
		p.log.Error("persist endpoint state", "endpoint", p.endpointName(t.Endpoint), "err", err)
	}
}

// restore adopts the accrual state a previous agent persisted, once the
// first desired state made the services known again and before their
// tables are written: it returns accrual's transitions, for the caller to
// handle, and the records, for prune after. Called with mu held.
func (p *persisted) restore() ([]accrual.Transition, []accrual.Record) {
	recs, err := p.rec.PersistedEndpoints()
	if err != nil {
		p.log.Error("read persisted endpoint state", "err", err)
		return nil, nil
	}
	if len(recs) == 0 {
		return nil, nil
	}
	trs, skipped := p.engine.Restore(recs)
	p.log.Info("restored endpoint state", "endpoints", len(recs)-skipped, "stale", skipped)
	return trs, recs
}

// prune deletes the records restore read that belong to endpoints that
// are gone.
func (p *persisted) prune(recs []accrual.Record) {
	if len(recs) > 0 {
		p.rec.PruneEndpoints(recs)
	}
}
