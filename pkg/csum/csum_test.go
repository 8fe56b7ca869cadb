package csum

import (
	"encoding/binary"
	"testing"
)

// A segment whose checksum is right sums, with its pseudo header, to
// 0xffff: the receiver's check.
func TestSetTCP4(t *testing.T) {
	f := make([]byte, 14+20+20+3)
	ip := f[14:]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], 20+20+3)
	ip[9] = 6
	copy(ip[12:], []byte{198, 18, 0, 2, 198, 18, 1, 2})
	copy(ip[20:], []byte{0x9c, 0x40, 0x1f, 0x90, 1, 2, 3, 4, 5, 6, 7, 8, 0x50, 0x12, 0xff, 0xff, 0xde, 0xad, 0, 0, 'a', 'b', 'c'})
	SetTCP4(f)
	seg := ip[20:]
	if got := Fold(Sum(seg, Sum(ip[12:20], 0)+6+uint32(len(seg)))); got != 0xffff {
		t.Fatalf("checksum check sums to %#x, want 0xffff", got)
	}
	// RFC 1071's example: 0001 f203 f4f5 f6f7 sums to ddf2.
	if got := Fold(Sum([]byte{0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7}, 0)); got != 0xddf2 {
		t.Fatalf("Fold(Sum(example)) = %#x, want 0xddf2", got)
	}
}

// The same for IPv6: the pseudo-header holds both 16-byte addresses.
func TestSetTCP6(t *testing.T) {
	f := make([]byte, 14+40+20+3)
	ip := f[14:]
	ip[0] = 0x60
	binary.BigEndian.PutUint16(ip[4:], 20+3)
	ip[6] = 6
	copy(ip[8:], []byte{0x20, 0x01, 0, 2, 15: 2})
	copy(ip[24:], []byte{0x20, 0x01, 0, 2, 0, 0, 1, 0, 15: 1})
	copy(ip[40:], []byte{0x9c, 0x40, 0x1f, 0x90, 1, 2, 3, 4, 5, 6, 7, 8, 0x50, 0x12, 0xff, 0xff, 0xde, 0xad, 0, 0, 'a', 'b', 'c'})
	SetTCP6(f)
	seg := ip[40:]
	if got := Fold(Sum(seg, Sum(ip[8:40], 0)+6+uint32(len(seg)))); got != 0xffff {
		t.Fatalf("checksum check sums to %#x, want 0xffff", got)
	}
}
