package maps

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
)

// GlobalStats sums pb_stats over CPUs.
func (m *Maps) GlobalStats() (bpf.LbGlobalStats, error) {
	var per []bpf.LbGlobalStats
	var s bpf.LbGlobalStats
	if err := m.m.PbStats.Lookup(uint32(0), &per); err != nil {
		return s, fmt.Errorf("pb_stats: %w", err)
	}
	for _, c := range per {
		s.EventsLost += c.EventsLost
		s.Redirected += c.Redirected
		s.PassedAfterNat += c.PassedAfterNat
		s.NoBackend += c.NoBackend
		s.ProbeAdmitted += c.ProbeAdmitted
		s.Steered += c.Steered
		s.SteerFailed += c.SteerFailed
		s.Repicked += c.Repicked
		s.CtCreateFailed += c.CtCreateFailed
		s.Malformed += c.Malformed
		s.InflightRejected += c.InflightRejected
		s.InflightUntracked += c.InflightUntracked
		s.RejectRstTx += c.RejectRstTx
		s.RejectRstPass += c.RejectRstPass
	}
	return s, nil
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

// ResetBackendStats zeroes a backend's counters and circuit-breaker count,
// as ResetServiceStats.
func (m *Maps) ResetBackendStats(id uint32) error {
	return errors.Join(m.m.PbBeStats.Put(id, make([]bpf.LbBeStats, m.ncpu)),
		m.m.PbBeInflight.Put(id, bpf.LbInflight{}))
}

// CTEntry is one conntrack entry.
type CTEntry struct {
	Key   bpf.LbCtKey
	Value bpf.LbCtValue
}

// Conntrack returns up to limit entries of pb_ct (all when limit <= 0).
func (m *Maps) Conntrack(limit int) ([]CTEntry, error) {
	var out []CTEntry
	var k bpf.LbCtKey
	var v bpf.LbCtValue
	it := m.m.PbCt.Iterate()
	for it.Next(&k, &v) {
		out = append(out, CTEntry{k, v})
		if limit > 0 && len(out) >= limit {
			break
		}
	}
	return out, it.Err()
}

// DeleteCT removes one conntrack entry; absence is not an error.
func (m *Maps) DeleteCT(k bpf.LbCtKey) error {
	if err := m.m.PbCt.Delete(k); err != nil && err != ebpf.ErrKeyNotExist {
		return err
	}
	return nil
}
