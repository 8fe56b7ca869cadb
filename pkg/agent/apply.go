// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"errors"
	"fmt"
	"net"

	"github.com/vishvananda/netlink"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/config"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
)

// Apply programs a desired state: services and backends, accrual's view
// of them, then each service's table.
func (a *Agent) Apply(st desired.State) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.apply(st)
}

func (a *Agent) apply(st desired.State) {
	changes, err := a.rec.Apply(st)
	if err != nil {
		a.metrics.ProgramErrors.Inc()
		a.log.Error("programming services", "err", err)
	}
	gone := map[uint32]bool{}
	for _, c := range changes {
		for _, id := range c.Retired {
			gone[id] = true
			delete(a.probeSeen, id)
			if int(id) < len(a.policy) {
				a.policy[id] = outcomes.Policy{}
			}
		}
		if c.Removed {
			a.handleTransitions(a.engine.RemoveService(c.Service.ID))
			// Its id may be handed to another service: nothing carries over.
			delete(a.handshakes, c.Service.ID)
			delete(a.tripsHandled, c.Service.ID)
		}
	}
	a.tracker.Forget(gone)
	services := a.rec.Services()
	if !a.restored {
		// The first desired state after a start: accrual adopts what the
		// previous agent persisted before any table is written, so the
		// first table already leaves out an endpoint that was ejected when
		// it died (programming first would admit it for a moment).
		a.restored = true
		var trs []accrual.Transition
		for _, s := range services {
			a.setPolicy(s)
			trs = append(trs, a.engine.SetService(s.ID, s.Spec.Name, s.Spec.Accrual, s.Backends)...)
		}
		a.restoreHealth()
		a.handleTransitions(trs)
	}
	for _, s := range services {
		a.setPolicy(s)
		a.handleTransitions(a.engine.SetService(s.ID, s.Spec.Name, s.Spec.Accrual, s.Backends))
		a.program(s.ID)
		// At 0 from the start, so that a rate over them is 0, not absent,
		// and a first increment shows in increase().
		a.metrics.FlowsToEjected.WithLabelValues(s.Spec.Name)
		a.metrics.KernelTrips.WithLabelValues(s.Spec.Name, "adopted")
		a.metrics.KernelTrips.WithLabelValues(s.Spec.Name, "undone")
	}
	// Spare tables for the changes to come, in one batch.
	if err := a.rec.PrepareTables(); err != nil {
		a.metrics.ProgramErrors.Inc()
		a.log.Error("preparing spare tables", "err", err)
	}
}

// setPolicy makes s's settings judge its backends' outcomes.
func (a *Agent) setPolicy(s *reconcile.Service) {
	pol := outcomes.PolicyFor(s.Spec.Accrual, s.Spec.Key.Protocol == desired.TCP)
	pol.Service = s.ID
	if a.replaysUnanswered() {
		pol.Replay = replayAfter(&s.Spec, a.handshakes[s.ID])
	}
	for _, id := range s.Backends {
		if n := int(id) + 1; n > len(a.policy) {
			// Grown as ids are handed out, not sized for MaxBackends up
			// front (8 MB at the default, most of it never used).
			a.policy = append(a.policy, make([]outcomes.Policy, n-len(a.policy))...)
		}
		a.policy[id] = pol
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

// ApplyConfig applies a config file (services, then interfaces) and
// counts the outcome. A file that cannot be applied whole changes nothing
// it can check beforehand (table size, interfaces).
func (a *Agent) ApplyConfig(cfg *config.Config) error {
	if err := a.applyConfig(cfg); err != nil {
		a.metrics.ConfigReloads.WithLabelValues("error").Inc()
		a.metrics.ConfigLastOK.Set(0)
		return err
	}
	a.metrics.ConfigReloads.WithLabelValues("success").Inc()
	a.metrics.ConfigLastOK.Set(1)
	a.metrics.ConfigLastSuccess.SetToCurrentTime()
	return nil
}

// ConfigRejected counts and logs a config file that did not load: the
// last good one stays in force.
func (a *Agent) ConfigRejected(err error) {
	a.metrics.ConfigReloads.WithLabelValues("error").Inc()
	a.metrics.ConfigLastOK.Set(0)
	a.log.Error("config reload rejected; the last good config stays in force", "err", err)
}

func (a *Agent) applyConfig(cfg *config.Config) error {
	// What the file cannot promise (that its interfaces exist) is checked
	// before anything is applied: a typo leaves the running config whole.
	if err := a.checkInterfaces(cfg); err != nil {
		return err
	}
	a.mu.Lock()
	if cfg.MaglevTableSize != a.rec.TableSize() {
		if err := a.rec.SetTableSize(cfg.MaglevTableSize); err != nil {
			a.mu.Unlock()
			return fmt.Errorf("maglev.tableSize: %d: %w", cfg.MaglevTableSize, err)
		}
	}
	// The file's defaults.maxInflight, else the flag's (the caller fills
	// it in when loading).
	a.maxInflightDefault = 0
	if cfg.MaxInflight != nil {
		a.maxInflightDefault = *cfg.MaxInflight
	}
	a.metrics.MaxInflightDefault.Set(float64(a.maxInflightDefault))
	a.apply(cfg.Desired())
	a.mu.Unlock()
	if err := a.PrefiltersWritten(); err != nil {
		return err
	}
	return a.applyInterfaces(cfg.Interfaces, cfg.RedirectInterfaces)
}

// checkInterfaces resolves every interface a config file names.
func (a *Agent) checkInterfaces(cfg *config.Config) error {
	var errs []error
	for _, f := range []struct {
		field string
		names []string
	}{{"interfaces", cfg.Interfaces}, {"redirectInterfaces", cfg.RedirectInterfaces}} {
		for i, n := range f.names {
			if _, err := a.link(n); err != nil {
				errs = append(errs, fmt.Errorf("%s[%d]: %q: %w", f.field, i, n, err))
			}
		}
	}
	return errors.Join(errs...)
}

// applyInterfaces attaches XDP where listed and detaches it elsewhere, and
// tells the datapath which interfaces are veths and which take redirects.
func (a *Agent) applyInterfaces(ifaces, redirect []string) error {
	a.hooksMu.Lock()
	defer a.hooksMu.Unlock()
	want := map[string]bool{}
	for _, n := range ifaces {
		want[n] = true
		if err := a.hooks.Attach(n); err != nil {
			return err
		}
	}
	for _, n := range a.hooks.Attached() {
		if !want[n] {
			if err := a.hooks.Detach(n); err != nil {
				a.log.Error("detach", "interface", n, "err", err)
			}
		}
	}
	var known []maps.Iface
	for _, n := range ifaces {
		if l, err := a.link(n); err == nil {
			known = append(known, l.iface(l.Veth))
		}
	}
	var idx []uint32
	for _, n := range redirect {
		l, err := a.link(n)
		if err != nil {
			return fmt.Errorf("redirectInterfaces: %q: %w", n, err)
		}
		idx = append(idx, uint32(l.Index))
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.rec.SetInterfaces(known); err != nil {
		return err
	}
	if err := a.rec.SetRedirectInterfaces(idx); err != nil {
		return err
	}
	a.interfaces = ifaces
	return nil
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

// LinkInfo is what the agent needs to know of an interface it attaches to.
type LinkInfo struct {
	Index int
	// Veth: a veth, whose local sender may leave the L4 checksum to the
	// device.
	Veth bool
	// Master is its master's index (a bridge port's bridge), 0: none.
	Master int
}

// iface is l as the datapath's pb_ifaces entry; partial says whether its
// packets may carry a partial checksum.
func (l LinkInfo) iface(partial bool) maps.Iface {
	return maps.Iface{Index: uint32(l.Index), Partial: partial, Master: uint32(l.Master)}
}

// netlinkLink resolves an interface by name.
func netlinkLink(name string) (LinkInfo, error) {
	ifc, err := net.InterfaceByName(name)
	if err != nil {
		return LinkInfo{}, err
	}
	l, err := netlink.LinkByIndex(ifc.Index)
	if err != nil {
		return LinkInfo{Index: ifc.Index}, nil
	}
	return LinkInfo{Index: ifc.Index, Veth: l.Type() == "veth", Master: l.Attrs().MasterIndex}, nil
}
