// SPDX-License-Identifier: Apache-2.0

package agent

import "time"

// Evidence rules for the agent's own connect deadlines. The kernel's
// signals (a RST, a SYN-ACK, a retransmitted SYN) are evidence when they
// arrive; the agent's deadline is evidence only of what did not arrive,
// so it is judged only when nothing can still be on its way:
//   - late events: a deadline is judged only once the reader has read
//     every event up to it (the reader's CaughtUp), so a SYN-ACK still in
//     the ring when the deadline passes is not a timeout;
//   - lost events: a connection that waited while the datapath dropped
//     events (pb_stats events_lost grew) gets no timeout from its deadline
//     (counted in connect_timeouts_withheld_total).
// While either happens, or more than floodPending connects await their
// backend's first answer, the agent is in flood mode (a gauge, a log line
// when it starts and ends), and no timeout counts (except a probe's). Only
// connects still waiting for a SYN-ACK count (an established connection
// that is settling is no sign of flood), and each service's up to
// floodShare: one service's half-open connections, which one tenant can
// open at will, cannot hold the node in flood mode alone (a flood of one
// service shows in the datapath's SYN rate, which arms the SYN guard and
// flood mode below). A node under a SYN flood drops packets, SYNs and the
// backends' answers alike, so a connect that went unanswered says nothing
// about the endpoint; nor does a SYN on a half-open tuple, which a flood
// walking its source ports sends again and again. Refusals and resets, the
// endpoint's own answers, still count.
//
// Flood mode also turns the datapath's SYN guard on: a SYN opening a flow
// from a source that has not lately proved itself real (a backend sent it
// payload) gets a small per-CPU budget and is dropped in XDP beyond it.
// A spoofed flood then costs the node one XDP pass per SYN instead of a
// handshake with a backend, two more passes and the client's RST, which
// is what saturated the veths and cost legit connects before. Sources
// that proved themselves keep connecting as before; new ones share the
// budget until the flood ends. Drops over the budget are a sign of flood,
// so the guard holds for as long as the flood lasts.

// floodPending is how many connects waiting for their backend's first
// answer are a sign of flood: a busy node has as many as new flows a
// second times a handshake's time, hundreds; a SYN flood has its rate
// times the connect timeout.
const floodPending = 10000

// floodShare is the most one service's pending connects count toward
// floodPending: at least five services must be flooded together.
const floodShare = floodPending / 4

// floodQuiet is how long flood mode outlasts its last sign.
const floodQuiet = 10 * time.Second

// lagLimit is how far behind the reader may be before it counts as a
// sign of flood (the reader's poll is 5 ms; a long Apply holding the
// agent's lock also holds the reader back, for less than this).
const lagLimit = time.Second

// judgeUpTo is the time up to which connect deadlines may be judged: now,
// or earlier while the reader is behind. Called with mu held.
func (a *Agent) judgeUpTo(now time.Time) time.Time {
	if a.events == nil {
		return now
	}
	c := a.events.CaughtUp()
	if c.IsZero() {
		return c // the reader has not yet read the ring to its end once
	}
	if c.Before(now) {
		if now.Sub(c) > lagLimit {
			a.floodSign(now, "events read late")
		}
		return c
	}
	return now
}

// checkLoss tells the tracker of events the datapath dropped since the
// last look, before deadlines are judged. Called with mu held.
func (a *Agent) checkLoss(now time.Time) {
	gs, err := a.stats.GlobalStats()
	if err != nil {
		return
	}
	if gs.EventsLost > a.lostSeen {
		a.tracker.EventsLost()
		a.lostSeen = gs.EventsLost
		a.floodSign(now, "events lost")
	}
}

// floodSign records a sign of flood, entering flood mode if not in it.
func (a *Agent) floodSign(now time.Time, why string) {
	a.flood.last = now
	if a.flood.on {
		return
	}
	a.flood.on, a.flood.since, a.flood.withheld = true, now, a.withheldTotal()
	if s, err := a.stats.SYNGuardStats(); err == nil {
		a.flood.dropped, a.flood.droppedAtStart = s.Dropped, s.Dropped
	}
	a.flood.looked = now
	a.metrics.FloodMode.Set(1)
	a.setGuard(true)
	a.log.Warn("flood mode: connect deadlines judge only connections whose events all arrived",
		"cause", why, "pending_connects", a.tracker.PendingConnects(), "flood_connects", a.tracker.FloodConnects(),
		"syn_guard_rate_per_cpu", a.guard.Rate)
}

// guardLease is how long the SYN guard stays on unless renewed: a few of
// Maintain's rounds, each of which renews it while flood mode lasts. A
// dead agent's guard ends by itself.
func (a *Agent) guardLease() time.Duration { return 5 * a.every.probes }

// setGuard turns the SYN guard on for a lease (renewing it) or off; off,
// a CPU that sees a flood's rate still arms it itself. With no rate
// configured there is no guard at all. Called with mu held.
func (a *Agent) setGuard(on bool) {
	if on && a.guard.Rate == 0 {
		return
	}
	g := a.guard
	g.Lease = 0
	if on {
		g.Lease = a.guardLease()
	}
	if err := a.rec.SetSYNGuard(g); err != nil {
		a.metrics.ProgramErrors.Inc()
		if !a.guardErr {
			a.log.Error("writing the SYN guard", "on", on, "err", err)
		}
		a.guardErr = true
		return
	}
	a.guardErr = false
	active := 0.0
	if on {
		active = 1
	}
	a.metrics.SYNGuard.Set(active)
}

// withheldTotal counts connect timeouts withheld for any reason.
func (a *Agent) withheldTotal() uint64 {
	return a.tracker.Withheld + a.tracker.WithheldOld + a.withheldHere
}

// floodCheck ends flood mode after floodQuiet without a sign (and looks
// at the reader's lag, which nothing else may have looked at lately).
// Called with mu held.
func (a *Agent) floodCheck(now time.Time) {
	a.judgeUpTo(now)
	// A CPU armed the guard itself since the last look: a flood, seen
	// first by the datapath.
	s, serr := a.stats.SYNGuardStats()
	if serr == nil {
		if s.Armed > a.flood.armed {
			a.floodSign(now, "the datapath armed the SYN guard: SYNs to services over --syn-guard-arm-rate")
		}
		a.flood.armed = s.Armed
	}
	if !a.flood.on {
		return
	}
	// The guard dropping more than a CPU's budget since the last look:
	// untrusted SYNs come at over twice the rate it admits, the flood
	// goes on, though the guard keeps it from showing anywhere else. Fewer
	// drops (a burst of new clients) do not hold flood mode. (A flood mode
	// that began just now read the counters after s: nothing to compare.)
	if serr == nil && s.Dropped >= a.flood.dropped {
		budget := float64(a.guard.Rate) * now.Sub(a.flood.looked).Seconds()
		if float64(s.Dropped-a.flood.dropped) > budget {
			a.floodSign(now, "SYNs from untrusted sources over the SYN guard's budget")
		}
		a.flood.dropped, a.flood.looked = s.Dropped, now
	}
	if now.Sub(a.flood.last) <= floodQuiet {
		a.setGuard(true)
		return
	}
	a.flood.on = false
	a.metrics.FloodMode.Set(0)
	a.setGuard(false)
	a.log.Info("flood mode ended", "lasted", now.Sub(a.flood.since).Round(time.Millisecond).String(),
		"timeouts_withheld", a.withheldTotal()-a.flood.withheld,
		"syns_dropped", a.flood.dropped-a.flood.droppedAtStart)
}
