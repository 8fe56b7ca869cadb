// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"log/slog"
	"math"
	"net/netip"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// Transition is an accrual transition with the names of what it concerns.
type Transition struct {
	Service  string
	Endpoint string // the endpoint's name (a pod), if it has one
	Addr     netip.AddrPort
	accrual.Transition
}

// Notify hears of every accrual transition of a service that still exists,
// after the maps were written (Kubernetes Events). It must not block.
type Notify func(Transition)

// transitions carry accrual's decisions out: each touched service's
// admission written to the maps, then every transition logged, counted,
// persisted and reported.
type transitions struct {
	*core
	wide      *serviceWide
	probes    *probes
	persisted *persisted
	// budget is how many more trips the datapath may make in a service
	// (kernelTrips.budget).
	budget func(svc uint32) int64
	// tripping is the backend whose kernel trip is being handled (noTrip:
	// none), so its ejection's log line says so; owed the service that
	// trip has not had programmed yet (0: none): see kernelTrips.
	tripping, owed uint32
	// retry: services whose last programming failed (Maintain retries).
	retry  map[uint32]bool
	notify Notify
	// begun: when Begin ran, on the events' clock; monoOffset converts the
	// kernel's timestamps to it.
	begun      time.Time
	monoOffset int64
	// handed: when the reader handed over the batch being handled
	// (CLOCK_MONOTONIC; 0 outside HandleEvents).
	handed int64
	// deferring: reports wait in deferred until the batch is handled
	// (deferReports).
	deferring bool
	deferred  []decided
}

// noTrip is no backend id (ids start at 1).
const noTrip = 0

// handle reprograms the services accrual's decisions touch, then logs,
// counts, persists and reports them (in HandleEvents, once the whole
// batch is handled: deferReports). Called with mu held.
func (t *transitions) handle(trs []accrual.Transition) {
	if len(trs) == 0 {
		return
	}
	// Accrual has decided: what follows is programming the maps (an
	// ejection's log line splits its reaction time here too).
	decidedAt := outcomes.MonoNow()
	var dirty []uint32
	for _, tr := range trs {
		if tr.To == accrual.Probation && tr.From != accrual.Probation {
			t.probes.seen[tr.Endpoint] = t.clk.Now() // granted now
		}
		if tr.To != accrual.Ready {
			t.wide.forget(tr.Service, tr.Endpoint)
		}
		if tr.Reason == accrual.ReasonProbeInconclusive {
			if err := t.rec.Regrant(tr.Endpoint); err != nil {
				t.log.Error("grant a new probe", "endpoint", t.endpointName(tr.Endpoint), "err", err)
			}
		}
		if len(dirty) == 0 || dirty[len(dirty)-1] != tr.Service {
			dirty = append(dirty, tr.Service)
		}
	}
	for _, id := range dirty {
		t.program(id)
	}
	// The maps are written: an ejection's reaction time ends here.
	now := outcomes.MonoNow()
	for _, tr := range trs {
		d := decided{Transition: tr, trip: tr.To == accrual.Ejected && tr.Endpoint == t.tripping}
		// Only a failure seen now has a reaction time: a restored ejection's
		// failure happened before the restart.
		if tr.To == accrual.Ejected && tr.From != accrual.Ejected && !tr.FailureAt.IsZero() &&
			tr.Reason != accrual.ReasonRestored && !tr.FailureAt.Before(t.begun) {
			at := tr.FailureAt.UnixNano() - t.monoOffset
			d.reaction = time.Duration(now - at)
			t.metrics.Reaction.Observe(d.reaction.Seconds())
			// Split where a batch the reader handed over held the failure
			// (not at a connect deadline's expiry, nor a fleet verdict).
			if t.handed >= at {
				d.read = time.Duration(t.handed - at)
				d.decided = time.Duration(decidedAt - at)
			}
		}
		if t.deferring {
			t.deferred = append(t.deferred, d)
		} else {
			t.report(d)
		}
	}
}

// decided is a transition whose maps are written, waiting to be reported.
type decided struct {
	accrual.Transition
	// reaction: the deciding failure's kernel timestamp -> the maps
	// written; read and decided: -> the reader's hand-over of its batch,
	// -> accrual's decision (0: no batch held the failure).
	reaction, read, decided time.Duration
	// trip: the datapath's own ejection (a kernel trip).
	trip bool
}

// report counts, persists, logs and hands on (Notify) one transition
// whose maps are written. Called with mu held.
func (t *transitions) report(d decided) {
	tr := d.Transition
	_, ok := t.rec.Service(tr.Service)
	name := t.serviceName(tr.Service)
	t.metrics.Transitions.WithLabelValues(name, string(tr.Reason)).Inc()
	if !tr.ServiceLevel() {
		t.persisted.save(tr)
	}
	t.logTransition(name, d)
	if t.notify != nil && ok {
		n := Transition{Service: name, Transition: tr}
		if b, bok := t.rec.Backend(tr.Endpoint); bok {
			n.Endpoint, n.Addr = b.Name, b.Addr
		}
		t.notify(n)
	}
}

// deferReports holds the reports of the transitions handled from now on
// until flushReports: HandleEvents writes every decision of a batch to
// the maps before it logs and persists any, so an ejection behind another
// in the same batch does not wait for the first one's log line.
func (t *transitions) deferReports() { t.deferring = true }

// flushReports reports the transitions held since deferReports, in order.
func (t *transitions) flushReports() {
	t.deferring = false
	for i := range t.deferred {
		t.report(t.deferred[i])
	}
	clear(t.deferred)
	t.deferred = t.deferred[:0]
}

// program writes one service's admission to the maps; a failure is
// counted and retried by Maintain.
func (t *transitions) program(id uint32) {
	if id == t.owed {
		t.owed = 0
	}
	if _, ok := t.rec.Service(id); !ok {
		delete(t.retry, id)
		return
	}
	active, probation, failOpen := t.engine.Admitted(id)
	if err := t.rec.ProgramService(id, active, probation, failOpen, t.budget(id)); err != nil {
		t.metrics.ProgramErrors.Inc()
		t.log.Error("programming table; retrying", "err", err)
		t.retry[id] = true
		return
	}
	delete(t.retry, id)
}

func (t *transitions) logTransition(service string, d decided) {
	tr, reaction, read := d.Transition, d.reaction, d.read
	switch tr.Reason {
	case accrual.ReasonFailOpenStart:
		t.log.Warn("service failing open: no endpoint ready, new flows go to all endpoints", "service", service)
		return
	case accrual.ReasonFailOpenEnd:
		t.log.Info("service no longer failing open", "service", service)
		return
	}
	attrs := []any{"service", service, "endpoint", t.endpointName(tr.Endpoint),
		"from", tr.From.String(), "to", tr.To.String(), "reason", string(tr.Reason)}
	if tr.Kind != 0 {
		attrs = append(attrs, "failure_kind", tr.Kind.String(), "consecutive_failures", tr.Failures)
	}
	if tr.Cause != "" {
		attrs = append(attrs, "cause", string(tr.Cause))
	}
	// A window rule says what the window held and the limit it passed.
	if w := tr.Window; w.Calls > 0 {
		attrs = append(attrs, "window_calls", w.Calls, "window_failures", w.Failures, "window_slow", w.Slow,
			"failure_rate", round3(w.FailureRate), "slow_rate", round3(w.SlowRate), "threshold", tr.Threshold)
	}
	// The penalty: drawn (ejected), served (probation), reset (ready: 0s).
	attrs = append(attrs, "penalty", tr.Penalty.String())
	if tr.To == accrual.Ejected {
		attrs = append(attrs, "probation_at", tr.ProbationAt.Format(time.RFC3339Nano))
	}
	if reaction > 0 {
		// Kernel's timestamp of the deciding failure -> maps written; of
		// which -> the reader handed its event over (the ring buffer's
		// wake-up), and -> accrual decided (the lock, the batch's events
		// before it, accrual); the rest is programming the maps.
		attrs = append(attrs, "reaction_us", reaction.Microseconds())
		if read > 0 {
			attrs = append(attrs, "reaction_read_us", read.Microseconds(),
				"reaction_decided_us", d.decided.Microseconds())
		}
	}
	if d.trip {
		// The datapath took it out at that failure already (a kernel
		// trip): no new flow waited for the reaction above.
		attrs = append(attrs, "kernel_trip", true)
	}
	level := slog.LevelInfo
	if tr.To == accrual.Ejected || tr.Reason == accrual.ReasonEjectionSuppressed {
		level = slog.LevelWarn
	}
	t.log.Log(context.Background(), level, "endpoint "+tr.To.String(), attrs...)
}

// round3 keeps log lines readable: a rate to three decimals.
func round3(f float64) float64 { return math.Round(f*1000) / 1000 }
