// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"errors"
	stdmaps "maps"
	"net/netip"

	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// syncPrefilters makes the datapath's two prefilters match the services:
// pb_ports marks every VIP port and every backend port (removed backends
// included: their flows' replies still need reverse NAT), pb_vip_slots the
// slot of every VIP address. Removed services whose flows may live on keep
// theirs.
func (r *Reconciler) syncPrefilters() error {
	want := prefilterSet{ports: map[uint16]uint8{}, slots: map[uint32]bool{}}
	for key := range r.services {
		want.vip(key.VIP, key.Port)
	}
	for _, key := range r.retiredKey {
		want.vip(key.VIP, key.Port)
	}
	for ap := range r.inUseVIPs {
		want.vip(ap.Addr(), ap.Port())
	}
	for _, b := range r.backends.all() {
		want.ports[b.Addr.Port()] |= maps.PortBackend
	}
	return r.writePrefilters(want.ports, want.slots)
}

// markPrefilters marks the VIP ports, address slots and backend ports of
// services on top of what is marked, clearing nothing.
func (r *Reconciler) markPrefilters(services []desired.Service) error {
	if !r.prefiltersDirty && r.marked(services) {
		// The usual change (an endpoint replaced at a port in use): no
		// copy of the marks, no comparison of 10,000 slots.
		return nil
	}
	want := prefilterSet{ports: stdmaps.Clone(r.ports), slots: stdmaps.Clone(r.vipSlots)}
	if want.ports == nil {
		want.ports = map[uint16]uint8{}
	}
	if want.slots == nil {
		want.slots = map[uint32]bool{}
	}
	for _, spec := range services {
		want.vip(spec.Key.VIP, spec.Key.Port)
		for _, ep := range spec.Endpoints {
			want.ports[ep.Addr.Port()] |= maps.PortBackend
		}
	}
	return r.writePrefilters(want.ports, want.slots)
}

// marked reports whether everything services need is marked already.
func (r *Reconciler) marked(services []desired.Service) bool {
	for _, spec := range services {
		if r.ports[spec.Key.Port]&maps.PortVIP == 0 || !r.vipSlots[maps.VIPSlot(spec.Key.VIP)] {
			return false
		}
		for _, ep := range spec.Endpoints {
			if r.ports[ep.Addr.Port()]&maps.PortBackend == 0 {
				return false
			}
		}
	}
	return true
}

// prefilterSet is what pb_ports and pb_vip_slots are to mark.
type prefilterSet struct {
	ports map[uint16]uint8
	slots map[uint32]bool
}

// vip marks a VIP: its port and its address's slot.
func (p prefilterSet) vip(addr netip.Addr, port uint16) {
	p.ports[port] |= maps.PortVIP
	p.slots[maps.VIPSlot(addr)] = true
}

// writePrefilters writes what differs from what the kernel holds. After a
// failed write the kernel's state is read back: a batch may have stopped
// part way, and a stale record would make later diffs skip entries.
func (r *Reconciler) writePrefilters(ports map[uint16]uint8, slots map[uint32]bool) error {
	var errs []error
	if !stdmaps.Equal(ports, r.ports) {
		if err := r.w.SetPorts(r.ports, ports); err != nil {
			errs = append(errs, err)
			if r.ports, err = r.w.Ports(); err != nil {
				r.ports = everyPort()
			}
		} else {
			r.ports = ports
		}
	}
	if !stdmaps.Equal(slots, r.vipSlots) {
		if err := r.w.SetVIPSlots(r.vipSlots, slots); err != nil {
			errs = append(errs, err)
			if r.vipSlots, err = r.w.VIPSlots(); err != nil {
				r.vipSlots = everySlot()
			}
		} else {
			r.vipSlots = slots
		}
	}
	r.prefiltersDirty = len(errs) > 0
	return errors.Join(errs...)
}

// everyPort and everySlot stand for a prefilter whose content is unknown:
// diffed against them, a write covers every entry.
func everyPort() map[uint16]uint8 {
	m := make(map[uint16]uint8, 1<<16)
	for p := range 1 << 16 {
		m[uint16(p)] = maps.PortVIP | maps.PortBackend
	}
	return m
}

func everySlot() map[uint32]bool {
	m := make(map[uint32]bool, maps.VIPSlots)
	for k := range uint32(maps.VIPSlots) {
		m[k] = true
	}
	return m
}

// PrefiltersDirty reports whether the last write of the prefilters failed
// (PrepareTables retries it): until it succeeds, packets of a new VIP may
// pass the datapath without being balanced.
func (r *Reconciler) PrefiltersDirty() bool { return r.prefiltersDirty }
