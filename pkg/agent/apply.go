// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"fmt"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
)

// Apply programs a desired state: services and backends, accrual's view
// of them, then each service's table. A delta (Kubernetes' hand-overs
// after the first) changes what it lists and leaves the rest. A state with Node (a config
// file's) also sets the table size and the interfaces; one that cannot be
// applied whole changes nothing it can check beforehand (table size,
// interfaces), and its outcome is counted as a config reload.
func (a *Agent) Apply(st desired.State) error {
	if st.Node == nil {
		a.mu.Lock()
		defer a.mu.Unlock()
		a.apply(st)
		return nil
	}
	if err := a.applyNode(st); err != nil {
		a.metrics.ConfigReloads.WithLabelValues("error").Inc()
		a.metrics.ConfigLastOK.Set(0)
		return err
	}
	a.metrics.ConfigReloads.WithLabelValues("success").Inc()
	a.metrics.ConfigLastOK.Set(1)
	a.metrics.ConfigLastSuccess.SetToCurrentTime()
	return nil
}

func (a *Agent) apply(st desired.State) {
	// Apply leaves the maps complete: services, backends, and each
	// service's table as accrual admits it (adoption, below).
	if _, err := a.rec.Apply(st, adoption{a}); err != nil {
		a.metrics.ProgramErrors.Inc()
		a.log.Error("programming services", "err", err)
	}
	// Spare tables for the changes to come, in one batch. The first
	// state's wait until the datapath is live (PrepareTables; or
	// PrefiltersWritten installs them, retrying a failed prefilter
	// write): at 10,000 services they are 10,000 tables to create, a
	// tenth of a second it would otherwise wait for; meanwhile a change
	// installs its own table (an RCU grace period).
	if !a.applied {
		a.applied = true
		return
	}
	a.prepareTables()
}

// PrepareTables installs the spare tables the first desired state left
// for later (see apply): the agent calls it once the datapath is live,
// and the maintenance calls it again.
func (a *Agent) PrepareTables() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.prepareTables()
}

func (a *Agent) prepareTables() {
	if err := a.rec.PrepareTables(); err != nil {
		a.metrics.ProgramErrors.Inc()
		a.log.Error("preparing spare tables", "err", err)
	}
}

// adoption is accrual's side of reconcile's Apply: accrual hears of the
// services as the desired state leaves them, then each is programmed as
// accrual admits it.
type adoption struct{ a *Agent }

// Adopt gives accrual the services Apply left, before any table of theirs
// is written. Called with mu held.
func (ad adoption) Adopt(changes []reconcile.Change, services []*reconcile.Service) {
	a := ad.a
	gone := map[uint32]bool{}
	for _, c := range changes {
		for _, id := range c.Retired {
			gone[id] = true
			delete(a.probes.seen, id)
			if int(id) < len(a.svcOf) {
				a.svcOf[id] = 0
			}
		}
		if c.Removed {
			a.trans.handle(a.engine.RemoveService(c.Service.ID))
			// Its id may be handed to another service: nothing carries over.
			delete(a.replays.handshakes, c.Service.ID)
			a.trips.forget(c.Service.ID)
		}
	}
	a.tracker.Forget(gone)
	if !a.persisted.restored {
		// The first desired state after a start: accrual adopts what the
		// previous agent persisted before any table is written, so the
		// first table already leaves out an endpoint that was ejected when
		// it died (programming first would admit it for a moment).
		a.persisted.restored = true
		var trs []accrual.Transition
		for _, s := range services {
			a.setPolicy(s)
			trs = append(trs, a.engine.SetService(s.ID, s.Spec.Name, s.Spec.Accrual, s.Backends)...)
		}
		restored, recs := a.persisted.restore()
		a.trans.handle(restored)
		// Stale records belong to endpoints that are gone.
		a.persisted.prune(recs)
		a.trans.handle(trs)
	}
	for _, s := range services {
		a.setPolicy(s)
		a.trans.handle(a.engine.SetService(s.ID, s.Spec.Name, s.Spec.Accrual, s.Backends))
		// At 0 from the start, so that a rate over them is 0, not absent,
		// and a first increment shows in increase().
		a.metrics.FlowsToEjected.Add(s.Spec.Name)
		a.metrics.KernelTrips.Add(s.Spec.Name)
	}
}

// Program writes one service's admission (a failure is retried by
// Maintain).
func (ad adoption) Program(id uint32) { ad.a.trans.program(id) }

// setPolicy makes s's settings judge its backends' outcomes.
func (a *Agent) setPolicy(s *reconcile.Service) {
	pol := outcomes.PolicyFor(s.Spec.Accrual, s.Spec.Key.Protocol == desired.TCP)
	pol.Service = s.ID
	pol.Replay = a.replays.after(s)
	// Grown as ids are handed out, not sized for MaxServices and
	// MaxBackends up front (most of it never used).
	a.svcPolicy = atLeast(a.svcPolicy, int(s.ID)+1)
	a.svcPolicy[s.ID] = pol
	for _, id := range s.Backends {
		a.svcOf = atLeast(a.svcOf, int(id)+1)
		a.svcOf[id] = s.ID
	}
}

// PrefiltersWritten retries a failed write of the prefilter maps once and
// fails if it fails again. It runs before XDP is attached: a program that
// finds a VIP's slot unmarked passes its packets unbalanced (after an
// upgrade that added pb_vip_slots, established flows too), so the agent
// would rather not attach (the program already attached keeps working).
func (a *Agent) PrefiltersWritten() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.rec.PrefiltersDirty() {
		return nil
	}
	if err := a.rec.PrepareTables(); err != nil && a.rec.PrefiltersDirty() {
		return fmt.Errorf("writing the prefilter maps: %w", err)
	}
	return nil
}

// ConfigRejected counts and logs a config file that did not load: the
// last good one stays in force.
func (a *Agent) ConfigRejected(err error) {
	a.metrics.ConfigReloads.WithLabelValues("error").Inc()
	a.metrics.ConfigLastOK.Set(0)
	a.log.Error("config reload rejected; the last good config stays in force", "err", err)
}

// applyNode applies a state with its node's settings (a config file's).
func (a *Agent) applyNode(st desired.State) error {
	n := st.Node
	// What the file cannot promise (that its interfaces exist) is checked
	// before anything is applied: a typo leaves the running config whole.
	if err := a.checkInterfaces(n); err != nil {
		return err
	}
	a.mu.Lock()
	if n.TableSize != a.rec.TableSize() {
		if err := a.rec.SetTableSize(n.TableSize); err != nil {
			a.mu.Unlock()
			return fmt.Errorf("maglev.tableSize: %d: %w", n.TableSize, err)
		}
	}
	a.maxInflightDefault = n.MaxInflightDefault
	a.metrics.MaxInflightDefault.Set(float64(a.maxInflightDefault))
	a.apply(st)
	a.mu.Unlock()
	if err := a.PrefiltersWritten(); err != nil {
		return err
	}
	return a.applyInterfaces(n.Interfaces, n.RedirectInterfaces)
}

// SetDatapathConfig writes the datapath's settings (pb_config_v2) but
// redirecting, which follows the interfaces.
func (a *Agent) SetDatapathConfig(c maps.Config) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.rec.SetDatapathConfig(c); err != nil {
		return err
	}
	a.log.Info("datapath settings", "reverse_path_check", c.ReversePath,
		"syn_retransmit_min_age", c.SYNRetransMinAge.String(), "hash_seed_set", c.HashSeed != 0)
	return nil
}
