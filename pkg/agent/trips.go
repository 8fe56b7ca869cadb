// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
)

// Kernel trips: the datapath ejects a backend itself, at the counted
// failure that makes its streak MaxFailures, and the agent adopts the
// ejection or undoes it. This file is the agent's whole side of that
// hand-off (docs/kernel-trips.md has the table with the datapath's side):
//
//	what happens                          who acts    what follows
//	N-th consecutive refusal or reset,    datapath    backend entry "ejected", the
//	  the service's budget > 0                        service's budget -1, trips +1,
//	                                                  the event flagged TRIPPED
//	the TRIPPED event is read             agent       note: the trip counted read; the
//	                                                  failure observed as any other
//	  accrual ejects the endpoint         agent       adopted: the penalty, probation,
//	  (by the failure, or KernelTripped)              everything as for its own ejection
//	  accrual keeps it in (the cap, fail  agent       undone: the entry rewritten with
//	  open, no consecutive rule here)                 the reconciler's state, streak reset
//	  either way                          agent       the service programmed ONCE: its
//	                                                  new admission and trip budget
//	the event is lost (ring full)         agent       Maintain finds it: more trips made
//	                                                  than read, and a backend the kernel
//	                                                  holds ejected that the reconciler
//	                                                  wrote active; adopted or undone
//	                                                  as above (kind: refused)
//	the budget is 0                       datapath    no trip (counted suppressed);
//	                                                  accrual alone decides
//	success judged by a deadline, or the  agent       the backend's kernel streak reset
//	  backend readmitted (active)
//
// An endpoint is out when accrual says so: a trip is an ejection made
// early, which accrual confirms or takes back at the next event.
type kernelTrips struct {
	*core
	trans *transitions
	// handled counts, per service, the kernel trips the agent has dealt
	// with, against pb_svc_trip.trips: the difference is trips whose events
	// are unread (or lost).
	handled map[uint32]uint64
}

// tripped says whether ev is the datapath's kernel trip.
func tripped(ev *outcomes.Event) bool {
	return ev.Flags&outcomes.FlagTripped != 0 && (ev.Type == outcomes.Refused || ev.Type == outcomes.Reset)
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

// note records the datapath's trip of backend bid in service svc, before
// its failure is observed: the reconciler writes whatever is decided next
// about the backend, even a state it believes the kernel holds already;
// the trip is read, so the service's budget no longer counts it as
// unread; and the service is owed one programming (adopt). Called with mu
// held.
func (k *kernelTrips) note(svc, bid uint32) {
	k.rec.NoteKernelTrip(bid)
	k.handled[svc]++
	k.trans.tripping, k.trans.owed = bid, svc
}

// adopt makes a noted kernel trip, the datapath's own ejection of backend
// bid at a failure of kind seen at at, accrual's decision: the failure has
// been observed already (when its event arrived), and if that did not
// eject the endpoint (its events were lost, or the tracker had judged the
// flow before), accrual ejects it now for its consecutive failures. If
// accrual keeps it in (the max-ejection cap, fail-open, or it is not ready
// here), the trip is undone: the backend's kernel entry gets the state
// accrual says. The service is programmed once, by whichever of these
// steps wrote it first, else here (its budget, with this trip read).
// Called with mu held.
func (k *kernelTrips) adopt(svc, bid uint32, kind accrual.Kind, at time.Time) {
	k.trans.handle(k.engine.KernelTripped(bid, kind, at))
	name := k.serviceName(svc)
	if k.engine.StateOf(bid) != accrual.Ready {
		k.metrics.KernelTrips.Inc(name, "adopted")
	} else {
		k.metrics.KernelTrips.Inc(name, "undone")
		k.log.Info("kernel trip undone: accrual keeps the endpoint in", "service", name,
			"endpoint", k.endpointName(bid))
		if err := k.rec.UndoTrip(bid); err != nil {
			k.metrics.ProgramErrors.Inc()
			k.log.Error("undo a kernel trip", "endpoint", k.endpointName(bid), "err", err)
		}
	}
	if k.trans.owed == svc {
		k.trans.program(svc)
	}
	k.trans.tripping, k.trans.owed = noTrip, 0
}

// budget is how many more trips the datapath may make in service id: the
// room accrual's max-ejection cap leaves, less the trips the datapath made
// that the agent has not read yet (their endpoints are out already).
// Called with mu held.
func (k *kernelTrips) budget(id uint32) int64 {
	room := k.engine.KernelTripRoom(id)
	if room == 0 {
		return 0
	}
	made := k.tripMaps.ServiceTrip(id).Trips
	handled := k.handled[id]
	if made < handled { // a recycled id: its counter started again
		k.handled[id], handled = made, made
	}
	return max(room-int64(made-handled), 0)
}

// findLost looks for kernel trips whose events were lost: the datapath
// counted more trips than the agent read, so some backend the agent
// believes active is ejected in the kernel. Each is adopted (or undone) as
// if its event had come. Called with mu held.
func (k *kernelTrips) findLost() {
	// Every service's counter is read (from the mmap); the few with trips
	// unread are handled in id order.
	lost := k.rec.ServicesWhere(func(s *reconcile.Service) bool {
		return k.tripMaps.ServiceTrip(s.ID).Trips > k.handled[s.ID]
	})
	for _, s := range lost {
		made := k.tripMaps.ServiceTrip(s.ID).Trips
		if made <= k.handled[s.ID] {
			continue
		}
		for _, bid := range k.rec.KernelEjected(s.ID) {
			k.log.Warn("kernel trip found without its event (events lost)", "service", s.Spec.Name,
				"endpoint", k.endpointName(bid))
			k.note(s.ID, bid)
			k.adopt(s.ID, bid, accrual.KindRefused, time.Time{})
		}
		k.handled[s.ID] = made
	}
}

// forget drops a removed service's count: its id may be handed to
// another service.
func (k *kernelTrips) forget(svc uint32) { delete(k.handled, svc) }
