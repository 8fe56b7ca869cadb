// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// eventCounts carry counts kept outside Prometheus into it: events by
// type, and what the tracker and the reader counted since the last look.
type eventCounts struct {
	*core
	flood *floodMode
	shed  *shedding
	types [16]interface{ Inc() }
	// what the counters held at the last look.
	overflowSeen, badSeen, withheldSeen, withheldOldSeen uint64
}

// event counts one event by its type.
func (c *eventCounts) event(ev *outcomes.Event) {
	if int(ev.Type) < len(c.types) && c.types[ev.Type] != nil {
		c.types[ev.Type].Inc()
	}
}

// unansweredDatagram counts a UDP flow its backend never answered (no
// verdict: many UDP protocols do not answer). Called with mu held.
func (c *eventCounts) unansweredDatagram(bid uint32) {
	svc := uint32(0)
	if b, ok := c.rec.Backend(bid); ok {
		svc = b.Service
	}
	c.metrics.UnansweredUDP.WithLabelValues(c.serviceName(svc)).Inc()
}

// sync carries counts kept outside Prometheus into it.
func (c *eventCounts) sync() {
	if c.tracker.FloodConnects() > floodPending {
		c.flood.sign(c.clk.Now(), "too many connects awaiting a verdict")
	}
	// Flows the tracker's caps left untracked are counted, not a flood
	// sign: a service over its cap is a tenant's doing (its connects count
	// toward flood mode up to its share all the same), and the node's
	// ceiling is memory, reached first by connections that are no connects.
	if d := c.tracker.Overflow - c.overflowSeen; d > 0 {
		c.metrics.PendingOverflow.Add(float64(d))
		c.overflowSeen = c.tracker.Overflow
	}
	c.tracker.DrainShed(c.shed.count)
	c.metrics.TrackedFlows.Set(float64(c.tracker.Pending()))
	if d := c.tracker.Withheld - c.withheldSeen; d > 0 {
		c.metrics.Withheld.WithLabelValues("events_lost").Add(float64(d))
		c.withheldSeen = c.tracker.Withheld
	}
	if d := c.tracker.WithheldOld - c.withheldOldSeen; d > 0 {
		c.metrics.Withheld.WithLabelValues("before_start").Add(float64(d))
		c.withheldOldSeen = c.tracker.WithheldOld
	}
	if c.events == nil {
		return
	}
	if bad := c.events.Undecodable(); bad > c.badSeen {
		c.metrics.EventsUndecodable.Add(float64(bad - c.badSeen))
		c.badSeen = bad
	}
}
