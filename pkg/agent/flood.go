// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"time"

	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Flood mode, and when the agent's own connect deadlines count. The kernel's
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

// floodMode is the agent's flood mode and the SYN guard it holds on.
type floodMode struct {
	*core
	on          bool
	since, last time.Time
	withheld    uint64
	// dropped: the SYN guard's drops at the last look (looked), and
	// when flood mode began.
	dropped, droppedAtStart uint64
	looked                  time.Time
	// armed: the datapath's own armings at the last look.
	armed uint64
	// lostSeen: pb_stats events_lost at the last look.
	lostSeen uint64
	// withheldHere: timeouts withheld by observe (flood, service-wide),
	// beside the tracker's own.
	withheldHere uint64
	// guard: the SYN guard's settings; guardErr: its last write failed
	// (logged once); lease: how long one write holds it on (see
	// guardLease).
	guard    maps.SYNGuard
	guardErr bool
	lease    time.Duration
}

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
// sign of flood (the reader polls every 5 to 50 ms and is kicked for a
// due deadline; a long Apply holding the agent's lock also holds the
// reader back, for less than this).
const lagLimit = time.Second

// judgeUpTo is the time up to which connect deadlines may be judged: now,
// or earlier while the reader is behind. Called with mu held.
func (f *floodMode) judgeUpTo(now time.Time) time.Time {
	if f.events == nil {
		return now
	}
	c := f.events.CaughtUp()
	if c.IsZero() {
		return c // the reader has not yet read the ring to its end once
	}
	if c.Before(now) {
		if now.Sub(c) > lagLimit {
			f.sign(now, "events read late")
		}
		return c
	}
	return now
}

// checkLoss tells the tracker of events the datapath dropped since the
// last look, before deadlines are judged. Called with mu held.
func (f *floodMode) checkLoss(now time.Time) {
	gs, err := f.stats.GlobalStats()
	if err != nil {
		return
	}
	if gs.EventsLost > f.lostSeen {
		f.tracker.EventsLost()
		f.lostSeen = gs.EventsLost
		f.sign(now, "events lost")
	}
}

// sign records a sign of flood, entering flood mode if not in it.
func (f *floodMode) sign(now time.Time, why string) {
	f.last = now
	if f.on {
		return
	}
	f.on, f.since, f.withheld = true, now, f.withheldTotal()
	if s, err := f.stats.SYNGuardStats(); err == nil {
		f.dropped, f.droppedAtStart = s.Dropped, s.Dropped
	}
	f.looked = now
	f.metrics.FloodMode.Set(1)
	f.setGuard(true)
	f.log.Warn("flood mode: connect deadlines judge only connections whose events all arrived",
		"cause", why, "pending_connects", f.tracker.PendingConnects(), "flood_connects", f.tracker.FloodConnects(),
		"syn_guard_rate_per_cpu", f.guard.Rate)
}

// guardLease is how long the SYN guard stays on unless renewed: a few of
// Maintain's rounds (every probeCheck), each of which renews it while
// flood mode lasts. A dead agent's guard ends by itself.
func guardLease(probeCheck time.Duration) time.Duration { return 5 * probeCheck }

// setGuard turns the SYN guard on for a lease (renewing it) or off; off,
// a CPU that sees a flood's rate still arms it itself. With no rate
// configured there is no guard at all. Called with mu held.
func (f *floodMode) setGuard(on bool) {
	if on && f.guard.Rate == 0 {
		return
	}
	lease := time.Duration(0)
	if on {
		lease = f.lease
	}
	if err := f.rec.GuardSYNs(lease); err != nil {
		f.metrics.ProgramErrors.Inc()
		if !f.guardErr {
			f.log.Error("writing the SYN guard", "on", on, "err", err)
		}
		f.guardErr = true
		return
	}
	f.guardErr = false
	active := 0.0
	if on {
		active = 1
	}
	f.metrics.SYNGuard.Set(active)
}

// withheldTotal counts connect timeouts withheld for any reason.
func (f *floodMode) withheldTotal() uint64 {
	return f.tracker.Withheld + f.tracker.WithheldOld + f.withheldHere
}

// check ends flood mode after floodQuiet without a sign (and looks
// at the reader's lag, which nothing else may have looked at lately).
// Called with mu held.
func (f *floodMode) check(now time.Time) {
	f.judgeUpTo(now)
	// A CPU armed the guard itself since the last look: a flood, seen
	// first by the datapath.
	s, serr := f.stats.SYNGuardStats()
	if serr == nil {
		if s.Armed > f.armed {
			f.sign(now, "the datapath armed the SYN guard: SYNs to services over --syn-guard-arm-rate")
		}
		f.armed = s.Armed
	}
	if !f.on {
		return
	}
	// The guard dropping more than a CPU's budget since the last look:
	// untrusted SYNs come at over twice the rate it admits, the flood
	// goes on, though the guard keeps it from showing anywhere else. Fewer
	// drops (a burst of new clients) do not hold flood mode. (A flood mode
	// that began just now read the counters after s: nothing to compare.)
	if serr == nil && s.Dropped >= f.dropped {
		budget := float64(f.guard.Rate) * now.Sub(f.looked).Seconds()
		if float64(s.Dropped-f.dropped) > budget {
			f.sign(now, "SYNs from untrusted sources over the SYN guard's budget")
		}
		f.dropped, f.looked = s.Dropped, now
	}
	if now.Sub(f.last) <= floodQuiet {
		f.setGuard(true)
		return
	}
	f.on = false
	f.metrics.FloodMode.Set(0)
	f.setGuard(false)
	f.log.Info("flood mode ended", "lasted", now.Sub(f.since).Round(time.Millisecond).String(),
		"timeouts_withheld", f.withheldTotal()-f.withheld,
		"syns_dropped", f.dropped-f.droppedAtStart)
}
