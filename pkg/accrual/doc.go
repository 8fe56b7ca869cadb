// SPDX-License-Identifier: Apache-2.0

// Package accrual is penaltybox's failure-accrual engine: for every endpoint
// of every service it runs the state machine
//
//	ready ──N consecutive counted failures──► ejected
//	ejected ──penalty over (Advance)────────► probation
//	probation ──probe succeeded─────────────► ready     (streak and penalty level reset)
//	probation ──probe failed────────────────► ejected   (penalty doubled, capped)
//
// driven by the classified L4 outcome of every new connection that the
// datapath reports, and tells the agent what each service's Maglev table
// must hold (Engine.Admitted). Settings and defaults follow Linkerd's
// consecutive failure accrual so operators can carry theirs over; the
// window rules (below) follow Linkerd's unified breaker and Envoy's
// success-rate outlier detection.
//
// # Decisions
//
// Outcomes. Only failure kinds in Settings.FailureKinds count; other kinds
// are ignored: they neither extend nor reset the streak (they are still
// counted in the endpoint's statistics). A success resets the streak of a
// ready endpoint. The engine does not read the clock on that common path
// (a window reads it only for an outcome without a time); Outcome.At is
// the event's own time and feeds "last failure", the time-based window and
// the reaction-time field Transition.FailureAt.
//
// Ejection at exactly N. The N-th consecutive counted failure ejects; the
// ejection is decided when that outcome is observed and the penalty starts
// at the engine clock's now (not at Outcome.At), so a backlog in the ring
// buffer never shortens a penalty.
//
// Penalty. A penalty level L counts the failed probes since the endpoint
// was last ready; the base penalty is MinPenalty·2^L capped at MaxPenalty,
// then jittered uniformly within [p·(1−JitterRatio), p·(1+JitterRatio)]
// using the injected random source. The jitter is applied after the cap, as
// Linkerd does, so a penalty may exceed MaxPenalty by up to JitterRatio:
// capping after jitter would pile every long-failing endpoint of a fleet onto
// the same instant, which is exactly what the jitter exists to prevent.
// Validate bounds MaxPenalty (MaxPenaltyLimit) and JitterRatio (≤ 1), and
// SetService clamps settings that skipped it to the same bounds, so the
// longest penalty is 48h and no doubling, jitter or deadline wraps; a
// penalty restored from disk is clamped too.
//
// Probation. The datapath admits exactly one new flow to an endpoint in
// probation and flags its outcomes Probe=true. A probe success returns the
// endpoint to ready; a counted probe failure ejects it again with the next
// penalty level. A probe failure of an ignored kind proves nothing either
// way: the endpoint stays in probation and the engine emits a
// probation→probation transition (ReasonProbeInconclusive) so the agent
// grants a fresh probe; otherwise the spent probe would leave the endpoint
// in probation forever. The Probe flag only means something while the
// endpoint is in probation; elsewhere the outcome is handled as any other.
//
// Stragglers. Outcomes without the Probe flag for an endpoint that is
// ejected or in probation come from flows opened before the ejection (the
// conntrack entry keeps them on their backend). They never change the state
// but are counted (Counters.Stragglers) — except during fail-open, below.
//
// Window rules. Modes failure-rate and unified, a SlowConnectThreshold
// and Outliers judge a window of each ready endpoint's recent outcomes
// (time-based: ten buckets of a tenth of Window each, the oldest dropped
// as time passes it, so the window holds nine tenths to all of its span;
// count-based: exactly the last WindowCalls outcomes). A window counts successes
// and counted failures (overtaken ones included: the overtaken rule is
// about streaks), and slow successes among the successes; it reads the
// outcome's own time and the clock only when that is zero. No rule judges
// a window of fewer than MinCalls. Failure rate: modes failure-rate and
// unified eject when failures exceed FailureRateThreshold of the calls
// (unified also on the streak, whichever comes first). Slow connects: any
// mode but none ejects when slow successes exceed SlowConnectRateThreshold;
// a slow success is a success for every other rule. Outliers: Advance
// judges each such service every tenth of Window (NextDeadline includes
// it): among its ready endpoints whose windows hold OutlierMinCalls, if
// there are OutlierMinHosts, those whose success rate is below the mean
// by more than OutlierStdevFactor population standard deviations are
// ejected. All three eject through the same path as the streak (cap,
// suppression once per spell of being due, fail-open, penalty). The window
// is emptied on ejection and takes nothing while the endpoint is out; a
// probe is judged alone. Relapse: a window rule that ejects an endpoint
// within Window of the probe success that returned it continues the
// penalty level it had then, one doubling further (the streak rule's
// ejections start from the minimum as before); a Window of readiness
// forgets it. Windows are allocated only for services whose settings need
// one (Settings.Windowed), and are not persisted: a restored endpoint
// starts with an empty window, and its per-rule ejection counts start from
// zero (the total, Counters.Ejections, is carried over).
//
// Max ejection percent. See [EjectionCap]: at most floor(n·pct/100) of a
// service's n endpoints may be ejected or in probation at once, with no
// floor of one, and 0 never ejects.
//
// Suppressed ejections. When the N-th failure finds the cap full the
// endpoint stays ready and one ReasonEjectionSuppressed event (ready→ready)
// is emitted and counted for that streak. The streak is kept, so every
// further counted failure retries the ejection (silently) and ejects as soon
// as the cap has room; a success ends the streak. That makes the
// suppressed counter mean "ejections that were due and did not happen"
// rather than "failures seen while capped", and it does not flood the agent
// with one event per failure of a dead endpoint. The window rules do the
// same, each on its own: one suppression per spell of the rule being due,
// which ends when its share falls back to the threshold (for outliers:
// when a judgement finds the endpoint no outlier).
//
// Fail-open. A service with endpoints of which none is ready fails open:
// Admitted lists every endpoint as active (no probation entries), because
// sending traffic to endpoints that recently failed beats sending it
// nowhere. While failing open, a success on an ejected or probation endpoint
// — probe or not, every flow is effectively a probe — returns it to ready at
// once with its streak and penalty level reset (ReasonFailOpenSuccess), and
// that ends fail-open; the other endpoints remain ejected or in probation and
// leave the table again. Penalty timers keep running during fail-open.
// Failures during fail-open change nothing (they are stragglers), except a
// Probe-flagged failure of an endpoint in probation, which is a failed probe
// as always. Start and end are emitted as service-level transitions
// (ReasonFailOpenStart / ReasonFailOpenEnd), exactly once each, right after
// the endpoint transition that caused them; their Endpoint field names that
// endpoint, or NoEndpoint when the cause was a change of the endpoint set.
// Each start counts one episode.
//
// Endpoint set. SetService lists a service's endpoints; new ones start
// ready with zero counters, missing ones are dropped with all their state
// (a re-added endpoint starts afresh: an endpoint that left the
// EndpointSlice and came back is usually a new pod). Adding a ready endpoint
// to a failing-open service ends fail-open; removing the last ready one
// starts it. Endpoint ids are unique across services: listing an id under
// another service moves it (its old state is dropped).
//
// Settings change. New settings apply from the next decision: streaks are
// kept, so lowering MaxFailures to or below an endpoint's current streak
// ejects it at its next counted failure, not at SetService. A penalty already
// drawn keeps its end time, except that it is shortened to end no later than
// ejected-at + MaxPenalty·(1+JitterRatio) under the new settings: lowering
// maxPenalty should not leave endpoints out for the old, longer time, and
// never lengthening keeps a running timer from moving under the operator's
// feet. The next penalty is drawn under the new settings at the kept level.
// Lowering MaxEjectionPercent ejects no more but un-ejects nothing either.
// Switching the mode to none returns every ejected or probation endpoint to
// ready at once (ReasonAccrualDisabled): turning accrual off means nothing
// stays penalised.
//
// Restart adoption. Export returns a Record per endpoint; Restore puts
// records back onto the endpoints the agent has set again (same service and
// endpoint id), ignoring the ejection cap since the state existed already.
// An ejected endpoint keeps its absolute probation time (clamped to at most
// now + MaxPenalty·(1+JitterRatio), which guards against a wall clock that
// jumped), so a restarted agent does not re-admit it early, and one whose
// penalty ended while the agent was down goes to probation on the first
// Advance. Restore returns transitions (ReasonRestored) like every other
// mutating call so the agent can treat its tables uniformly, and the number
// of records it could not place. Call it after SetService has set every
// service again and before writing the tables.
//
// Concurrency and results. The mutating methods (SetService, RemoveService,
// Observe, Advance, Restore) return transitions in a buffer the Engine
// reuses to keep Observe allocation-free: a result is valid until the next
// mutating call, so they must all be called from one goroutine (the agent's
// event loop). The read-only methods (Admitted, NextDeadline, Snapshot,
// Export, UnknownOutcomes) may be called from any goroutine; an internal
// mutex makes that safe.
package accrual
