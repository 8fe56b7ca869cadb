// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maglev"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// ProgramService writes a service's admission into the kernel: backend
// states, the fallback table and the Maglev table. active and probation
// are backend ids of the service; failOpen admits every endpoint.
//
// Writes are ordered so that no new flow can reach an endpoint the agent
// is taking out, and none is turned away from one it is putting in:
// endpoints leaving are marked ejected first (the kernel steers around
// them at once), the fallback table exists before any endpoint enters
// probation, and the new table goes in last.
func (r *Reconciler) ProgramService(id uint32, active, probation []uint32, failOpen bool, tripBudget int64) error {
	s, ok := r.byID[id]
	if !ok {
		return fmt.Errorf("program service %d: unknown", id)
	}
	// Every time, even when nothing else changed: the datapath takes from
	// the budget, and an undone trip gives a unit back.
	trips := tripSettings(&s.Spec)
	if r.noTrips {
		trips = maps.TripSettings{}
	}
	r.w.SetServiceTrip(id, trips, tripBudget)
	if failOpen {
		active, probation = s.Backends, nil
	}
	if s.FailOpen == failOpen && slices.Equal(s.Active, active) && slices.Equal(s.Probation, probation) && s.Active != nil {
		// The admission is what the kernel holds but for what the datapath
		// did on its own: the entries of backends it tripped are written
		// again; the tables are as they were.
		var errs []error
		for _, bid := range s.Backends {
			if b := r.backends.get(bid); b != nil && b.Tripped {
				errs = append(errs, r.setState(bid, b.State))
			}
		}
		if err := errors.Join(errs...); err != nil {
			return fmt.Errorf("program service %s: %w", s.Spec.Name, err)
		}
		return nil
	}
	in := map[uint32]maps.BackendState{}
	for _, b := range active {
		in[b] = maps.BackendActive
	}
	for _, b := range probation {
		in[b] = maps.BackendProbation
	}

	var errs []error
	// 1. Out first.
	for _, bid := range s.Backends {
		if _, ok := in[bid]; !ok {
			errs = append(errs, r.setState(bid, maps.BackendEjected))
		}
	}
	// 2. The fallback table, whenever a probe shares the table with others,
	// and kept current once it exists (it must never hold a backend the
	// service no longer has). Without it, no endpoint may enter probation.
	size := r.sizeFor(len(s.Backends))
	if len(active) > 0 && (len(probation) > 0 || s.hasFallback) &&
		(!slices.Equal(s.fallback, active) || s.fallbackSize != size) {
		slots, err := r.build(active, size)
		if err == nil {
			err = r.w.SetFallback(id, slots)
		}
		if err != nil {
			return fmt.Errorf("program service %s: fallback table: %w", s.Spec.Name, errors.Join(append(errs, err)...))
		}
		s.hasFallback = true
		s.fallback = append([]uint32(nil), active...)
		s.fallbackSize = size
	}
	// 3. States of the endpoints going in.
	for _, bid := range s.Backends {
		if st, ok := in[bid]; ok {
			errs = append(errs, r.setState(bid, st))
		}
	}
	// 4. The active backends a circuit breaker scans for room. Entries go
	// first; the service's backend_count, written with the table below,
	// makes them visible.
	if !slices.Equal(s.listed, active) {
		err := r.w.SetServiceBackends(id, s.listed, active)
		if err == nil {
			s.listed = append(make([]uint32, 0, len(active)), active...)
		}
		errs = append(errs, err)
	}
	// 5. The table: fill the one not live, then flip the service to it
	// (its table index and size change in one value update). A table is
	// only installed here if prepareTables could not do it beforehand.
	all := append(append([]uint32(nil), active...), probation...)
	if len(all) > 0 {
		n := nextTable(s)
		var err error
		if s.sizes[n] != size {
			r.makeRoom(1)
			err = r.w.InstallTables([]maps.TableInstall{{SvcID: id, N: n, Size: size}})
			if err == nil {
				s.sizes[n] = size
			}
		}
		var slots []uint32
		if err == nil {
			slots, err = r.build(all, size)
		}
		if err == nil {
			err = r.w.FillTable(id, n, slots)
		}
		if err == nil {
			err = r.writeService(s, n, size)
		}
		if err == nil && s.sizes[1-n] != size {
			r.spare[id] = true
		}
		errs = append(errs, err)
	} else {
		// No endpoint at all: no table, the service drops new flows (counted).
		errs = append(errs, r.writeService(s, s.value.Table, 0))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("program service %s: %w", s.Spec.Name, err)
	}
	s.Active = append(make([]uint32, 0, len(active)), active...)
	s.Probation = append([]uint32(nil), probation...)
	s.FailOpen = failOpen
	return nil
}

// setState writes a backend's kernel state when it changes. Entering
// probation grants ProbeGrants flows; staying in probation grants nothing
// new, so a probe the kernel already admitted is not repeated.
func (r *Reconciler) setState(id uint32, st maps.BackendState) error {
	b := r.backends.get(id)
	if b.State == st && !b.Tripped {
		return nil
	}
	grants := int32(0)
	if st == maps.BackendProbation {
		grants = ProbeGrants
	}
	if err := r.w.SetBackend(id, maps.NewBackend(b.Addr, b.Service, st, grants)); err != nil {
		return fmt.Errorf("backend %s: %w", b.Addr, err)
	}
	// Back in: its kernel streak starts afresh, as accrual's does.
	if st == maps.BackendActive {
		r.w.ResetBackendTrip(id)
	}
	b.State, b.Tripped = st, false
	return nil
}

// NoteKernelTrip records that the datapath ejected backend id on its own:
// whatever is decided next about it is written, even a state the
// reconciler believes the kernel holds already.
func (r *Reconciler) NoteKernelTrip(id uint32) {
	if b, ok := r.backends.lookup(id); ok {
		b.Tripped = true
	}
}

// UndoTrip puts back a backend the datapath ejected on its own (a kernel
// trip) that accrual keeps in: its entry is rewritten with the state the
// reconciler last wrote, whatever the kernel holds now, and its kernel
// streak starts afresh. A backend written since its trip was noted
// (NoteKernelTrip) holds that state already: nothing is written twice.
func (r *Reconciler) UndoTrip(id uint32) error {
	b, ok := r.backends.lookup(id)
	if !ok || !b.Tripped {
		return nil
	}
	if err := r.setState(id, b.State); err != nil {
		return err
	}
	r.w.ResetBackendTrip(id) // setState resets it only for an active backend
	return nil
}

// tripKinds are the failure kinds the datapath counts, with their bits.
var tripKinds = []struct {
	kind accrual.Kind
	bit  uint32
}{
	{accrual.KindRefused, maps.TripRefused},
	{accrual.KindReset, maps.TripReset},
	{accrual.KindResetAfterData, maps.TripResetAfterData},
}

// tripSettings are a service's kernel-trip settings: its consecutive rule
// (modes consecutive and unified) and the failure kinds the datapath can
// tell apart (UDP: refusals, its port unreachables); a connect timeout is
// the agent's own deadline, so it never trips in the kernel; nor does a
// reset once the agent has judged its flow (connectTimeout after the SYN).
// MaxFailures 0: no kernel trips.
func tripSettings(s *desired.Service) maps.TripSettings {
	a := &s.Accrual
	if !a.Mode.Consecutive() || a.MaxFailures < 1 {
		return maps.TripSettings{}
	}
	var kinds uint32
	for _, k := range tripKinds {
		if a.FailureKinds.Has(k.kind) {
			kinds |= k.bit
		}
	}
	if s.Key.Protocol != desired.TCP {
		kinds &= maps.TripRefused
	}
	if kinds == 0 {
		return maps.TripSettings{}
	}
	return maps.TripSettings{MaxFailures: uint32(min(a.MaxFailures, math.MaxUint32)), Kinds: kinds, Settle: a.ConnectTimeout}
}

// EndKernelStreak starts backend id's kernel streak afresh: a success the
// datapath never sees (one judged by a deadline) ends the streak, as it
// ends accrual's.
func (r *Reconciler) EndKernelStreak(id uint32) {
	if _, ok := r.backends.lookup(id); ok {
		r.w.ResetBackendTrip(id)
	}
}

// KernelEjected lists the backends of service id that the kernel holds
// ejected while the reconciler last wrote them active: kernel trips whose
// events never arrived.
func (r *Reconciler) KernelEjected(id uint32) []uint32 {
	s, ok := r.byID[id]
	if !ok {
		return nil
	}
	var out []uint32
	for _, bid := range s.Backends {
		b := r.backends.get(bid)
		if b == nil || b.State != maps.BackendActive {
			continue
		}
		if kb, err := r.w.Backend(bid); err == nil && maps.BackendState(kb.State) == maps.BackendEjected {
			out = append(out, bid)
		}
	}
	return out
}

// writeService writes s's pb_services entry when it changed: table n of
// tableSize slots is live (tableSize 0: none).
func (r *Reconciler) writeService(s *Service, n, tableSize uint32) error {
	spec := &s.Spec
	v := bpf.LbSvcValue{Id: s.ID, Table: n, TableSize: tableSize, MaxInflight: spec.MaxInflight,
		MaxInflightPerBackend: spec.MaxInflightPerEndpoint, BackendCount: uint32(len(s.listed)),
		AffinityTimeoutS: affinitySeconds(spec.Affinity)}
	if spec.RetryRefused {
		v.Flags |= maps.ServiceRetryRefused
	}
	v.Flags |= quietFlags(spec)
	if !s.takenOver.IsZero() && r.clk.Since(s.takenOver) < r.takeover {
		v.Flags |= maps.ServiceTakenOver
	}
	if v == s.value {
		return nil
	}
	if err := r.w.UpsertService(maps.ServiceKey(spec.Key.VIP, spec.Key.Port, uint8(spec.Key.Protocol)), v); err != nil {
		return fmt.Errorf("service %s: %w", spec.Name, err)
	}
	// Affinity switched off: the clients pinned so far are let go, so
	// that switching it on again starts afresh, as kube-proxy does.
	if s.value.AffinityTimeoutS != 0 && v.AffinityTimeoutS == 0 {
		if err := r.w.ForgetAffinity(s.ID); err != nil {
			return fmt.Errorf("service %s: %w", spec.Name, err)
		}
	}
	s.value = v
	return nil
}

// affinitySeconds is d in whole seconds for pb_services, a part second
// rounded up (a timeout never shortens), at most desired.MaxAffinity.
func affinitySeconds(d time.Duration) uint32 {
	if d <= 0 {
		return 0
	}
	return uint32((min(d, desired.MaxAffinity) + time.Second - 1) / time.Second)
}

// Regrant gives an endpoint in probation a fresh probe: its last probe
// ended without a verdict (a failure of a kind that does not count, or
// events lost), or the kernel's entry drifted. It rewrites the entry
// whatever the reconciler believes it holds.
func (r *Reconciler) Regrant(id uint32) error {
	b, ok := r.backends.lookup(id)
	if !ok || b.State != maps.BackendProbation {
		return nil
	}
	return r.w.SetBackend(id, maps.NewBackend(b.Addr, b.Service, maps.BackendProbation, ProbeGrants))
}

// KernelState reads a backend's entry back from the kernel: its state and
// the probe grants left, which the datapath spends.
func (r *Reconciler) KernelState(id uint32) (maps.BackendState, int32, error) {
	kb, err := r.w.Backend(id)
	if err != nil {
		return 0, 0, err
	}
	return maps.BackendState(kb.State), kb.ProbeGrants, nil
}

// build computes a Maglev table over the given backends. Keys are the
// endpoint addresses, so the table depends only on the set, not on ids or
// order, and a restarted agent rebuilds it byte for byte. The slice it
// returns is the next build's too: write it before building again.
func (r *Reconciler) build(ids []uint32, size uint32) ([]uint32, error) {
	r.keys = r.keys[:0]
	for _, id := range ids {
		r.keys = append(r.keys, r.backends.get(id).Addr.String())
	}
	b := r.builders[size]
	if b == nil {
		b = maglev.NewBuilder(size)
		r.builders[size] = b
	}
	slots, err := b.Build(r.keys, r.slots[size])
	if err != nil {
		return nil, err
	}
	r.slots[size] = slots
	// Reused: what build returns is written (copied) into a table before
	// the next build. At a cold start, 10,000 fresh copies were 40 MB of
	// garbage.
	out := r.tables[size]
	if len(out) != len(slots) {
		out = make([]uint32, len(slots))
		r.tables[size] = out
	}
	for i, idx := range slots {
		out[i] = ids[idx]
	}
	return out, nil
}

// quietFlags spares the agent the events its verdicts on s's flows do not
// need: each is a ring buffer record to read and classify, and a healthy
// connection otherwise costs four. What the verdict waits for is the
// tracker's Settle, from the same settings.
func quietFlags(s *desired.Service) uint32 {
	pol := outcomes.PolicyFor(s.Accrual, s.Key.Protocol == desired.TCP)
	if !pol.Tracked {
		return maps.ServiceQuietData | maps.ServiceQuietEnd // no verdicts at all
	}
	switch pol.Settle {
	case outcomes.SettleOnSynAck:
		return maps.ServiceQuietData | maps.ServiceQuietEnd
	case outcomes.SettleOnData:
		return maps.ServiceQuietEnd
	}
	return 0 // SettleOnEnd: a normal close is the success
}
