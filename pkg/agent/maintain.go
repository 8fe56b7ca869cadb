// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"errors"
	"log/slog"

	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/metrics"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
)

// Maintain keeps probation from stalling, retries services whose
// programming failed, prepares the spare tables the next changes fill and
// ends flood mode when its signs are gone.
func (a *Agent) Maintain() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.flood.check(a.clk.Now())
	a.shed.end(a.clk.Now())
	a.wide.check(a.clk.Now())
	a.probes.watch(a.clk.Now())
	a.trips.findLost()
	for _, s := range a.rec.EndTakeovers() {
		a.log.Info("takeover grace over: the service takes every flow, kube-proxy's old ones too", "service", s.Spec.Name)
	}
	for id := range a.trans.retry {
		a.trans.program(id)
	}
	a.prepareTables()
}

// sweepProgramFailed is the warning, logged once, that the conntrack
// sweep's program failed (maps.ExpireCT).
const sweepProgramFailed = "conntrack sweep program failed: the sweep deletes with a system call per entry from now on"

// logSweepErrs logs what went wrong with a sweep's programs. A program
// that fails is logged once (the sweeps after it do without it); a kernel
// sweep that could not fill its in-use sets, at each sweep it happens.
func logSweepErrs(log *slog.Logger, res conntrack.Result) {
	if res.ExpireErr != nil {
		log.Warn(sweepProgramFailed, "err", res.ExpireErr)
	}
	if res.KernelErr != nil {
		log.Warn("kernel conntrack sweep failed: this sweep copied the table", "err", res.KernelErr)
	}
}

// sweepWay is how a sweep ran, for conntrack_sweeps_total: a kernel
// sweep that failed is a copy from then on, one that could not fill its
// sets a fallback.
func sweepWay(res conntrack.Result) string {
	var inc maps.ErrSweepIncomplete
	switch {
	case res.Kernel:
		return metrics.SweepKernel
	case errors.As(res.KernelErr, &inc):
		return metrics.SweepFallback
	}
	return metrics.SweepCopy
}

// SweepConntrack expires idle flows, releasing their circuit-breaker
// slots, and returns the ids live flows use. It takes no lock: Run calls
// it off its goroutine, one sweep at a time, then hands the result to
// SweepDone.
func (a *Agent) SweepConntrack() conntrack.InUse {
	res, err := a.sweeper.Sweep()
	logSweepErrs(a.log, res)
	if err != nil {
		// A partial view must not free ids that live flows may still use.
		a.log.Warn("conntrack sweep", "err", err)
		return conntrack.InUse{Services: map[uint32]bool{}, Backends: map[uint32]bool{}, Incomplete: true}
	}
	if res.Expired > 0 || res.Released > 0 {
		a.log.Debug("conntrack sweep", "entries", res.Entries, "expired", res.Expired, "released", res.Released)
	}
	a.metrics.ConntrackEntries.Set(float64(res.Entries))
	a.metrics.ConntrackSize.Set(float64(res.Size))
	a.metrics.ConntrackExpired.Add(float64(res.Expired))
	a.metrics.ConntrackSweeps.WithLabelValues(sweepWay(res)).Inc()
	return res.InUse
}

// BeginSweep marks the start of a conntrack sweep, for SweepDone: the
// reconciler counts only the walks begun after an id left use.
func (a *Agent) BeginSweep() reconcile.SweepMark {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.rec.BeginSweep()
}

// sweepResult is what a sweep begun at mark found in use.
type sweepResult struct {
	inUse conntrack.InUse
	mark  reconcile.SweepMark
}

// SweepDone frees the ids of removed services and backends that no live
// flow uses any more: the sweep begun at mark found none, nor the last
// complete one before it, both begun after the id left use
// (reconcile.Reconciler.Sweep).
func (a *Agent) SweepDone(inUse conntrack.InUse, mark reconcile.SweepMark) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.rec.Sweep(inUse, mark)
}

// Heartbeat tells the datapath the agent is alive (see
// maps.Config.DeadMan): its time, on the kernel's monotonic clock.
func (a *Agent) Heartbeat() {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := uint64(a.clk.Now().UnixNano() - a.trans.monoOffset)
	if why := a.rec.DatapathConfig().HandedOver(now); why == "agent-away" {
		// The other side of the switch: an agent back from a crash or a
		// stall past the bound (the datapath cannot log its own trip).
		a.log.Info("heartbeat resumed: the datapath takes new flows back from kube-proxy")
	}
	if err := a.rec.Heartbeat(now); err != nil {
		a.metrics.ProgramErrors.Inc()
		if !a.heartbeatErr {
			a.log.Error("writing the heartbeat", "err", err)
		}
		a.heartbeatErr = true
		return
	}
	a.heartbeatErr = false
}

// TakeOverAll marks every service taken over anew (reconcile's
// TakeOverAll): kube-proxy had their new flows while no agent ran.
func (a *Agent) TakeOverAll() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.rec.TakeOverAll()
}

// Drain hands every new flow to kube-proxy from now on, the flows already
// here finishing where they are: the install is going (see
// cmd/agent's uninstall).
func (a *Agent) Drain() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	c := a.rec.DatapathConfig()
	c.Drain = true
	if err := a.rec.SetDatapathConfig(c); err != nil {
		return err
	}
	a.log.Info("draining: new flows go to kube-proxy; the flows here finish")
	return nil
}
