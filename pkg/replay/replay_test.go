package replay

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/csum"
)

// A copy the datapath could not have written (options not a whole number
// of words, or more than the array holds) builds no frame.
func TestFrameRejectsImpossibleCopies(t *testing.T) {
	for _, n := range []uint8{3, 41, 44, 255} {
		if _, err := Frame(&bpf.LbSynCopy{OptLen: n, Family: 4}, 1); err == nil {
			t.Errorf("opt_len %d: built a frame", n)
		}
	}
}

// The frame's headers are consistent: lengths, data offset, SYN alone,
// checksums that verify.
func TestFrameHeaders(t *testing.T) {
	c := bpf.LbSynCopy{OptLen: 4, Ttl: 63, Family: 4}
	copy(c.Opts[:], []byte{2, 4, 0x05, 0xb4})
	f, err := Frame(&c, 7)
	if err != nil {
		t.Fatal(err)
	}
	if len(f) != 14+20+24 {
		t.Fatalf("frame of %d bytes", len(f))
	}
	ip, tcp := f[14:34], f[34:]
	if binary.BigEndian.Uint16(ip[2:]) != 44 || ip[8] != 63 || binary.BigEndian.Uint16(ip[4:]) != 7 {
		t.Errorf("IP header % x", ip)
	}
	if csum.Fold(csum.Sum(ip, 0)) != 0xffff {
		t.Errorf("IP checksum does not verify")
	}
	if tcp[12] != 6<<4 || tcp[13] != 0x02 {
		t.Errorf("TCP data offset %d, flags %#x", tcp[12]>>4, tcp[13])
	}
	ps := csum.Sum(ip[12:20], 0) + 6 + uint32(len(tcp))
	if csum.Fold(csum.Sum(tcp, ps)) != 0xffff {
		t.Errorf("TCP checksum does not verify")
	}
}

// An IPv6 copy builds an IPv6 frame: payload length, next header, hop
// limit, addresses, and a TCP checksum over the IPv6 pseudo-header. A copy
// of no known family builds none.
func TestFrameIPv6(t *testing.T) {
	c := bpf.LbSynCopy{OptLen: 4, Ttl: 61, Family: 6}
	copy(c.Opts[:], []byte{2, 4, 0x05, 0xa0})
	c6 := netip.MustParseAddr("2001:2::2").As16()
	v6 := netip.MustParseAddr("2001:2:0:100::1").As16()
	c.Client.Bytes, c.Vip.Bytes = c6, v6
	f, err := Frame(&c, 7)
	if err != nil {
		t.Fatal(err)
	}
	if len(f) != 14+40+24 || binary.BigEndian.Uint16(f[12:]) != 0x86dd {
		t.Fatalf("frame of %d bytes, ethertype %#x", len(f), binary.BigEndian.Uint16(f[12:]))
	}
	ip, tcp := f[14:54], f[54:]
	if ip[0] != 0x60 || binary.BigEndian.Uint16(ip[4:]) != 24 || ip[6] != 6 || ip[7] != 61 ||
		[16]byte(ip[8:24]) != c6 || [16]byte(ip[24:40]) != v6 {
		t.Errorf("IPv6 header % x", ip)
	}
	ps := csum.Sum(ip[8:40], 0) + 6 + uint32(len(tcp))
	if csum.Fold(csum.Sum(tcp, ps)) != 0xffff || tcp[13] != 0x02 {
		t.Errorf("TCP checksum or flags wrong: % x", tcp)
	}
	if _, err := Frame(&bpf.LbSynCopy{Family: 0}, 1); err == nil {
		t.Error("a copy of family 0 built a frame")
	}
}
