// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"encoding/binary"
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/csum"
)

// The datapath sums a usual SYN's checksums in place and copies the rest
// out (syn_doomed): both ways must judge every SYN as a reference does.
// Random SYNs, with and without IP options, TCP options (well-formed,
// signed, or garbage) and payload, whole or with one bit flipped anywhere
// that keeps them a SYN to the VIP: a SYN is doomed (passed, no flow) iff
// a checksum is wrong or its options hold TCP-MD5 or TCP-AO.
func TestSYNChecksAgreeWithAReference(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	rng := rand.New(rand.NewPCG(35, 2))
	doomedSeen, wholeSeen := 0, 0
	for i := range 800 {
		frame, want := randomSYN(rng, netip.AddrPortFrom(client.Addr(), uint16(10000+i)))
		before := f.stats().SynDoomed
		bpftest.Run(t, f.PbXdp, frame)
		got := f.stats().SynDoomed-before == 1
		if got != want {
			t.Fatalf("SYN %d judged doomed=%v, the reference says %v: % x", i, got, want, frame)
		}
		if want {
			doomedSeen++
		} else {
			wholeSeen++
		}
	}
	// The mix must hold both, or the test proves nothing.
	if doomedSeen < 200 || wholeSeen < 200 {
		t.Fatalf("%d doomed and %d whole SYNs: want at least 200 of each", doomedSeen, wholeSeen)
	}
}

// randomSYN builds a SYN from src to the VIP and says whether a receiver
// would drop it (the reference).
func randomSYN(rng *rand.Rand, src netip.AddrPort) ([]byte, bool) {
	var ipOpts []byte
	if rng.IntN(4) == 0 {
		ipOpts = []byte{0x94, 0x04, 0x00, 0x00} // router alert
	}
	opts := randomTCPOptions(rng)
	var payload []byte
	if rng.IntN(6) == 0 {
		payload = make([]byte, 1+rng.IntN(30))
		for i := range payload {
			payload[i] = byte(rng.Uint32())
		}
	}
	ihl := 20 + len(ipOpts)
	thl := 20 + len(opts)
	frame := make([]byte, 14+ihl+thl+len(payload))
	copy(frame[0:6], bpftest.NodeMAC)
	copy(frame[6:12], bpftest.ClientMAC)
	binary.BigEndian.PutUint16(frame[12:], 0x0800)
	ip := frame[14 : 14+ihl]
	ip[0] = 0x40 | byte(ihl/4)
	binary.BigEndian.PutUint16(ip[2:], uint16(ihl+thl+len(payload)))
	binary.BigEndian.PutUint16(ip[4:], uint16(rng.Uint32()))
	ip[8], ip[9] = 64, 6
	copy(ip[12:16], src.Addr().AsSlice())
	copy(ip[16:20], vip.Addr().AsSlice())
	copy(ip[20:], ipOpts)
	binary.BigEndian.PutUint16(ip[10:], ipChecksum(ip))
	tcp := frame[14+ihl:]
	binary.BigEndian.PutUint16(tcp[0:], src.Port())
	binary.BigEndian.PutUint16(tcp[2:], vip.Port())
	binary.BigEndian.PutUint32(tcp[4:], rng.Uint32())
	tcp[12] = byte(thl/4) << 4
	tcp[13] = 0x02 // SYN
	binary.BigEndian.PutUint16(tcp[14:], 64240)
	copy(tcp[20:], opts)
	copy(tcp[thl:], payload)
	binary.BigEndian.PutUint16(tcp[16:], tcpChecksum(ip, tcp))

	// Half of them get one bit flipped where the frame stays a SYN to the
	// VIP: the IP header's id, TTL's neighbour, checksum or options, or the
	// TCP segment past ports and flags (sequence number, window, checksum,
	// urgent pointer, options, payload).
	if rng.IntN(2) == 0 {
		var spots []int
		for _, o := range []int{4, 5, 10, 11} {
			spots = append(spots, 14+o)
		}
		for o := 20; o < ihl; o++ {
			spots = append(spots, 14+o)
		}
		for o := 4; o < len(tcp); o++ {
			if o != 12 && o != 13 {
				spots = append(spots, 14+ihl+o)
			}
		}
		at := spots[rng.IntN(len(spots))]
		frame[at] ^= 1 << rng.IntN(8)
	}
	ip, tcp = frame[14:14+ihl], frame[14+ihl:]
	doomed := sum16(ip, 0) != 0xffff ||
		sum16(tcp, pseudo(ip, len(tcp))) != 0xffff ||
		signed(tcp[20:thl])
	return frame, doomed
}

// randomTCPOptions is 0 to 40 bytes (a multiple of 4) of options: a
// Linux SYN's, a signed one's, or garbage.
func randomTCPOptions(rng *rand.Rand) []byte {
	switch rng.IntN(6) {
	case 0:
		return nil
	case 1: // garbage, any kinds and lengths
		b := make([]byte, 4*(1+rng.IntN(10)))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	case 2: // TCP-MD5 (kind 19) or TCP-AO (kind 29) after a no-op or two
		kind := byte(19)
		if rng.IntN(2) == 0 {
			kind = 29
		}
		b := []byte{1, 1, kind, 18}
		return append(b, make([]byte, 16)...)
	default: // MSS, SACK permitted, timestamps, no-op, window scale
		b := []byte{2, 4, 5, 0xb4, 4, 2, 8, 10}
		b = binary.BigEndian.AppendUint32(b, rng.Uint32())
		b = append(b, 0, 0, 0, 0, 1, 3, 3, 7)
		return b
	}
}

// signed walks options as the datapath does (pb_tcp_opts_signed).
func signed(opts []byte) bool {
	pos := 0
	for range 40 {
		if pos >= len(opts) {
			return false
		}
		switch kind := opts[pos]; kind {
		case 0:
			return false
		case 1:
			pos++
			continue
		case 19, 29:
			return true
		}
		if pos+1 >= len(opts) || opts[pos+1] < 2 {
			// The last byte, or a length under 2: the walk ends
			// without a signature (the datapath's reads whatever byte
			// follows in its copy, and ends either way).
			return false
		}
		pos += int(opts[pos+1])
	}
	return false
}

// sum16 is the folded ones' complement sum of b added to s.
func sum16(b []byte, s uint32) uint16 { return csum.Fold(csum.Sum(b, s)) }

func pseudo(ip []byte, l4len int) uint32 {
	s := uint32(sum16(ip[12:20], 0)) + 6 + uint32(l4len)
	return s
}

func tcpChecksum(ip, tcp []byte) uint16 {
	return ^sum16(tcp, pseudo(ip, len(tcp)))
}
