// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"github.com/penaltybox/penaltybox/pkg/conntrack"

	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Sweep frees ids of removed services and backends whose cooldown is over
// and that no conntrack entry refers to, and drops their port roles.
func (r *Reconciler) Sweep(inUse InUse) {
	if inUse.Incomplete {
		return
	}
	now := r.clk.Now()
	for id, b := range r.backends.all() {
		if b.State != maps.BackendRemoved || now.Sub(r.removedAt[id]) < r.cooldown || inUse.Backends[id] {
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
	for id, at := range r.retiredBe {
		if now.Sub(at) >= r.cooldown && !inUse.Backends[id] {
			delete(r.retiredBe, id)
			r.beIDs.put(id)
		}
	}
	r.endHandBacks(inUse, now)
	for id, at := range r.retiredSvc {
		if _, pending := r.deleting[id]; pending {
			continue
		}
		if now.Sub(at) >= r.cooldown && !inUse.Services[id] {
			delete(r.retiredSvc, id)
			delete(r.retiredKey, id)
			r.svcIDs.put(id)
		}
	}
	r.inUseVIPs = inUse.VIPs
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
