// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// adopt reads the pinned maps a previous agent wrote. Services and backends
// found there keep their ids; the first Apply then rewrites only what the
// desired state changed.
func (r *Reconciler) adopt() error {
	svcs, err := r.w.Services()
	if err != nil {
		return fmt.Errorf("adopt services: %w", err)
	}
	// An id more than one entry holds (no agent writes that, but pins can
	// be anything): the entries dropped go alone (id 0), the id's tables,
	// affinity and pb_svc_keys entry being the one kept's, which writes
	// its own key again below.
	holders := map[uint32]int{}
	for _, v := range svcs {
		holders[v.Id]++
	}
	drop := func(k bpf.LbSvcKey, id uint32) {
		if holders[id] > 1 {
			id = 0
		}
		if err := r.w.DeleteService(k, id); err != nil {
			r.log.Error("drop pinned service", "id", id, "err", err)
		}
	}
	for k, v := range svcs {
		key := desired.Key{VIP: maps.AddrFromFamily(k.Family, k.Vip.Bytes), Port: maps.Port(k.Port), Protocol: desired.Protocol(k.Proto)}
		if !key.VIP.IsValid() {
			// No key of ours: the service could never be matched to the
			// desired state, nor deleted through a key rebuilt from it.
			r.log.Warn("pinned service with an unknown address family, dropping it", "family", k.Family, "id", v.Id)
			drop(k, v.Id)
			continue
		}
		if !r.svcIDs.take(v.Id) {
			r.log.Warn("pinned service with an unusable id, dropping it", "service", key, "id", v.Id)
			drop(k, v.Id)
			continue
		}
		s := &Service{ID: v.Id, Spec: desired.Service{Key: key}, value: v}
		if v.Flags&(maps.ServiceTakenOver|maps.ServiceHandedBack) != 0 {
			// Taken over before the restart, when is not kept: the
			// grace starts again. Handed back, kube-proxy had its new
			// flows: served again, it is taken over anew (and if not,
			// the first Apply hands it back again).
			s.takenOver = r.clk.Now()
		}
		if s.sizes, err = r.w.TableSizes(v.Id); err != nil {
			return fmt.Errorf("adopt service %s: tables: %w", key, err)
		}
		if s.listed, err = r.w.ServiceBackends(v.Id, v.BackendCount); err != nil {
			r.log.Warn("pinned service's backend list unreadable, rewriting it", "service", key, "err", err)
			s.listed, s.value.BackendCount = nil, 0
		}
		r.services[key] = s
		r.byID[v.Id] = s
	}
	for id, n := range holders {
		if kept := r.byID[id]; n > 1 && kept != nil {
			kk := kept.Spec.Key
			if err := r.w.UpsertService(maps.ServiceKey(kk.VIP, kk.Port, uint8(kk.Protocol)), kept.value); err != nil {
				r.log.Error("rewrite pinned service", "service", kk, "id", id, "err", err)
			}
		}
	}
	bes, err := r.w.Backends()
	if err != nil {
		return fmt.Errorf("adopt backends: %w", err)
	}
	ids := make([]uint32, 0, len(bes))
	for id := range bes {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		v := bes[id]
		addr := maps.AddrFromFamily(v.Family, v.Addr.Bytes)
		if !addr.IsValid() {
			// Not an entry of ours (Backends lists those with a family):
			// clear it rather than rewrite it as an address it is not.
			r.log.Warn("pinned backend with an unknown address family, clearing it", "family", v.Family, "id", id)
			if err := r.w.ClearBackend(id); err != nil {
				r.log.Error("clear backend", "id", id, "err", err)
			}
			continue
		}
		if !r.beIDs.take(id) {
			continue
		}
		b := &Backend{ID: id, Service: v.SvcId, State: maps.BackendState(v.State),
			Addr: netip.AddrPortFrom(addr, maps.Port(v.Port))}
		r.backends.set(id, b)
		if s, ok := r.byID[v.SvcId]; ok && b.State != maps.BackendRemoved {
			s.Backends = append(s.Backends, id)
			s.Spec.Endpoints = append(s.Spec.Endpoints, desired.Endpoint{Addr: b.Addr})
		} else {
			// An orphan (its service is gone or was dropped above): mark it
			// removed in the kernel too, as retire would have.
			b.State = maps.BackendRemoved
			r.removedAt[id] = r.retiredAt(r.clk.Now())
			if v.State != uint8(maps.BackendRemoved) || v.ProbeGrants != 0 {
				if err := r.w.SetBackend(id, maps.NewBackend(b.Addr, b.Service, maps.BackendRemoved, 0)); err != nil {
					r.log.Error("mark orphaned backend removed", "backend", b.Addr, "id", id, "err", err)
				}
			}
		}
	}
	ports, err := r.w.Ports()
	if err != nil {
		return fmt.Errorf("adopt ports: %w", err)
	}
	r.ports = ports
	if r.vipSlots, err = r.w.VIPSlots(); err != nil {
		return fmt.Errorf("adopt VIP slots: %w", err)
	}
	if len(svcs) > 0 || len(bes) > 0 {
		r.log.Info("adopted pinned state", "services", len(r.services), "backends", r.backends.len())
	}
	return nil
}

// Adopted returns what the pinned maps held at start, for restoring
// accrual state: backend id by (service key, endpoint).
func (r *Reconciler) Adopted() map[desired.Key]map[netip.AddrPort]uint32 {
	out := map[desired.Key]map[netip.AddrPort]uint32{}
	for k, s := range r.services {
		m := map[netip.AddrPort]uint32{}
		for _, id := range s.Backends {
			m[r.backends.get(id).Addr] = id
		}
		out[k] = m
	}
	return out
}
