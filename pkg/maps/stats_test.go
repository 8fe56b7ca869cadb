// SPDX-License-Identifier: Apache-2.0

package maps_test

import (
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// ResetBackendStats zeroes every id it is given, also past one batch's
// worth (it writes in chunks), and no other.
func TestResetBackendStatsChunks(t *testing.T) {
	l := bpftest.Shared(t)
	defer maps.SetResetChunk(64)()
	const n = 200 // three chunks and a part (the shared datapath has 256 backends)
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = uint32(20 + i)
	}
	mark := func(id uint32) {
		t.Helper()
		var per []bpf.LbBeStats
		if err := l.PbBeStats.Lookup(id, &per); err != nil {
			t.Fatal(err)
		}
		for i := range per {
			per[i].Flows = 7
		}
		if err := l.PbBeStats.Put(id, per); err != nil {
			t.Fatal(err)
		}
		if err := l.PbBeInflight.Put(id, bpf.LbInflight{Count: 3}); err != nil {
			t.Fatal(err)
		}
	}
	outside := uint32(20 + n)
	for _, id := range []uint32{ids[0], ids[63], ids[64], ids[n-1], outside} {
		mark(id)
	}
	if err := l.Maps.ResetBackendStats(ids); err != nil {
		t.Fatal(err)
	}
	flows := func(id uint32) (uint64, int64) {
		t.Helper()
		var per []bpf.LbBeStats
		if err := l.PbBeStats.Lookup(id, &per); err != nil {
			t.Fatal(err)
		}
		var sum uint64
		for _, s := range per {
			sum += s.Flows
		}
		var in bpf.LbInflight
		if err := l.PbBeInflight.Lookup(id, &in); err != nil {
			t.Fatal(err)
		}
		return sum, in.Count
	}
	for _, id := range []uint32{ids[0], ids[63], ids[64], ids[n-1]} {
		if f, c := flows(id); f != 0 || c != 0 {
			t.Errorf("id %d after the reset: flows %d, inflight %d; want 0, 0", id, f, c)
		}
	}
	if f, c := flows(outside); f == 0 || c != 3 {
		t.Errorf("id %d, not reset: flows %d, inflight %d; want both kept", outside, f, c)
	}
	// Leave the shared datapath as found.
	if err := l.Maps.ResetBackendStats([]uint32{outside}); err != nil {
		t.Fatal(err)
	}
}
