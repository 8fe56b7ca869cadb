// SPDX-License-Identifier: Apache-2.0

// Package maps is typed access to the datapath's pinned BPF maps: it turns
// Go values (netip addresses, backend states, Maglev tables) into the C
// layouts of bpf/include/pb_structs.h and back. It holds no policy; the
// reconciler decides what to write.
package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
)

// BackendState is enum pb_backend_state (bpf/include/pb_consts.h), as
// stored in the __u8 state of struct backend. The values come from the
// bpf2go-generated constants, so they cannot drift from the C enum.
type BackendState uint8

const (
	BackendActive    = BackendState(bpf.LbPbBackendStatePB_BE_ACTIVE)
	BackendProbation = BackendState(bpf.LbPbBackendStatePB_BE_PROBATION)
	BackendEjected   = BackendState(bpf.LbPbBackendStatePB_BE_EJECTED)
	BackendRemoved   = BackendState(bpf.LbPbBackendStatePB_BE_REMOVED)
)

func (s BackendState) String() string {
	switch s {
	case BackendActive:
		return "active"
	case BackendProbation:
		return "probation"
	case BackendEjected:
		return "ejected"
	case BackendRemoved:
		return "removed"
	}
	return fmt.Sprintf("state(%d)", uint8(s))
}

// pb_services flags.
const (
	// ServiceRetryRefused: a refused new flow of the service gets one more
	// try on another backend.
	ServiceRetryRefused = uint32(bpf.LbPbSvcFlagPB_SVC_F_RETRY_REFUSED)
	// ServiceQuietData: the datapath reports no FIRST_DATA for the
	// service's flows (the agent's verdict does not wait for data).
	ServiceQuietData = uint32(bpf.LbPbSvcFlagPB_SVC_F_QUIET_DATA)
	// ServiceQuietEnd: no FLOW_END for a flow whose verdict is known (its
	// SYN-ACK seen, and its first data unless ServiceQuietData).
	ServiceQuietEnd = uint32(bpf.LbPbSvcFlagPB_SVC_F_QUIET_END)
	// ServiceTakenOver: the service was kube-proxy's until lately: a TCP
	// packet of a flow the datapath has no entry for is one of
	// kube-proxy's flows, and passes to it.
	ServiceTakenOver = uint32(bpf.LbPbSvcFlagPB_SVC_F_TAKEN_OVER)
	// ServiceHandedBack: the service is no longer served: new flows pass
	// to kube-proxy, the flows here finish.
	ServiceHandedBack = uint32(bpf.LbPbSvcFlagPB_SVC_F_HANDED_BACK)
)

// Values of pb_ports bits, PB_AF_*, pb_config flags and event types.
const (
	PortVIP     uint8 = 0x1
	PortBackend uint8 = 0x2

	FamilyIPv4 uint8 = 4 // PB_AF_INET
	FamilyIPv6 uint8 = 6 // PB_AF_INET6

	configRedirect    uint32 = 0x1 // PB_CFG_REDIRECT
	configReversePath uint32 = 0x2 // PB_CFG_RPF
	configDrain       uint32 = 0x4 // PB_CFG_DRAIN

	ifacePartial uint32 = 0x1 // PB_IF_PARTIAL
	ifaceDecap   uint32 = 0x2 // PB_IF_DECAP
	ifaceIPIP    uint32 = 0x4 // PB_IF_IPIP
)

// Flow state bits of pb_ct_value.flags (PB_CT_*).
const (
	CTEstablished uint32 = 0x0001
	CTBackendData uint32 = 0x0002
	CTFinFwd      uint32 = 0x0004
	CTFinRev      uint32 = 0x0008
	CTClosed      uint32 = 0x0010
	CTTimeoutSeen uint32 = 0x0020
	CTProbe       uint32 = 0x0040
	CTMidstream   uint32 = 0x0080
	CTClientAcked uint32 = 0x0100 // forward entry: the client finished the handshake
	CTRescued     uint32 = 0x0400 // refused, and the RST kept from the client
	CTRetry       uint32 = 0x0800 // a rescued flow's second try
	CTMoved       uint32 = 0x8000 // reverse entry of the backend an unanswered flow was moved off
)

// ReplyKey is the pb_ct key of a TCP flow's reverse entry: as the backend's
// replies to the client carry it. Its family is the client's (a flow's
// addresses are all of one family).
func ReplyKey(backend, client netip.AddrPort) bpf.LbCtKey {
	return tcpKey(backend, client, DirRev, Family(client.Addr()))
}

// RequestKey is the pb_ct key of a TCP flow's forward entry: as the
// client's packets to the VIP carry it.
func RequestKey(client, vip netip.AddrPort) bpf.LbCtKey {
	return tcpKey(client, vip, DirFwd, Family(client.Addr()))
}

// tcpKey is the pb_ct key of a TCP packet from src to dst.
func tcpKey(src, dst netip.AddrPort, dir, family uint8) bpf.LbCtKey {
	var k bpf.LbCtKey
	k.Src.Bytes = Addr16(src.Addr())
	k.Dst.Bytes = Addr16(dst.Addr())
	k.Sport, k.Dport = Port(src.Port()), Port(dst.Port())
	k.Proto = 6 // TCP
	k.Dir = dir
	k.Family = family
	return k
}

// Conntrack directions.
const (
	DirFwd uint8 = 0
	DirRev uint8 = 1
)

// Maps wraps the loaded maps of one datapath.
type Maps struct {
	m     *bpf.LbMaps
	inner *ebpf.MapSpec
	ncpu  int

	t    tables
	tr   *Trips
	keys []byte // pb_svc_keys, memory-mapped (svckeys.go); nil read-only
	// The conntrack sweep's program (expire.go); nil: system calls.
	expMu     sync.Mutex
	exp       *ctExpirer
	sweep     *ebpf.Program // pb_ct_sweep_run (sweep.go); nil: the agent's copy
	sweepMark uint16        // the last kernel sweep's mark
	// sweepFresh: no kernel sweep has cleared the table's marks since
	// UseCTSweep; the next one does first (its walk 0).
	sweepFresh bool
	// pb_stats_reset_run (stats.go), and pb_stats_reset, its one buffer.
	resetMu sync.Mutex
	reset   *ebpf.Program
}

// New wraps loaded maps. inner is the Maglev inner map template
// (pb_maglev's InnerMap spec) used to create new tables.
func New(m *bpf.LbMaps, inner *ebpf.MapSpec) (*Maps, error) {
	n, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, fmt.Errorf("maps: %w", err)
	}
	mm := &Maps{m: m, inner: inner.Copy(), ncpu: n}
	if mm.tr, err = mm.OpenTrips(); err != nil {
		return nil, fmt.Errorf("maps: %w", err)
	}
	if err := mm.openServiceKeys(); err != nil {
		mm.tr.Close()
		mm.closeServiceKeys()
		return nil, fmt.Errorf("maps: %w", err)
	}
	mm.t.init()
	return mm, nil
}

// OpenReadOnly wraps maps opened read-only (datapath.OpenPinned) for
// reading: nothing is memory-mapped, the kernel-trip and circuit-breaker
// arrays are read by lookups, the trip writers do nothing, and every other
// writer fails with the kernel's EPERM.
func OpenReadOnly(m *bpf.LbMaps) (*Maps, error) {
	n, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, fmt.Errorf("maps: %w", err)
	}
	mm := &Maps{m: m, ncpu: n}
	mm.t.init()
	return mm, nil
}

// Close releases the tables' handles and mappings (the tables stay: the
// outer maps hold them).
func (m *Maps) Close() {
	m.t.close()
	if m.tr != nil {
		m.tr.Close()
	}
	m.closeServiceKeys()
	m.closeCTExpire()
}

// SynSlot is the pb_syns_v2 slot of a client's SYN: syn_slot in bpf/lb.c
// (PB_SYN_SLOT_BITS, PB_SYN_PORT_MUL, and the VIP slots' multiplier), for
// either family.
func SynSlot(client netip.Addr, port uint16) uint32 {
	return (fold(client)*vipSlotMul ^ uint32(port)*synPortMul) >> (32 - synSlotBits)
}

// fold is addr_fold in bpf/lb.c, in host order: an IPv4 address's word,
// an IPv6 address's four words XORed.
func fold(a netip.Addr) uint32 {
	switch Family(a) {
	case FamilyIPv4:
		v4 := a.As4()
		return binary.BigEndian.Uint32(v4[:])
	case FamilyIPv6:
		v6 := a.As16()
		return binary.BigEndian.Uint32(v6[0:]) ^ binary.BigEndian.Uint32(v6[4:]) ^
			binary.BigEndian.Uint32(v6[8:]) ^ binary.BigEndian.Uint32(v6[12:])
	}
	return 0
}

const (
	synSlotBits = 16
	synPortMul  = 0x85ebca6b
)

// SetServiceTrip writes a service's kernel-trip settings and budget (see
// Trips.SetService).
func (m *Maps) SetServiceTrip(id uint32, s TripSettings, budget int64) {
	if m.tr != nil {
		m.tr.SetService(id, s, budget)
	}
}

// ResetServiceTrip zeroes a fresh or recycled service id's trip entry.
func (m *Maps) ResetServiceTrip(id uint32) {
	if m.tr != nil {
		m.tr.ResetService(id)
	}
}

// ServiceTrip reads a service's kernel-trip entry.
func (m *Maps) ServiceTrip(id uint32) bpf.LbSvcTrip {
	if m.tr == nil {
		var v bpf.LbSvcTrip
		_ = m.m.PbSvcTrip.Lookup(id, &v)
		return v
	}
	return m.tr.Service(id)
}

// ResetBackendTrip starts a backend's kernel streak afresh.
func (m *Maps) ResetBackendTrip(id uint32) {
	if m.tr != nil {
		m.tr.ResetBackend(id)
	}
}

// BackendTrip reads a backend's kernel streak.
func (m *Maps) BackendTrip(id uint32) bpf.LbBeTrip {
	if m.tr == nil {
		var v bpf.LbBeTrip
		_ = m.m.PbBeTrip.Lookup(id, &v)
		return v
	}
	return m.tr.Backend(id)
}

// InflightCounts reads a service's and a backend's circuit-breaker counts
// by lookups (the agent's own reads go through the mapping, OpenInflight).
func (m *Maps) InflightCounts(svcID, backendID uint32) (svc, be int64, err error) {
	var s, b bpf.LbInflight
	if err := m.m.PbSvcInflight.Lookup(svcID, &s); err != nil {
		return 0, 0, fmt.Errorf("pb_svc_inflight[%d]: %w", svcID, err)
	}
	if err := m.m.PbBeInflight.Lookup(backendID, &b); err != nil {
		return 0, 0, fmt.Errorf("pb_be_inflight[%d]: %w", backendID, err)
	}
	return s.Count, b.Count, nil
}

// Raw exposes the underlying maps for tests and tools.
func (m *Maps) Raw() *bpf.LbMaps { return m.m }

// Family is a's PB_AF_* value: FamilyIPv4 for an IPv4 address (and an
// IPv4-mapped IPv6 one, which Addr16 stores as the IPv4 address it maps:
// on the wire it is an IPv4 packet's), FamilyIPv6 for any other IPv6
// address, 0 for the zero Addr (no family: the datapath matches nothing
// with it, and pb_backends counts an entry of family 0 as unused).
func Family(a netip.Addr) uint8 {
	switch {
	case a.Is4() || a.Is4In6():
		return FamilyIPv4
	case a.Is6():
		return FamilyIPv6
	}
	return 0
}

// Addr16 is an address as a union addr's bytes: for IPv4 (Family
// FamilyIPv4) the four address bytes, then zeroes; for IPv6 the sixteen
// bytes in network order; zeroes for the zero Addr. An IPv6 zone is not
// kept (config rejects zones).
func Addr16(a netip.Addr) [16]uint8 {
	var b [16]uint8
	switch Family(a) {
	case FamilyIPv4:
		v4 := a.As4()
		copy(b[:], v4[:])
	case FamilyIPv6:
		b = a.As16()
	}
	return b
}

// AddrFrom16 is the inverse of Addr16 for IPv4: the first four bytes.
// For a key or value whose family field may be FamilyIPv6, use
// AddrFromFamily.
func AddrFrom16(b [16]uint8) netip.Addr {
	return netip.AddrFrom4([4]byte(b[:4]))
}

// AddrFromFamily is the inverse of Addr16: the address a union addr holds
// in a key or value whose family field is family. An unknown family
// (0: an unused entry) gives the zero Addr, whose IsValid is false.
func AddrFromFamily(family uint8, b [16]uint8) netip.Addr {
	switch family {
	case FamilyIPv4:
		return AddrFrom16(b)
	case FamilyIPv6:
		return netip.AddrFrom16(b)
	}
	return netip.Addr{}
}

// AddrFromV4 reads an IPv4 address from a __be32 field (as in events).
func AddrFromV4(v uint32) netip.Addr {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

// Port converts a host-order port to the __be16 field value and back.
func Port(p uint16) uint16 {
	if binary.NativeEndian.Uint16([]byte{1, 0}) == 1 {
		return bits.ReverseBytes16(p)
	}
	return p
}

// ServiceKey builds a pb_services key; its family is the VIP's.
func ServiceKey(vip netip.Addr, port uint16, proto uint8) bpf.LbSvcKey {
	var k bpf.LbSvcKey
	k.Vip.Bytes = Addr16(vip)
	k.Port = Port(port)
	k.Proto = proto
	k.Family = Family(vip)
	return k
}

// UpsertService writes a pb_services entry, its id's key first
// (pb_svc_keys: the datapath takes no value whose id is not the key's).
func (m *Maps) UpsertService(k bpf.LbSvcKey, v bpf.LbSvcValue) error {
	if m.keys != nil && !m.setServiceKey(v.Id, k) {
		return fmt.Errorf("pb_svc_keys: service id %d past the map's %d entries", v.Id, m.m.PbSvcKeys.MaxEntries())
	}
	if err := m.m.PbServices.Put(raw(&k), raw(&v)); err != nil {
		return fmt.Errorf("pb_services: put: %w", err)
	}
	return nil
}

// DeleteService removes a pb_services entry, its id's key (after it), the
// service's tables and its clients' affinity; with id 0 (no service's),
// the entry alone.
func (m *Maps) DeleteService(k bpf.LbSvcKey, id uint32) error {
	err := m.m.PbServices.Delete(k)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("pb_services: delete: %w", err)
	}
	if id == 0 {
		return nil
	}
	m.clearServiceKey(id, k)
	m.DeleteTables(id)
	return m.ForgetAffinity(id)
}

func (m *Maps) deleteOuter(outer *ebpf.Map, id uint32) {
	_ = outer.Delete(id) // absent is fine
}

// Services returns every pb_services entry.
func (m *Maps) Services() (map[bpf.LbSvcKey]bpf.LbSvcValue, error) {
	return entries[bpf.LbSvcKey, bpf.LbSvcValue](m.m.PbServices)
}

// SetBackend writes pb_backends[id]. Writing a backend ejected also
// prepares its service's fallback table, in the background, if the
// service has none: its probation will need one (see SetFallback).
func (m *Maps) SetBackend(id uint32, b bpf.LbBackend) error {
	if err := m.m.PbBackends.Put(id, raw(&b)); err != nil {
		return fmt.Errorf("pb_backends[%d]: %w", id, err)
	}
	if BackendState(b.State) == BackendEjected {
		m.prepareFallback(b.SvcId)
	}
	return nil
}

// SetBackends writes several pb_backends entries in one batch.
func (m *Maps) SetBackends(ids []uint32, vals []bpf.LbBackend) error {
	if len(ids) == 0 {
		return nil
	}
	if _, err := m.m.PbBackends.BatchUpdate(ids, vals, nil); err != nil {
		return fmt.Errorf("pb_backends: batch of %d: %w", len(ids), err)
	}
	return nil
}

// Backend reads pb_backends[id].
func (m *Maps) Backend(id uint32) (bpf.LbBackend, error) {
	var b bpf.LbBackend
	err := m.m.PbBackends.Lookup(id, &b)
	return b, err
}

// ClearBackend zeroes pb_backends[id] (an array entry cannot be deleted).
func (m *Maps) ClearBackend(id uint32) error {
	return m.SetBackend(id, bpf.LbBackend{})
}

// Backends returns the used entries of pb_backends (those with a family).
func (m *Maps) Backends() (map[uint32]bpf.LbBackend, error) {
	out := map[uint32]bpf.LbBackend{}
	err := EachBatch(m.m.PbBackends, 8192, func(keys []uint32, vals []bpf.LbBackend) error {
		for i := range keys {
			if vals[i].Family != 0 {
				out[keys[i]] = vals[i]
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("pb_backends: %w", err)
	}
	return out, nil
}

// NewBackend builds a pb_backends value; its family is the address's.
func NewBackend(addr netip.AddrPort, svcID uint32, state BackendState, grants int32) bpf.LbBackend {
	var b bpf.LbBackend
	b.Addr.Bytes = Addr16(addr.Addr())
	b.Port = Port(addr.Port())
	b.Family = Family(addr.Addr())
	b.State = uint8(state)
	b.SvcId = svcID
	b.ProbeGrants = grants
	return b
}

// SetPorts makes pb_ports hold exactly roles (port -> PB_PORT_* bits),
// writing only entries that change.
func (m *Maps) SetPorts(old, roles map[uint16]uint8) error {
	for p := range old {
		if _, ok := roles[p]; !ok {
			if err := m.m.PbPorts.Put(uint32(p), uint8(0)); err != nil {
				return fmt.Errorf("pb_ports[%d]: %w", p, err)
			}
		}
	}
	for p, r := range roles {
		if o, ok := old[p]; ok && o == r {
			continue
		}
		if err := m.m.PbPorts.Put(uint32(p), r); err != nil {
			return fmt.Errorf("pb_ports[%d]: %w", p, err)
		}
	}
	return nil
}

// Ports reads every non-zero pb_ports entry.
func (m *Maps) Ports() (map[uint16]uint8, error) {
	out := map[uint16]uint8{}
	err := nonZeroBytes(m.m.PbPorts, func(k uint32, v uint8) { out[uint16(k)] = v })
	if err != nil {
		return nil, fmt.Errorf("pb_ports: %w", err)
	}
	return out, nil
}

// nonZeroBytes reads an array of __u8 in one batch and hands each non-zero
// entry to f.
func nonZeroBytes(m *ebpf.Map, f func(k uint32, v uint8)) error {
	n := int(m.MaxEntries())
	keys := make([]uint32, n)
	vals := make([]uint8, n)
	var cursor ebpf.MapBatchCursor
	got, err := m.BatchLookup(&cursor, keys, vals, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return err
	}
	for i := range got {
		if vals[i] != 0 {
			f(keys[i], vals[i])
		}
	}
	return nil
}

// VIPSlot is addr's pb_vip_slots index: the datapath's vip_slot_marked
// hash (PB_VIP_SLOT_*), on the address in host byte order. An IPv6
// address is folded first: the XOR of its four 32-bit words, each read
// big-endian, takes the IPv4 address's place. (The zero Addr gets slot 0.)
func VIPSlot(addr netip.Addr) uint32 {
	return (fold(addr) * vipSlotMul) >> (32 - vipSlotBits)
}

// PB_VIP_SLOT_BITS and PB_VIP_SLOT_MUL; VIPSlots is pb_vip_slots' size.
const (
	vipSlotBits = 16
	vipSlotMul  = 0x9e3779b1
	VIPSlots    = 1 << vipSlotBits
)

// SetVIPSlots marks the slots in want and clears those only in old (what
// pb_vip_slots holds now), in one batch.
func (m *Maps) SetVIPSlots(old, want map[uint32]bool) error {
	var keys []uint32
	var vals []uint8
	for k := range old {
		if !want[k] {
			keys, vals = append(keys, k), append(vals, 0)
		}
	}
	for k := range want {
		if !old[k] {
			keys, vals = append(keys, k), append(vals, 1)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	if _, err := m.m.PbVipSlots.BatchUpdate(keys, vals, nil); err != nil {
		return fmt.Errorf("pb_vip_slots: %w", err)
	}
	return nil
}

// VIPSlots reads the marked pb_vip_slots entries.
func (m *Maps) VIPSlots() (map[uint32]bool, error) {
	out := map[uint32]bool{}
	if err := nonZeroBytes(m.m.PbVipSlots, func(k uint32, _ uint8) { out[k] = true }); err != nil {
		return nil, fmt.Errorf("pb_vip_slots: %w", err)
	}
	return out, nil
}

// Config is pb_config_v2[0]: the datapath's runtime settings.
type Config struct {
	// Redirect: forward with bpf_fib_lookup and XDP_REDIRECT where the
	// egress interface takes redirected frames (pb_redirect).
	Redirect bool
	// ReversePath: a reply decides an outcome only if it arrived where the
	// node routes its sender (the strict reverse-path rule).
	ReversePath bool
	// HashSeed is the flow hash's secret seed.
	HashSeed uint32
	// SYNRetransMinAge: a pending flow's SYN seen again sooner is a
	// duplicate, not the client's retransmission (0: the datapath's 200 ms).
	SYNRetransMinAge time.Duration
	// Heartbeat is the agent's last heartbeat, in CLOCK_MONOTONIC
	// nanoseconds (the kernel's bpf_ktime_get_ns).
	Heartbeat uint64
	// DeadMan: once the heartbeat is older, new flows go to kube-proxy
	// (0: never).
	DeadMan time.Duration
	// Drain: the install is going; new flows go to kube-proxy, the flows
	// here finish.
	Drain bool
}

// HandedOver says why the datapath passes new flows to kube-proxy at
// monotonic time now (CLOCK_MONOTONIC nanoseconds), as lb.c's handed_over()
// decides: "uninstalling" (Drain), "agent-away" (the heartbeat older than
// DeadMan), or "" (the datapath takes them).
func (c Config) HandedOver(now uint64) string {
	switch {
	case c.Drain:
		return "uninstalling"
	case c.DeadMan > 0 && c.Heartbeat != 0 && int64(now-c.Heartbeat) > c.DeadMan.Nanoseconds():
		return "agent-away"
	}
	return ""
}

// SetConfig writes pb_config_v2[0].
func (m *Maps) SetConfig(c Config) error {
	v := bpf.LbConfig{HashSeed: c.HashSeed, SynRetransMinNs: uint64(c.SYNRetransMinAge.Nanoseconds()),
		HeartbeatNs: c.Heartbeat, DeadManNs: uint64(c.DeadMan.Nanoseconds())}
	if c.Redirect {
		v.Flags |= configRedirect
	}
	if c.ReversePath {
		v.Flags |= configReversePath
	}
	if c.Drain {
		v.Flags |= configDrain
	}
	if err := m.m.PbConfigV2.Put(uint32(0), v); err != nil {
		return fmt.Errorf("pb_config_v2: %w", err)
	}
	return nil
}

// Config reads pb_config_v2[0] (a restarted agent keeps the hash seed the
// datapath has).
func (m *Maps) Config() (Config, error) {
	var v bpf.LbConfig
	if err := m.m.PbConfigV2.Lookup(uint32(0), &v); err != nil {
		return Config{}, fmt.Errorf("pb_config_v2: %w", err)
	}
	return Config{Redirect: v.Flags&configRedirect != 0, ReversePath: v.Flags&configReversePath != 0,
		HashSeed: v.HashSeed, SYNRetransMinAge: time.Duration(v.SynRetransMinNs),
		Heartbeat: v.HeartbeatNs, DeadMan: time.Duration(v.DeadManNs), Drain: v.Flags&configDrain != 0}, nil
}

// SetRedirect makes pb_redirect hold exactly ifindexes.
func (m *Maps) SetRedirect(ifindexes []uint32) error {
	want := map[uint32]bool{}
	for _, i := range ifindexes {
		want[i] = true
	}
	var k, v uint32
	var stale []uint32
	it := m.m.PbRedirect.Iterate()
	for it.Next(&k, &v) {
		if !want[k] {
			stale = append(stale, k)
		}
	}
	for _, k := range stale {
		_ = m.m.PbRedirect.Delete(k)
	}
	for i := range want {
		if err := m.m.PbRedirect.Put(i, i); err != nil {
			return fmt.Errorf("pb_redirect[%d]: %w", i, err)
		}
	}
	return nil
}

// PutPersisted writes an endpoint's persisted accrual state,
// pb_health[id] (the map's name predates the word: it holds what accrual
// keeps across a restart, not a health check).
func (m *Maps) PutPersisted(id uint32, h bpf.LbEndpointHealth) error {
	if err := m.m.PbHealth.Put(id, raw(&h)); err != nil {
		return fmt.Errorf("pb_health[%d]: %w", id, err)
	}
	return nil
}

// DeletePersisted removes pb_health[id]; absence is not an error.
func (m *Maps) DeletePersisted(id uint32) error {
	if err := m.m.PbHealth.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("pb_health[%d]: %w", id, err)
	}
	return nil
}

// entries reads every entry of a hash map.
func entries[K comparable, V any](hm *ebpf.Map) (map[K]V, error) {
	out := map[K]V{}
	var k K
	var v V
	it := hm.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	return out, it.Err()
}

// Persisted reads every pb_health entry.
func (m *Maps) Persisted() (map[uint32]bpf.LbEndpointHealth, error) {
	return entries[uint32, bpf.LbEndpointHealth](m.m.PbHealth)
}

// SetServiceBackends writes a service's list of active backends for the
// circuit breaker's scan (pb_svc_backends), removing entries past the new
// end. The service's n_backends is written separately, after.
func (m *Maps) SetServiceBackends(svcID uint32, old, ids []uint32) error {
	var keys []bpf.LbSvcBackendKey
	var vals []uint32
	for i, id := range ids {
		if i < len(old) && old[i] == id {
			continue
		}
		keys = append(keys, bpf.LbSvcBackendKey{SvcId: svcID, Idx: uint32(i)})
		vals = append(vals, id)
	}
	if len(keys) > 0 {
		if _, err := m.m.PbSvcBackends.BatchUpdate(keys, vals, nil); err != nil {
			return fmt.Errorf("pb_svc_backends[%d]: %w", svcID, err)
		}
	}
	for i := len(ids); i < len(old); i++ {
		k := bpf.LbSvcBackendKey{SvcId: svcID, Idx: uint32(i)}
		if err := m.m.PbSvcBackends.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("pb_svc_backends[%d/%d]: %w", svcID, i, err)
		}
	}
	return nil
}

// ServiceBackends reads the first n entries of a service's list.
func (m *Maps) ServiceBackends(svcID uint32, n uint32) ([]uint32, error) {
	out := make([]uint32, 0, n)
	for i := range n {
		var id uint32
		if err := m.m.PbSvcBackends.Lookup(bpf.LbSvcBackendKey{SvcId: svcID, Idx: i}, &id); err != nil {
			return nil, fmt.Errorf("pb_svc_backends[%d/%d]: %w", svcID, i, err)
		}
		out = append(out, id)
	}
	return out, nil
}

// Iface is what the datapath knows of an interface it is attached to
// (pb_ifaces).
type Iface struct {
	Index uint32
	// Partial: a local sender may hand the datapath a packet whose L4
	// checksum the device is still to finish (a pod's veth).
	Partial bool
	// Master is the interface's master (a bridge port's bridge), 0: none:
	// the node routes a bridged pod through the bridge, so its replies pass
	// the reverse-path check on the port when the route names the bridge.
	Master uint32
	// Decap: a node's uplink, where IPIP packets are a pod network's tunnel
	// traffic, whose inner packets the datapath parses.
	Decap bool
	// IPIP: an IPIP tunnel device (not attached): a route through it names
	// the node a tunnelled reply must come from.
	IPIP bool
}

// SetIfaces makes pb_ifaces hold exactly ifs (those with something to
// say: a partial checksum or a master), writing only the entries that
// change: the agent calls it at every change of the node's links, and a
// hash map's replaced entry races the datapath's lookups of it (one
// racing can miss the key, or read the entry reused for another), so
// rewriting unchanged entries would expose every pod's on each pod's start.
func (m *Maps) SetIfaces(ifs []Iface) error {
	have, err := entries[uint32, bpf.LbIface](m.m.PbIfaces)
	if err != nil {
		return fmt.Errorf("pb_ifaces: %w", err)
	}
	put, del := ifaceChanges(have, ifs)
	for _, k := range del {
		_ = m.m.PbIfaces.Delete(k)
	}
	for i, v := range put {
		if err := m.m.PbIfaces.Put(i, v); err != nil {
			return fmt.Errorf("pb_ifaces[%d]: %w", i, err)
		}
	}
	return nil
}

// ifaceChanges says which pb_ifaces entries to write, and which to delete
// (sorted), for the map to go from have to what ifs say. An interface
// with nothing to say (no flag, no master) has no entry.
func ifaceChanges(have map[uint32]bpf.LbIface, ifs []Iface) (put map[uint32]bpf.LbIface, del []uint32) {
	want := map[uint32]bpf.LbIface{}
	for _, i := range ifs {
		v := bpf.LbIface{Master: i.Master}
		if i.Partial {
			v.Flags |= ifacePartial
		}
		if i.Decap {
			v.Flags |= ifaceDecap
		}
		if i.IPIP {
			v.Flags |= ifaceIPIP
		}
		if v != (bpf.LbIface{}) {
			want[i.Index] = v
		}
	}
	for k := range have {
		if _, ok := want[k]; !ok {
			del = append(del, k)
		}
	}
	slices.Sort(del)
	put = map[uint32]bpf.LbIface{}
	for k, v := range want {
		if h, ok := have[k]; !ok || h != v {
			put[k] = v
		}
	}
	return put, del
}
