// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"time"

	"k8s.io/utils/clock"

	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// Run is the agent's loop until ctx ends: it applies desired state as it
// changes (a config file's, or Kubernetes', both as desired.State), runs
// deadlines as they fall due, and maintains the maps. Outcome events
// arrive through HandleEvents on the reader's goroutine meanwhile.
func (a *Agent) Run(ctx context.Context, states <-chan desired.State) {
	timer := a.clk.NewTimer(time.Hour)
	defer timer.Stop()
	a.rearm(timer) // sets armed, which HandleEvents compares against
	sweep := a.clk.NewTicker(a.every.sweep)
	defer sweep.Stop()
	sweepDone := make(chan sweepResult, 1)
	sweeping := false
	probes := a.clk.NewTicker(a.every.probes)
	defer probes.Stop()
	// The heartbeat the datapath's dead-man's switch watches: written
	// from the loop itself, so a loop that hangs stops it too.
	heartbeat := a.clk.NewTicker(time.Second)
	defer heartbeat.Stop()
	a.Heartbeat()
	for {
		select {
		case <-ctx.Done():
			return
		case st := <-states:
			// Only a config file's node settings can fail to apply.
			if err := a.Apply(st); err != nil {
				a.log.Error("config reload failed to apply", "err", err)
			}
		case <-timer.C():
			a.Advance()
		case <-a.deadlines:
			// Events brought new deadlines: rearm below.
		case <-sweep.C():
			// Scanning conntrack takes a while on a big table: off the loop,
			// one at a time (two would release a flow's slot twice).
			if !sweeping {
				sweeping = true
				mark := a.BeginSweep()
				go func() { sweepDone <- sweepResult{a.SweepConntrack(), mark} }()
			}
		case <-probes.C():
			a.Maintain()
		case <-heartbeat.C():
			a.Heartbeat()
		case done := <-sweepDone:
			sweeping = false
			a.SweepDone(done.inUse, done.mark)
		}
		a.rearm(timer)
	}
}

// Advance runs due deadlines: penalties ending, connects timing out,
// replays of unanswered SYNs.
func (a *Agent) Advance() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.trans.handle(a.engine.Advance())
	now := a.clk.Now()
	upTo := a.flood.judgeUpTo(now)
	if a.tracker.Due(upTo) {
		a.flood.checkLoss(now)
	}
	a.tracker.Expire(upTo, a.observer.observeSettled)
	// The reader runs the replays as it reads (caughtUp); what is due
	// here besides is not left for its next read.
	a.runReplays(upTo, now)
	a.metrics.PendingConnects.Set(float64(a.tracker.PendingConnects()))
	a.counts.sync()
}

// runReplays replays the SYNs still unanswered at their replay deadline
// by upTo, a time up to which every event has been read. Called with mu
// held.
func (a *Agent) runReplays(upTo, now time.Time) {
	if a.replays.replayer == nil {
		return
	}
	if !a.tracker.ReplayDue(upTo) {
		return
	}
	// As before Expire: events lost since the last look are flood mode,
	// in which no replay is sent (a lost SYN-ACK would leave its flow
	// looking unanswered).
	a.flood.checkLoss(now)
	// Deadlines read long after they passed (a reader that lagged) are
	// not replayed: the replay would come well after the moment it was
	// for.
	a.tracker.DueReplays(upTo.Add(-maxReplayAge), a.replays.late)
	a.tracker.DueReplays(upTo, a.replays.unanswered)
	a.replays.applyVoids()
}

// caughtUp is the reader's, on its goroutine, each time it has handed
// over every event up to at: it replays the SYNs still unanswered at
// their replay deadline by then, and asks to read again by the next one.
// A replay deadline (16 ms or more) can fall due before the reader's
// 50 ms poll, and only a read can say whether its SYN was answered: run
// from the loop, such a deadline cost a wake-up of the loop, a kick of
// the reader and a second wake-up once it had read.
func (a *Agent) caughtUp(at time.Time) (readBy time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.runReplays(at, a.clk.Now())
	next, ok := a.tracker.NextReplay()
	if !ok || a.flood.on {
		// In flood mode no replay is sent: the deadlines wait for the
		// reader's poll, not a wake-up each.
		return time.Time{}
	}
	// Deadlines a moment apart (many SYNs unanswered) are read together.
	if soon := at.Add(replaySlack); next.Before(soon) {
		return soon
	}
	return next
}

// replaySlack is the soonest the reader is asked to read again after a
// read: deadlines closer together are read together, a replay at most
// that late (a replay deadline is 16 ms at least).
const replaySlack = time.Millisecond

// wake tells Run of a deadline earlier than the one its timer is armed
// for. Called with mu held, after events or a condemnation: new connects
// end after the pending ones, so under load this is rare (a wake-up per
// batch cost the agent measurable CPU in the e2e benchmark).
func (a *Agent) wake() {
	if a.nextDeadline().Before(a.armed) {
		select {
		case a.deadlines <- struct{}{}:
		default:
		}
	}
}

// nextDeadline is the next accrual or connect deadline, or an hour from
// now when there is none. Called with mu held.
func (a *Agent) nextDeadline() time.Time {
	next, ok := a.engine.NextDeadline()
	// Once the reader is there, it runs the replay deadlines (caughtUp):
	// the loop's timer does not wake for them.
	tracked := a.tracker.NextDeadline
	if a.events != nil {
		tracked = a.tracker.NextExpiry
	}
	if t, tok := tracked(); tok {
		// A deadline the reader has not caught up with yet is looked at
		// again shortly, not in a busy loop.
		if now := a.clk.Now(); !t.After(now) && a.events != nil {
			if c := a.events.CaughtUp(); c.Before(t) {
				// Soon while the reader keeps up (kicked, as it polls
				// seldom: outcomes.PollMax); once a second while it lags
				// or has stopped (Ready says so), not in a busy loop.
				if now.Sub(c) < lagLimit {
					a.events.Kick()
					t = now.Add(outcomes.Poll)
				} else {
					t = now.Add(lagLimit)
				}
			}
		}
		if !ok || t.Before(next) {
			next, ok = t, true
		}
	}
	if !ok {
		return a.clk.Now().Add(time.Hour)
	}
	return next
}

// rearm points the timer at the next accrual or connect deadline.
func (a *Agent) rearm(timer clock.Timer) {
	a.mu.Lock()
	a.armed = a.nextDeadline()
	d := max(a.armed.Sub(a.clk.Now()), 0)
	a.mu.Unlock()
	if !timer.Stop() {
		select {
		case <-timer.C():
		default:
		}
	}
	timer.Reset(d)
}

// NextDeadline is when Advance next has work: a penalty ending or a
// connect timing out (an hour from now when nothing is pending).
func (a *Agent) NextDeadline() time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.nextDeadline()
}
