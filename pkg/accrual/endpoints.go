// SPDX-License-Identifier: Apache-2.0

package accrual

import "time"

// epChunk is how many endpoints one allocation holds. The table grows a
// chunk at a time: 100,000 endpoints take what they use, not the next
// power of two, and growing copies nothing (a doubling slice left the
// heap holding both copies while the 10,000-service config was applied).
const epChunk = 256

// endpoints is the dense endpoint table, indexed by endpoint id. Ids
// below len that no service lists have svc nil.
type endpoints struct {
	chunks []*[epChunk]endpoint
}

func (t *endpoints) len() int { return len(t.chunks) * epChunk }

// at returns id's endpoint; id must be below len.
func (t *endpoints) at(id uint32) *endpoint { return &t.chunks[id/epChunk][id%epChunk] }

// grow makes id valid.
func (t *endpoints) grow(id uint32) {
	for int(id) >= t.len() {
		c := new([epChunk]endpoint)
		for i := range c {
			c[i].heapIdx = -1
		}
		t.chunks = append(t.chunks, c)
	}
}

// stamp is an instant as nanoseconds from the engine's epoch (when it
// was made), offset by stampBias so that 0 is free to mean none: a third
// of a time.Time. Only instants that never leave the engine are stamps
// (newestOK, returnedAt), each compared only with stamps of its own kind:
// a stamp of the clock's now is monotonic, as the time it came from; one
// of an event's time (wall only) is its wall distance from the epoch.
type stamp int64

// stampBias: 2⁶² ns, 146 years either side of the epoch.
const stampBias = stamp(1) << 62

func (e *Engine) stamp(t time.Time) stamp {
	if t.IsZero() {
		return 0
	}
	return stamp(t.Sub(e.epoch)) + stampBias
}
