// SPDX-License-Identifier: Apache-2.0

package outcomes

import (
	"math"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

func clientPort(i int) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, byte(i >> 16), byte(i >> 8)}), uint16(i))
}

// A flow timed out is remembered for ten connect timeouts, so a late RST is
// no second verdict. A connect timeout whose tenfold overflows used to wrap
// the memory's deadline into the past: it expired at once and the late RST
// counted again.
func TestTrackerMemorySaturates(t *testing.T) {
	s := accrual.Defaults()
	s.ConnectTimeout = math.MaxInt64 / 5 // past Validate's bound: the tracker must not rely on it
	pol := PolicyFor(s, true)
	tr := NewTracker(func(uint32) Policy { return pol })
	c := clientPort(1)
	tr.Classify(Event{Type: NewFlow, Backend: 1, Client: c, At: t0})
	if o, ok := tr.Classify(Event{Type: SynRetrans, Backend: 1, Client: c, At: t0.Add(time.Second)}); !ok || o.Kind != accrual.KindTimeout {
		t.Fatalf("retransmitted SYN: %+v %v, want a timeout", o, ok)
	}
	tr.Expire(t0.Add(2*time.Second), func(o accrual.Outcome) { t.Errorf("deadline verdict %+v", o) })
	if o, ok := tr.Classify(Event{Type: Refused, Backend: 1, Client: c, At: t0.Add(3 * time.Second)}); ok {
		t.Fatalf("a late RST after the timeout was a second verdict: %+v", o)
	}
}

// The sign of flood counts connects still waiting for their first answer,
// each service's share capped: one service's 10,000 idle connections
// (established, settling under a long connect timeout) count nothing, its
// half-open ones count up to the share, another service's count in full.
func TestTrackerFloodConnects(t *testing.T) {
	s := accrual.Defaults()
	s.ConnectTimeout = 30 * time.Second
	pols := map[uint32]Policy{}
	for be, svc := range map[uint32]uint32{1: 10, 2: 20, 3: 30, 4: 40, 5: 50, 6: 60} {
		p := PolicyFor(s, true)
		p.Service = svc
		pols[be] = p
	}
	tr := NewTracker(func(be uint32) Policy { return pols[be] })
	tr.SetConnectShare(2500)
	n := 0
	open := func(be uint32, count int, established bool) {
		for range count {
			n++
			tr.Classify(Event{Type: NewFlow, Backend: be, Client: clientPort(n), At: t0})
			if established {
				tr.Classify(Event{Type: Established, Backend: be, Client: clientPort(n), At: t0.Add(time.Millisecond)})
			}
		}
	}
	open(1, 10000, true)
	if got := tr.FloodConnects(); got != 0 {
		t.Fatalf("10,000 idle established connections count %d toward flood, want 0", got)
	}
	if got := tr.PendingConnects(); got != 0 {
		t.Fatalf("pending connects %d with only established connections", got)
	}
	open(1, 10000, false)
	if got, all := tr.FloodConnects(), tr.PendingConnects(); got != 2500 || all != 10000 {
		t.Fatalf("one service's 10,000 half-open connections: flood connects %d (want its share, 2500), pending connects %d (want 10000)", got, all)
	}
	open(2, 100, false)
	if got := tr.FloodConnects(); got != 2600 {
		t.Fatalf("another service's 100 connects: flood connects %d, want 2600", got)
	}
	// A flood spread over services counts in full up to each share.
	for be := uint32(3); be <= 6; be++ {
		open(be, 2000, false)
	}
	if got := tr.FloodConnects(); got != 2500+100+4*2000 {
		t.Fatalf("flood over five services: flood connects %d, want %d", got, 2500+100+4*2000)
	}
	// Their verdicts take them out again.
	tr.Expire(t0.Add(time.Minute), func(accrual.Outcome) {})
	if got, all := tr.FloodConnects(), tr.PendingConnects(); got != 0 || all != 0 {
		t.Fatalf("after every deadline: flood connects %d, pending connects %d, want 0", got, all)
	}
	tr.SetConnectShare(0)
	open(1, 3000, false)
	if got := tr.FloodConnects(); got != 3000 {
		t.Fatalf("no share: flood connects %d, want 3000", got)
	}
}

// Beyond its cap a service's new flows are not tracked, and are counted;
// other services and probes are not held back. A shed flow's RST still
// judges it; its SYN-ACK is its success (no settling).
func TestTrackerPerServiceCap(t *testing.T) {
	s := accrual.Defaults()
	polA, polB := PolicyFor(s, true), PolicyFor(s, true)
	polA.Service, polB.Service = 10, 20
	tr := NewTracker(func(be uint32) Policy {
		if be == 1 {
			return polA
		}
		return polB
	})
	tr.MaxPendingPerService = 100
	for i := range 150 {
		tr.Classify(Event{Type: NewFlow, Backend: 1, Client: clientPort(i), At: t0})
	}
	for i := range 50 {
		tr.Classify(Event{Type: NewFlow, Backend: 2, Client: clientPort(1000 + i), At: t0})
	}
	tr.Classify(Event{Type: NewFlow, Backend: 1, Client: clientPort(5000), At: t0, Flags: FlagProbe})
	if tr.Pending() != 151 {
		t.Fatalf("pending %d, want 100 of service A, its probe, and 50 of B", tr.Pending())
	}
	shed := map[uint32][2]uint64{}
	tr.DrainShed(func(svc uint32, overCap, overMemory uint64) { shed[svc] = [2]uint64{overCap, overMemory} })
	if len(shed) != 1 || shed[10] != [2]uint64{50, 0} {
		t.Fatalf("shed %v, want 50 of service 10 over its cap", shed)
	}
	tr.DrainShed(func(svc uint32, overCap, overMemory uint64) {
		t.Errorf("drained twice: %d %d %d", svc, overCap, overMemory)
	})
	// A shed flow: its refusal counts, its SYN-ACK is a success at once.
	if o, ok := tr.Classify(Event{Type: Refused, Backend: 1, Client: clientPort(120), At: t0.Add(time.Millisecond)}); !ok || o.Kind != accrual.KindRefused {
		t.Fatalf("shed flow's RST: %+v %v, want refused", o, ok)
	}
	if o, ok := tr.Classify(Event{Type: Established, Backend: 1, Client: clientPort(121), At: t0.Add(time.Millisecond)}); !ok || !o.Success {
		t.Fatalf("shed flow's SYN-ACK: %+v %v, want a success", o, ok)
	}
	// A tracked flow goes on to settle: no more room taken.
	if _, ok := tr.Classify(Event{Type: Established, Backend: 1, Client: clientPort(0), At: t0.Add(time.Millisecond)}); ok {
		t.Fatal("a tracked flow's SYN-ACK decided it, want it settling")
	}
	tr.DrainShed(func(svc uint32, overCap, overMemory uint64) {
		t.Errorf("settling counted as shed: %d %d %d", svc, overCap, overMemory)
	})
}

// Over the node's ceiling new flows are not tracked, counted per service.
func TestTrackerCeilingCountsPerService(t *testing.T) {
	pol := PolicyFor(accrual.Defaults(), true)
	pol.Service = 7
	tr := NewTracker(func(uint32) Policy { return pol })
	tr.MaxPending = 10
	for i := range 25 {
		tr.Classify(Event{Type: NewFlow, Backend: 1, Client: clientPort(i), At: t0})
	}
	var got [2]uint64
	tr.DrainShed(func(svc uint32, overCap, overMemory uint64) {
		if svc != 7 {
			t.Errorf("shed of service %d", svc)
		}
		got = [2]uint64{overCap, overMemory}
	})
	if got != [2]uint64{0, 15} || tr.Overflow != 15 {
		t.Fatalf("shed %v overflow %d, want 15 over the ceiling", got, tr.Overflow)
	}
}

// queuedDeadlines counts the deadlines in tr's queues, decided or not.
func queuedDeadlines(tr *Tracker) int {
	n := 0
	for _, qs := range []queueSet{tr.queues, tr.replays} {
		for _, q := range qs {
			n += len(q.q) - q.head
		}
	}
	return n
}

// Flows decided at once leave their deadlines queued until those come up:
// at a high rate of short connections the queues must not hold rate ×
// connect timeout of them (here 200,000 flows in 0.2 s, each decided at
// once: at most a few thousand deadlines, not 400,000).
func TestTrackerQueuesStayBounded(t *testing.T) {
	s := accrual.Defaults()
	s.ConnectTimeout = 30 * time.Second
	pol := PolicyFor(s, true)
	pol.Replay = time.Second
	tr := NewTracker(func(uint32) Policy { return pol })
	for i := range 200_000 {
		at := t0.Add(time.Duration(i) * time.Microsecond)
		tr.Classify(Event{Type: NewFlow, Backend: 1, Client: clientPort(i), At: at})
		tr.Classify(Event{Type: Refused, Backend: 1, Client: clientPort(i), At: at})
		if i%1000 == 999 {
			if n := queuedDeadlines(tr); n > 3*tr.Pending()+4096+8 {
				t.Fatalf("after %d flows, %d deadlines queued for %d pending", i+1, n, tr.Pending())
			}
		}
	}
	if n := queuedDeadlines(tr); n != tr.queued {
		t.Fatalf("queued %d, counted %d", tr.queued, n)
	}
}

// EntryBytes is an upper bound of what a tracked flow costs: flows that
// wait for a replay, then settle (three deadlines each, two of them
// decided), measured on the heap.
func TestEntryBytes(t *testing.T) {
	s := accrual.Defaults()
	pol := PolicyFor(s, true)
	pol.Replay = 500 * time.Millisecond
	const n = 60_000 // just past a growth of the map: near the most a flow costs
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	tr := NewTracker(func(uint32) Policy { return pol })
	for i := range n {
		tr.Classify(Event{Type: NewFlow, Backend: 1, Client: clientPort(i), At: t0})
		tr.Classify(Event{Type: Established, Backend: 1, Client: clientPort(i), At: t0.Add(time.Millisecond)})
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / n
	t.Logf("%d settling flows: %.0f bytes each (EntryBytes %d)", tr.Pending(), per, EntryBytes)
	if tr.Pending() != n {
		t.Fatalf("pending %d, want %d", tr.Pending(), n)
	}
	if per > EntryBytes {
		t.Fatalf("%.0f bytes a flow, over EntryBytes (%d)", per, EntryBytes)
	}
	runtime.KeepAlive(tr)
}
