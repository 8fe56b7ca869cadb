// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"net/netip"
	"time"

	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// SweepMark numbers the conntrack walks in the order they began
// (BeginSweep).
type SweepMark uint64

// BeginSweep marks the start of a conntrack walk; Sweep takes the mark
// with the walk's result.
func (r *Reconciler) BeginSweep() SweepMark {
	r.walks++
	return r.walks
}

// retirement is an id out of use (a removed service or backend, or one
// only flows left at start referred to): when it left, and how many walks
// in a row since then found no flow on it.
type retirement struct {
	at time.Time
	// after: the walks begun before it left. A walk that began earlier
	// may have passed a bucket before a flow on the id was made there.
	after  SweepMark
	missed uint8
}

// retiredAt is the record of an id retiring now.
func (r *Reconciler) retiredAt(now time.Time) retirement {
	return retirement{at: now, after: r.walks}
}

// free says whether retired id (its record in m) may be handed out again,
// after a walk (mark) that found a flow on it or not (used), and keeps
// the walk in the record: once its cooldown is over and two walks in a
// row that began after it left found none. Misses during the cooldown
// count; an incomplete walk (Sweep skips it) neither counts nor breaks
// the row. One miss is not enough: the kernel's walk
// (bpf_for_each_map_elem) can lose the rest of a bucket when the datapath
// deletes the entry it stands on (at a closed flow's last ACK) and the
// LRU hands that element to a new flow in another bucket. Handed out
// again while a flow refers to it, the id would take that flow's outcome
// events, kernel trips and breaker slot for another endpoint.
func (r *Reconciler) free(m map[uint32]retirement, id uint32, used bool, mark SweepMark, now time.Time) bool {
	rt := m[id]
	switch {
	case used:
		rt.missed = 0
	case mark > rt.after && rt.missed < 2:
		rt.missed++
	}
	m[id] = rt
	return rt.missed >= 2 && now.Sub(rt.at) >= r.cooldown
}

// Sweep takes what the conntrack walk begun at mark found in use: it
// frees the ids of removed services and backends (see free) and drops
// their port roles, and keeps marked the VIPs either of the last two
// walks found flows to.
func (r *Reconciler) Sweep(inUse InUse, mark SweepMark) {
	if inUse.Incomplete {
		return
	}
	now := r.clk.Now()
	for id, b := range r.backends.all() {
		if b.State != maps.BackendRemoved || !r.free(r.removedAt, id, inUse.Backends[id], mark, now) {
			continue
		}
		if err := r.w.ClearBackend(id); err != nil {
			r.log.Error("clear backend", "id", id, "err", err)
			continue
		}
		r.backends.del(id)
		delete(r.removedAt, id)
		r.beIDs.put(id)
	}
	for id := range r.retiredBe {
		if r.free(r.retiredBe, id, inUse.Backends[id], mark, now) {
			delete(r.retiredBe, id)
			r.beIDs.put(id)
		}
	}
	r.endHandBacks(inUse, now)
	for id := range r.retiredSvc {
		if _, pending := r.deleting[id]; pending {
			continue
		}
		if r.free(r.retiredSvc, id, inUse.Services[id], mark, now) {
			delete(r.retiredSvc, id)
			delete(r.retiredKey, id)
			r.svcIDs.put(id)
		}
	}
	vips := make(map[netip.AddrPort]bool, len(inUse.VIPs)+len(r.lastVIPs))
	for ap := range inUse.VIPs {
		vips[ap] = true
	}
	for ap := range r.lastVIPs {
		vips[ap] = true
	}
	r.inUseVIPs, r.lastVIPs = vips, inUse.VIPs
	if err := r.syncPrefilters(); err != nil {
		r.log.Error("sync prefilters", "err", err)
	}
}

// InUse are the ids live flows refer to, as the conntrack sweep reports
// them: Sweep frees none of them.
type InUse = conntrack.InUse

// idPool hands out ids 1..max-1 (0 means "none" in the maps), reusing
// freed ones before fresh ones.
type idPool struct {
	max  uint32
	next uint32
	free []uint32
	// used is a bitmap of the ids handed out, grown as higher ids are: at
	// 100,000 backends a map of them held 3.5 MB, the bitmap 12.5 KB.
	used []uint64
	// zeroed: the maps were created empty (Options.Fresh), so an id never
	// handed out before has counters nothing ever wrote.
	zeroed bool
}

func newIDPool(max uint32, zeroed bool) idPool {
	return idPool{max: max, next: 1, zeroed: zeroed}
}

func (p *idPool) isUsed(id uint32) bool {
	w := id / 64
	return int(w) < len(p.used) && p.used[w]&(1<<(id%64)) != 0
}

func (p *idPool) mark(id uint32) {
	w := int(id / 64)
	if w >= len(p.used) {
		p.used = append(p.used, make([]uint64, w+1-len(p.used))...)
	}
	p.used[w] |= 1 << (id % 64)
}

// get hands out an id; clean says its counters need no reset (see
// zeroed): it is one the pool never handed out, over maps created empty.
func (p *idPool) get() (id uint32, clean, ok bool) {
	for len(p.free) > 0 {
		id := p.free[len(p.free)-1]
		p.free = p.free[:len(p.free)-1]
		if !p.isUsed(id) {
			p.mark(id)
			return id, false, true
		}
	}
	for p.next < p.max {
		id := p.next
		p.next++
		if !p.isUsed(id) {
			p.mark(id)
			return id, p.zeroed, true
		}
	}
	return 0, false, false
}

// take reserves a specific id (adoption).
func (p *idPool) take(id uint32) bool {
	if id == 0 || id >= p.max || p.isUsed(id) {
		return false
	}
	p.mark(id)
	return true
}

func (p *idPool) put(id uint32) {
	if p.isUsed(id) {
		p.used[id/64] &^= 1 << (id % 64)
		p.free = append(p.free, id)
	}
}
