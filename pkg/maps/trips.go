// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"errors"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
)

// Kernel-trip failure kinds (pb_svc_trip.kinds, enum pb_trip_kind).
const (
	TripRefused        = uint32(bpf.LbPbTripKindPB_TRIP_REFUSED)
	TripReset          = uint32(bpf.LbPbTripKindPB_TRIP_RESET)
	TripResetAfterData = uint32(bpf.LbPbTripKindPB_TRIP_RESET_AFTER_DATA)
)

// TripKindNames names the Trip* bits of kinds, as accrual names the kinds.
func TripKindNames(kinds uint32) []string {
	out := []string{}
	for _, k := range []struct {
		bit  uint32
		name string
	}{{TripRefused, "refused"}, {TripReset, "reset"}, {TripResetAfterData, "reset-after-data"}} {
		if kinds&k.bit != 0 {
			out = append(out, k.name)
		}
	}
	return out
}

// Trips gives the agent the kernel-trip arrays, pb_svc_trip and
// pb_be_trip, memory-mapped: the datapath takes budget, counts trips and
// streaks with atomic adds, and the agent's stores land on the same words,
// so neither side's update is lost to the other's read-modify-write.
type Trips struct {
	svc, be []byte
}

// OpenTrips maps both arrays.
func (m *Maps) OpenTrips() (*Trips, error) {
	svc, be, err := mmapPair(m.m.PbSvcTrip, "pb_svc_trip", m.m.PbBeTrip, "pb_be_trip")
	if err != nil {
		return nil, err
	}
	return &Trips{svc: svc, be: be}, nil
}

// Close unmaps the arrays.
func (t *Trips) Close() error {
	return errors.Join(unix.Munmap(t.svc), unix.Munmap(t.be))
}

// element returns the id-th value of an array of T, or nil out of range.
func element[T any](b []byte, id uint32) *T {
	size := (int(unsafe.Sizeof(*new(T))) + 7) &^ 7
	off := int(id) * size
	if off+size > len(b) { // (the mapping is page-rounded: callers pass ids below max_entries)
		return nil
	}
	return (*T)(unsafe.Pointer(&b[off]))
}

// TripSettings are a service's kernel-trip settings.
type TripSettings struct {
	// MaxFailures consecutive counted failures trip a backend; 0: never.
	MaxFailures uint32
	// Kinds are the Trip* bits counted.
	Kinds uint32
	// Settle: a reset counts only this soon after its flow's SYN (the
	// agent's connect timeout, after which it has judged the flow).
	Settle time.Duration
}

// SetService writes a service's trip settings and budget: budget is how
// many more of its backends the datapath may eject (the agent's
// maxEjectionPercent room, less the trips it has not read yet).
func (t *Trips) SetService(id uint32, s TripSettings, budget int64) {
	v := element[bpf.LbSvcTrip](t.svc, id)
	if v == nil {
		return
	}
	atomic.StoreUint32(&v.MaxFailures, s.MaxFailures)
	atomic.StoreUint32(&v.Kinds, s.Kinds)
	atomic.StoreUint64(&v.SettleNs, uint64(max(s.Settle, 0)))
	atomic.StoreInt64(&v.Budget, budget)
}

// ResetService zeroes a service's entry, counters included: only for a
// fresh or recycled id.
func (t *Trips) ResetService(id uint32) {
	if v := element[bpf.LbSvcTrip](t.svc, id); v != nil {
		atomic.StoreUint32(&v.MaxFailures, 0)
		atomic.StoreUint32(&v.Kinds, 0)
		atomic.StoreUint64(&v.SettleNs, 0)
		atomic.StoreInt64(&v.Budget, 0)
		atomic.StoreUint64(&v.Trips, 0)
		atomic.StoreUint64(&v.Suppressed, 0)
	}
}

// Service reads a service's entry.
func (t *Trips) Service(id uint32) bpf.LbSvcTrip {
	v := element[bpf.LbSvcTrip](t.svc, id)
	if v == nil {
		return bpf.LbSvcTrip{}
	}
	return bpf.LbSvcTrip{MaxFailures: atomic.LoadUint32(&v.MaxFailures), Kinds: atomic.LoadUint32(&v.Kinds), SettleNs: atomic.LoadUint64(&v.SettleNs),
		Budget: atomic.LoadInt64(&v.Budget), Trips: atomic.LoadUint64(&v.Trips), Suppressed: atomic.LoadUint64(&v.Suppressed)}
}

// ResetBackend starts a backend's kernel streak afresh.
func (t *Trips) ResetBackend(id uint32) {
	if v := element[bpf.LbBeTrip](t.be, id); v != nil {
		atomic.StoreUint32(&v.Failures, 0)
	}
}

// Backend reads a backend's streak and its last trip's kernel time.
func (t *Trips) Backend(id uint32) bpf.LbBeTrip {
	v := element[bpf.LbBeTrip](t.be, id)
	if v == nil {
		return bpf.LbBeTrip{}
	}
	return bpf.LbBeTrip{Failures: atomic.LoadUint32(&v.Failures), TrippedNs: atomic.LoadUint64(&v.TrippedNs)}
}
