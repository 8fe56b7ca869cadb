// SPDX-License-Identifier: Apache-2.0

package conntrack

import (
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// The sweep's index finds every forward entry it holds, and nothing for a
// key it does not, however alike the keys (one field apart).
func TestPairIndexFindsExactlyItsKeys(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var ents []maps.CTEntry
	for i := 0; i < 5000; i++ {
		var e maps.CTEntry
		e.Key.Src.Bytes = maps.Addr16(netip.AddrFrom4([4]byte{198, 18, byte(rng.IntN(4)), byte(rng.IntN(256))}))
		e.Key.Dst.Bytes = maps.Addr16(netip.AddrFrom4([4]byte{198, 19, 0, byte(rng.IntN(4))}))
		e.Key.Sport, e.Key.Dport = uint16(rng.IntN(64)), 80
		e.Key.Proto, e.Key.Family = 6, maps.FamilyIPv4
		e.Key.Dir = uint8(rng.IntN(2))
		ents = append(ents, e)
	}
	var p pairIndex
	for round := 0; round < 2; round++ { // the second reuses the first's slots
		p.reset(len(ents))
		want := map[bpf.LbCtKey]int{}
		for i := range ents {
			if _, dup := want[ents[i].Key]; ents[i].Key.Dir == maps.DirFwd && !dup {
				p.add(ents, i)
				want[ents[i].Key] = i
			}
		}
		for i := range ents {
			k := ents[i].Key
			got := p.find(ents, &k)
			if w, ok := want[k]; ok != (got >= 0) || (ok && got != w) {
				t.Fatalf("find(%+v) = %d, want %d (indexed: %v)", k, got, w, ok)
			}
			k.Sport ^= 0x8000 // a key no entry has
			if got := p.find(ents, &k); got >= 0 {
				t.Fatalf("find of an absent key = %d", got)
			}
		}
	}
}

// inUse writes each set only when its key changes, and still ends with
// every service, backend and VIP it was given.
func TestInUseCollectsEveryID(t *testing.T) {
	u := inUse{InUse: InUse{Services: map[uint32]bool{}, Backends: map[uint32]bool{}, VIPs: map[netip.AddrPort]bool{}}}
	vip := func(last byte, port uint16) *bpf.LbCtKey {
		var k bpf.LbCtKey
		k.Dst.Bytes = maps.Addr16(netip.AddrFrom4([4]byte{198, 19, 0, last}))
		k.Dport, k.Family = maps.Port(port), maps.FamilyIPv4
		return &k
	}
	u.add(vip(1, 80), 1, 10)
	u.add(vip(1, 80), 1, 10)
	u.add(vip(1, 81), 1, 11)
	u.add(vip(2, 81), 2, 11)
	u.add(vip(1, 80), 1, 10)
	if len(u.Services) != 2 || len(u.Backends) != 2 || len(u.VIPs) != 3 {
		t.Fatalf("in use %+v: want 2 services, 2 backends, 3 VIPs", u.InUse)
	}
	for _, ap := range []string{"198.19.0.1:80", "198.19.0.1:81", "198.19.0.2:81"} {
		if !u.VIPs[netip.MustParseAddrPort(ap)] {
			t.Errorf("VIP %s missing from %v", ap, u.VIPs)
		}
	}
}
