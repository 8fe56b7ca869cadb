// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Change is a service whose endpoint set Apply changed: failure accrual
// hears of it before the service is programmed.
type Change struct {
	Service *Service
	Removed bool
	// Retired are backend ids whose endpoints left the service.
	Retired []uint32
}

// Accrual is failure accrual as Apply works with it (pkg/agent implements
// it over its engine): which endpoints of a service new flows may reach is
// accrual's decision, so Apply asks it for each service's table.
type Accrual interface {
	// Adopt hears of the services as Apply leaves them, once their
	// entries and backends are written and before any table is: changes
	// are those whose endpoints changed, or that were removed; services
	// are every service the first time, then those Apply found new or
	// changed in any way (a service asked for exactly as before is left
	// as it is: accrual holds it already).
	Adopt(changes []Change, services []*Service)
	// Program writes service id's admission as accrual decides it, with
	// ProgramService, and keeps a failure to retry.
	Program(id uint32)
}

// Apply makes the maps match st, complete: service entries and backends,
// the prefilters, then, once acc has adopted them, the tables (acc.Program)
// of every service the first time, then of each service new or changed.
// A service asked for exactly as it was programmed is not touched: a
// desired state of 10,000 services with one changed costs one service's
// work, not 10,000's. It returns the changes acc heard of.
//
// A delta (st.Delta) changes the services it lists and removes those it
// has gone, leaving the rest as they are: the maps end as the complete
// state it stands for would leave them (desired.State.Merge), at the cost
// of the changes alone. But for one thing, which is only a matter of
// when: a complete state also clears the takeover flag of every service
// whose grace is over, a delta only of those it lists, and EndTakeovers
// (the agent's periodic maintenance) of the rest. The first state applied
// must be complete: a delta then is refused, changing nothing.
func (r *Reconciler) Apply(st desired.State, acc Accrual) ([]Change, error) {
	if st.Delta && !r.applied {
		return nil, errors.New("a delta of the desired state before any complete one: ignored")
	}
	changes, err := r.sync(st)
	var services []*Service
	if !r.applied {
		r.applied = true
		services = r.Services()
	} else {
		services = r.touched
		sort.Slice(services, func(i, j int) bool { return services[i].ID < services[j].ID })
	}
	r.touched = nil
	acc.Adopt(changes, services)
	for _, s := range services {
		acc.Program(s.ID)
	}
	return changes, err
}

// sync makes the services and backends match st; no table is written.
func (r *Reconciler) sync(st desired.State) ([]Change, error) {
	now := r.clk.Now()
	var changes []Change
	var errs []error
	r.gen++ // marks the services st lists (Service.mark)

	// Services asked for exactly as they are programmed: left alone.
	same := make([]bool, len(st.Services))
	var fresh []desired.Service
	for i := range st.Services {
		spec := &st.Services[i]
		if s, ok := r.services[spec.Key]; ok && s.Active != nil && s.Spec.SameSettings(spec) &&
			len(s.Spec.Endpoints) == len(spec.Endpoints) &&
			(identical(s.given, spec.Endpoints) || desired.SameEndpoints(s.Spec.Endpoints, spec.Endpoints)) {
			s.given = spec.Endpoints
			s.mark = r.gen
			same[i] = true
			// Only what time changes (the takeover flag) may need writing.
			if err := r.writeService(s, s.value.Table, s.value.TableSize); err != nil {
				errs = append(errs, err)
			}
		} else {
			fresh = append(fresh, *spec)
		}
	}
	// New VIPs get past the prefilters before any entry of theirs is
	// written; what is no longer needed is cleared at the end.
	if err := r.markPrefilters(fresh); err != nil {
		errs = append(errs, err)
	}

	for i := range st.Services {
		if same[i] {
			continue
		}
		spec := st.Services[i]
		s, existed := r.services[spec.Key]
		if existed {
			s.mark = r.gen
		}
		if !existed {
			if s = r.takeBack(spec.Key, now); s != nil {
				s.mark = r.gen
			}
		}
		if !existed && s == nil {
			id, clean, ok := r.svcIDs.get()
			if !ok {
				errs = append(errs, fmt.Errorf("service %s: no free service id (max %d)", spec.Name, r.svcIDs.max))
				continue
			}
			delete(r.retiredSvc, id)
			if !clean {
				r.w.ResetServiceStats(id)
			}
			r.w.ResetServiceTrip(id)
			s = &Service{ID: id, mark: r.gen}
			if r.takeover > 0 {
				s.takenOver = now
			}
			r.services[spec.Key] = s
			r.byID[id] = s
		}
		r.touched = append(r.touched, s)
		endpointsChanged := !existed || !sameEndpoints(s, spec.Endpoints, &r.backends)
		// Spec shares the caller's endpoints slice (a copy of each
		// service's was megabytes at 10,000 services): the reconciler
		// never writes into it, and replaces it where it must differ.
		s.Spec = spec
		s.given = spec.Endpoints
		var retired []uint32
		if endpointsChanged {
			var err error
			if retired, err = r.syncBackends(s, now); err != nil {
				errs = append(errs, err)
			}
		} else {
			r.renameBackends(s)
		}
		// A service with endpoints gets its first entry from its first
		// ProgramService, with its table: one write, not two.
		if s.value.Id == 0 && len(s.Backends) > 0 {
			// not yet
		} else if err := r.writeService(s, s.value.Table, s.value.TableSize); err != nil {
			// Report the change anyway: the backends it retired are gone
			// from the kernel's view whatever happened to the service entry,
			// and no later Apply would report them again.
			errs = append(errs, err)
		}
		if endpointsChanged {
			changes = append(changes, Change{Service: s, Retired: retired})
		}
	}

	if err := r.flushBackends(); err != nil {
		errs = append(errs, err)
	}

	// Removed: a complete state's unlisted services, a delta's gone ones
	// (unless it lists them again).
	remove := func(key desired.Key, s *Service) {
		if err := r.handBackOrDelete(key, s, now, slices.Contains(st.HandBack, key)); err != nil {
			errs = append(errs, err)
		}
		for _, id := range s.Backends {
			r.retire(r.backends.get(id), now)
		}
		retired := s.Backends
		s.Backends, s.Active, s.Probation = nil, nil, nil
		delete(r.services, key)
		delete(r.byID, s.ID)
		r.retiredKey[s.ID] = key
		changes = append(changes, Change{Service: s, Removed: true, Retired: retired})
		r.log.Info("service removed", "service", s.Spec.Name, "key", key.String(), "handed_back", r.handingBack[s.ID] != nil)
	}
	if st.Delta {
		for _, key := range st.Gone {
			if s, ok := r.services[key]; ok && s.mark != r.gen {
				remove(key, s)
			}
		}
	} else {
		for key, s := range r.services {
			if s.mark != r.gen {
				remove(key, s)
			}
		}
	}
	r.endGoneHandBacks(st.HandBack, now)

	// The spare tables of the services this state programs: all of them
	// for a complete state, those it touched for a delta (the others'
	// spares are as the last state left them, or in r.spare, which
	// PrepareTables installs).
	var prepared error
	if st.Delta {
		prepared = r.prepare(slices.Values(r.touched))
	} else {
		prepared = r.prepareTables()
	}
	errs = append(errs, r.retryDeletes(), prepared)
	// markPrefilters marked what this state adds. What it no longer needs
	// stays needed here: a removed service's key, a retired backend's port
	// stay marked until Sweep frees them (and clears them then). So the
	// prefilters are rebuilt from everything only the first time, or after
	// a failed write, or a backend dropped (flushBackends).
	if !r.applied || r.prefiltersDirty || r.dropped {
		r.dropped = false
		if err := r.syncPrefilters(); err != nil {
			errs = append(errs, err)
		}
	}
	sort.Slice(changes, func(i, j int) bool { return changes[i].Service.ID < changes[j].Service.ID })
	return changes, errors.Join(errs...)
}

// identical reports whether a and b are the same slice (a caller's state
// is not modified once handed to Apply).
func identical(a, b []desired.Endpoint) bool {
	return len(a) == len(b) && len(a) > 0 && &a[0] == &b[0]
}

func sameEndpoints(s *Service, eps []desired.Endpoint, bes *backendTable) bool {
	if len(s.Backends) != len(eps) {
		return false
	}
	for i, id := range s.Backends {
		if bes.get(id).Addr != eps[i].Addr {
			return false
		}
	}
	return true
}

func (r *Reconciler) renameBackends(s *Service) {
	for i, id := range s.Backends {
		r.backends.get(id).Name = s.Spec.Endpoints[i].Name
	}
}

// syncBackends gives every endpoint of s a backend id, keeping the ids of
// endpoints it already had, and retires the rest.
func (r *Reconciler) syncBackends(s *Service, now time.Time) (retired []uint32, _ error) {
	have := map[netip.AddrPort]uint32{}
	for _, id := range s.Backends {
		have[r.backends.get(id).Addr] = id
	}
	var errs []error
	ids := make([]uint32, 0, len(s.Spec.Endpoints))
	for _, ep := range s.Spec.Endpoints {
		id, ok := have[ep.Addr]
		if ok {
			delete(have, ep.Addr)
			r.backends.get(id).Name = ep.Name
			ids = append(ids, id)
			continue
		}
		var clean bool
		id, clean, ok = r.beIDs.get()
		if !ok {
			errs = append(errs, fmt.Errorf("service %s: endpoint %s: no free backend id (max %d)", s.Spec.Name, ep.Addr, r.beIDs.max))
			continue
		}
		// New endpoints start active, as failure accrual starts them ready:
		// the kernel only reaches a backend through a table, so one that is
		// in none yet is harmless. Written in one batch by flushBackends.
		b := &Backend{ID: id, Service: s.ID, Addr: ep.Addr, Name: ep.Name, State: maps.BackendActive, clean: clean}
		r.backends.set(id, b)
		r.fresh = append(r.fresh, b)
		ids = append(ids, id)
	}
	for _, id := range have {
		r.retire(r.backends.get(id), now)
		retired = append(retired, id)
	}
	slices.Sort(retired)
	s.Backends = ids
	// Keep Spec.Endpoints aligned with Backends when an id was unavailable.
	if len(ids) != len(s.Spec.Endpoints) {
		eps := make([]desired.Endpoint, 0, len(ids))
		for _, id := range ids {
			eps = append(eps, desired.Endpoint{Addr: r.backends.get(id).Addr, Name: r.backends.get(id).Name})
		}
		s.Spec.Endpoints = eps
	}
	return retired, errors.Join(errs...)
}

// flushBackends writes the backends syncBackends created, in batches: the
// counters of their (possibly recycled) ids zeroed, unless clean, then
// their entries.
// An entry that cannot be written leaves its service.
func (r *Reconciler) flushBackends() error {
	if len(r.fresh) == 0 {
		return nil
	}
	fresh := r.fresh
	r.fresh = nil
	ids := make([]uint32, len(fresh))
	vals := make([]bpf.LbBackend, len(fresh))
	var used []uint32
	for i, b := range fresh {
		ids[i] = b.ID
		vals[i] = maps.NewBackend(b.Addr, b.Service, b.State, 0)
		if !b.clean {
			used = append(used, b.ID)
		}
		b.clean = false
	}
	var errs []error
	if err := r.w.ResetBackendStats(used); err != nil {
		errs = append(errs, err)
	}
	for _, id := range ids {
		r.w.ResetBackendTrip(id)
	}
	if r.w.SetBackends(ids, vals) == nil {
		return errors.Join(errs...)
	}
	// Find the entries that fail, one by one.
	for i, b := range fresh {
		if err := r.w.SetBackend(b.ID, vals[i]); err != nil {
			name := fmt.Sprint(b.Service)
			if s, ok := r.byID[b.Service]; ok {
				name = s.Spec.Name
			}
			errs = append(errs, fmt.Errorf("service %s: endpoint %s: %w", name, b.Addr, err))
			if s, ok := r.byID[b.Service]; ok {
				idx := slices.Index(s.Backends, b.ID)
				s.Backends = slices.Delete(s.Backends, idx, idx+1)
				// A new slice: this one may be the caller's.
				s.Spec.Endpoints = slices.Delete(slices.Clone(s.Spec.Endpoints), idx, idx+1)
			}
			r.backends.del(b.ID)
			r.beIDs.put(b.ID)
			r.dropped = true // its port may be marked for nothing
		}
	}
	return errors.Join(errs...)
}

// retire marks a backend removed. Its entry stays (live flows carry their
// backend's address in conntrack, so they keep working) until Sweep frees
// it (see free).
func (r *Reconciler) retire(b *Backend, now time.Time) {
	if b == nil || b.State == maps.BackendRemoved {
		return
	}
	b.State = maps.BackendRemoved
	r.removedAt[b.ID] = r.retiredAt(now)
	if err := r.w.SetBackend(b.ID, maps.NewBackend(b.Addr, b.Service, maps.BackendRemoved, 0)); err != nil {
		r.log.Error("mark backend removed", "backend", b.Addr, "id", b.ID, "err", err)
	}
	r.forgetPersisted(b.ID)
}

// retryDeletes deletes the pb_services entries of removed services whose
// delete failed before.
func (r *Reconciler) retryDeletes() error {
	var errs []error
	for id, key := range r.deleting {
		if err := r.w.DeleteService(maps.ServiceKey(key.VIP, key.Port, uint8(key.Protocol)), id); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(r.deleting, id)
		r.retiredSvc[id] = r.retiredAt(r.clk.Now())
		r.retiredKey[id] = key
	}
	return errors.Join(errs...)
}
