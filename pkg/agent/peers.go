package agent

import (
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// When every endpoint degrades together, the service is sick, not an
// endpoint: a node dropping packets under a SYN flood, a network
// partition, a shared dependency down. Timeouts then say nothing about
// which endpoint to take out, and ejecting them one by one only churns
// the tables and cuts long flows. So a timeout of an endpoint is withheld
// (counted, logged once per episode), not judged, while at least three
// quarters of its service's other active endpoints are timing out about
// as much: each with at least half as many timeouts as it, and at least
// two, over the last one to two connect timeouts (two windows of one).
// Refusals and resets are the endpoint's own answer and always count; so
// does a probe's timeout (one flow, one endpoint), which is not recorded.

// svcTimeouts are the timeouts of one service's active endpoints in the
// current and the previous window (a connect timeout long each).
type svcTimeouts struct {
	start     time.Time
	cur, prev map[uint32]int
	// wideSince: when the current service-wide episode began (zero: none);
	// wideLast its last withheld timeout, wideCount how many.
	wideSince, wideLast time.Time
	wideCount           uint64
}

func (st *svcTimeouts) count(id uint32) int { return st.cur[id] + st.prev[id] }

// serviceWide records a timeout of o's endpoint and reports whether most
// of its peers are timing out as much. Called with mu held.
func (a *Agent) serviceWide(o accrual.Outcome, now time.Time) bool {
	if o.Success || o.Kind != accrual.KindTimeout || o.Probe {
		return false
	}
	b, ok := a.rec.Backend(o.Endpoint)
	if !ok || b.State != maps.BackendActive {
		return false
	}
	s, ok := a.rec.Service(b.Service)
	if !ok {
		return false
	}
	st := a.timeouts[s.ID]
	if st == nil {
		st = &svcTimeouts{cur: map[uint32]int{}, prev: map[uint32]int{}}
		a.timeouts[s.ID] = st
	}
	w := a.policyOf(o.Endpoint).ConnectTimeout
	if w <= 0 {
		w = time.Second
	}
	if d := now.Sub(st.start); d >= w {
		st.prev, st.cur = st.cur, map[uint32]int{}
		if d >= 2*w {
			st.prev = map[uint32]int{}
		}
		st.start = now
	}
	st.cur[o.Endpoint]++
	mine := st.count(o.Endpoint)
	others, degraded := 0, 0
	for _, id := range s.Active {
		if id == o.Endpoint {
			continue
		}
		others++
		if n := st.count(id); n >= 2 && 2*n >= mine {
			degraded++
		}
	}
	if others == 0 || 4*degraded < 3*others {
		return false
	}
	if st.wideSince.IsZero() {
		st.wideSince = now
		a.log.Warn("connect timeouts on most endpoints of the service at once: the service is degraded, not an endpoint; timeouts withheld",
			"service", s.Spec.Name, "endpoints_timing_out", degraded+1, "active_endpoints", len(s.Active))
	}
	st.wideLast = now
	st.wideCount++
	return true
}

// forgetTimeouts drops an endpoint that left the active set (ejected,
// removed) from its service's windows: it is nobody's peer any more.
// Called with mu held.
func (a *Agent) forgetTimeouts(svc, id uint32) {
	if st := a.timeouts[svc]; st != nil {
		delete(st.cur, id)
		delete(st.prev, id)
	}
}

// serviceWideCheck ends the episodes that had no withheld timeout for a
// while. Called with mu held.
func (a *Agent) serviceWideCheck(now time.Time) {
	for id, st := range a.timeouts {
		if !st.wideSince.IsZero() && now.Sub(st.wideLast) > floodQuiet {
			name := ""
			if s, ok := a.rec.Service(id); ok {
				name = s.Spec.Name
			}
			a.log.Info("service no longer degraded as a whole", "service", name,
				"lasted", st.wideLast.Sub(st.wideSince).Round(time.Millisecond).String(), "timeouts_withheld", st.wideCount)
			st.wideSince, st.wideCount = time.Time{}, 0
		}
		if _, ok := a.rec.Service(id); !ok {
			delete(a.timeouts, id)
		}
	}
}

// observe hands one outcome to accrual, unless it is a timeout the
// service's state makes no evidence against the endpoint. Called with mu
// held.
func (a *Agent) observe(o accrual.Outcome) {
	if !o.Success && o.Kind == accrual.KindTimeout && a.serviceWide(o, a.clk.Now()) {
		a.metrics.Withheld.WithLabelValues("service_wide").Inc()
		a.withheldWide++
		return
	}
	a.handleTransitions(a.engine.Observe(o))
}
