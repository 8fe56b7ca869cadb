// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/desired"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/maps/mapsfake"
)

// IPv6 addresses: 2001:2::/48 (RFC 5180's benchmarking range), VIPs at
// 2001:2::1x, backends at 2001:2::n:2.
const (
	vip6a = "2001:2::10"
	vip6b = "2001:2::11"
	be6A  = "[2001:2::1:2]:8080"
	be6B  = "[2001:2::2:2]:8080"
	be6C  = "[2001:2::3:2]:8080"
)

// wantEntries checks the kernel's pb_services entry and pb_backends
// entries of a service, byte for byte as the datapath reads them.
func (e *env) wantEntries(spec desired.Service) {
	e.t.Helper()
	fam := pbmaps.FamilyIPv4
	if spec.Key.VIP.Is6() {
		fam = pbmaps.FamilyIPv6
	}
	s := e.service(spec.Key)
	found := false
	for k, v := range e.f.PbServices {
		if v.Id != s.ID {
			continue
		}
		found = true
		if k.Family != fam || k.Vip.Bytes != pbmaps.Addr16(spec.Key.VIP) || pbmaps.Port(k.Port) != spec.Key.Port ||
			k.Proto != uint8(spec.Key.Protocol) {
			e.t.Errorf("service %s: pb_services key %+v, want family %d, vip %v", spec.Name, k, fam, spec.Key.VIP)
		}
		if fam == pbmaps.FamilyIPv6 && k.Vip.Bytes != spec.Key.VIP.As16() {
			e.t.Errorf("service %s: vip bytes %v, want the address's 16 bytes", spec.Name, k.Vip.Bytes)
		}
	}
	if !found {
		e.t.Errorf("service %s (%d): no pb_services entry", spec.Name, s.ID)
	}
	for _, id := range s.Backends {
		kb := e.f.PbBackends[id]
		b, _ := e.r.Backend(id)
		got := netip.AddrPortFrom(pbmaps.AddrFromFamily(kb.Family, kb.Addr.Bytes), pbmaps.Port(kb.Port))
		if kb.Family != fam || got != b.Addr || kb.SvcId != s.ID {
			e.t.Errorf("service %s: pb_backends[%d] = %+v (%s), want %s of family %d", spec.Name, id, kb, got, b.Addr, fam)
		}
	}
	if !e.f.PbVIPSlots[pbmaps.VIPSlot(spec.Key.VIP)] {
		e.t.Errorf("service %s: VIP slot %d not marked", spec.Name, pbmaps.VIPSlot(spec.Key.VIP))
	}
}

// An IPv6 service goes through the reconciler as an IPv4 one does: its
// entries carry family 6 and the addresses' sixteen bytes, its VIP slot is
// the folded address's, ejection and probation work on it, a restarted
// agent adopts it unchanged, and removing it deletes its family-6 key.
func TestIPv6Service(t *testing.T) {
	e := newEnv(t)
	web6 := svc("web6", vip6a, 80, epn(be6A, "a"), epn(be6B, "b"), epn(be6C, "c"))
	e.apply(web6)
	s := e.service(web6.Key)
	a, b, c := e.bid(web6.Key, be6A), e.bid(web6.Key, be6B), e.bid(web6.Key, be6C)
	e.program(s.ID, []uint32{a, b, c}, nil, false)
	e.prepare()
	e.checkKernel()
	e.wantEntries(web6)
	if got, want := e.f.NonZeroPorts(), map[uint16]uint8{80: pbmaps.PortVIP, 8080: pbmaps.PortBackend}; !mapsEqual(got, want) {
		t.Errorf("pb_ports = %v, want %v", got, want)
	}
	if got := e.liveTable(web6.Key); !slices.Equal(got, e.wantTable(testTableSize, []uint32{a, b, c})) {
		t.Errorf("live table %v is not Maglev's over the three endpoints", got)
	}

	// c ejected, then on probation.
	e.program(s.ID, []uint32{a, b}, nil, false)
	e.wantKernelState(c, pbmaps.BackendEjected, 0)
	e.wantUnreachable(c)
	e.program(s.ID, []uint32{a, b}, []uint32{c}, false)
	e.wantKernelState(c, pbmaps.BackendProbation, ProbeGrants)
	e.checkKernel()
	e.f.TakeOps()

	// Restart: the pinned entries decode to the same key and endpoints.
	e.clk.Step(time.Minute)
	e.restart()
	if ops := e.f.TakeOps(); len(ops) != 0 {
		t.Errorf("New wrote %s", opsString(ops))
	}
	want := map[desired.Key]map[netip.AddrPort]uint32{web6.Key: {mustAP(be6A): a, mustAP(be6B): b, mustAP(be6C): c}}
	if got := e.r.Adopted(); !adoptedEqual(got, want) {
		t.Errorf("Adopted() = %v, want %v", got, want)
	}
	if changes := e.apply(web6); len(changes) != 0 {
		t.Errorf("first Apply after the restart: changes %+v", changes)
	}
	if ops := e.f.TakeOps(); len(ops) != 0 {
		t.Errorf("first Apply after the restart wrote %s", opsString(ops))
	}
	e.program(s.ID, []uint32{a, b}, []uint32{c}, false)
	e.checkKernel()
	e.wantEntries(web6)

	// An endpoint leaves, another comes.
	web6.Endpoints = []desired.Endpoint{ep(be6A), ep(be6B), ep("[2001:2::4:2]:9090")}
	ch := e.apply(web6)
	if len(ch) != 1 || !slices.Equal(ch[0].Retired, []uint32{c}) {
		t.Fatalf("changes %+v, want c retired", ch)
	}
	d := e.bid(web6.Key, "[2001:2::4:2]:9090")
	e.program(s.ID, []uint32{a, b, d}, nil, false)
	e.checkKernel()
	e.wantEntries(web6)
	if got := e.f.PbBackends[c]; pbmaps.BackendState(got.State) != pbmaps.BackendRemoved || got.Family != pbmaps.FamilyIPv6 {
		t.Errorf("retired backend %d: %+v, want removed and still IPv6 (its flows' replies)", c, got)
	}

	// Removal deletes the family-6 key.
	e.apply()
	if len(e.f.PbServices) != 0 {
		t.Errorf("pb_services after the removal: %v", e.f.PbServices)
	}
	e.checkKernel()
}

// An IPv4 and an IPv6 service on the same port and protocol are two
// services: two keys that differ by family and VIP, two ids, one VIP port
// and two VIP slots; each service's flows go to its own family's
// backends; removing one leaves the other untouched, and conntrack's
// report of an IPv6 VIP keeps its slot marked.
func TestDualStackServices(t *testing.T) {
	e := newEnv(t)
	web4 := svc("web4", vip1, 80, ep("198.19.1.1:8080"), ep("198.19.1.2:8080"))
	web6 := svc("web6", vip6a, 80, ep(be6A), ep(be6B))
	// The same addresses, UDP: a third and fourth key.
	dns4 := svc("dns4", vip1, 80, ep("198.19.1.1:8080"))
	dns4.Key.Protocol = desired.UDP
	dns6 := svc("dns6", vip6a, 80, ep(be6A))
	dns6.Key.Protocol = desired.UDP
	all := []desired.Service{web4, web6, dns4, dns6}
	e.apply(all...)
	ids := map[uint32]bool{}
	for _, spec := range all {
		s := e.service(spec.Key)
		ids[s.ID] = true
		e.program(s.ID, s.Backends, nil, false)
	}
	if len(ids) != len(all) {
		t.Fatalf("%d service ids for %d services", len(ids), len(all))
	}
	e.prepare()
	e.checkKernel()
	for _, spec := range all {
		e.wantEntries(spec)
	}
	if len(e.f.PbServices) != 4 {
		t.Errorf("pb_services has %d entries, want 4", len(e.f.PbServices))
	}
	if got, want := e.f.NonZeroPorts(), map[uint16]uint8{80: pbmaps.PortVIP, 8080: pbmaps.PortBackend}; !mapsEqual(got, want) {
		t.Errorf("pb_ports = %v, want %v", got, want)
	}
	slot4, slot6 := pbmaps.VIPSlot(web4.Key.VIP), pbmaps.VIPSlot(web6.Key.VIP)
	if slot4 == slot6 {
		t.Fatalf("test addresses share VIP slot %d", slot4)
	}
	if want := map[uint32]bool{slot4: true, slot6: true}; !mapsEqualBool(e.f.PbVIPSlots, want) {
		t.Errorf("pb_vip_slots = %v, want %v", e.f.PbVIPSlots, want)
	}
	// The datapath's pick, on each key, lands on that service's backends.
	for _, spec := range all {
		s := e.service(spec.Key)
		for h := range uint32(64) {
			id, _, ok := e.f.Pick(keyOf(spec.Key), h*2654435761+7, false)
			if !ok || !slices.Contains(s.Backends, id) {
				t.Fatalf("%s: hash %d picked backend %d (ok %v), not one of %v", spec.Name, h, id, ok, s.Backends)
			}
			if b, _ := e.r.Backend(id); b.Addr.Addr().Is4() != spec.Key.VIP.Is4() {
				t.Fatalf("%s: picked %s", spec.Name, b.Addr)
			}
		}
	}

	// The IPv4 services go; the IPv6 ones stay as they were.
	s6, d6 := e.service(web6.Key), e.service(dns6.Key)
	live6 := slices.Clone(e.liveTable(web6.Key))
	e.f.TakeOps()
	e.apply(web6, dns6)
	ops := e.f.TakeOps()
	for _, s := range []*Service{s6, d6} {
		if n := count(ops, func(o op) bool {
			return o.ID == s.ID && slices.Contains([]string{opUpsertService, opDeleteService, opFillTable, opSetFallback}, o.Kind) ||
				slices.Contains(s.Backends, o.ID) && slices.Contains([]string{opSetBackend, opClearBackend}, o.Kind)
		}); n != 0 {
			t.Errorf("removing the IPv4 services touched %s: %s", s.Spec.Name, opsString(ops))
		}
	}
	if _, ok := e.f.PbServices[keyOf(web4.Key)]; ok {
		t.Error("web4 still in pb_services")
	}
	if _, ok := e.f.PbServices[keyOf(web6.Key)]; !ok {
		t.Error("web6 gone from pb_services")
	}
	if got := e.liveTable(web6.Key); !slices.Equal(got, live6) {
		t.Error("web6's live table changed")
	}
	e.checkKernel()

	// Past the cooldown, the IPv6 services removed too: a live flow to
	// the IPv6 VIP (as the conntrack sweep reports it) keeps its slot.
	e.apply()
	e.clk.Step(testCooldown)
	vip6 := netip.AddrPortFrom(web6.Key.VIP, 80)
	// (Two walks in a row must miss a flow before its ids and VIP are let
	// go: see free.)
	flow6 := InUse{Services: map[uint32]bool{s6.ID: true}, VIPs: map[netip.AddrPort]bool{vip6: true}}
	e.sweep(flow6)
	e.sweep(flow6)
	if !e.f.PbVIPSlots[slot6] || e.f.PbVIPSlots[slot4] {
		t.Errorf("slots: IPv6 VIP's %v (want marked), IPv4 VIP's %v (want clear)", e.f.PbVIPSlots[slot6], e.f.PbVIPSlots[slot4])
	}
	e.sweep(InUse{})
	if !e.f.PbVIPSlots[slot6] {
		t.Error("the IPv6 VIP's slot cleared after one walk missed its flow")
	}
	e.sweep(InUse{})
	if e.f.PbVIPSlots[slot6] || e.f.PbVIPSlots[slot4] {
		t.Errorf("slots still marked after every flow ended: %v", e.f.PbVIPSlots)
	}
	e.checkKernel()
}

func mapsEqualBool(a, b map[uint32]bool) bool {
	n := 0
	for k, v := range a {
		if v {
			n++
			if !b[k] {
				return false
			}
		}
	}
	return n == len(b)
}

// Pinned entries of a family the agent does not know are not adopted:
// such a service is deleted under its own key (a key rebuilt from a
// decoded address would miss it), such a backend cleared.
func TestAdoptionOfUnknownFamilies(t *testing.T) {
	f := mapsfake.New(t)
	kWeb := pbmaps.ServiceKey(netip.MustParseAddr(vip6a), 80, uint8(desired.TCP))
	kOdd := pbmaps.ServiceKey(netip.MustParseAddr(vip6b), 80, uint8(desired.TCP))
	kOdd.Family = 10
	f.PbServices[kWeb] = bpf.LbSvcValue{Id: 5}
	f.PbServices[kOdd] = bpf.LbSvcValue{Id: 6}
	f.PbBackends[7] = pbmaps.NewBackend(mustAP(be6A), 5, pbmaps.BackendActive, 0)
	odd := pbmaps.NewBackend(mustAP(be6B), 5, pbmaps.BackendActive, 0)
	odd.Family = 2
	f.PbBackends[8] = odd
	f.Check = nil

	r, err := New(f, Options{MaxServices: 64, MaxBackends: 256, TableSize: testTableSize,
		Cooldown: testCooldown, Clock: testingclock.NewFakeClock(t0), Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ops := f.TakeOps()
	if index(ops, is(opDeleteService, 6)) < 0 || index(ops, is(opClearBackend, 8)) < 0 {
		t.Errorf("unknown families not dropped: %s", opsString(ops))
	}
	if _, ok := f.PbServices[kOdd]; ok {
		t.Error("the service of family 10 is still in pb_services")
	}
	if _, ok := r.Service(6); ok {
		t.Error("the service of family 10 was adopted")
	}
	if _, ok := r.Backend(8); ok {
		t.Error("the backend of family 2 was adopted")
	}
	want := map[desired.Key]map[netip.AddrPort]uint32{
		{VIP: netip.MustParseAddr(vip6a), Port: 80, Protocol: desired.TCP}: {mustAP(be6A): 7},
	}
	if got := r.Adopted(); !adoptedEqual(got, want) {
		t.Errorf("Adopted() = %v, want %v", got, want)
	}
}
