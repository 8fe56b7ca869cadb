// SPDX-License-Identifier: Apache-2.0

package accrual

// The deadline heap holds exactly the ejected endpoints, ordered by
// probation time (ties by id, so Advance's output order is deterministic).
// It is hand-rolled over endpoint ids rather than container/heap so that
// each endpoint records its own position (heapIdx) for O(log n) removal when
// it leaves ejected other than by its penalty ending (removal, fail-open
// success, settings change), without interface boxing.

func (e *Engine) heapLess(i, j int) bool {
	// Every ejected endpoint has its activity: eject and Restore made it.
	a, b := e.eps.at(e.heap[i]).seen(), e.eps.at(e.heap[j]).seen()
	if a.probationAt.Equal(b.probationAt) {
		return e.heap[i] < e.heap[j]
	}
	return a.probationAt.Before(b.probationAt)
}

func (e *Engine) heapSwap(i, j int) {
	h := e.heap
	h[i], h[j] = h[j], h[i]
	e.eps.at(h[i]).heapIdx = int32(i)
	e.eps.at(h[j]).heapIdx = int32(j)
}

func (e *Engine) heapUp(j int) {
	for j > 0 {
		i := (j - 1) / 2
		if !e.heapLess(j, i) {
			break
		}
		e.heapSwap(i, j)
		j = i
	}
}

func (e *Engine) heapDown(i int) bool {
	start, n := i, len(e.heap)
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		j := l
		if r := l + 1; r < n && e.heapLess(r, l) {
			j = r
		}
		if !e.heapLess(j, i) {
			break
		}
		e.heapSwap(i, j)
		i = j
	}
	return i > start
}

func (e *Engine) heapPush(id uint32) {
	e.heap = append(e.heap, id)
	i := len(e.heap) - 1
	e.eps.at(id).heapIdx = int32(i)
	e.heapUp(i)
}

// heapRemove removes the element at index i.
func (e *Engine) heapRemove(i int32) {
	idx := int(i)
	last := len(e.heap) - 1
	id := e.heap[idx]
	if idx != last {
		e.heapSwap(idx, last)
	}
	e.heap = e.heap[:last]
	e.eps.at(id).heapIdx = -1
	if idx != last {
		e.heapFix(idx)
	}
}

// heapFix restores the order after the key at index i changed.
func (e *Engine) heapFix(i int) {
	if !e.heapDown(i) {
		e.heapUp(i)
	}
}
