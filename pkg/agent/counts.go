// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"math/bits"

	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// eventCounts carry counts kept outside Prometheus into it: events by
// type, and what the tracker and the reader counted since the last look.
type eventCounts struct {
	*core
	flood *floodMode
	shed  *shedding
	types [16]interface{ Add(float64) }
	// typed: events by type since the last sync, which adds them to types
	// (one atomic add a batch and type: one an event was 3% of the
	// agent's CPU under the agentcpu part's load).
	typed [16]uint64
	// typedSet: the types counted in typed since the last sync (a batch of
	// one event costs sync one look, not sixteen).
	typedSet uint16
	// what the counters held at the last look.
	overflowSeen, badSeen, withheldSeen, withheldOldSeen uint64
}

// event counts one event by its type, for sync to carry into Prometheus.
func (c *eventCounts) event(ev *outcomes.Event) {
	if int(ev.Type) < len(c.typed) {
		c.typed[ev.Type]++
		c.typedSet |= 1 << ev.Type
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
	for set := c.typedSet; set != 0; set &= set - 1 {
		t := bits.TrailingZeros16(set)
		if c.types[t] != nil {
			c.types[t].Add(float64(c.typed[t]))
		}
		c.typed[t] = 0
	}
	c.typedSet = 0
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
