// SPDX-License-Identifier: Apache-2.0

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
// quarters of its service's other active endpoints are degraded too: at
// least two timeouts and at least degradedShare of their outcomes over the
// last one to two connect timeouts (two windows of one). A healthy peer's
// occasional slow connect does not make it degraded, so it shields no dead
// endpoint. Refusals and resets are the endpoint's own answer and always
// count; so does a probe (one flow, one endpoint), which is not recorded.

// degradedShare is the share of timeouts among its outcomes that makes an
// endpoint degraded: well above a healthy endpoint's rare slow connect,
// well below what a flood that makes the node drop packets causes.
const degradedShare = 0.05

// window counts one endpoint's outcomes and timeouts in one window.
type window struct{ outcomes, timeouts int }

// svcTimeouts are the outcomes of one service's active endpoints in the
// current and the previous window (a connect timeout long each).
type svcTimeouts struct {
	start     time.Time
	cur, prev map[uint32]window
	// wideSince: when the current service-wide episode began (zero: none);
	// wideLast its last withheld timeout, wideCount how many.
	wideSince, wideLast time.Time
	wideCount           uint64
}

// degraded: the endpoint timed out at least twice and at least
// degradedShare of the time in the two windows.
func (st *svcTimeouts) degraded(id uint32) bool {
	c, p := st.cur[id], st.prev[id]
	t, n := c.timeouts+p.timeouts, c.outcomes+p.outcomes
	return t >= 2 && float64(t) >= degradedShare*float64(n)
}

// serviceWide tells a service's trouble from an endpoint's: its
// endpoints' recent timeouts, by service.
type serviceWide struct {
	*core
	timeouts map[uint32]*svcTimeouts
}

// withholds counts o for its endpoint, if active and not a probe, and
// reports whether o is a timeout while most of the endpoint's peers are
// degraded. Called with mu held, for every outcome.
func (w *serviceWide) withholds(o accrual.Outcome, now time.Time) bool {
	if o.Probe {
		return false
	}
	b, ok := w.rec.Backend(o.Endpoint)
	if !ok || b.State != maps.BackendActive {
		return false
	}
	s, ok := w.rec.Service(b.Service)
	if !ok {
		return false
	}
	st := w.timeouts[s.ID]
	if st == nil {
		st = &svcTimeouts{cur: map[uint32]window{}, prev: map[uint32]window{}}
		w.timeouts[s.ID] = st
	}
	span := w.policyOf(o.Endpoint).ConnectTimeout
	if span <= 0 {
		span = time.Second
	}
	if d := now.Sub(st.start); d >= span {
		st.prev, st.cur = st.cur, map[uint32]window{}
		if d >= 2*span {
			st.prev = map[uint32]window{}
		}
		st.start = now
	}
	timeout := !o.Success && o.Kind == accrual.KindTimeout
	c := st.cur[o.Endpoint]
	c.outcomes++
	if timeout {
		c.timeouts++
	}
	st.cur[o.Endpoint] = c
	if !timeout {
		return false
	}
	others, degraded := 0, 0
	for _, id := range s.Active {
		if id == o.Endpoint {
			continue
		}
		others++
		if st.degraded(id) {
			degraded++
		}
	}
	if others == 0 || 4*degraded < 3*others {
		return false
	}
	if st.wideSince.IsZero() {
		st.wideSince = now
		w.log.Warn("connect timeouts on most endpoints of the service at once: the service is degraded, not an endpoint; timeouts withheld",
			"service", s.Spec.Name, "endpoints_degraded", degraded+1, "active_endpoints", len(s.Active))
	}
	st.wideLast = now
	st.wideCount++
	return true
}

// forget drops an endpoint that left the active set (ejected,
// removed) from its service's windows: it is nobody's peer any more.
// Called with mu held.
func (w *serviceWide) forget(svc, id uint32) {
	if st := w.timeouts[svc]; st != nil {
		delete(st.cur, id)
		delete(st.prev, id)
	}
}

// check ends the episodes that had no withheld timeout for a while.
// Called with mu held.
func (w *serviceWide) check(now time.Time) {
	for id, st := range w.timeouts {
		if !st.wideSince.IsZero() && now.Sub(st.wideLast) > floodQuiet {
			name := ""
			if s, ok := w.rec.Service(id); ok {
				name = s.Spec.Name
			}
			w.log.Info("service no longer degraded as a whole", "service", name,
				"lasted", st.wideLast.Sub(st.wideSince).Round(time.Millisecond).String(), "timeouts_withheld", st.wideCount)
			st.wideSince, st.wideCount = time.Time{}, 0
		}
		if _, ok := w.rec.Service(id); !ok {
			delete(w.timeouts, id)
		}
	}
}
