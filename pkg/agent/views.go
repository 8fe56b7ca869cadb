// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"slices"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/admin"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/metrics"
)

// Services implements metrics.Source.
func (a *Agent) Services() []metrics.ServiceView {
	a.mu.RLock()
	defer a.mu.RUnlock()
	var out []metrics.ServiceView
	for _, s := range a.rec.Services() {
		v := metrics.ServiceView{ID: s.ID, Name: s.Spec.Name, MaxInflight: s.Spec.MaxInflight,
			Inflight: a.inflight.Service(s.ID), Served: s.Spec.Served}
		for _, id := range s.Backends {
			b, _ := a.rec.Backend(id)
			v.Backends = append(v.Backends, metrics.BackendView{ID: id, Endpoint: b.Addr.String()})
		}
		out = append(out, v)
	}
	return out
}

// Accrual implements metrics.Source.
func (a *Agent) Accrual() []accrual.ServiceSnapshot { return a.engine.Snapshot() }

// ServicesView is GET /admin/services: what the datapath holds.
func (a *Agent) ServicesView() admin.ServicesView {
	a.mu.RLock()
	defer a.mu.RUnlock()
	// Cloned: the view is encoded after the lock is released.
	out := admin.ServicesView{Interfaces: slices.Clone(a.interfaces), Services: []admin.Service{}}
	stats := maps.Snapshot(a.stats) // each element of the counters read once
	if gs, err := stats.GlobalStats(); err == nil {
		out.Datapath = admin.NewDatapathCounters(gs)
	}
	for _, s := range a.rec.Services() {
		sj := admin.Service{Name: s.Spec.Name, Served: s.Spec.Served, ID: s.ID, VIP: s.Spec.Key.VIP.String(), Port: s.Spec.Key.Port,
			Protocol: s.Spec.Key.Protocol.String(), FailOpen: s.FailOpen, RetryRefused: s.Spec.RetryRefused,
			Backends: []admin.Backend{}}
		if st, err := stats.ServiceStats(s.ID); err == nil {
			sj.Counters = admin.NewServiceCounters(st)
		}
		if d := a.replays.after(s); d > 0 {
			sj.ReplayAfter = d.String()
		}
		sj.KernelTrips = admin.NewKernelTrips(a.tripMaps.ServiceTrip(s.ID))
		for _, id := range s.Backends {
			b, _ := a.rec.Backend(id)
			bj := admin.Backend{ID: id, Endpoint: b.Addr.String(), Name: b.Name, DatapathState: b.State.String(),
				KernelStreak: a.tripMaps.BackendTrip(id).Failures}
			if st, err := stats.BackendStats(id); err == nil {
				bj.Counters = admin.NewBackendCounters(st)
			}
			sj.Backends = append(sj.Backends, bj)
		}
		out.Services = append(out.Services, sj)
	}
	return out
}

// EndpointsView is GET /admin/endpoints: failure accrual per endpoint.
func (a *Agent) EndpointsView() admin.EndpointsView {
	snap := a.engine.Snapshot()
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := admin.EndpointsView{Services: []admin.AccrualService{}}
	for _, s := range snap {
		sj := admin.AccrualService{Service: s.Name, ID: s.ID, Mode: s.Settings.Mode, Thresholds: admin.ThresholdsOf(s.Settings),
			Ready: s.Ready, Ejected: s.Ejected,
			Probation: s.Probation, FailOpen: s.FailOpen, FailOpenSince: admin.TimeOrNil(s.FailOpenSince),
			Endpoints: []admin.Endpoint{}}
		for _, e := range s.Endpoints {
			ej := admin.Endpoint{ID: e.ID, State: e.State.String(), ConsecutiveFailures: e.ConsecutiveFailures,
				ProbationAt: admin.TimeOrNil(e.ProbationAt), LastFailureAt: admin.TimeOrNil(e.LastFailureAt),
				Window: e.Window, Counters: e.Counters}
			if b, ok := a.rec.Backend(e.ID); ok {
				ej.Endpoint, ej.Name = b.Addr.String(), b.Name
			}
			if e.Penalty > 0 {
				ej.Penalty = e.Penalty.String()
			}
			if e.LastFailureKind != 0 {
				ej.LastFailureKind = e.LastFailureKind.String()
			}
			sj.Endpoints = append(sj.Endpoints, ej)
		}
		out.Services = append(out.Services, sj)
	}
	return out
}

// CircuitBreakersView is GET /admin/circuit_breakers.
func (a *Agent) CircuitBreakersView() admin.CircuitBreakersView {
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := admin.CircuitBreakersView{DefaultMaxInflight: a.maxInflightDefault, Services: []admin.CircuitBreaker{},
		BackendMaxInflightRequests: map[string]uint32{}, BackendInflightCurrent: map[string]int64{},
		RejectedBackendByName: map[string]uint64{}}
	stats := maps.Snapshot(a.stats)
	if gs, err := stats.GlobalStats(); err == nil {
		out.RejectedTotal = gs.InflightRejected
		out.UntrackedTotal = gs.InflightUntracked
	}
	for _, s := range a.rec.Services() {
		cb := admin.CircuitBreaker{Service: s.Spec.Name, ID: s.ID, MaxInflight: s.Spec.MaxInflight,
			MaxInflightPerEndpoint: s.Spec.MaxInflightPerEndpoint, Inflight: a.inflight.Service(s.ID),
			Endpoints: []admin.EndpointFlows{}}
		if st, err := stats.ServiceStats(s.ID); err == nil {
			cb.Rejected = st.OverLimit
		}
		for _, id := range s.Backends {
			b, _ := a.rec.Backend(id)
			cb.Endpoints = append(cb.Endpoints, admin.EndpointFlows{Endpoint: b.Addr.String(), ID: id, Inflight: a.inflight.Backend(id)})
		}
		out.Services = append(out.Services, cb)
		out.BackendMaxInflightRequests[cb.Service] = cb.MaxInflight
		out.BackendInflightCurrent[cb.Service] = cb.Inflight
		out.RejectedBackendByName[cb.Service] = cb.Rejected
		out.RejectedBackendTotal += cb.Rejected
	}
	return out
}
