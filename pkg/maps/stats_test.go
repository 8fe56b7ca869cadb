// SPDX-License-Identifier: Apache-2.0

package maps_test

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// markBackend sets a backend's flows counter to 7 on every CPU and its
// circuit-breaker count to 3, through its element of pb_be_stats_v2 (no
// traffic runs here, so the read and the write of the element lose
// nothing).
func markBackend(t *testing.T, l *bpftest.Loaded, id uint32) {
	t.Helper()
	var per []bpf.LbBeStatsBlock
	if err := l.PbBeStatsV2.Lookup(id/maps.StatsBlock, &per); err != nil {
		t.Fatal(err)
	}
	for i := range per {
		per[i].B[id%maps.StatsBlock].Flows = 7
	}
	if err := l.PbBeStatsV2.Put(id/maps.StatsBlock, per); err != nil {
		t.Fatal(err)
	}
	if err := l.PbBeInflight.Put(id, bpf.LbInflight{Count: 3}); err != nil {
		t.Fatal(err)
	}
}

// backendFlows is a backend's flows counter, summed over CPUs, and its
// circuit-breaker count.
func backendFlows(t *testing.T, l *bpftest.Loaded, id uint32) (uint64, int64) {
	t.Helper()
	st, err := l.Maps.BackendStats(id)
	if err != nil {
		t.Fatal(err)
	}
	var in bpf.LbInflight
	if err := l.PbBeInflight.Lookup(id, &in); err != nil {
		t.Fatal(err)
	}
	return st.Flows, in.Count
}

// ResetBackendStats zeroes every id it is given, also past one batch's
// worth (it writes in chunks), and no other: not even the ids that share
// an element of pb_be_stats_v2 with one it zeroes.
func TestResetBackendStatsChunks(t *testing.T) {
	l := bpftest.Shared(t)
	defer maps.SetResetChunk(64)()
	const n = 200 // three chunks and a part (the shared datapath has 256 backends)
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = uint32(20 + i)
	}
	// 19 shares ids[0]'s element (16-31), 220 ids[n-1]'s (208-223).
	before, after := ids[0]-1, ids[n-1]+1
	for _, id := range []uint32{before, ids[0], ids[63], ids[64], ids[n-1], after} {
		markBackend(t, l, id)
	}
	if err := l.Maps.ResetBackendStats(ids); err != nil {
		t.Fatal(err)
	}
	for _, id := range []uint32{ids[0], ids[63], ids[64], ids[n-1]} {
		if f, c := backendFlows(t, l, id); f != 0 || c != 0 {
			t.Errorf("id %d after the reset: flows %d, inflight %d; want 0, 0", id, f, c)
		}
	}
	for _, id := range []uint32{before, after} {
		if f, c := backendFlows(t, l, id); f != 7*cpus(t) || c != 3 {
			t.Errorf("id %d, not reset: flows %d, inflight %d; want both kept", id, f, c)
		}
	}
	// Leave the shared datapath as found.
	if err := l.Maps.ResetBackendStats([]uint32{before, after}); err != nil {
		t.Fatal(err)
	}
}

// ResetServiceStats zeroes one service's counters, and not those of the
// services beside it in its element of pb_svc_stats_v2.
func TestResetServiceStatsKeepsItsNeighbours(t *testing.T) {
	l := bpftest.Shared(t)
	const id = 35 // element 2 (32-47)
	mark := func(id uint32) {
		t.Helper()
		var per []bpf.LbSvcStatsBlock
		if err := l.PbSvcStatsV2.Lookup(id/maps.StatsBlock, &per); err != nil {
			t.Fatal(err)
		}
		for i := range per {
			per[i].S[id%maps.StatsBlock].Packets = 5
		}
		if err := l.PbSvcStatsV2.Put(id/maps.StatsBlock, per); err != nil {
			t.Fatal(err)
		}
	}
	for _, i := range []uint32{id - 1, id, id + 1} {
		mark(i)
	}
	if err := l.Maps.ResetServiceStats(id); err != nil {
		t.Fatal(err)
	}
	n := cpus(t)
	for i, want := range map[uint32]uint64{id - 1: 5 * n, id: 0, id + 1: 5 * n} {
		st, err := l.Maps.ServiceStats(i)
		if err != nil {
			t.Fatal(err)
		}
		if st.Packets != want {
			t.Errorf("service %d after resetting %d: %d packets, want %d", i, id, st.Packets, want)
		}
	}
	if err := l.Maps.ResetServiceStats(id - 1); err != nil {
		t.Fatal(err)
	}
	if err := l.Maps.ResetServiceStats(id + 1); err != nil {
		t.Fatal(err)
	}
}

// A snapshot reads what Maps reads, each element once: a change after
// its first read of an element is not in it, and a new snapshot has it.
func TestCounterSnapshot(t *testing.T) {
	l := bpftest.Shared(t)
	markBackend(t, l, 40)
	snap := maps.Snapshot(l.Maps)
	want, err := l.Maps.BackendStats(40)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []uint32{40, 41} {
		got, err := snap.BackendStats(id)
		if err != nil {
			t.Fatal(err)
		}
		direct, _ := l.Maps.BackendStats(id)
		if got != direct {
			t.Errorf("backend %d: snapshot %+v, maps %+v", id, got, direct)
		}
	}
	markBackend(t, l, 41) // the same element, after the snapshot read it
	if got, _ := snap.BackendStats(41); got.Flows != 0 {
		t.Errorf("backend 41 in the snapshot: %d flows, want the 0 it read first", got.Flows)
	}
	if got, _ := maps.Snapshot(l.Maps).BackendStats(41); got.Flows != want.Flows {
		t.Errorf("backend 41 in a new snapshot: %d flows, want %d", got.Flows, want.Flows)
	}
	if err := l.Maps.ResetBackendStats([]uint32{40, 41}); err != nil {
		t.Fatal(err)
	}
}

// Without its reset program the maps refuse a reset, rather than write
// whole elements from user space.
func TestResetNeedsTheProgram(t *testing.T) {
	l := bpftest.Shared(t)
	m, err := maps.New(&l.LbMaps, l.InnerSpec)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.ResetBackendStats([]uint32{1}); err == nil {
		t.Error("ResetBackendStats without pb_stats_reset_run: no error")
	}
}

// cpus is the number of possible CPUs: a per-CPU map's copies.
func cpus(t *testing.T) uint64 {
	t.Helper()
	n, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	return uint64(n)
}

// An id past the end of the counters' map is an error, not a reset that
// silently did nothing; the ids beside it in the batch are still reset.
func TestResetPastTheEnd(t *testing.T) {
	l := bpftest.Shared(t)
	markBackend(t, l, 30)
	past := l.PbBeStatsV2.MaxEntries() * maps.StatsBlock // the first id with no element
	if err := l.Maps.ResetCounters([]uint32{30, past}, true); err == nil {
		t.Errorf("a reset of backend id %d, past the map's end: no error", past)
	}
	if f, _ := backendFlows(t, l, 30); f != 0 {
		t.Errorf("backend 30 reset beside one past the end: flows %d, want 0", f)
	}
	if err := l.Maps.ResetCounters([]uint32{l.PbSvcStatsV2.MaxEntries() * maps.StatsBlock}, false); err == nil {
		t.Error("a reset of a service id past the map's end: no error")
	}
	if err := l.Maps.ResetBackendStats([]uint32{30}); err != nil {
		t.Fatal(err)
	}
}
