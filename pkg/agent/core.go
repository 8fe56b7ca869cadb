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
	// policy[backend id] judges that backend's outcomes (dense, hot path).
	policy []outcomes.Policy
	// events: the ring buffer reader (nil before Begin).
	events Events
}

func (c *core) policyOf(backend uint32) outcomes.Policy {
	if int(backend) < len(c.policy) {
		return c.policy[backend]
	}
	return outcomes.Policy{}
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
