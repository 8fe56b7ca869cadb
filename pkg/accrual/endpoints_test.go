// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"testing"
	"time"

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
