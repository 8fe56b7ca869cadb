// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
)

// These tests need no root.

func TestLinkAddrs(t *testing.T) {
	for _, c := range []struct {
		i, host int
		v4, v6  string
	}{
		{0, 1, "198.18.0.1/24", "2001:2::1/64"},
		{0, 2, "198.18.0.2/24", "2001:2::2/64"},
		{1, 2, "198.18.1.2/24", "2001:2:0:1::2/64"},
		{12, 1, "198.18.12.1/24", "2001:2:0:12::1/64"}, // the same digits
		{MaxBackends, 2, "198.18.99.2/24", "2001:2:0:99::2/64"},
	} {
		if got := addr4(c.i, c.host).String(); got != c.v4 {
			t.Errorf("addr4(%d, %d) = %s, want %s", c.i, c.host, got, c.v4)
		}
		if got := addr6(c.i, c.host).String(); got != c.v6 {
			t.Errorf("addr6(%d, %d) = %s, want %s", c.i, c.host, got, c.v6)
		}
	}
	// The IPv6 VIP network mirrors the IPv4 one and holds no link.
	vnet := netip.MustParsePrefix(VIP6Net)
	if !vnet.Contains(VIP6Addr) || !netip.MustParsePrefix(VIPNet).Contains(VIPAddr) {
		t.Errorf("VIPs outside their networks")
	}
	rfc5180 := netip.MustParsePrefix("2001:2::/48")
	if !rfc5180.Contains(VIP6Addr) {
		t.Errorf("VIP6 %s outside 2001:2::/48", VIP6)
	}
	for i := 0; i <= MaxBackends; i++ {
		if p := addr6(i, 1); vnet.Overlaps(p) || !rfc5180.Contains(p.Addr()) {
			t.Errorf("link %d: %s", i, p)
		}
	}
}

// TestDialAddresses checks DialContext's address handling before any
// socket is made (so the Dialer needs no namespace).
func TestDialAddresses(t *testing.T) {
	d := &Dialer{}
	for _, c := range []struct{ network, addr string }{
		{"tcp", "2001:2:0:1::2:80"}, // IPv6 without brackets
		{"tcp", "[2001:2:0:1::2]"},  // no port
		{"tcp", "b1:80"},            // not a literal
		{"tcp4", "[2001:2:0:1::2]:80"},
		{"udp4", "[2001:2:0:1::2]:53"},
		{"tcp6", "198.18.1.2:80"},
		{"udp6", "198.18.1.2:53"},
		{"tcp6", "[::ffff:198.18.1.2]:80"}, // IPv4-mapped is IPv4
		{"sctp", "[2001:2:0:1::2]:80"},
	} {
		_, err := d.DialContext(context.Background(), c.network, c.addr)
		var oe *net.OpError
		if !errors.As(err, &oe) || oe.Op != "dial" || Classify(err) != Other {
			t.Errorf("%s %s: %v, want a dial error", c.network, c.addr, err)
		}
	}
}

// TestHeldFrame checks that the SYN-ACKs DelayHandshakes sends again get
// the checksum a real stack computes, IPv4 and IPv6.
func TestHeldFrame(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		eth := &layers.Ethernet{SrcMAC: mac(1, 2), DstMAC: mac(1, 1), EthernetType: layers.EthernetTypeIPv4}
		tcp := &layers.TCP{SrcPort: 80, DstPort: 40000, Seq: 7, Ack: 8, SYN: true, ACK: true, Window: 64240,
			Options: []layers.TCPOption{{OptionType: layers.TCPOptionKindMSS, OptionLength: 4, OptionData: []byte{5, 0xb4}}}}
		var ip gopacket.SerializableLayer
		if v6 {
			eth.EthernetType = layers.EthernetTypeIPv6
			ip6 := &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: layers.IPProtocolTCP,
				SrcIP: addr6(1, 2).Addr().AsSlice(), DstIP: addr6(0, 2).Addr().AsSlice()}
			tcp.SetNetworkLayerForChecksum(ip6)
			ip = ip6
		} else {
			ip4 := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolTCP,
				SrcIP: addr4(1, 2).Addr().AsSlice(), DstIP: addr4(0, 2).Addr().AsSlice()}
			tcp.SetNetworkLayerForChecksum(ip4)
			ip = ip4
		}
		buf := gopacket.NewSerializeBuffer()
		if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, eth, ip, tcp); err != nil {
			t.Fatal(err)
		}
		want := buf.Bytes()
		// The ring record: le32 length, then the frame with a bad checksum,
		// padded to FRAME_MAX.
		rec := make([]byte, 4+128)
		rec[0] = byte(len(want))
		copy(rec[4:], want)
		tcpOff := 14 + 20
		if v6 {
			tcpOff = 14 + 40
		}
		rec[4+tcpOff+16] ^= 0xff
		got, proto, ok := heldFrame(rec)
		wantProto := uint16(0x0800)
		if v6 {
			wantProto = 0x86dd
		}
		if !ok || proto != wantProto || string(got) != string(want) {
			t.Errorf("v6=%v: heldFrame ok=%v proto=%#x\n got  %x\n want %x", v6, ok, proto, got, want)
		}
		// Truncated records are refused.
		rec[0] = byte(tcpOff + 10)
		if _, _, ok := heldFrame(rec); ok {
			t.Errorf("v6=%v: truncated frame accepted", v6)
		}
	}
}
