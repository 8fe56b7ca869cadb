package accrual

import (
	"testing"
	"time"

	"k8s.io/utils/clock"
)

// Stamps go in and out of the engine as the instants they stand for: a
// live deadline (monotonic, from the clock), a record's wall time from
// before the engine started, and none.
func TestStampRoundTrip(t *testing.T) {
	e := New(clock.RealClock{}, nil)
	now := time.Now()
	if e.stamp(time.Time{}) != 0 || !e.onClock(0, now).IsZero() || e.stampFrom(time.Time{}, now) != 0 {
		t.Fatal("the zero time and stamp 0 must stand for each other")
	}
	deadline := now.Add(90 * time.Second)
	if got := e.onClock(e.stamp(deadline), now); !got.Equal(deadline) || got.Sub(now) != 90*time.Second {
		t.Fatalf("live deadline came back as %v, want %v", got, deadline)
	}
	// A record's time: wall only, an hour before the engine was made.
	rec := now.Add(-time.Hour).Round(0)
	s := e.stampFrom(rec, now)
	if s == 0 || s >= e.stamp(now) {
		t.Fatalf("an earlier record's time stamped %d, now %d", s, e.stamp(now))
	}
	if got := e.onClock(s, now).Round(0); !got.Equal(rec) {
		t.Fatalf("record time came back as %v, want %v", got, rec)
	}
}
