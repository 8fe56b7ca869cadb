// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"fmt"
	"log/slog"
	"time"

	"k8s.io/utils/clock"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/metrics"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
)

// Events is the ring buffer reader, as far as the agent needs it.
type Events interface {
	// Offset converts the kernel's CLOCK_MONOTONIC timestamps to Unix time.
	Offset() int64
	// Undecodable counts records that did not decode.
	Undecodable() uint64
	// CaughtUp is a time up to which every event has been handed over.
	CaughtUp() time.Time
	// Kick asks for the ring to be read to its end now, not at the
	// reader's next poll (a deadline is due that it has not caught up
	// with).
	Kick()
	// OnCaughtUp, before the reader starts, has it call f each time it
	// has handed over every event up to at; f says by when the ring must
	// be read next (the zero time: no sooner than the reader polls).
	OnCaughtUp(f func(at time.Time) (readBy time.Time))
}

// core is what every feature of the loop works with, all of it under the
// agent's mu: the three owners of state (the reconciler, the accrual
// engine, the outcome tracker), the policy that judges each backend's
// outcomes, the datapath's counters and the ring buffer reader, and the
// log, clock and metrics. Each feature (events.go, trips.go,
// transitions.go, flood.go, servicewide.go, replays.go, probes.go,
// persist.go, shedding.go) holds a pointer to the one core and its own
// state beside it.
type core struct {
	log     *slog.Logger
	clk     clock.WithTicker
	metrics *metrics.Metrics
	// stats: the datapath's counters; tripMaps: its kernel-trip arrays
	// (read here, written through the reconciler).
	stats    maps.Counters
	tripMaps maps.TripReader

	rec     *reconcile.Reconciler
	engine  *accrual.Engine
	tracker *outcomes.Tracker
	// A backend's outcomes are judged by its service's policy:
	// svcPolicy[svcOf[backend id]] (dense, hot path). One Policy per
	// service, not a copy per backend: at 10,000 Services of 10 endpoints
	// the copies held 3-8 MB of the agent's heap.
	svcOf     []uint32
	svcPolicy []outcomes.Policy
	// events: the ring buffer reader (nil before Begin).
	events Events
}

func (c *core) policyOf(backend uint32) outcomes.Policy {
	if int(backend) < len(c.svcOf) {
		if s := c.svcOf[backend]; int(s) < len(c.svcPolicy) {
			return c.svcPolicy[s] // service id 0 (none) holds the zero Policy
		}
	}
	return outcomes.Policy{}
}

// atLeast returns s with a length of at least n, new elements zero.
func atLeast[T any](s []T, n int) []T {
	if n <= len(s) {
		return s
	}
	return append(s, make([]T, n-len(s))...)
}

// serviceName names service id in metrics and logs (its id once it is
// gone).
func (c *core) serviceName(id uint32) string {
	if s, ok := c.rec.Service(id); ok {
		return s.Spec.Name
	}
	return fmt.Sprint(id)
}

func (c *core) endpointName(id uint32) string {
	b, ok := c.rec.Backend(id)
	if !ok {
		return fmt.Sprintf("backend-%d", id)
	}
	if b.Name != "" {
		return b.Name + " (" + b.Addr.String() + ")"
	}
	return b.Addr.String()
}
