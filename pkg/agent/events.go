// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// HandleEvents feeds one batch of kernel events through classification
// and accrual. A decision is written to the maps before the next event is
// looked at, so an ejection is never delayed by the rest of a batch.
//
// One event's path: counted; a refused SYN the datapath rescued replayed
// (first: the client waits for it); a kernel trip noted; the event
// classified into an outcome and observed; the trip adopted or undone.
func (a *Agent) HandleEvents(batch []outcomes.Event) {
	// The batch's hand-over, before the lock: an ejection's log line
	// splits its reaction time here (the ring buffer's wake-up and the
	// agent's own part).
	handed := outcomes.MonoNow()
	a.mu.Lock()
	defer a.mu.Unlock()
	a.trans.handed = handed
	a.trans.deferReports()
	defer func() {
		a.trans.handed = 0
		a.trans.flushReports()
	}()
	for i := range batch {
		ev := &batch[i]
		a.counts.event(ev)
		if ev.Type == outcomes.NewFlow {
			if ev.Flags&outcomes.FlagProbe != 0 {
				a.probes.seen[ev.Backend] = a.clk.Now()
			} else if a.engine.Excluded(ev.Backend) {
				// Events come in the datapath's order: this flow was
				// admitted after the failure that ejected its endpoint.
				a.metrics.FlowsToEjected.Inc(a.serviceName(ev.Service))
			}
		}
		// First, before accrual may spend time on a table: the client
		// waits for this.
		if ev.Type == outcomes.Refused && ev.Flags&outcomes.FlagRescued != 0 {
			a.replays.refused(ev)
		}
		trip := tripped(ev)
		if trip {
			a.trips.note(ev.Service, ev.Backend)
		}
		if o, ok := a.tracker.Classify(*ev); ok {
			a.observer.observe(o)
		}
		if trip {
			a.trips.adopt(ev.Service, ev.Backend, tripKind(ev), ev.At)
		}
		if len(a.replays.unsent) > 0 {
			a.replays.applyVoids()
		}
	}
	a.metrics.PendingConnects.Set(float64(a.tracker.PendingConnects()))
	a.counts.sync()
	a.wake()
}
