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
// of a time.Time, for the instants each endpoint keeps. A stamp of a live
// instant (the clock's now, now plus a penalty) is monotonic, as the
// time.Time it came from: a step of the wall clock moves no deadline.
// Instants from elsewhere (a restored record's) are put on the clock's
// now before they are stamped, and stamps leave the engine the same way
// (onClock), so what the outside sees is a wall time as of its now.
type stamp int64

// stampBias: 2⁶² ns, 146 years either side of the epoch.
const stampBias = stamp(1) << 62

func (e *Engine) stamp(t time.Time) stamp {
	if t.IsZero() {
		return 0
	}
	return stamp(t.Sub(e.epoch)) + stampBias
}

// onClock returns s as a time on the same clock as now (zero for none).
func (e *Engine) onClock(s stamp, now time.Time) time.Time {
	if s == 0 {
		return time.Time{}
	}
	return now.Add(time.Duration(s - e.stamp(now)))
}

// stampFrom stamps t, an instant not read from the engine's clock (a
// restored record's wall time): taken as its distance from now.
func (e *Engine) stampFrom(t, now time.Time) stamp {
	if t.IsZero() {
		return 0
	}
	return e.stamp(now.Add(t.Sub(now)))
}
