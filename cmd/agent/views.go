package main

import (
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/metrics"
)

// persist writes an endpoint's accrual state to pb_health, so a restarted
// agent keeps its penalty. Called with mu held, on state changes only.
func (a *agent) persist(t accrual.Transition) {
	r, ok := a.engine.ExportEndpoint(t.Endpoint)
	if !ok {
		return
	}
	h := bpf.LbEndpointHealth{
		SvcId:               r.Service,
		State:               uint8(r.State),
		PenaltyLevel:        r.PenaltyLevel,
		LastFailureKind:     uint8(r.LastFailureKind),
		ConsecutiveFailures: r.ConsecutiveFailures,
		Ejections:           r.Ejections,
		PenaltyNs:           uint64(r.Penalty),
		EjectedAtNs:         unixNano(r.EjectedAt),
		ProbationAtNs:       unixNano(r.ProbationAt),
		LastFailureNs:       unixNano(r.LastFailureAt),
	}
	if err := a.maps.PutHealth(t.Endpoint, h); err != nil {
		a.log.Error("persist endpoint state", "endpoint", a.endpointName(t.Endpoint), "err", err)
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

// restoreHealth adopts the accrual state a previous agent persisted, after
// the first desired state made the services known again.
func (a *agent) restoreHealth() {
	hs, err := a.maps.Health()
	if err != nil {
		a.log.Error("read persisted endpoint state", "err", err)
		return
	}
	if len(hs) == 0 {
		return
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
	a.mu.Lock()
	defer a.mu.Unlock()
	trs, skipped := a.engine.Restore(recs)
	a.log.Info("restored endpoint state", "endpoints", len(recs)-skipped, "stale", skipped)
	a.handleTransitions(trs)
	// Stale records belong to endpoints that are gone.
	for id, h := range hs {
		if b, ok := a.rec.Backend(id); !ok || b.Service != h.SvcId || b.State == maps.BackendRemoved {
			a.maps.DeleteHealth(id)
		}
	}
}

// Services implements metrics.Source.
func (a *agent) Services() []metrics.ServiceView {
	a.mu.RLock()
	defer a.mu.RUnlock()
	var out []metrics.ServiceView
	for _, s := range a.rec.Services() {
		v := metrics.ServiceView{ID: s.ID, Name: s.Spec.Name, MaxInflight: s.Spec.MaxInflight,
			Inflight: a.inflight.Service(s.ID)}
		for _, id := range s.Backends {
			b, _ := a.rec.Backend(id)
			v.Backends = append(v.Backends, metrics.BackendView{ID: id, Endpoint: b.Addr.String()})
		}
		out = append(out, v)
	}
	return out
}

// Accrual implements metrics.Source.
func (a *agent) Accrual() []accrual.ServiceSnapshot { return a.engine.Snapshot() }

// GlobalStats implements metrics.Source.
func (a *agent) GlobalStats() (bpf.LbGlobalStats, error) { return a.maps.GlobalStats() }

// ServiceStats implements metrics.Source.
func (a *agent) ServiceStats(id uint32) (bpf.LbSvcStats, error) { return a.maps.ServiceStats(id) }

// BackendStats implements metrics.Source.
func (a *agent) BackendStats(id uint32) (bpf.LbBeStats, error) { return a.maps.BackendStats(id) }

type serviceJSON struct {
	Name     string `json:"name"`
	ID       uint32 `json:"id"`
	VIP      string `json:"vip"`
	Port     uint16 `json:"port"`
	Protocol string `json:"protocol"`
	FailOpen bool   `json:"failOpen"`
	// RetryRefused: refused new connections get a second try (pb_services flags).
	RetryRefused bool            `json:"retryRefused"`
	Counters     *bpf.LbSvcStats `json:"counters,omitempty"`
	Backends     []backendJSON   `json:"backends"`
}

type backendJSON struct {
	ID       uint32         `json:"id"`
	Endpoint string         `json:"endpoint"`
	Name     string         `json:"name,omitempty"`
	State    string         `json:"datapathState"`
	Counters *bpf.LbBeStats `json:"counters,omitempty"`
}

// servicesView is GET /admin/services: what the datapath holds.
func (a *agent) servicesView() any {
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := struct {
		Interfaces []string      `json:"interfaces"`
		Services   []serviceJSON `json:"services"`
		Datapath   any           `json:"datapath,omitempty"`
	}{Interfaces: a.interfaces, Services: []serviceJSON{}}
	if gs, err := a.maps.GlobalStats(); err == nil {
		out.Datapath = gs
	}
	for _, s := range a.rec.Services() {
		sj := serviceJSON{Name: s.Spec.Name, ID: s.ID, VIP: s.Spec.Key.VIP.String(), Port: s.Spec.Key.Port,
			Protocol: s.Spec.Key.Protocol.String(), FailOpen: s.FailOpen, RetryRefused: s.Spec.RetryRefused,
			Backends: []backendJSON{}}
		if st, err := a.maps.ServiceStats(s.ID); err == nil {
			sj.Counters = &st
		}
		for _, id := range s.Backends {
			b, _ := a.rec.Backend(id)
			bj := backendJSON{ID: id, Endpoint: b.Addr.String(), Name: b.Name, State: b.State.String()}
			if st, err := a.maps.BackendStats(id); err == nil {
				bj.Counters = &st
			}
			sj.Backends = append(sj.Backends, bj)
		}
		out.Services = append(out.Services, sj)
	}
	return out
}

type endpointJSON struct {
	Endpoint            string           `json:"endpoint"`
	Name                string           `json:"name,omitempty"`
	ID                  uint32           `json:"id"`
	State               string           `json:"state"`
	ConsecutiveFailures uint32           `json:"consecutiveFailures"`
	Penalty             string           `json:"penalty,omitempty"`
	ProbationAt         *time.Time       `json:"probationAt,omitempty"`
	LastFailureKind     string           `json:"lastFailureKind,omitempty"`
	LastFailureAt       *time.Time       `json:"lastFailureAt,omitempty"`
	Counters            accrual.Counters `json:"counters"`
}

// endpointsView is GET /admin/endpoints: failure accrual per endpoint.
func (a *agent) endpointsView() any {
	snap := a.engine.Snapshot()
	a.mu.RLock()
	defer a.mu.RUnlock()
	type svcJSON struct {
		Service       string         `json:"service"`
		ID            uint32         `json:"id"`
		Mode          accrual.Mode   `json:"mode"`
		Ready         int            `json:"ready"`
		Ejected       int            `json:"ejected"`
		Probation     int            `json:"probation"`
		FailOpen      bool           `json:"failOpen"`
		FailOpenSince *time.Time     `json:"failOpenSince,omitempty"`
		Endpoints     []endpointJSON `json:"endpoints"`
	}
	out := []svcJSON{}
	for _, s := range snap {
		sj := svcJSON{Service: s.Name, ID: s.ID, Mode: s.Settings.Mode, Ready: s.Ready, Ejected: s.Ejected,
			Probation: s.Probation, FailOpen: s.FailOpen, FailOpenSince: timePtr(s.FailOpenSince),
			Endpoints: []endpointJSON{}}
		for _, e := range s.Endpoints {
			ej := endpointJSON{ID: e.ID, State: e.State.String(), ConsecutiveFailures: e.ConsecutiveFailures,
				ProbationAt: timePtr(e.ProbationAt), LastFailureAt: timePtr(e.LastFailureAt), Counters: e.Counters}
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
		out = append(out, sj)
	}
	return map[string]any{"services": out}
}

func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

type circuitBreakerJSON struct {
	Service                string          `json:"service"`
	ID                     uint32          `json:"id"`
	MaxInflight            uint32          `json:"maxInflight"`
	MaxInflightPerEndpoint uint32          `json:"maxInflightPerEndpoint"`
	Inflight               int64           `json:"inflight"`
	Rejected               uint64          `json:"rejected"`
	Endpoints              []endpointFlows `json:"endpoints"`
}

type endpointFlows struct {
	Endpoint string `json:"endpoint"`
	ID       uint32 `json:"id"`
	Inflight int64  `json:"inflight"`
}

// circuitBreakersView is GET /admin/circuit_breakers: limits, live flows
// and rejections. A rejection here is the node refusing a flow over the
// limit; a backend's own refusal shows as a refused failure in
// /admin/endpoints instead.
func (a *agent) circuitBreakersView() any {
	a.mu.RLock()
	defer a.mu.RUnlock()
	out := struct {
		DefaultMaxInflight uint32               `json:"defaultMaxInflight"`
		RejectedTotal      uint64               `json:"rejectedTotal"`
		Untracked          uint64               `json:"untrackedTotal"`
		Services           []circuitBreakerJSON `json:"services"`
	}{DefaultMaxInflight: a.maxInflightDefault, Services: []circuitBreakerJSON{}}
	if gs, err := a.maps.GlobalStats(); err == nil {
		out.RejectedTotal = gs.InflightRejected
		out.Untracked = gs.InflightUntracked
	}
	for _, s := range a.rec.Services() {
		cb := circuitBreakerJSON{Service: s.Spec.Name, ID: s.ID, MaxInflight: s.Spec.MaxInflight,
			MaxInflightPerEndpoint: s.Spec.MaxInflightPerEndpoint, Inflight: a.inflight.Service(s.ID),
			Endpoints: []endpointFlows{}}
		if st, err := a.maps.ServiceStats(s.ID); err == nil {
			cb.Rejected = st.OverLimit
		}
		for _, id := range s.Backends {
			b, _ := a.rec.Backend(id)
			cb.Endpoints = append(cb.Endpoints, endpointFlows{Endpoint: b.Addr.String(), ID: id, Inflight: a.inflight.Backend(id)})
		}
		out.Services = append(out.Services, cb)
	}
	return out
}
