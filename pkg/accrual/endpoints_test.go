// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"runtime"
	"testing"
	"time"
	"unsafe"

	"k8s.io/utils/clock"
)

// A stamp stands for none only when its time is zero, and keeps the order
// of the instants it stands for on both sides of the epoch: a connection
// that began before the engine was made (a successful one sets newestOK)
// stamps below now, not as none.
func TestStampOrder(t *testing.T) {
	e := New(clock.RealClock{}, nil)
	now := time.Now()
	if e.stamp(time.Time{}) != 0 {
		t.Fatal("the zero time must stamp as none")
	}
	before := now.Add(-time.Hour).Round(0) // an event's time: wall only
	b, n, later := e.stamp(before), e.stamp(now), e.stamp(now.Add(time.Second))
	if b == 0 || !(b < n && n < later) {
		t.Fatalf("stamps %d, %d, %d: want nonzero and increasing", b, n, later)
	}
	if d := time.Duration(later - n); d != time.Second {
		t.Fatalf("stamps a second apart differ by %v", d)
	}
}

// An endpoint that has seen no traffic holds only its place and state:
// 10,000 services of 10 endpoints cost the engine about 10 MB (5 of them
// the endpoint table, the rest the services), not the 33 MB it took with
// whole endpoints in the table. Its activity comes with its first
// outcome (or ejection) and goes when it leaves its service.
func TestEndpointsWithoutTrafficStaySmall(t *testing.T) {
	if n := unsafe.Sizeof(endpoint{}); n > 48 {
		t.Fatalf("an endpoint takes %d bytes in the table, want at most 48", n)
	}
	h := newHarness(t, nil)
	const services, per = 10_000, 10
	eps := make([]uint32, per)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for s := range uint32(services) {
		for i := range eps {
			eps[i] = s*per + uint32(i)
		}
		h.e.SetService(s, "svc", testSettings(), eps)
	}
	runtime.ReadMemStats(&after)
	if got := after.TotalAlloc - before.TotalAlloc; got > 12<<20 {
		t.Errorf("%d services of %d endpoints allocated %d MB, want at most 12", services, per, got>>20)
	}
	checkInvariants(t, h.e)
	for id := range uint32(services * per) {
		if h.e.eps.at(id).act != nil {
			t.Fatalf("endpoint %d has an activity without any traffic", id)
		}
	}
	// The first outcome gives one; the endpoint's counters are in it.
	h.obs(succ(5))
	h.obs(fail(7, KindRefused))
	if h.e.eps.at(5).act == nil || h.counters(5).Successes != 1 || h.counters(7).Failures.Refused != 1 {
		t.Fatalf("outcomes not counted: %+v, %+v", h.counters(5), h.counters(7))
	}
	if h.e.eps.at(6).act != nil {
		t.Fatal("an outcome of another endpoint gave endpoint 6 an activity")
	}
	// Leaving the service drops it: back, the endpoint starts from zero.
	h.set(0, testSettings(), 0, 1, 2, 3, 4, 6, 7, 8, 9)
	if h.e.eps.at(5).act != nil {
		t.Fatal("a removed endpoint kept its activity")
	}
	h.set(0, testSettings(), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
	if c := h.counters(5); c != (Counters{}) {
		t.Fatalf("a returning endpoint kept its counters: %+v", c)
	}
}
