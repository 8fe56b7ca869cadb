// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"cmp"
	"math"
	"slices"
	"time"
)

// KindCounts counts failures by kind. Other collects kinds the engine does
// not know (a datapath newer than the agent).
type KindCounts struct {
	Refused        uint64 `json:"refused"`
	Timeout        uint64 `json:"timeout"`
	Reset          uint64 `json:"reset"`
	ResetAfterData uint64 `json:"resetAfterData"`
	Other          uint64 `json:"other,omitempty"`
}

// Counters are an endpoint's lifetime statistics (since it joined its
// service or the agent started; Restore carries only Ejections over).
type Counters struct {
	Successes uint64     `json:"successes"`
	Failures  KindCounts `json:"failures"` // every failure seen, counted kind or not
	// Ignored failures were of kinds not in FailureKinds.
	Ignored uint64 `json:"ignored"`
	// Stragglers are outcomes of non-probe flows while ejected or in
	// probation that changed nothing.
	Stragglers uint64 `json:"stragglers"`
	// Overtaken are counted failures of connections that began before the
	// newest one that succeeded: no part of a streak.
	Overtaken uint64 `json:"overtaken"`
	// Ejections counts entries into ejected, by any rule (EjectionsBy
	// splits it); Restore carries it over.
	Ejections         uint64 `json:"ejections"`
	ProbeSuccesses    uint64 `json:"probeSuccesses"`
	ProbeFailures     uint64 `json:"probeFailures"`
	ProbeInconclusive uint64 `json:"probeInconclusive"`
	// SuppressedEjections counts due ejections the max-ejection-percent
	// cap prevented: once per streak, or per spell of a window rule being due.
	SuppressedEjections uint64 `json:"suppressedEjections"`
	// FailOpenRecoveries counts returns to ready by a success during
	// fail-open.
	FailOpenRecoveries uint64 `json:"failOpenRecoveries"`
	// SlowConnects counts successes slower than SlowConnectThreshold.
	SlowConnects uint64 `json:"slowConnects"`
	// EjectionsBy splits Ejections by the rule that ejected, since the
	// agent started (Restore does not carry it over).
	EjectionsBy EjectionCounts `json:"ejectionsBy"`
}

// EjectionCounts counts ejections by reason.
type EjectionCounts struct {
	ConsecutiveFailures uint64 `json:"consecutiveFailures"`
	ProbeFailed         uint64 `json:"probeFailed"`
	FailureRate         uint64 `json:"failureRate"`
	SlowConnects        uint64 `json:"slowConnects"`
	Outlier             uint64 `json:"successRateOutlier"`
	Fleet               uint64 `json:"fleet"`
}

// Of returns the count for reason r (0 for a reason that does not eject).
func (c EjectionCounts) Of(r Reason) uint64 {
	switch r {
	case ReasonConsecutiveFailures:
		return c.ConsecutiveFailures
	case ReasonProbeFailed:
		return c.ProbeFailed
	case ReasonFailureRate:
		return c.FailureRate
	case ReasonSlowConnects:
		return c.SlowConnects
	case ReasonOutlier:
		return c.Outlier
	case ReasonFleet:
		return c.Fleet
	}
	return 0
}

// EndpointSnapshot is one endpoint's state for display.
type EndpointSnapshot struct {
	ID                  uint32        `json:"id"`
	State               State         `json:"state"`
	ConsecutiveFailures uint32        `json:"consecutiveFailures"`
	PenaltyLevel        uint8         `json:"penaltyLevel"`
	Penalty             time.Duration `json:"penalty"` // current (last drawn) penalty; 0 when ready
	EjectedAt           time.Time     `json:"ejectedAt,omitzero"`
	ProbationAt         time.Time     `json:"probationAt,omitzero"`
	LastFailureKind     Kind          `json:"lastFailureKind,omitempty"`
	LastFailureAt       time.Time     `json:"lastFailureAt,omitzero"`
	// Window is the endpoint's window of recent connections as its rules
	// judge it now; nil when its service's settings judge none.
	Window   *WindowSnapshot `json:"window,omitempty"`
	Counters Counters        `json:"counters"`
}

// ServiceSnapshot is one service's state for display.
type ServiceSnapshot struct {
	ID       uint32   `json:"id"`
	Name     string   `json:"name"`
	Settings Settings `json:"settings"` // as applied (clamped)
	Ready    int      `json:"ready"`
	Ejected  int      `json:"ejected"`
	// Probation endpoints are in the table with one probe flow each.
	Probation        int                `json:"probation"`
	EjectionCap      int                `json:"ejectionCap"`
	FailOpen         bool               `json:"failOpen"`
	FailOpenSince    time.Time          `json:"failOpenSince,omitzero"`
	FailOpenEpisodes uint64             `json:"failOpenEpisodes"`
	Endpoints        []EndpointSnapshot `json:"endpoints"`
}

func (c *counters) export() Counters {
	return Counters{
		Successes: c.successes,
		Failures: KindCounts{
			Refused:        c.failures[KindRefused],
			Timeout:        c.failures[KindTimeout],
			Reset:          c.failures[KindReset],
			ResetAfterData: c.failures[KindResetAfterData],
			Other:          c.failures[0],
		},
		Ignored:             c.ignored,
		Stragglers:          c.stragglers,
		Overtaken:           c.overtaken,
		Ejections:           uint64(c.ejections),
		ProbeSuccesses:      uint64(c.probeSuccesses),
		ProbeFailures:       uint64(c.probeFailures),
		ProbeInconclusive:   uint64(c.probeInconclusive),
		SuppressedEjections: c.suppressed,
		FailOpenRecoveries:  uint64(c.failOpenRecoveries),
		SlowConnects:        c.slow,
		EjectionsBy:         c.reasons(),
	}
}

func (c *counters) reasons() EjectionCounts {
	at := func(r Reason) uint64 { return uint64(c.byReason[ejectReasonIndex(r)]) }
	return EjectionCounts{
		ConsecutiveFailures: at(ReasonConsecutiveFailures),
		ProbeFailed:         at(ReasonProbeFailed),
		FailureRate:         at(ReasonFailureRate),
		SlowConnects:        at(ReasonSlowConnects),
		Outlier:             at(ReasonOutlier),
		Fleet:               at(ReasonFleet),
	}
}

// sortedServices returns the services in id order (the map has none).
func (e *Engine) sortedServices() []*service {
	out := make([]*service, 0, len(e.svcs))
	for _, s := range e.svcs {
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b *service) int { return cmp.Compare(a.id, b.id) })
	return out
}

// Snapshot returns every service and endpoint, ordered by id. The result is
// the caller's.
func (e *Engine) Snapshot() []ServiceSnapshot {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []ServiceSnapshot
	now := e.clk.Now()
	for _, s := range e.sortedServices() {
		ss := ServiceSnapshot{
			ID: s.id, Name: s.name, Settings: *s.st,
			Ready: s.count[Ready], Ejected: s.count[Ejected], Probation: s.count[Probation],
			EjectionCap:      EjectionCap(len(s.members), s.st.MaxEjectionPercent),
			FailOpen:         s.failOpen,
			FailOpenSince:    s.failOpenSince,
			FailOpenEpisodes: s.episodes,
			Endpoints:        make([]EndpointSnapshot, 0, len(s.members)),
		}
		for _, id := range s.members {
			ep := e.eps.at(id)
			a := ep.seen()
			es := EndpointSnapshot{
				ID: id, State: ep.state, ConsecutiveFailures: ep.consecutive,
				PenaltyLevel: ep.level, Penalty: a.penalty,
				EjectedAt: a.ejectedAt, ProbationAt: a.probationAt,
				LastFailureKind: ep.lastKind, LastFailureAt: a.lastFailAt,
				Counters: a.c.export(),
			}
			if ep.win != nil {
				ws := ep.win.view(s.st, now).snapshot()
				es.Window = &ws
			}
			ss.Endpoints = append(ss.Endpoints, es)
		}
		out = append(out, ss)
	}
	return out
}

// Record is the persistable state of one endpoint, for restart adoption.
// Times are absolute (wall clock), so a record means the same after a
// restart.
type Record struct {
	Service             uint32        `json:"service"`
	Endpoint            uint32        `json:"endpoint"`
	State               State         `json:"state"`
	ConsecutiveFailures uint32        `json:"consecutiveFailures"`
	PenaltyLevel        uint8         `json:"penaltyLevel"`
	Penalty             time.Duration `json:"penalty"` // the penalty drawn for the current ejection
	EjectedAt           time.Time     `json:"ejectedAt,omitzero"`
	ProbationAt         time.Time     `json:"probationAt,omitzero"` // when the penalty ends
	LastFailureKind     Kind          `json:"lastFailureKind,omitempty"`
	LastFailureAt       time.Time     `json:"lastFailureAt,omitzero"`
	Ejections           uint64        `json:"ejections"`
}

// Export returns a Record for every endpoint, ordered by service and
// endpoint id. The monotonic clock reading is stripped from the times: it
// means nothing to another process.
func (e *Engine) Export() []Record {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []Record
	for _, s := range e.sortedServices() {
		for _, id := range s.members {
			out = append(out, e.record(s, id))
		}
	}
	return out
}

// ExportEndpoint returns one endpoint's Record (false when no service has
// it), for persisting a single transition cheaply.
func (e *Engine) ExportEndpoint(id uint32) (Record, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if int(id) >= e.eps.len() || e.eps.at(id).svc == nil {
		return Record{}, false
	}
	return e.record(e.eps.at(id).svc, id), true
}

func (e *Engine) record(s *service, id uint32) Record {
	ep := e.eps.at(id)
	a := ep.seen()
	return Record{
		Service: s.id, Endpoint: id, State: ep.state,
		ConsecutiveFailures: ep.consecutive, PenaltyLevel: ep.level,
		Penalty: a.penalty, EjectedAt: a.ejectedAt.Round(0), ProbationAt: a.probationAt.Round(0),
		LastFailureKind: ep.lastKind, LastFailureAt: a.lastFailAt.Round(0),
		Ejections: uint64(a.c.ejections),
	}
}

// Restore adopts records, typically Export's from before a restart. Call it
// after SetService has set the services again: a record applies only to an
// endpoint that currently belongs to the record's service, others (and
// records with an invalid state) are skipped, and the count of skipped
// records is returned. The ejection cap is not checked (the state existed);
// a service whose mode is now none adopts counters but stays ready. An
// ejected record keeps its absolute probation time, clamped to at most now
// + MaxPenalty·(1+JitterRatio); one already past goes to probation at the
// next Advance. The transitions (ReasonRestored, plus any fail-open start)
// are valid until the next mutating call.
func (e *Engine) Restore(recs []Record) (ts []Transition, skipped int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.out = e.out[:0]
	now := e.clk.Now()
	for _, r := range recs {
		if r.State >= numStates || int(r.Endpoint) >= e.eps.len() {
			skipped++
			continue
		}
		id := r.Endpoint
		ep := e.eps.at(id)
		s := ep.svc
		if s == nil || s.id != r.Service {
			skipped++
			continue
		}
		a := ep.acts()
		ep.consecutive = r.ConsecutiveFailures
		ep.lastKind, a.lastFailAt = r.LastFailureKind, r.LastFailureAt
		a.c.ejections = uint32(min(r.Ejections, math.MaxUint32))
		ep.suppressed = 0
		to := r.State
		if s.st.Mode == ModeNone {
			to = Ready
		}
		from := ep.state
		if to == Ready {
			ep.level, a.penalty = 0, 0
			a.ejectedAt, a.probationAt = time.Time{}, time.Time{}
		} else {
			ep.level = clampLevel(s.st, r.PenaltyLevel)
			// Clamped as the probation time is, so that ejectedAt below
			// (probation − penalty) cannot wrap.
			a.penalty = min(max(r.Penalty, 0), maxDrawn(s.st))
			a.probationAt = r.ProbationAt
			if a.probationAt.IsZero() {
				a.probationAt = now
			}
			if limit := now.Add(maxDrawn(s.st)); a.probationAt.After(limit) {
				a.probationAt = limit
			}
			a.ejectedAt = r.EjectedAt
			if a.ejectedAt.IsZero() || a.ejectedAt.After(a.probationAt) {
				a.ejectedAt = a.probationAt.Add(-a.penalty)
			}
		}
		if from == to {
			if to == Ejected {
				e.heapFix(int(ep.heapIdx))
			}
			continue
		}
		e.setState(s, id, ep, to)
		e.emit(s, id, ep, from, ReasonRestored, ep.lastKind, now, a.lastFailAt)
		e.updateFailOpen(s, id, now)
	}
	return e.result(), skipped
}
