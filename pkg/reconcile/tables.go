// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"errors"
	"iter"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/pkg/maglev"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// TableSize is the largest Maglev table size.
func (r *Reconciler) TableSize() uint32 { return r.maxTableSize }

// SetTableSize changes the largest Maglev table size. Services whose size
// changes get new tables at their next ProgramService (forced here).
func (r *Reconciler) SetTableSize(n uint32) error {
	if err := maglev.ValidateTableSize(n); err != nil {
		return err
	}
	r.maxTableSize = n
	for _, s := range r.byID {
		s.Active, s.Probation = nil, nil // force a rebuild
	}
	return r.prepareTables()
}

// sizeLadder are the table sizes services get: primes, each about twice
// the last, so a service's size changes only when its endpoint count
// doubles.
var sizeLadder = []uint32{1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071, 262139, 524287, 1048573}

// sizeFor picks the table size for n endpoints: the smallest size of the
// ladder with at least 100 slots per endpoint (Maglev's rule for shares
// within 1%), capped at the configured maximum. Small services thus cost
// 4 KiB per table, not 64 KiB.
func (r *Reconciler) sizeFor(n int) uint32 {
	want := uint64(n) * 100
	for _, p := range sizeLadder {
		if p > r.maxTableSize {
			break
		}
		if uint64(p) >= want {
			return p
		}
	}
	return r.maxTableSize
}

// nextTable is which of s's two tables the next ProgramService fills:
// the one not live.
func nextTable(s *Service) uint32 {
	if s.value.TableSize == 0 {
		return s.value.Table & 1
	}
	return 1 - s.value.Table&1
}

// prepareTables installs, in one batch, the empty tables the next
// ProgramService of each service will fill, where they are missing or of
// the wrong size: replacing an inner map costs an RCU grace period per
// update call, so doing it here for all services at once keeps it off
// the path of an ejection and makes programming many services fast.
func (r *Reconciler) prepareTables() error {
	return r.prepare(func(yield func(*Service) bool) {
		for _, s := range r.byID {
			if !yield(s) {
				return
			}
		}
	})
}

// PrepareTables installs, in one batch, the spare tables that flips since
// the last call left missing or of the wrong size, and retries deletions
// that failed. The agent calls it after programming (after the first
// state's, once the datapath is live) and periodically, so an ejection
// finds its spare table ready.
func (r *Reconciler) PrepareTables() error {
	pending := r.spare
	r.spare = map[uint32]bool{}
	err := r.prepare(func(yield func(*Service) bool) {
		for id := range pending {
			if s, ok := r.byID[id]; ok && !yield(s) {
				return
			}
		}
	})
	if r.prefiltersDirty {
		err = errors.Join(err, r.syncPrefilters())
	}
	return errors.Join(r.retryDeletes(), err)
}

func (r *Reconciler) prepare(services iter.Seq[*Service]) error {
	var reqs []maps.TableInstall
	var svcs []*Service
	for s := range services {
		if len(s.Backends) == 0 {
			continue
		}
		size, n := r.sizeFor(len(s.Backends)), nextTable(s)
		if s.sizes[n] != size {
			reqs = append(reqs, maps.TableInstall{SvcID: s.ID, N: n, Size: size})
			svcs = append(svcs, s)
		}
	}
	r.makeRoom(len(reqs))
	if err := r.w.InstallTables(reqs); err != nil {
		return err
	}
	for i, s := range svcs {
		s.sizes[reqs[i].N] = reqs[i].Size
	}
	return nil
}

// handlesFromLimit is the default of Options.MaxTableHandles: the open
// files RLIMIT_NOFILE allows (Go raises the soft limit to the hard one at
// start), less an eighth (at least 256, at most 4096) for everything else
// the agent opens: maps, links, sockets, the API server's connections.
func handlesFromLimit() int {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil || lim.Cur == unix.RLIM_INFINITY {
		return 1 << 20
	}
	return tableHandles(lim.Cur)
}

// tableHandles is how many table handles nofile open files leave room for.
func tableHandles(nofile uint64) int {
	reserve := min(max(nofile/8, 256), 4096)
	if nofile <= reserve {
		return 0
	}
	return int(min(nofile-reserve, 1<<30))
}

// makeRoom releases the handles of live tables until need more tables fit
// within maxHandles, of services in no particular order. A live table is
// never written (the next change fills the other one), so its handle only
// saves installing a fresh spare at the change after next: with handles
// short, that install (batched by PrepareTables) is the price. While there
// is room, nothing is released.
func (r *Reconciler) makeRoom(need int) {
	if need == 0 {
		return
	}
	over := r.w.TableHandles() + need - r.maxHandles
	if over <= 0 {
		return
	}
	released := 0
	for _, s := range r.byID {
		if released >= over {
			break
		}
		live := s.value.Table & 1
		if s.value.TableSize == 0 || s.sizes[live] == 0 {
			continue // no live table, or no handle on it
		}
		r.w.ReleaseTable(s.ID, live)
		s.sizes[live] = 0
		released++
	}
	if released > 0 {
		r.log.Debug("released live tables' handles", "released", released, "max_handles", r.maxHandles)
	}
}
