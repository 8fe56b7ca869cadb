// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"fmt"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Accrual state outlives the agent in pb_health, one entry per backend id,
// so a restarted agent keeps every endpoint's penalty: an ejected endpoint
// stays out until its penalty ends.

// PersistEndpoint writes an endpoint's accrual record to pb_health.
func (r *Reconciler) PersistEndpoint(rec accrual.Record) error {
	h := bpf.LbEndpointHealth{
		SvcId:               rec.Service,
		State:               uint8(rec.State),
		PenaltyLevel:        rec.PenaltyLevel,
		LastFailureKind:     uint8(rec.LastFailureKind),
		ConsecutiveFailures: rec.ConsecutiveFailures,
		Ejections:           rec.Ejections,
		PenaltyNs:           uint64(rec.Penalty),
		EjectedAtNs:         unixNano(rec.EjectedAt),
		ProbationAtNs:       unixNano(rec.ProbationAt),
		LastFailureNs:       unixNano(rec.LastFailureAt),
	}
	if err := r.w.PutPersisted(rec.Endpoint, h); err != nil {
		return fmt.Errorf("pb_health[%d]: %w", rec.Endpoint, err)
	}
	return nil
}

// PersistedEndpoints reads the accrual records a previous agent left.
func (r *Reconciler) PersistedEndpoints() ([]accrual.Record, error) {
	hs, err := r.w.Persisted()
	if err != nil {
		return nil, fmt.Errorf("read pb_health: %w", err)
	}
	recs := make([]accrual.Record, 0, len(hs))
	for id, h := range hs {
		recs = append(recs, accrual.Record{
			Service: h.SvcId, Endpoint: id, State: accrual.State(h.State),
			ConsecutiveFailures: h.ConsecutiveFailures, PenaltyLevel: h.PenaltyLevel,
			Penalty: time.Duration(h.PenaltyNs), EjectedAt: fromUnixNano(h.EjectedAtNs),
			ProbationAt: fromUnixNano(h.ProbationAtNs), LastFailureKind: accrual.Kind(h.LastFailureKind),
			LastFailureAt: fromUnixNano(h.LastFailureNs), Ejections: h.Ejections,
		})
	}
	return recs, nil
}

// PruneEndpoints deletes the records of endpoints that are no longer
// programmed in the service they were recorded for.
func (r *Reconciler) PruneEndpoints(recs []accrual.Record) {
	for _, rec := range recs {
		if b, ok := r.backends.lookup(rec.Endpoint); !ok || b.Service != rec.Service || b.State == maps.BackendRemoved {
			r.forgetPersisted(rec.Endpoint)
		}
	}
}

// forgetPersisted deletes a backend's record: its endpoint left the service,
// and a recycled id must not inherit its penalty.
func (r *Reconciler) forgetPersisted(id uint32) {
	if err := r.w.DeletePersisted(id); err != nil {
		r.log.Error("delete persisted endpoint state", "id", id, "err", err)
	}
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromUnixNano(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}
