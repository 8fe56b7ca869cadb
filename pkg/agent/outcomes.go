// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"net/netip"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// HandleEvents feeds one batch of kernel events through classification
// and accrual. A decision is written to the maps before the next event is
// looked at, so an ejection is never delayed by the rest of a batch.
func (a *Agent) HandleEvents(batch []outcomes.Event) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := range batch {
		ev := &batch[i]
		if int(ev.Type) < len(a.eventTypes) && a.eventTypes[ev.Type] != nil {
			a.eventTypes[ev.Type].Inc()
		}
		if ev.Type == outcomes.NewFlow {
			if ev.Flags&outcomes.FlagProbe != 0 {
				a.probeSeen[ev.Backend] = a.clk.Now()
			} else if a.engine.Excluded(ev.Backend) {
				// Events come in the datapath's order: this flow was
				// admitted after the failure that ejected its endpoint.
				a.metrics.FlowsToEjected.WithLabelValues(a.serviceName(ev.Service)).Inc()
			}
		}
		// First, before accrual may spend time on a table: the client
		// waits for this.
		if ev.Type == outcomes.Refused && ev.Flags&outcomes.FlagRescued != 0 {
			a.replay(ev)
		}
		tripped := ev.Flags&outcomes.FlagTripped != 0 && (ev.Type == outcomes.Refused || ev.Type == outcomes.Reset)
		if tripped {
			a.tripNow = ev.Backend
			a.rec.NoteKernelTrip(ev.Backend)
		}
		if o, ok := a.tracker.Classify(*ev); ok {
			a.observe(o)
		}
		if tripped {
			a.adoptTrip(ev.Service, ev.Backend, tripKind(ev), ev.At)
			a.tripNow = noTrip
		}
	}
	a.metrics.PendingConnects.Set(float64(a.tracker.PendingConnects()))
	a.syncCounters()
	// Wake the loop only when its timer would now be late: new connects
	// end after the pending ones, so under load this is rare (a wake-up
	// per batch cost the agent measurable CPU in the e2e benchmark).
	if a.nextDeadline().Before(a.armed) {
		select {
		case a.deadlines <- struct{}{}:
		default:
		}
	}
}

// serviceName names service id in metrics and logs (its id once it is
// gone). Called with mu held.
func (a *Agent) serviceName(id uint32) string {
	if s, ok := a.rec.Service(id); ok {
		return s.Spec.Name
	}
	return fmt.Sprint(id)
}

// unansweredDatagram counts a UDP flow its backend never answered (no
// verdict: many UDP protocols do not answer). Called with mu held.
func (a *Agent) unansweredDatagram(bid uint32) {
	svc := uint32(0)
	if b, ok := a.rec.Backend(bid); ok {
		svc = b.Service
	}
	a.metrics.UnansweredUDP.WithLabelValues(a.serviceName(svc)).Inc()
}

// noTrip is no backend id (ids start at 1).
const noTrip = 0

// observeSettled observes what the tracker's deadlines decided. A success
// decided by time (an established connection that outlived the connect
// timeout without a reset) is one the datapath never sees: its streak of
// failures ends here too, as accrual's does.
func (a *Agent) observeSettled(o accrual.Outcome) {
	if o.Success {
		a.rec.ResetBackendTrip(o.Endpoint)
	}
	a.observe(o)
}

// tripKind is the failure kind of a tripping event.
func tripKind(ev *outcomes.Event) accrual.Kind {
	switch {
	case ev.Type != outcomes.Reset:
		return accrual.KindRefused
	case ev.Flags&outcomes.FlagBackendData != 0:
		return accrual.KindResetAfterData
	}
	return accrual.KindReset
}

// adoptTrip makes a kernel trip, the datapath's own ejection of backend
// bid at a failure of kind seen at at, accrual's decision: the failure has
// been observed already (when its event arrived), and if that did not
// eject the endpoint (its events were lost, or the tracker had judged the
// flow before), accrual ejects it now for its consecutive failures. If
// accrual keeps it in (the max-ejection cap, fail-open, or it is not ready
// here), the trip is undone: the backend's kernel entry gets the state
// accrual says. Called with mu held.
func (a *Agent) adoptTrip(svc, bid uint32, kind accrual.Kind, at time.Time) {
	a.tripsHandled[svc]++
	a.handleTransitions(a.engine.KernelTripped(bid, kind, at))
	name := a.serviceName(svc)
	if a.engine.StateOf(bid) != accrual.Ready {
		a.metrics.KernelTrips.WithLabelValues(name, "adopted").Inc()
		a.program(svc) // the budget, with this trip read
		return
	}
	a.metrics.KernelTrips.WithLabelValues(name, "undone").Inc()
	a.log.Info("kernel trip undone: accrual keeps the endpoint in", "service", name,
		"endpoint", a.endpointName(bid))
	if err := a.rec.UndoTrip(bid); err != nil {
		a.metrics.ProgramErrors.Inc()
		a.log.Error("undo a kernel trip", "endpoint", a.endpointName(bid), "err", err)
	}
	a.program(svc) // the budget unit it took comes back
}

// tripBudget is how many more trips the datapath may make in service id:
// the room accrual's max-ejection cap leaves, less the trips the datapath
// made that the agent has not read yet (their endpoints are out already).
// Called with mu held.
func (a *Agent) tripBudget(id uint32) int64 {
	room := a.engine.KernelTripRoom(id)
	if room == 0 {
		return 0
	}
	made := a.rec.ServiceTrip(id).Trips
	handled := a.tripsHandled[id]
	if made < handled { // a recycled id: its counter started again
		a.tripsHandled[id], handled = made, made
	}
	return max(room-int64(made-handled), 0)
}

// findLostTrips looks for kernel trips whose events were lost: the
// datapath counted more trips than the agent read, so some backend the
// agent believes active is ejected in the kernel. Each is adopted (or
// undone) as if its event had come. Called with mu held.
func (a *Agent) findLostTrips() {
	for _, s := range a.rec.Services() {
		made := a.rec.ServiceTrip(s.ID).Trips
		if made <= a.tripsHandled[s.ID] {
			continue
		}
		for _, bid := range a.rec.KernelEjected(s.ID) {
			a.log.Warn("kernel trip found without its event (events lost)", "service", s.Spec.Name,
				"endpoint", a.endpointName(bid))
			a.rec.NoteKernelTrip(bid)
			a.adoptTrip(s.ID, bid, accrual.KindRefused, time.Time{})
		}
		a.tripsHandled[s.ID] = made
	}
}

// maxReplayAge: a refusal older than this is not replayed. Linux clients
// retransmit a SYN after 1 s, after which the flow has moved on its own.
const maxReplayAge = 200 * time.Millisecond

// replay sends a refused flow's SYN again, so that the datapath moves it
// to another backend now rather than on the client's retransmission.
func (a *Agent) replay(ev *outcomes.Event) {
	if a.replayer == nil {
		return
	}
	s, ok := a.rec.Service(ev.Service)
	b, bok := a.rec.Backend(ev.Backend)
	if !ok || !bok {
		return
	}
	// An old refusal (a backlog after a restart, a reader far behind) has
	// had the client's own retransmission by now; and in a flood, a replay
	// per refused SYN would be the flood's work done twice.
	if a.clk.Now().Sub(ev.At) > maxReplayAge {
		a.metrics.Replays.WithLabelValues("refused", "stale").Inc()
		return
	}
	if a.flood.on {
		a.metrics.Replays.WithLabelValues("refused", "flood").Inc()
		return
	}
	vip := netip.AddrPortFrom(s.Spec.Key.VIP, s.Spec.Key.Port)
	a.countReplay("refused", s.Spec.Name, ev.Client, a.replayer.Replay(ev.Client, vip, b.Addr))
}

// countShed counts a service's flows the tracker left untracked, and logs
// when a spell of it starts (endShedding logs its end).
func (a *Agent) countShed(svc uint32, overCap, overMemory uint64) {
	name := a.serviceName(svc)
	now := a.clk.Now()
	for _, r := range []struct {
		n      uint64
		reason string
	}{{overCap, "service_cap"}, {overMemory, "memory_limit"}} {
		if r.n == 0 {
			continue
		}
		a.metrics.UntrackedFlows.WithLabelValues(name, r.reason).Add(float64(r.n))
		key := shedKey{svc, r.reason}
		sp := a.shedding[key]
		if sp == nil {
			sp = &shedSpell{name: name, since: now}
			a.shedding[key] = sp
			a.log.Warn("not tracking some new flows of a service: the kernel's signals (RST, retransmitted SYN) still judge them, connect deadlines and settling do not",
				"service", name, "reason", r.reason, "tracked_flows", a.tracker.Pending(),
				"per_service_cap", a.tracker.MaxPendingPerService, "limit", a.tracker.MaxPending)
		}
		sp.last = now
		sp.flows += r.n
	}
}

// shedKey is a service and the reason its flows went untracked.
type shedKey struct {
	svc    uint32
	reason string
}

// shedSpell is a time a service's new flows were not all tracked.
type shedSpell struct {
	name        string
	since, last time.Time
	flows       uint64
}

// endShedding ends the spells with no untracked flow for floodQuiet, one
// log line each. Called with mu held.
func (a *Agent) endShedding(now time.Time) {
	for key, sp := range a.shedding {
		if now.Sub(sp.last) <= floodQuiet {
			continue
		}
		delete(a.shedding, key)
		a.log.Info("tracking every new flow of a service again", "service", sp.name, "reason", key.reason,
			"lasted", sp.last.Sub(sp.since).Round(time.Millisecond).String(), "untracked_flows", sp.flows)
	}
}

// syncCounters carries counts kept outside Prometheus into it.
func (a *Agent) syncCounters() {
	if a.tracker.FloodConnects() > floodPending {
		a.floodSign(a.clk.Now(), "too many connects awaiting a verdict")
	}
	// Flows the tracker's caps left untracked are counted, not a flood
	// sign: a service over its cap is a tenant's doing (its connects count
	// toward flood mode up to its share all the same), and the node's
	// ceiling is memory, reached first by connections that are no connects.
	if d := a.tracker.Overflow - a.overflowSeen; d > 0 {
		a.metrics.PendingOverflow.Add(float64(d))
		a.overflowSeen = a.tracker.Overflow
	}
	a.tracker.DrainShed(a.countShed)
	a.metrics.TrackedFlows.Set(float64(a.tracker.Pending()))
	if d := a.tracker.Withheld - a.withheldSeen; d > 0 {
		a.metrics.Withheld.WithLabelValues("events_lost").Add(float64(d))
		a.withheldSeen = a.tracker.Withheld
	}
	if d := a.tracker.WithheldOld - a.withheldOldSeen; d > 0 {
		a.metrics.Withheld.WithLabelValues("before_start").Add(float64(d))
		a.withheldOldSeen = a.tracker.WithheldOld
	}
	if a.events == nil {
		return
	}
	if bad := a.events.Undecodable(); bad > a.badSeen {
		a.metrics.EventsUndecodable.Add(float64(bad - a.badSeen))
		a.badSeen = bad
	}
}

// Advance runs due deadlines: penalties ending, connects timing out.
func (a *Agent) Advance() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.handleTransitions(a.engine.Advance())
	now := a.clk.Now()
	upTo := a.judgeUpTo(now)
	if a.tracker.Due(upTo) {
		a.checkLoss(now)
	}
	a.tracker.Expire(upTo, a.observeSettled)
	if a.replayer != nil {
		a.tracker.DueReplays(upTo, a.replayUnanswered)
	}
	a.metrics.PendingConnects.Set(float64(a.tracker.PendingConnects()))
	a.syncCounters()
}

// handleTransitions reprograms the services accrual's decisions touch,
// then logs, counts, persists and reports them. Called with mu held.
func (a *Agent) handleTransitions(trs []accrual.Transition) {
	if len(trs) == 0 {
		return
	}
	var dirty []uint32
	for _, t := range trs {
		if t.To == accrual.Probation && t.From != accrual.Probation {
			a.probeSeen[t.Endpoint] = a.clk.Now() // granted now
		}
		if t.To != accrual.Ready {
			a.forgetTimeouts(t.Service, t.Endpoint)
		}
		if t.Reason == accrual.ReasonProbeInconclusive {
			if err := a.rec.Regrant(t.Endpoint); err != nil {
				a.log.Error("grant a new probe", "endpoint", a.endpointName(t.Endpoint), "err", err)
			}
		}
		if len(dirty) == 0 || dirty[len(dirty)-1] != t.Service {
			dirty = append(dirty, t.Service)
		}
	}
	for _, id := range dirty {
		a.program(id)
	}
	// The maps are written: an ejection's reaction time ends here.
	now := outcomes.MonoNow()
	for _, t := range trs {
		_, ok := a.rec.Service(t.Service)
		name := a.serviceName(t.Service)
		a.metrics.Transitions.WithLabelValues(name, string(t.Reason)).Inc()
		var reaction time.Duration
		// Only a failure seen now has a reaction time: a restored ejection's
		// failure happened before the restart.
		if t.To == accrual.Ejected && t.From != accrual.Ejected && !t.FailureAt.IsZero() &&
			t.Reason != accrual.ReasonRestored && !t.FailureAt.Before(a.begun) {
			reaction = time.Duration(now - (t.FailureAt.UnixNano() - a.monoOffset))
			a.metrics.Reaction.Observe(reaction.Seconds())
		}
		if !t.ServiceLevel() {
			a.persist(t)
		}
		a.logTransition(name, t, reaction)
		if a.notify != nil && ok {
			n := Transition{Service: name, Transition: t}
			if b, bok := a.rec.Backend(t.Endpoint); bok {
				n.Endpoint, n.Addr = b.Name, b.Addr
			}
			a.notify(n)
		}
	}
}

// program writes one service's admission to the maps; a failure is
// counted and retried by Maintain.
func (a *Agent) program(id uint32) {
	if _, ok := a.rec.Service(id); !ok {
		delete(a.retry, id)
		return
	}
	active, probation, failOpen := a.engine.Admitted(id)
	if err := a.rec.ProgramService(id, active, probation, failOpen, a.tripBudget(id)); err != nil {
		a.metrics.ProgramErrors.Inc()
		a.log.Error("programming table; retrying", "err", err)
		a.retry[id] = true
		return
	}
	delete(a.retry, id)
}

func (a *Agent) logTransition(service string, t accrual.Transition, reaction time.Duration) {
	switch t.Reason {
	case accrual.ReasonFailOpenStart:
		a.log.Warn("service failing open: no endpoint ready, new flows go to all endpoints", "service", service)
		return
	case accrual.ReasonFailOpenEnd:
		a.log.Info("service no longer failing open", "service", service)
		return
	}
	attrs := []any{"service", service, "endpoint", a.endpointName(t.Endpoint),
		"from", t.From.String(), "to", t.To.String(), "reason", string(t.Reason)}
	if t.Kind != 0 {
		attrs = append(attrs, "failure_kind", t.Kind.String(), "consecutive_failures", t.Failures)
	}
	if t.Cause != "" {
		attrs = append(attrs, "cause", string(t.Cause))
	}
	// A window rule says what the window held and the limit it passed.
	if w := t.Window; w.Calls > 0 {
		attrs = append(attrs, "window_calls", w.Calls, "window_failures", w.Failures, "window_slow", w.Slow,
			"failure_rate", round3(w.FailureRate), "slow_rate", round3(w.SlowRate), "threshold", t.Threshold)
	}
	// The penalty: drawn (ejected), served (probation), reset (ready: 0s).
	attrs = append(attrs, "penalty", t.Penalty.String())
	if t.To == accrual.Ejected {
		attrs = append(attrs, "probation_at", t.ProbationAt.Format(time.RFC3339Nano))
	}
	if reaction > 0 {
		// Kernel's timestamp of the deciding failure -> maps written.
		attrs = append(attrs, "reaction_us", reaction.Microseconds())
	}
	if t.To == accrual.Ejected && t.Endpoint == a.tripNow {
		// The datapath took it out at that failure already (a kernel
		// trip): no new flow waited for the reaction above.
		attrs = append(attrs, "kernel_trip", true)
	}
	level := slog.LevelInfo
	if t.To == accrual.Ejected || t.Reason == accrual.ReasonEjectionSuppressed {
		level = slog.LevelWarn
	}
	a.log.Log(context.Background(), level, "endpoint "+t.To.String(), attrs...)
}

// round3 keeps log lines readable: a rate to three decimals.
func round3(f float64) float64 { return math.Round(f*1000) / 1000 }
