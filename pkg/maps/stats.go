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

// ServiceStats sums pb_svc_stats[id] over CPUs.
func (m *Maps) ServiceStats(id uint32) (bpf.LbSvcStats, error) {
	var per []bpf.LbSvcStats
	var s bpf.LbSvcStats
	if err := m.m.PbSvcStats.Lookup(id, &per); err != nil {
		return s, fmt.Errorf("pb_svc_stats[%d]: %w", id, err)
	}
	for _, c := range per {
		s.Packets += c.Packets
		s.Bytes += c.Bytes
		s.Flows += c.Flows
		s.NoBackend += c.NoBackend
		s.OverLimit += c.OverLimit
	}
	return s, nil
}

// BackendStats sums pb_be_stats[id] over CPUs.
func (m *Maps) BackendStats(id uint32) (bpf.LbBeStats, error) {
	var per []bpf.LbBeStats
	var s bpf.LbBeStats
	if err := m.m.PbBeStats.Lookup(id, &per); err != nil {
		return s, fmt.Errorf("pb_be_stats[%d]: %w", id, err)
	}
	for _, c := range per {
		s.Packets += c.Packets
		s.Bytes += c.Bytes
		s.Flows += c.Flows
		s.ReplyPackets += c.ReplyPackets
		s.ReplyBytes += c.ReplyBytes
	}
	return s, nil
}

// ResetServiceStats zeroes a service's counters and circuit-breaker count,
// so a reused id starts clean. Only for ids no live flow refers to.
func (m *Maps) ResetServiceStats(id uint32) error {
	return errors.Join(m.m.PbSvcStats.Put(id, make([]bpf.LbSvcStats, m.ncpu)),
		m.m.PbSvcInflight.Put(id, bpf.LbInflight{}))
}

// resetChunk is how many ids ResetBackendStats writes per batch.
var resetChunk = 4096

// ResetBackendStats zeroes backends' counters and circuit-breaker counts,
// as ResetServiceStats, in batches.
func (m *Maps) ResetBackendStats(ids []uint32) error {
	if len(ids) == 0 {
		return nil
	}
	// In chunks: one batch of 100,000 ids (a cold start's) marshalled
	// megabytes of zeros, every per-CPU value boxed on its own, while the
	// agent's whole state was live: the peak of its heap.
	chunk := resetChunk
	n := min(len(ids), chunk)
	stats := make([]bpf.LbBeStats, n*m.ncpu)
	inflight := make([]bpf.LbInflight, n)
	var errs []error
	for len(ids) > 0 {
		c := ids[:min(len(ids), chunk)]
		ids = ids[len(c):]
		if _, err := m.m.PbBeStats.BatchUpdate(c, stats[:len(c)*m.ncpu], nil); err != nil {
			errs = append(errs, err)
		}
		if _, err := m.m.PbBeInflight.BatchUpdate(c, inflight[:len(c)], nil); err != nil {
			errs = append(errs, err)
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
	keys := make([]bpf.LbCtKey, chunk)
	vals := make([]bpf.LbCtValue, chunk)
	size := int(m.m.PbCtV2.MaxEntries())
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.m.PbCtV2.BatchLookup(&cursor, keys, vals, nil)
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
		for i := 0; i < n; i++ {
			out = append(out, CTEntry{keys[i], vals[i]})
			if limit > 0 && len(out) >= limit {
				return out, nil
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
	}
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
