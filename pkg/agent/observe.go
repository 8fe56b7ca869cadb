// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// observer weighs each outcome before accrual hears of it: a timeout that
// says nothing against its endpoint is withheld.
type observer struct {
	*core
	flood   *floodMode
	wide    *serviceWide
	replays *replays
	trans   *transitions
}

// observe hands one outcome to accrual, unless it is a timeout that says
// nothing against the endpoint: one seen in flood mode (withheld, reason
// flood), or one while most of its peers time out too (service_wide).
// Called with mu held.
func (ob *observer) observe(o accrual.Outcome) {
	if o.Success {
		ob.replays.noteHandshake(o)
	}
	if ob.flood.on && !o.Success && o.Kind == accrual.KindTimeout && !o.Probe {
		ob.metrics.Withheld.WithLabelValues("flood").Inc()
		ob.flood.withheldHere++
		return
	}
	if ob.wide.withholds(o, ob.clk.Now()) {
		ob.metrics.Withheld.WithLabelValues("service_wide").Inc()
		ob.flood.withheldHere++
		return
	}
	ob.trans.handle(ob.engine.Observe(o))
}

// observeSettled observes what the tracker's deadlines decided. A success
// decided by time (an established connection that outlived the connect
// timeout without a reset) is one the datapath never sees: its streak of
// failures ends here too, as accrual's does.
func (ob *observer) observeSettled(o accrual.Outcome) {
	if o.Success {
		ob.rec.EndKernelStreak(o.Endpoint)
	}
	ob.observe(o)
}
