// SPDX-License-Identifier: Apache-2.0

package bpftest

import (
	"net/netip"
	"testing"
)

// The checksum verifier must catch corruption, or the datapath's checksum
// tests could not fail.
func TestParseRejectsBadChecksums(t *testing.T) {
	src := netip.MustParseAddrPort("198.18.0.2:40000")
	dst := netip.MustParseAddrPort("198.18.1.2:8080")
	for name, c := range map[string]struct {
		pkt           []byte
		csum, payload int // offsets of the L4 checksum and payload
	}{
		"tcp": {TCP(src, dst, SYN, []byte("abc")), 14 + 20 + 16, 14 + 20 + 20},
		"udp": {UDP(src, dst, []byte("abc")), 14 + 20 + 6, 14 + 20 + 8},
	} {
		pkt := c.pkt
		if _, err := Parse(pkt); err != nil {
			t.Fatalf("%s: valid packet rejected: %v", name, err)
		}
		// IP checksum, L4 checksum, IP destination, L4 payload.
		for _, off := range []int{14 + 10, c.csum, 14 + 16, c.payload} {
			bad := append([]byte(nil), pkt...)
			bad[off] ^= 0x40
			if _, err := Parse(bad); err == nil {
				t.Errorf("%s: corruption at byte %d not detected", name, off)
			}
		}
	}
}
