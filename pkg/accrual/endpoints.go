package accrual

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
