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

// stamp is an instant as nanoseconds since the engine's epoch, 0 for none:
// a third of a time.Time, for the five instants each endpoint keeps. The
// epoch is stampsBack before the engine was made, so every instant an
// engine meets (now, a connection's start, a restored record's) is
// positive; time.Sub keeps the clock's monotonic reading when both have
// one.
type stamp int64

const stampsBack = 100 * 365 * 24 * time.Hour

func (e *Engine) stamp(t time.Time) stamp {
	if t.IsZero() {
		return 0
	}
	return stamp(t.Sub(e.epoch))
}

func (e *Engine) time(s stamp) time.Time {
	if s == 0 {
		return time.Time{}
	}
	return e.epoch.Add(time.Duration(s))
}
