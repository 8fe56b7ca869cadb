// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"slices"
	"testing"
)

func TestBackendTable(t *testing.T) {
	var bt backendTable
	for _, id := range []uint32{5, 1, 300} {
		bt.set(id, &Backend{ID: id})
	}
	bt.set(5, &Backend{ID: 5, Name: "again"}) // a replacement is not a second backend
	if bt.len() != 3 || bt.get(5).Name != "again" || bt.get(2) != nil || bt.get(100000) != nil {
		t.Fatalf("len %d, 5 %+v, 2 %v, 100000 %v", bt.len(), bt.get(5), bt.get(2), bt.get(100000))
	}
	if _, ok := bt.lookup(4); ok {
		t.Error("lookup(4) found a backend never set")
	}
	// In id order; deleting the one given does not skip the next.
	var seen []uint32
	for id, b := range bt.all() {
		if b.ID != id {
			t.Errorf("id %d holds backend %d", id, b.ID)
		}
		seen = append(seen, id)
		if id == 1 {
			bt.del(id)
		}
	}
	if !slices.Equal(seen, []uint32{1, 5, 300}) {
		t.Errorf("all yielded %v, want [1 5 300]", seen)
	}
	bt.del(1) // twice: no change
	bt.del(7) // never set
	if _, ok := bt.lookup(1); ok || bt.len() != 2 {
		t.Errorf("after deleting 1: found %v, len %d", ok, bt.len())
	}
	for id := range bt.all() {
		if id == 5 {
			break // a loop that stops early stops
		}
		t.Errorf("all yielded %d before 5", id)
	}
}
