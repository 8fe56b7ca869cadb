// SPDX-License-Identifier: Apache-2.0

package outcomes

import (
	"net/netip"
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

// The reader waits its poll, or less to read by a deadline that asked
// for a read (OnCaughtUp), and not at all for one already past.
func TestWaitFor(t *testing.T) {
	now := int64(1_000_000_000)
	ms := int64(time.Millisecond)
	for _, c := range []struct {
		name   string
		readBy int64
		want   time.Duration
	}{
		{"no deadline", 0, PollMax},
		{"a deadline after the poll", now + 80*ms, PollMax},
		{"a deadline before it", now + 16*ms, 16 * time.Millisecond},
		{"a deadline now", now, 0},
		{"a deadline past", now - ms, 0},
	} {
		if got := waitFor(PollMax, c.readBy, now); got != c.want {
			t.Errorf("%s: waitFor = %v, want %v", c.name, got, c.want)
		}
	}
}

// A flow's key gives back the client the event named, whatever its
// family: IPv4, IPv6, and an IPv4-mapped IPv6 address (a different client
// from the IPv4 one, as netip has it).
func TestFlowKeyClient(t *testing.T) {
	for _, s := range []string{"198.18.0.7:40000", "[2001:2::7]:40000", "[::ffff:198.18.0.7]:40000"} {
		c := netip.MustParseAddrPort(s)
		k := keyOf(3, c)
		if got := k.client(); got != c || k.backend != 3 {
			t.Errorf("%s: key gives back %s of backend %d", c, got, k.backend)
		}
	}
	if keyOf(3, netip.MustParseAddrPort("198.18.0.7:1")) == keyOf(3, netip.MustParseAddrPort("[::ffff:198.18.0.7]:1")) {
		t.Error("an IPv4 client and its IPv4-mapped twin share a key")
	}
}
