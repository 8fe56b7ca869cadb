// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"errors"
	"fmt"
	"reflect"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
)

// GlobalStats sums pb_stats_v2 over CPUs.
func (m *Maps) GlobalStats() (bpf.LbGlobalStats, error) {
	var per []bpf.LbGlobalStats
	if err := m.m.PbStatsV2.Lookup(uint32(0), &per); err != nil {
		return bpf.LbGlobalStats{}, fmt.Errorf("pb_stats_v2: %w", err)
	}
	return sumCounters(per), nil
}

// sumCounters adds up per-CPU copies of a struct of uint64 counters, field
// by field: a counter added to the C struct is summed without a line here.
func sumCounters[T any](per []T) T {
	var sum T
	out := reflect.ValueOf(&sum).Elem()
	for i := range per {
		v := reflect.ValueOf(per[i])
		for f := range out.NumField() {
			if out.Field(f).Kind() == reflect.Uint64 {
				out.Field(f).SetUint(out.Field(f).Uint() + v.Field(f).Uint())
			}
		}
	}
	return sum
}

// StatsBlock is how many services' or backends' counters one element of
// pb_svc_stats_v2 and pb_be_stats_v2 holds (PB_STATS_BLOCK): id i is
// element i/StatsBlock, slot i%StatsBlock.
const StatsBlock = uint32(len(bpf.LbSvcStatsBlock{}.S))

// StatsResetBatch is pb_stats_reset's size (PB_STATS_RESET_BATCH): the ids
// one run of pb_stats_reset_run zeroes.
const StatsResetBatch = 4096

// ServiceStats sums a service's counters (its slot of pb_svc_stats_v2)
// over CPUs.
func (m *Maps) ServiceStats(id uint32) (bpf.LbSvcStats, error) {
	per, err := statsElement[bpf.LbSvcStatsBlock](m.m.PbSvcStatsV2, "pb_svc_stats_v2", id)
	if err != nil {
		return bpf.LbSvcStats{}, err
	}
	return sumServiceSlot(per, id%StatsBlock), nil
}

// BackendStats sums a backend's counters (its slot of pb_be_stats_v2)
// over CPUs.
func (m *Maps) BackendStats(id uint32) (bpf.LbBeStats, error) {
	per, err := statsElement[bpf.LbBeStatsBlock](m.m.PbBeStatsV2, "pb_be_stats_v2", id)
	if err != nil {
		return bpf.LbBeStats{}, err
	}
	return sumBackendSlot(per, id%StatsBlock), nil
}

// statsElement reads the element of m (pb_svc_stats_v2 or pb_be_stats_v2,
// named name) that holds id's counters: every CPU's copy of it.
func statsElement[B any](m *ebpf.Map, name string, id uint32) ([]B, error) {
	var per []B
	if err := m.Lookup(id/StatsBlock, &per); err != nil {
		return nil, fmt.Errorf("%s[%d] (id %d): %w", name, id/StatsBlock, id, err)
	}
	return per, nil
}

func sumServiceSlot(per []bpf.LbSvcStatsBlock, slot uint32) bpf.LbSvcStats {
	var s bpf.LbSvcStats
	for i := range per {
		c := &per[i].S[slot]
		s.Packets += c.Packets
		s.Bytes += c.Bytes
		s.Flows += c.Flows
		s.NoBackend += c.NoBackend
		s.OverLimit += c.OverLimit
	}
	return s
}

func sumBackendSlot(per []bpf.LbBeStatsBlock, slot uint32) bpf.LbBeStats {
	var s bpf.LbBeStats
	for i := range per {
		c := &per[i].B[slot]
		s.Packets += c.Packets
		s.Bytes += c.Bytes
		s.Flows += c.Flows
		s.ReplyPackets += c.ReplyPackets
		s.ReplyBytes += c.ReplyBytes
	}
	return s
}

// CounterSnapshot reads the counters of many services and backends, as a
// scrape does: each element of pb_svc_stats_v2 and pb_be_stats_v2 is read
// once, for all StatsBlock ids in it, where a read per id would copy
// every CPU's copy of the element StatsBlock times. It keeps an element's
// sums (StatsBlock ids' counters, whatever the CPUs), not its copies. Its
// reads are as of the first read of each element; use one per scrape.
type CounterSnapshot struct {
	m   *Maps
	svc map[uint32]*[StatsBlock]bpf.LbSvcStats
	be  map[uint32]*[StatsBlock]bpf.LbBeStats
}

// Snapshot is c's counters through a CounterSnapshot when c is a *Maps,
// else c itself.
func Snapshot(c Counters) Counters {
	if m, ok := c.(*Maps); ok {
		return &CounterSnapshot{m: m, svc: map[uint32]*[StatsBlock]bpf.LbSvcStats{}, be: map[uint32]*[StatsBlock]bpf.LbBeStats{}}
	}
	return c
}

// ServiceStats is Maps.ServiceStats from the snapshot.
func (s *CounterSnapshot) ServiceStats(id uint32) (bpf.LbSvcStats, error) {
	return snapshotRead(s.svc, s.m.m.PbSvcStatsV2, "pb_svc_stats_v2", id, sumServiceSlot)
}

// BackendStats is Maps.BackendStats from the snapshot.
func (s *CounterSnapshot) BackendStats(id uint32) (bpf.LbBeStats, error) {
	return snapshotRead(s.be, s.m.m.PbBeStatsV2, "pb_be_stats_v2", id, sumBackendSlot)
}

// snapshotRead is id's counters from sums, the element's sums, read from
// m into sums the first time the element is asked for.
func snapshotRead[B, S any](sums map[uint32]*[StatsBlock]S, m *ebpf.Map, name string, id uint32,
	sum func([]B, uint32) S) (S, error) {
	k := id / StatsBlock
	el, ok := sums[k]
	if !ok {
		per, err := statsElement[B](m, name, id)
		if err != nil {
			var zero S
			return zero, err
		}
		el = new([StatsBlock]S)
		for i := range el {
			el[i] = sum(per, uint32(i))
		}
		sums[k] = el
	}
	return el[id%StatsBlock], nil
}

// The rest of Counters, read at once.

func (s *CounterSnapshot) GlobalStats() (bpf.LbGlobalStats, error)   { return s.m.GlobalStats() }
func (s *CounterSnapshot) SYNGuardStats() (bpf.LbSynGuardCpu, error) { return s.m.SYNGuardStats() }
func (s *CounterSnapshot) NFForgotten() (NFForgotten, error)         { return s.m.NFForgotten() }
func (s *CounterSnapshot) AffinityFill() (entries, capacity int, err error) {
	return s.m.AffinityFill()
}

// UseStatsReset gives the maps pb_stats_reset_run, which ResetServiceStats
// and ResetBackendStats need (see there).
func (m *Maps) UseStatsReset(p *ebpf.Program) error {
	if p == nil || m.m.PbStatsReset == nil {
		return errors.New("maps: no counter reset program")
	}
	if n := m.m.PbStatsReset.MaxEntries(); n != StatsResetBatch {
		return fmt.Errorf("maps: pb_stats_reset holds %d entries, want %d", n, StatsResetBatch)
	}
	m.resetMu.Lock()
	defer m.resetMu.Unlock()
	m.reset = p
	return nil
}

// ResetServiceStats zeroes a service's counters and circuit-breaker count,
// so a reused id starts clean. Only for ids no live flow refers to.
func (m *Maps) ResetServiceStats(id uint32) error {
	return errors.Join(m.resetCounters([]uint32{id}, false),
		m.m.PbSvcInflight.Put(id, bpf.LbInflight{}))
}

// resetChunk is how many ids ResetBackendStats writes per batch, and
// (up to StatsResetBatch) pb_stats_reset_run zeroes per run.
var resetChunk = 4096

// ResetBackendStats zeroes backends' counters and circuit-breaker counts,
// as ResetServiceStats, in batches.
func (m *Maps) ResetBackendStats(ids []uint32) error {
	if len(ids) == 0 {
		return nil
	}
	var errs []error
	if err := m.resetCounters(ids, true); err != nil {
		errs = append(errs, err)
	}
	chunk := resetChunk
	inflight := make([]bpf.LbInflight, min(len(ids), chunk))
	for len(ids) > 0 {
		c := ids[:min(len(ids), chunk)]
		ids = ids[len(c):]
		if _, err := m.m.PbBeInflight.BatchUpdate(c, inflight[:len(c)], nil); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// resetCounters has pb_stats_reset_run zero the ids' slots of
// pb_be_stats_v2 (backend) or pb_svc_stats_v2 on every CPU. From user
// space it would take a read and a write of each whole element, which
// would lose what the datapath counted for the element's other ids in
// between.
func (m *Maps) resetCounters(ids []uint32, backend bool) error {
	m.resetMu.Lock()
	defer m.resetMu.Unlock()
	if m.reset == nil {
		return errors.New("maps: counters not reset: no pb_stats_reset_run (UseStatsReset)")
	}
	flag := uint32(0)
	if backend {
		flag = 1
	}
	chunk := min(resetChunk, StatsResetBatch)
	keys := make([]uint32, min(len(ids), chunk))
	vals := make([]bpf.LbStatsReset, len(keys))
	for i := range keys {
		keys[i] = uint32(i)
	}
	var errs []error
	for len(ids) > 0 {
		c := ids[:min(len(ids), chunk)]
		ids = ids[len(c):]
		for i, id := range c {
			vals[i] = bpf.LbStatsReset{Id: id, Backend: flag}
		}
		if _, err := m.m.PbStatsReset.BatchUpdate(keys[:len(c)], vals[:len(c)], nil); err != nil {
			errs = append(errs, fmt.Errorf("pb_stats_reset: %w", err))
			continue
		}
		args := bpf.LbStatsResetArgs{N: uint32(len(c)), Ncpu: uint32(m.ncpu)}
		ret, err := m.reset.Run(&ebpf.RunOptions{Context: &args, ContextOut: &args})
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("pb_stats_reset_run: %w", err))
		case ret != 0:
			errs = append(errs, fmt.Errorf("pb_stats_reset_run stopped short of its batch of %d ids", len(c)))
		case args.Missed > 0:
			errs = append(errs, fmt.Errorf("pb_stats_reset_run: %d of %d ids past the end of their map", args.Missed, len(c)))
		}
	}
	return errors.Join(errs...)
}

// CTEntry is one conntrack entry.
type CTEntry struct {
	Key   bpf.LbCtKey
	Value bpf.LbCtValue
}

// Conntrack returns up to limit entries of pb_ct (all when limit <= 0).
// It reads in batches (bucket by bucket): a key-by-key iteration restarts
// from the first bucket whenever its cursor key is deleted meanwhile, which
// on a full LRU happens on every new flow, and then aborts.
func (m *Maps) Conntrack(limit int) ([]CTEntry, error) {
	return m.ConntrackInto(nil, limit)
}

// ConntrackSize is the entries the conntrack table holds (two per flow).
func (m *Maps) ConntrackSize() int { return int(m.m.PbCtV2.MaxEntries()) }

// errEnough ends a batch walk that has what it wanted.
var errEnough = errors.New("enough")

// ConntrackInto is Conntrack appending to buf[:0]: a caller that scans the
// table again and again (the conntrack sweep) reuses one array rather than
// growing a new one, page by page, every time.
//
// The array grows by doubling, up to the table's size: append's quarter
// steps allocated, faulted in and copied a big snapshot several times
// over (BenchmarkSweepFirst).
func (m *Maps) ConntrackInto(buf []CTEntry, limit int) ([]CTEntry, error) {
	out := buf[:0]
	const chunk = 4096
	size := m.ConntrackSize()
	err := EachBatch(m.m.PbCtV2, chunk, func(keys []bpf.LbCtKey, vals []bpf.LbCtValue) error {
		n := len(keys)
		if need := len(out) + n; need > cap(out) {
			c := max(2*cap(out), need, chunk)
			switch {
			case limit > 0:
				c = max(min(c, limit), need)
			case need <= size:
				c = min(c, size)
			default:
				// More than the table holds: a batch read of a table
				// that changes can see an entry twice. A little room,
				// not another doubling.
				c = need + chunk
			}
			out = append(make([]CTEntry, 0, c), out...)
		}
		for i := range n {
			out = append(out, CTEntry{keys[i], vals[i]})
			if limit > 0 && len(out) >= limit {
				return errEnough
			}
		}
		return nil
	})
	if errors.Is(err, errEnough) {
		return out, nil
	}
	return out, err
}

// CTEntry reads one conntrack entry.
func (m *Maps) CTEntry(k bpf.LbCtKey) (bpf.LbCtValue, error) {
	var v bpf.LbCtValue
	err := m.m.PbCtV2.Lookup(k, &v)
	return v, err
}

// DeleteCT removes one conntrack entry; absence is not an error.
func (m *Maps) DeleteCT(k bpf.LbCtKey) error {
	if err := m.m.PbCtV2.Delete(k); err != nil && err != ebpf.ErrKeyNotExist {
		return err
	}
	return nil
}

// NFForgotten counts the entries of the kernel's conntrack the datapath
// expired where kube-proxy's path and its own meet (pb_nf_stats).
type NFForgotten struct {
	// TakenOver: kube-proxy's finished flows on the tuples of new flows
	// of services lately taken over.
	TakenOver uint64
	// HandedOver: the datapath's finished flows on the tuples of new
	// flows handed to kube-proxy.
	HandedOver uint64
}

// NFForgotten sums pb_nf_stats over CPUs.
func (m *Maps) NFForgotten() (NFForgotten, error) {
	var n NFForgotten
	for why, dst := range map[bpf.LbPbNfWhy]*uint64{bpf.LbPbNfWhyPB_NF_TAKEN_OVER: &n.TakenOver,
		bpf.LbPbNfWhyPB_NF_HANDED_OVER: &n.HandedOver} {
		var per []uint64
		if err := m.m.PbNfStats.Lookup(uint32(why), &per); err != nil {
			return n, fmt.Errorf("pb_nf_stats: %w", err)
		}
		for _, v := range per {
			*dst += v
		}
	}
	return n, nil
}
