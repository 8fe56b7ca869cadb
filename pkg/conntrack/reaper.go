// SPDX-License-Identifier: Apache-2.0

// Package conntrack expires idle flows from the datapath's conntrack map
// and releases their circuit-breaker slots. The kernel ends most flows
// itself (FIN both ways, RST); this covers the rest: clients that vanish,
// UDP flows, entries the LRU evicted under pressure. It also reports which
// service and backend ids live flows still use, so the reconciler does not
// recycle them.
package conntrack

import (
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Timeouts are how long a flow may stay silent before it is expired, by
// state. The defaults follow Cilium's conntrack GC.
type Timeouts struct {
	TCPEstablished time.Duration // handshake done, not closed
	TCPOpening     time.Duration // SYN sent, no SYN-ACK yet
	TCPClosed      time.Duration // FIN both ways or RST
	UDP            time.Duration
	// Orphan: a counted flow whose conntrack entry is gone (evicted) is
	// released once it is at least this old, so a flow being created right
	// now (its pb_flows entry is written before its conntrack entries) is
	// never taken for one.
	Orphan time.Duration
}

// DefaultTimeouts: TCP 6h established, 60s opening, 10s closed; UDP 60s.
func DefaultTimeouts() Timeouts {
	return Timeouts{
		TCPEstablished: 6 * time.Hour,
		TCPOpening:     time.Minute,
		TCPClosed:      10 * time.Second,
		UDP:            time.Minute,
		Orphan:         10 * time.Second,
	}
}

// Clocks of the kernel's timestamps: last_seen_ns is coarse monotonic,
// created_ns monotonic. Both are injectable for tests.
type Clocks struct {
	Coarse func() int64
	Mono   func() int64
}

func clockNow(id int32) func() int64 {
	return func() int64 {
		var ts unix.Timespec
		_ = unix.ClockGettime(id, &ts)
		return ts.Nano()
	}
}

// KernelClocks reads the clocks the datapath uses.
func KernelClocks() Clocks {
	return Clocks{Coarse: clockNow(unix.CLOCK_MONOTONIC_COARSE), Mono: clockNow(unix.CLOCK_MONOTONIC)}
}

// Reaper sweeps the maps. Sweep is safe to run beside the datapath and
// the agent's loop; two Sweeps must not overlap.
type Reaper struct {
	Maps     *maps.Maps
	Inflight *maps.Inflight
	Timeouts Timeouts
	Clocks   Clocks

	// What one sweep leaves for the next to reuse: the table's snapshot
	// and the pairing maps, sized by the table (a sweep every few seconds
	// of a table of tens of thousands of flows made them much of the
	// agent's allocation).
	ents []maps.CTEntry
	fwd  map[bpf.LbCtKey]*maps.CTEntry
	live map[bpf.LbCtKey]bool
}

// InUse are the ids live conntrack entries refer to: their events and
// counters would be misattributed if the ids were handed out again, so the
// reconciler keeps them out of reuse.
type InUse struct {
	Services, Backends map[uint32]bool
	// VIPs are the forward entries' destinations: VIP address and port.
	VIPs map[netip.AddrPort]bool
	// Incomplete: the scan failed part way; nothing may be freed.
	Incomplete bool
}

// Result says what one sweep saw and did.
type Result struct {
	Entries  int // conntrack entries scanned
	Expired  int // flows expired (both entries deleted)
	Released int // circuit-breaker slots given back
	Counted  int // pb_flows entries left
	InUse    InUse
}

type flow struct {
	fwd, rev       *maps.CTEntry
	fwdKey, revKey bpf.LbCtKey
}

// keepEntries bounds the snapshot a sweep keeps for the next: the
// datapath's default table (PB_CT_SIZE), about 27 MB of entries and half
// as much again in the pairing maps at most. A sweep of a full table
// needs that much anyway; kept, it is not allocated (and faulted in)
// again every SweepEvery. A bigger table's snapshot is not kept.
const keepEntries = 1 << 18

// Sweep expires idle flows and releases their slots.
func (r *Reaper) Sweep() (Result, error) {
	res := Result{InUse: InUse{Services: map[uint32]bool{}, Backends: map[uint32]bool{}, VIPs: map[netip.AddrPort]bool{}}}
	// A live flow's forward key names the VIP it was addressed to.
	vip := func(fk bpf.LbCtKey) {
		if ap, ok := ForwardVIP(fk); ok {
			res.InUse.VIPs[ap] = true
		}
	}
	ents, err := r.Maps.ConntrackInto(r.ents, 0)
	if err != nil {
		return res, err
	}
	if r.fwd == nil {
		r.fwd, r.live = map[bpf.LbCtKey]*maps.CTEntry{}, map[bpf.LbCtKey]bool{}
	}
	fwd, live := r.fwd, r.live
	defer func() {
		// Kept for the next sweep up to keepEntries: a table that was
		// full once should not hold its snapshot's memory for ever.
		if cap(ents) <= keepEntries {
			r.ents = ents[:0]
			clear(fwd)
			clear(live)
		} else {
			r.ents, r.fwd, r.live = nil, nil, nil
		}
	}()
	res.Entries = len(ents)
	now := r.Clocks.Coarse()

	// Pair entries: a reverse entry's forward key is derivable from it.
	for i := range ents {
		if ents[i].Key.Dir == maps.DirFwd {
			fwd[ents[i].Key] = &ents[i]
		}
	}
	for i := range ents {
		e := &ents[i]
		if e.Key.Dir != maps.DirRev {
			continue
		}
		fk := ForwardKey(e.Key, e.Value)
		f := fwd[fk]
		if f != nil && f.Value.CreatedNs != e.Value.CreatedNs {
			// The two halves of a flow share its start. A forward entry
			// with another start is another flow's: the one the agent's
			// replay moved off this entry's backend (PB_CT_MOVED), which
			// lives on with its own reverse entry.
			f = nil
		}
		last := e.Value.LastSeenNs
		if f != nil && f.Value.LastSeenNs > last {
			last = f.Value.LastSeenNs
		}
		flags := e.Value.Flags
		if f == nil || f.Value.Flags&maps.CTClientAcked == 0 {
			flags &^= maps.CTEstablished // handshake never completed by the client
		}
		if now-int64(last) > int64(r.timeout(e.Key.Proto, flags)) {
			// The snapshot may be old: if the tuple was reused meanwhile,
			// the entries are a new flow's. Leave them.
			if cur, err := r.Maps.CTEntry(e.Key); err != nil || cur.CreatedNs != e.Value.CreatedNs {
				continue
			}
			r.Maps.DeleteCT(e.Key)
			if f != nil {
				// The forward key too may be a new flow's by now (the
				// client's port reused towards another backend).
				if cur, err := r.Maps.CTEntry(fk); err == nil && cur.CreatedNs == f.Value.CreatedNs {
					r.Maps.DeleteCT(fk)
				}
				delete(fwd, fk)
			}
			res.Expired++
			continue
		}
		live[fk] = true
		vip(fk)
		res.InUse.Services[e.Value.SvcId] = true
		res.InUse.Backends[e.Value.BackendId] = true
	}
	// Forward entries whose reverse half is gone (LRU eviction) get the
	// short closed timeout; until then they pin their ids.
	for k, f := range fwd {
		if !live[k] && now-int64(f.Value.LastSeenNs) > int64(r.Timeouts.TCPClosed) {
			cur, err := r.Maps.CTEntry(k)
			if err != nil {
				continue // gone already
			}
			// As above: a reused tuple's entry is a new flow's; keep it.
			if cur.CreatedNs == f.Value.CreatedNs {
				r.Maps.DeleteCT(k)
				res.Expired++
				continue
			}
		}
		if !live[k] {
			res.InUse.Services[f.Value.SvcId] = true
			res.InUse.Backends[f.Value.BackendId] = true
			live[k] = true
			vip(k)
		}
	}

	flows, err := r.Maps.Flows()
	if err != nil {
		return res, err
	}
	mono := r.Clocks.Mono()
	for _, fl := range flows {
		if live[fl.Key] || mono-int64(fl.Value.CreatedNs) < int64(r.Timeouts.Orphan) {
			res.Counted++
			vip(fl.Key)
			res.InUse.Services[fl.Value.SvcId] = true
			res.InUse.Backends[fl.Value.BackendId] = true
			continue
		}
		released, err := r.Maps.ReleaseFlow(r.Inflight, fl)
		if err != nil {
			return res, err
		}
		if released {
			res.Released++
		}
	}
	return res, nil
}

func (r *Reaper) timeout(proto uint8, flags uint32) time.Duration {
	switch {
	case proto != 6:
		return r.Timeouts.UDP
	case flags&maps.CTClosed != 0:
		return r.Timeouts.TCPClosed
	case flags&maps.CTEstablished != 0:
		return r.Timeouts.TCPEstablished
	default:
		return r.Timeouts.TCPOpening
	}
}

// ForwardVIP is the VIP and port a forward (client -> VIP) key is
// addressed to, read by the key's family (IPv4 or IPv6); ok is false for
// a family the agent does not know.
func ForwardVIP(fk bpf.LbCtKey) (netip.AddrPort, bool) {
	a := maps.AddrFromFamily(fk.Family, fk.Dst.Bytes)
	return netip.AddrPortFrom(a, maps.Port(fk.Dport)), a.IsValid()
}

// ForwardKey derives a flow's forward (client -> VIP) key from its
// reverse entry; the family carries over (a flow is of one family).
func ForwardKey(rk bpf.LbCtKey, rv bpf.LbCtValue) bpf.LbCtKey {
	var fk bpf.LbCtKey
	fk.Src = rk.Dst
	fk.Dst = rv.NatAddr
	fk.Sport = rk.Dport
	fk.Dport = rv.NatPort
	fk.Proto = rk.Proto
	fk.Dir = maps.DirFwd
	fk.Family = rk.Family
	return fk
}
