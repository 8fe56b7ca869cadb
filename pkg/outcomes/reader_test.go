// SPDX-License-Identifier: Apache-2.0

package outcomes

import (
	"testing"
	"time"
)

// The reader's poll follows the ring's fill rate: as seldom as PollMax
// while an eighth of the ring lasts that long, sooner when it fills
// faster, never sooner than Poll.
func TestNextPoll(t *testing.T) {
	const ring = 1 << 20
	sec := int64(time.Second)
	for _, c := range []struct {
		name  string
		bytes int
		d     int64
		want  time.Duration
	}{
		{"nothing read", 0, sec, PollMax},
		{"a slow trickle", 1000 * recordBytes, sec, PollMax},
		{"an eighth of the ring a second", ring / 8, sec, PollMax},
		{"an eighth of the ring in 20ms", ring / 8, int64(20 * time.Millisecond), 20 * time.Millisecond},
		{"a flood", ring, int64(time.Millisecond), Poll},
		{"no time", 100, 0, PollMax},
	} {
		if got := nextPoll(ring, c.bytes, c.d); got != c.want {
			t.Errorf("%s: nextPoll = %v, want %v", c.name, got, c.want)
		}
	}
}
