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
// While either happens, or more than floodPending connects await a verdict,
// the agent is in flood mode (a gauge, a log line when it starts and
// ends), and no timeout counts (except a probe's): a node under a SYN
// flood drops packets, SYNs and the backends' answers alike, so a connect
// that went unanswered says nothing about the endpoint; nor does a SYN on a
// half-open tuple, which a flood walking its source ports sends again and
// again. Refusals and resets, the endpoint's own answers, still count.

// floodPending is how many connects awaiting a verdict are a sign of
// flood: a busy node has as many as new flows a second times the time a
// handshake and its settling take, hundreds; a SYN flood has its rate
// times the connect timeout.
const floodPending = 10000

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
	a.metrics.FloodMode.Set(1)
	a.log.Warn("flood mode: connect deadlines judge only connections whose events all arrived",
		"cause", why, "pending_connects", a.tracker.PendingConnects())
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
	if a.flood.on && now.Sub(a.flood.last) > floodQuiet {
		a.flood.on = false
		a.metrics.FloodMode.Set(0)
		a.log.Info("flood mode ended", "lasted", now.Sub(a.flood.since).Round(time.Millisecond).String(),
			"timeouts_withheld", a.withheldTotal()-a.flood.withheld)
	}
}
