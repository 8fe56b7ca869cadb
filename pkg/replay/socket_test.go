// SPDX-License-Identifier: Apache-2.0

package replay

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
)

// What Socket sends of a frame the program returned, without a socket: a
// frame too short or of another protocol is an error, a passed packet
// that a forward would have dropped (TTL 1) is not sent, and one it would
// have forwarded goes out one hop older (here to a closed descriptor,
// whose error shows it was sent).
func TestSocketSendsWhatAForwardWould(t *testing.T) {
	const closed = 1 << 20 // a descriptor no process has open
	s := &Socket{fd4: closed, fd6: closed}
	if err := s.send(make([]byte, 10), true); err == nil {
		t.Error("a 10-byte frame was sent")
	}
	arp := make([]byte, 60)
	arp[12], arp[13] = 0x08, 0x06
	if err := s.send(arp, true); err == nil {
		t.Error("an ARP frame was sent")
	}
	for _, fam := range []uint8{4, 6} {
		ttlAt := 14 + 8
		if fam == 6 {
			ttlAt = 14 + 7
		}
		frame := func(ttl uint8) []byte {
			c := bpf.LbSynCopy{Family: fam, Ttl: ttl}
			f, err := Frame(&c, 1)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
		if err := s.send(frame(1), true); err != nil {
			t.Errorf("IPv%d, TTL 1, passed: %v, want it not sent", fam, err)
		}
		f := frame(64)
		if err := s.send(f, true); !errors.Is(err, unix.EBADF) {
			t.Errorf("IPv%d, TTL 64, passed: %v, want it sent", fam, err)
		}
		if f[ttlAt] != 63 {
			t.Errorf("IPv%d, TTL 64, passed: sent with TTL %d, want 63", fam, f[ttlAt])
		}
		// Redirected or sent back, the program took the hop off already.
		f = frame(1)
		if err := s.send(f, false); !errors.Is(err, unix.EBADF) || f[ttlAt] != 1 {
			t.Errorf("IPv%d, TTL 1, redirected: %v, TTL %d, want it sent as it is", fam, err, f[ttlAt])
		}
	}
}
