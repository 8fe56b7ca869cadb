// SPDX-License-Identifier: Apache-2.0

package conntrack

import (
	"net/netip"
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// reverseEntry is the reverse (backend -> client) entry of a flow from
// client to vip balanced to backend, as the datapath writes it.
func reverseEntry(client, vip, backend netip.AddrPort) (bpf.LbCtKey, bpf.LbCtValue) {
	var k bpf.LbCtKey
	k.Src.Bytes, k.Dst.Bytes = maps.Addr16(backend.Addr()), maps.Addr16(client.Addr())
	k.Sport, k.Dport = maps.Port(backend.Port()), maps.Port(client.Port())
	k.Proto, k.Dir, k.Family = 6, maps.DirRev, maps.Family(client.Addr())
	var v bpf.LbCtValue
	v.NatAddr.Bytes, v.NatPort = maps.Addr16(vip.Addr()), maps.Port(vip.Port())
	return k, v
}

// The forward key derived from a reverse entry, and the VIP read from it,
// are right for both families.
func TestForwardKeyAndVIP(t *testing.T) {
	for _, c := range []struct {
		client, vip, backend string
		family               uint8
	}{
		{"198.18.0.2:40000", "198.18.100.1:80", "198.19.1.1:8080", maps.FamilyIPv4},
		{"[2001:1::2]:40000", "[2001:2::10]:80", "[2001:2::1:2]:8080", maps.FamilyIPv6},
	} {
		client, vip := netip.MustParseAddrPort(c.client), netip.MustParseAddrPort(c.vip)
		rk, rv := reverseEntry(client, vip, netip.MustParseAddrPort(c.backend))
		fk := ForwardKey(rk, rv)
		if fk.Family != c.family || fk.Dir != maps.DirFwd || fk.Proto != 6 {
			t.Errorf("%s: forward key %+v", c.client, fk)
		}
		if got := netip.AddrPortFrom(maps.AddrFromFamily(fk.Family, fk.Src.Bytes), maps.Port(fk.Sport)); got != client {
			t.Errorf("forward key's source %s, want %s", got, client)
		}
		if got, ok := ForwardVIP(fk); !ok || got != vip {
			t.Errorf("ForwardVIP = %s, %v, want %s", got, ok, vip)
		}
	}
	var odd bpf.LbCtKey
	odd.Family = 5
	if ap, ok := ForwardVIP(odd); ok {
		t.Errorf("family 5: ForwardVIP = %s, want not ok", ap)
	}
}
