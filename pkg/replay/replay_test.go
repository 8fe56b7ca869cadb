package replay

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/csum"
)

// A copy the datapath could not have written (options not a whole number
// of words, or more than the array holds) builds no frame.
func TestFrameRejectsImpossibleCopies(t *testing.T) {
	for _, n := range []uint8{3, 41, 44, 255} {
		if _, err := Frame(&bpf.LbSynCopy{OptLen: n}, 1); err == nil {
			t.Errorf("opt_len %d: built a frame", n)
		}
	}
}

// The frame's headers are consistent: lengths, data offset, SYN alone,
// checksums that verify.
func TestFrameHeaders(t *testing.T) {
	c := bpf.LbSynCopy{OptLen: 4, Ttl: 63}
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

// An IPv6 flow is refused before any map is looked at: pb_syns holds no
// IPv6 SYN, and the frames are IPv4.
func TestIPv6Refused(t *testing.T) {
	r := New(nil, nil) // no map is read
	c6 := netip.MustParseAddrPort("[2001:1::2]:40000")
	v6 := netip.MustParseAddrPort("[2001:2::10]:80")
	be6 := netip.MustParseAddrPort("[2001:2::1:2]:8080")
	if err := r.Replay(c6, v6, be6); !errors.Is(err, ErrNotIPv4) {
		t.Errorf("Replay of an IPv6 client: %v, want ErrNotIPv4", err)
	}
	if err := r.ReplayUnanswered(c6, v6, be6, 3); !errors.Is(err, ErrNotIPv4) {
		t.Errorf("ReplayUnanswered of an IPv6 client: %v, want ErrNotIPv4", err)
	}
	if err := r.send(c6, v6, nil); !errors.Is(err, ErrNotIPv4) {
		t.Errorf("send of an IPv6 client: %v, want ErrNotIPv4", err)
	}
}
