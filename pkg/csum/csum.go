// Package csum computes the internet checksum (RFC 1071) of packets that
// tests and benchmarks craft or capture, and of the SYNs pkg/replay
// rebuilds.
package csum

import "encoding/binary"

// Sum adds b to s as big-endian 16-bit words (an odd last byte is the high
// half of a word), without folding the carries.
func Sum(b []byte, s uint32) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	return s
}

// Fold folds the carries of a sum into 16 bits.
func Fold(s uint32) uint16 {
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}

// SetTCP4 recomputes the TCP checksum of an Ethernet frame carrying IPv4
// and TCP, over the segment the IPv4 total length gives and the pseudo
// header. The caller checks that the frame holds both headers and the
// segment.
func SetTCP4(frame []byte) {
	ip := frame[14:]
	ihl := int(ip[0]&0xf) * 4
	seg := ip[ihl:binary.BigEndian.Uint16(ip[2:])]
	seg[16], seg[17] = 0, 0
	ps := Sum(ip[12:20], 0) + uint32(ip[9]) + uint32(len(seg))
	binary.BigEndian.PutUint16(seg[16:], ^Fold(Sum(seg, ps)))
}

// SetTCP6 is SetTCP4 for an Ethernet frame carrying IPv6 (no extension
// headers) and TCP: the pseudo-header holds both addresses, the segment's
// length and the next header (RFC 8200 8.1).
func SetTCP6(frame []byte) {
	ip := frame[14:]
	seg := ip[40 : 40+int(binary.BigEndian.Uint16(ip[4:]))]
	seg[16], seg[17] = 0, 0
	ps := Sum(ip[8:40], 0) + uint32(ip[6]) + uint32(len(seg))
	binary.BigEndian.PutUint16(seg[16:], ^Fold(Sum(seg, ps)))
}
