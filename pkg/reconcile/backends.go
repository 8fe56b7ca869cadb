// SPDX-License-Identifier: Apache-2.0

package reconcile

import "iter"

// backendTable holds the backends by id, in a slice indexed by it: idPool
// hands ids out densely (freed ones first, then counting up). At 100,000
// backends a map of them held 6 MB (the apiscale bench's heap profile), the
// slice 0.8 MB.
type backendTable struct {
	byID []*Backend
	n    int
}

// get returns backend id, nil when there is none.
func (t *backendTable) get(id uint32) *Backend {
	if int(id) < len(t.byID) {
		return t.byID[id]
	}
	return nil
}

// lookup is get with an ok.
func (t *backendTable) lookup(id uint32) (*Backend, bool) {
	b := t.get(id)
	return b, b != nil
}

// set makes b backend id.
func (t *backendTable) set(id uint32, b *Backend) {
	if int(id) >= len(t.byID) {
		t.byID = append(t.byID, make([]*Backend, int(id)+1-len(t.byID))...)
	}
	if t.byID[id] == nil {
		t.n++
	}
	t.byID[id] = b
}

// del drops backend id.
func (t *backendTable) del(id uint32) {
	if t.get(id) != nil {
		t.byID[id] = nil
		t.n--
	}
}

// len is the number of backends.
func (t *backendTable) len() int { return t.n }

// all yields the backends in id order; the loop may delete the one it is
// given.
func (t *backendTable) all() iter.Seq2[uint32, *Backend] {
	return func(yield func(uint32, *Backend) bool) {
		for id, b := range t.byID {
			if b != nil && !yield(uint32(id), b) {
				return
			}
		}
	}
}
