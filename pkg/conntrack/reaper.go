// SPDX-License-Identifier: Apache-2.0

// Package conntrack expires idle flows from the datapath's conntrack map
// and releases their circuit-breaker slots. The kernel ends most flows
// itself (FIN both ways, RST); this covers the rest: clients that vanish,
// UDP flows, entries the LRU evicted under pressure. It also reports which
// service and backend ids live flows still use, so the reconciler does not
// recycle them. The sweep runs in the kernel (pb_ct_sweep_run, through
// maps.SweepCT) where it loads, and on a copy of the table otherwise; both
// decide alike (kernel_test.go).
package conntrack

import (
	"hash/maphash"
	"net/netip"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Timeouts are how long a flow may stay silent before it is expired, by
// state. The defaults follow Cilium's conntrack GC.
type Timeouts struct {
	TCPEstablished time.Duration // handshake done, not closed
	TCPOpening     time.Duration // SYN sent, no SYN-ACK yet
	TCPClosed      time.Duration // RST, or FIN both ways without the last ACK the datapath deletes a flow at
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

	// What one sweep leaves for the next to reuse: the table's snapshot,
	// the index pairing its entries and their states, sized by the table
	// (a sweep every few seconds of a table of tens of thousands of flows
	// made them much of the agent's allocation).
	ents  []maps.CTEntry
	pairs pairIndex
	state []entryState
	batch expiryBatch

	// afterSnapshot, in tests, changes the table between the snapshot and
	// the deletes, as the datapath may.
	afterSnapshot func()
}

// entryState is what a sweep has decided about one forward entry of its
// snapshot.
type entryState uint8

const (
	unseen  entryState = iota
	live               // its flow lives: its ids are in use
	expired            // deleted by this sweep
	pending            // its flow is in the expiry batch, its deletion not yet known
)

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
	Size     int // entries the table holds (--conntrack-size)
	Expired  int // flows expired (both entries deleted)
	Released int // circuit-breaker slots given back
	Counted  int // pb_flows entries left
	InUse    InUse
	// Kernel: the sweep ran in the kernel (pb_ct_sweep_run), without a
	// copy of the table.
	Kernel bool
	// KernelErr: the kernel sweep failed, or could not fill its in-use
	// sets; this sweep (and, if the program failed, every later one)
	// copied the table as before.
	KernelErr error
	// ExpireErr: the kernel's sweep program failed; the flows were
	// expired by system calls, and will be from now on (maps.ExpireCT).
	ExpireErr error
}

// keepEntries bounds the snapshot a sweep keeps for the next: the
// datapath's default table (PB_CT_SIZE), about 27 MB of entries (the
// array grows by doubling, up to the table's size) and a tenth as much in
// the index. A sweep of a full table needs that much anyway; kept, it is
// not allocated (and faulted in) again every SweepEvery. A bigger table's
// snapshot is not kept.
const keepEntries = 1 << 18

// inUse collects a sweep's InUse. Consecutive flows mostly share their
// service, backend and VIP, so each set is written only when its key
// changes from the last one written: at a table of 100,000 flows the map
// writes were a tenth of a sweep.
type inUse struct {
	InUse
	lastSvc, lastBackend uint32
	lastVIP              bpf.LbCtKey // only Dst, Dport and Family are set
	any                  bool
}

func (u *inUse) add(fk *bpf.LbCtKey, svc, backend uint32) {
	if !u.any || svc != u.lastSvc {
		u.Services[svc] = true
		u.lastSvc = svc
	}
	if !u.any || backend != u.lastBackend {
		u.Backends[backend] = true
		u.lastBackend = backend
	}
	if !u.any || fk.Dst != u.lastVIP.Dst || fk.Dport != u.lastVIP.Dport || fk.Family != u.lastVIP.Family {
		if ap, ok := ForwardVIP(*fk); ok {
			u.VIPs[ap] = true
		}
		u.lastVIP.Dst, u.lastVIP.Dport, u.lastVIP.Family = fk.Dst, fk.Dport, fk.Family
	}
	u.any = true
}

// Sweep expires idle flows and releases their slots: in the kernel when
// the maps have its program (maps.SweepCT), with a copy of the table
// otherwise, or when the kernel's sweep could not say which ids are in
// use.
func (r *Reaper) Sweep() (Result, error) {
	res, err := r.sweep()
	res.Size = r.Maps.ConntrackSize()
	return res, err
}

func (r *Reaper) sweep() (Result, error) {
	if !r.Maps.CTSweepProgram() {
		return r.sweepCopy()
	}
	s, err := r.Maps.SweepCT(r.sweepArgs())
	if err == nil {
		return Result{Kernel: true, Entries: s.Entries, Expired: s.Expired, Released: s.Released, Counted: s.Counted,
			InUse: InUse{Services: s.Services, Backends: s.Backends, VIPs: s.VIPs}}, nil
	}
	// What the kernel expired and released stands; the copy finds the
	// rest, and the ids in use.
	res, cerr := r.sweepCopy()
	res.Expired += s.Expired
	res.Released += s.Released
	res.KernelErr = err
	return res, cerr
}

// sweepArgs are the kernel sweep's clocks and timeouts, as sweepCopy
// reads them.
func (r *Reaper) sweepArgs() maps.CTSweepArgs {
	t := r.Timeouts
	return maps.CTSweepArgs{
		NowCoarse: uint64(r.Clocks.Coarse()), NowMono: uint64(r.Clocks.Mono()),
		TcpEstablished: uint64(t.TCPEstablished), TcpOpening: uint64(t.TCPOpening),
		TcpClosed: uint64(t.TCPClosed), Udp: uint64(t.UDP), Orphan: uint64(t.Orphan),
	}
}

// sweepCopy is Sweep with a copy of the table (maps.ConntrackInto).
func (r *Reaper) sweepCopy() (Result, error) {
	use := inUse{InUse: InUse{Services: map[uint32]bool{}, Backends: map[uint32]bool{}, VIPs: map[netip.AddrPort]bool{}}}
	res := Result{InUse: use.InUse} // the same maps, filled by use.add
	ents, err := r.Maps.ConntrackInto(r.ents, 0)
	if err != nil {
		return res, err
	}
	defer func() {
		// Kept for the next sweep up to keepEntries: a table that was
		// full once should not hold its snapshot's memory for ever.
		if len(ents) <= keepEntries {
			r.ents = ents[:0]
		} else {
			r.ents, r.pairs, r.state = nil, pairIndex{}, nil
		}
	}()
	res.Entries = len(ents)
	now := r.Clocks.Coarse()
	if r.afterSnapshot != nil {
		r.afterSnapshot()
	}

	// Pair entries: a reverse entry's forward key is derivable from it.
	pairs := &r.pairs
	pairs.reset(len(ents))
	if cap(r.state) >= len(ents) {
		r.state = r.state[:len(ents)]
		clear(r.state)
	} else {
		r.state = make([]entryState, len(ents))
	}
	state := r.state
	for i := range ents {
		if ents[i].Key.Dir == maps.DirFwd {
			pairs.add(ents, i)
		}
	}
	// Live flows whose forward entry is not in the snapshot (evicted, or
	// another flow's: see below): rare, so a map.
	var liveElsewhere map[bpf.LbCtKey]bool
	// Flows found idle are deleted in batches (ExpireCT: in the kernel,
	// one system call for many), each entry only if it still is the flow
	// the snapshot saw: the snapshot may be old, and a tuple reused since
	// is a new flow's.
	batch := &r.batch
	batch.reset()
	// A reverse entry's flow: expired if its reverse entry went. If not
	// (gone already, or another flow's), its forward entry is as it was
	// before (unseen: judged below as one without its reverse half).
	revDone := func(x *maps.CTExpire, fi int32, prev entryState) {
		if x.RevResult == maps.ExpireDeleted {
			res.Expired++
			if fi >= 0 {
				state[fi] = expired
			}
		} else if fi >= 0 {
			state[fi] = prev
		}
	}
	for i := range ents {
		e := &ents[i]
		if e.Key.Dir != maps.DirRev {
			continue
		}
		fk := ForwardKey(e.Key, e.Value)
		fi := pairs.find(ents, &fk)
		if fi >= 0 && state[fi] == pending {
			// Another reverse entry's flow holds it, its deletion not yet
			// known: decided first, as a sweep deleting one flow at a
			// time would have (no flow of the datapath's has two).
			batch.flush(r.Maps, revDone, &res)
		}
		if fi >= 0 && (ents[fi].Value.CreatedNs != e.Value.CreatedNs || state[fi] == expired) {
			// The two halves of a flow share its start. A forward entry
			// with another start is another flow's: the one the agent's
			// replay moved off this entry's backend (PB_CT_MOVED), which
			// lives on with its own reverse entry.
			fi = -1
		}
		var f *maps.CTEntry
		if fi >= 0 {
			f = &ents[fi]
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
			x := maps.CTExpire{Rev: e.Key, CreatedNs: e.Value.CreatedNs}
			prev := unseen
			if f != nil {
				// The forward key too may be a new flow's by now (the
				// client's port reused towards another backend): it goes
				// only if it still has the flow's start, and only once
				// the reverse entry went.
				x.Fwd = fk
				prev, state[fi] = state[fi], pending
			}
			batch.add(r.Maps, x, int32(fi), prev, revDone, &res)
			continue
		}
		if f != nil {
			state[fi] = live
		} else {
			if liveElsewhere == nil {
				liveElsewhere = map[bpf.LbCtKey]bool{}
			}
			liveElsewhere[fk] = true
		}
		use.add(&fk, e.Value.SvcId, e.Value.BackendId)
	}
	batch.flush(r.Maps, revDone, &res)
	// Forward entries whose reverse half is gone (LRU eviction) get the
	// short closed timeout; until then they pin their ids.
	isLive := func(fi int, k *bpf.LbCtKey) bool {
		return (fi >= 0 && state[fi] == live) || liveElsewhere[*k]
	}
	fwdDone := func(x *maps.CTExpire, i int32, _ entryState) {
		switch x.FwdResult {
		case maps.ExpireDeleted:
			state[i] = expired
			res.Expired++
		case maps.ExpireOther:
			// A reused tuple's entry is a new flow's; keep it.
			state[i] = live
			use.add(&ents[i].Key, ents[i].Value.SvcId, ents[i].Value.BackendId)
		}
		// Absent: gone already, neither live nor expired here.
	}
	for i := range ents {
		f := &ents[i]
		if f.Key.Dir != maps.DirFwd || state[i] != unseen {
			continue
		}
		k := &f.Key
		if liveElsewhere[*k] {
			continue
		}
		if now-int64(f.Value.LastSeenNs) > int64(r.Timeouts.TCPClosed) {
			batch.add(r.Maps, maps.CTExpire{Fwd: *k, CreatedNs: f.Value.CreatedNs}, int32(i), unseen, fwdDone, &res)
			continue
		}
		state[i] = live
		use.add(k, f.Value.SvcId, f.Value.BackendId)
	}
	batch.flush(r.Maps, fwdDone, &res)

	flows, err := r.Maps.Flows()
	if err != nil {
		return res, err
	}
	mono := r.Clocks.Mono()
	for _, fl := range flows {
		if isLive(pairs.find(ents, &fl.Key), &fl.Key) || mono-int64(fl.Value.CreatedNs) < int64(r.Timeouts.Orphan) {
			res.Counted++
			use.add(&fl.Key, fl.Value.SvcId, fl.Value.BackendId)
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

// pairIndex finds a forward entry of a sweep's snapshot by its key: open
// addressing over the snapshot's indexes, where a Go map of 40-byte keys
// (hashing, probing and comparing the key) was a third of a sweep. A slot
// keeps its key's hash beside the index, so a probe compares keys only
// when the hashes agree. The hash is seeded: clients pick the tuples, and
// must not be able to pick ones that collide.
type pairIndex struct {
	seed  maphash.Seed
	slots []pairSlot
	mask  uint64
}

type pairSlot struct {
	hash uint32 // the key's hash, high half
	idx  int32  // an index into the snapshot plus one; 0 is empty
}

// reset empties the index for a snapshot of n entries: at most half full.
func (p *pairIndex) reset(n int) {
	size := 1024
	for size < 2*n {
		size *= 2
	}
	if p.slots == nil {
		p.seed = maphash.MakeSeed()
	}
	if cap(p.slots) >= size {
		p.slots = p.slots[:size]
		clear(p.slots)
	} else {
		p.slots = make([]pairSlot, size)
	}
	p.mask = uint64(size - 1)
}

func (p *pairIndex) hash(k *bpf.LbCtKey) uint64 {
	return maphash.Bytes(p.seed, unsafe.Slice((*byte)(unsafe.Pointer(k)), unsafe.Sizeof(*k)))
}

// add indexes ents[i].
func (p *pairIndex) add(ents []maps.CTEntry, i int) {
	h := p.hash(&ents[i].Key)
	s := h & p.mask
	for p.slots[s].idx != 0 {
		s = (s + 1) & p.mask
	}
	p.slots[s] = pairSlot{hash: uint32(h >> 32), idx: int32(i + 1)}
}

// find is the index of the entry keyed k, or -1.
func (p *pairIndex) find(ents []maps.CTEntry, k *bpf.LbCtKey) int {
	h := p.hash(k)
	tag := uint32(h >> 32)
	for s := h & p.mask; p.slots[s].idx != 0; s = (s + 1) & p.mask {
		if p.slots[s].hash != tag {
			continue
		}
		if i := int(p.slots[s].idx - 1); ents[i].Key == *k {
			return i
		}
	}
	return -1
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

// expiryBatch gathers the flows a sweep found idle for one ExpireCT,
// each with the snapshot index its result is applied to and that entry's
// state before it was queued.
type expiryBatch struct {
	flows []maps.CTExpire
	idx   []int32
	prev  []entryState
}

// expiryDone applies one flow's result.
type expiryDone func(x *maps.CTExpire, idx int32, prev entryState)

func (b *expiryBatch) reset() { b.flows, b.idx, b.prev = b.flows[:0], b.idx[:0], b.prev[:0] }

// add queues x, flushing a full batch first: a batch is one run of the
// sweep's program, and the sweep's memory for it stays small however
// many flows expire.
func (b *expiryBatch) add(m *maps.Maps, x maps.CTExpire, idx int32, prev entryState, done expiryDone, res *Result) {
	if len(b.flows) == maps.CTExpireBatch {
		b.flush(m, done, res)
	}
	b.flows, b.idx, b.prev = append(b.flows, x), append(b.idx, idx), append(b.prev, prev)
}

// flush expires the queued flows and hands each result to done. The
// program's failure is kept in res (the flows are expired all the same,
// by system calls).
func (b *expiryBatch) flush(m *maps.Maps, done expiryDone, res *Result) {
	if len(b.flows) == 0 {
		return
	}
	if _, err := m.ExpireCT(b.flows); err != nil && res.ExpireErr == nil {
		res.ExpireErr = err
	}
	for j := range b.flows {
		done(&b.flows[j], b.idx[j], b.prev[j])
	}
	b.reset()
}
