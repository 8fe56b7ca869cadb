// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"maps"
	"net/netip"
	"slices"
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
)

// The strings are metric label values: they must not change.
func TestBackendStateStrings(t *testing.T) {
	for st, want := range map[BackendState]string{
		BackendActive: "active", BackendProbation: "probation",
		BackendEjected: "ejected", BackendRemoved: "removed", 9: "state(9)",
	} {
		if got := st.String(); got != want {
			t.Errorf("BackendState(%d).String() = %q, want %q", uint8(st), got, want)
		}
	}
}

// The slots are the datapath's (bpf/lb.c vip_slot_marked): the values here
// were computed by hand from the formula, not by VIPSlot.
func TestVIPSlot(t *testing.T) {
	for _, c := range []struct {
		addr string
		want uint32
	}{
		// (0xc6126401 * 0x9e3779b1) >> 16
		{"198.18.100.1", 48690},
		// The IPv4-mapped form is the IPv4 address's slot.
		{"::ffff:198.18.100.1", 48690},
		// 0x20010002 ^ 0 ^ 0 ^ 0x00000010 = 0x20010012
		{"2001:2::10", 47511},
		// 0x20010db8 ^ 0x85a30000 ^ 0x00008a2e ^ 0x03707334 = 0xa6d2f4a2
		{"2001:db8:85a3::8a2e:370:7334", 38985},
	} {
		if got := VIPSlot(netip.MustParseAddr(c.addr)); got != c.want {
			t.Errorf("VIPSlot(%s) = %d, want %d", c.addr, got, c.want)
		}
	}
	// An IPv6 address whose words XOR to an IPv4 address's value shares
	// its slot, as in the datapath.
	if a, b := VIPSlot(netip.MustParseAddr("198.18.100.1")), VIPSlot(netip.MustParseAddr("::c612:6401")); a != b {
		t.Errorf("::c612:6401 in slot %d, 198.18.100.1 in %d: the fold is not the XOR of the words", b, a)
	}
	if got := VIPSlot(netip.Addr{}); got != 0 {
		t.Errorf("VIPSlot of the zero Addr = %d", got)
	}
}

// Addr16 and AddrFromFamily are each other's inverse, by family; the
// union addr layout is the contract with the datapath.
func TestAddrBytes(t *testing.T) {
	for _, c := range []struct {
		addr   string
		family uint8
		bytes  [16]uint8
		back   string // what AddrFromFamily returns
	}{
		{"198.18.100.1", FamilyIPv4, [16]uint8{198, 18, 100, 1}, "198.18.100.1"},
		{"::ffff:198.18.100.1", FamilyIPv4, [16]uint8{198, 18, 100, 1}, "198.18.100.1"},
		{"2001:2::10", FamilyIPv6, [16]uint8{0x20, 0x01, 0, 0x02, 15: 0x10}, "2001:2::10"},
		{"fd00::ffff:c612:6401", FamilyIPv6, [16]uint8{0xfd, 10: 0xff, 11: 0xff, 12: 198, 13: 18, 14: 100, 15: 1}, "fd00::ffff:c612:6401"},
	} {
		a := netip.MustParseAddr(c.addr)
		if f := Family(a); f != c.family {
			t.Errorf("Family(%s) = %d, want %d", c.addr, f, c.family)
		}
		b := Addr16(a)
		if b != c.bytes {
			t.Errorf("Addr16(%s) = %v, want %v", c.addr, b, c.bytes)
		}
		if got := AddrFromFamily(c.family, b); got != netip.MustParseAddr(c.back) {
			t.Errorf("AddrFromFamily(%d, Addr16(%s)) = %s, want %s", c.family, c.addr, got, c.back)
		}
	}
	// The IPv4 helper keeps reading the first four bytes.
	if got := AddrFrom16([16]uint8{198, 18, 100, 1}); got != netip.MustParseAddr("198.18.100.1") {
		t.Errorf("AddrFrom16 = %s", got)
	}
	if f, b := Family(netip.Addr{}), Addr16(netip.Addr{}); f != 0 || b != [16]uint8{} {
		t.Errorf("zero Addr: family %d, bytes %v", f, b)
	}
	for _, f := range []uint8{0, 2, 10} {
		if got := AddrFromFamily(f, [16]uint8{1, 2, 3, 4}); got.IsValid() {
			t.Errorf("AddrFromFamily(%d) = %s, want the zero Addr", f, got)
		}
	}
}

// Keys and values take their family from the address.
func TestKeysCarryTheFamily(t *testing.T) {
	v6 := netip.MustParseAddr("2001:2::10")
	k := ServiceKey(v6, 80, 6)
	if k.Family != FamilyIPv6 || k.Vip.Bytes != v6.As16() || Port(k.Port) != 80 || k.Proto != 6 {
		t.Errorf("ServiceKey(%s) = %+v", v6, k)
	}
	if k4 := ServiceKey(netip.MustParseAddr("198.18.100.1"), 80, 6); k4.Family != FamilyIPv4 {
		t.Errorf("IPv4 ServiceKey family %d", k4.Family)
	}
	be := netip.MustParseAddrPort("[2001:2::1:2]:8080")
	b := NewBackend(be, 3, BackendProbation, 1)
	if b.Family != FamilyIPv6 || b.Addr.Bytes != be.Addr().As16() || Port(b.Port) != 8080 ||
		b.SvcId != 3 || BackendState(b.State) != BackendProbation || b.ProbeGrants != 1 {
		t.Errorf("NewBackend(%s) = %+v", be, b)
	}
	if got := netip.AddrPortFrom(AddrFromFamily(b.Family, b.Addr.Bytes), Port(b.Port)); got != be {
		t.Errorf("backend read back as %s, want %s", got, be)
	}
	client := netip.MustParseAddrPort("[2001:1::5]:40000")
	rk := ReplyKey(be, client)
	if rk.Family != FamilyIPv6 || rk.Src.Bytes != be.Addr().As16() || rk.Dst.Bytes != client.Addr().As16() ||
		rk.Dir != DirRev || Port(rk.Sport) != 8080 || Port(rk.Dport) != 40000 {
		t.Errorf("ReplyKey = %+v", rk)
	}
}

// pb_ifaces is rewritten at every change of the node's links; a replaced
// hash entry races the datapath's lookups, so only what changes is
// written: nothing for the same links again, one entry for a master set
// later, a delete for a link gone or left with nothing to say.
func TestIfaceChanges(t *testing.T) {
	pod := func(idx, master uint32) Iface { return Iface{Index: idx, Partial: true, Master: master} }
	ifs := []Iface{pod(4, 0), pod(5, 3), {Index: 2, Decap: true}, {Index: 9}, {Index: 11, IPIP: true}}
	put, del := ifaceChanges(nil, ifs)
	if len(put) != 4 || len(del) != 0 {
		t.Fatalf("into an empty map: put %v, delete %v; want 4 entries (not the interface with nothing to say) and no delete", put, del)
	}
	have := maps.Clone(put)
	if put, del := ifaceChanges(have, ifs); len(put) != 0 || len(del) != 0 {
		t.Fatalf("the same links again: put %v, delete %v; want nothing written", put, del)
	}
	ifs[0].Master = 3        // the CNI made the bridge its master
	ifs[2] = Iface{Index: 2} // nothing left to say
	ifs = ifs[:4]            // the tunnel gone
	put, del = ifaceChanges(have, ifs)
	if len(put) != 1 || put[4] != (bpf.LbIface{Master: 3, Flags: ifacePartial}) || !slices.Equal(del, []uint32{2, 11}) {
		t.Fatalf("a master set, a link gone, one with nothing to say: put %v, delete %v; want pb_ifaces[4] with master 3 alone, and 2 and 11 deleted", put, del)
	}
}
