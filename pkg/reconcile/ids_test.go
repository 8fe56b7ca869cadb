// SPDX-License-Identifier: Apache-2.0

package reconcile

import "testing"

func TestIDPool(t *testing.T) {
	p := newIDPool(200, true)
	// Adoption reserves ids across the bitmap's words, the last one included.
	for _, id := range []uint32{2, 63, 64, 130, 199} {
		if !p.take(id) {
			t.Fatalf("take(%d) refused on an empty pool", id)
		}
	}
	for _, id := range []uint32{0, 2, 130, 200, 5000} {
		if p.take(id) {
			t.Errorf("take(%d) accepted: out of range or taken", id)
		}
	}
	// Fresh ids skip the taken ones and are clean over zeroed maps.
	got := map[uint32]bool{}
	for range 194 { // ids 1..199 less the five taken
		id, clean, ok := p.get()
		if !ok {
			t.Fatalf("pool ran dry after %d ids", len(got))
		}
		if id == 0 || id >= 200 || got[id] || id == 2 || id == 63 || id == 64 || id == 130 || id == 199 {
			t.Fatalf("get handed out %d twice, taken or out of range", id)
		}
		if !clean {
			t.Errorf("fresh id %d not clean", id)
		}
		got[id] = true
	}
	if id, _, ok := p.get(); ok {
		t.Fatalf("get handed out %d from a full pool", id)
	}
	// A freed id comes back, not clean (its counters were written); a
	// second put of it does not hand it out twice.
	p.put(64)
	p.put(64)
	p.put(150)
	for _, want := range []uint32{150, 64} {
		id, clean, ok := p.get()
		if !ok || id != want || clean {
			t.Errorf("get = %d, clean %v, ok %v; want %d, not clean", id, clean, ok, want)
		}
	}
	if id, _, ok := p.get(); ok {
		t.Errorf("get handed out %d again", id)
	}
	// A freed id taken back by adoption is skipped when the free list
	// reaches it.
	p.put(7)
	if !p.take(7) {
		t.Fatal("take(7) refused after put")
	}
	if id, _, ok := p.get(); ok {
		t.Errorf("get handed out %d, the id adoption took", id)
	}
}
