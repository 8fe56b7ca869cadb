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
	"sync"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
)

// Values of enum pb_backend_state (bpf/include/pb_consts.h).
type BackendState uint8

const (
	BackendActive    BackendState = 0
	BackendProbation BackendState = 1
	BackendEjected   BackendState = 2
	BackendRemoved   BackendState = 3
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

// Values of pb_ports bits, PB_AF_*, pb_config flags and event types.
const (
	PortVIP     uint8 = 0x1
	PortBackend uint8 = 0x2

	FamilyIPv4 uint8 = 4

	ConfigRedirect uint32 = 0x1
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
)

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

	// tables caches the memory maps of recently filled Maglev tables by
	// pb_maglev key, so a refill costs a copy and no map/unmap (unmapping
	// costs a TLB shootdown on every CPU: the bulk of an ejection's work
	// otherwise). Bounded, least recently used out, so ten thousand
	// services do not keep their tables mapped into the agent.
	mu     sync.Mutex
	tables map[uint32]*mapped
	fills  map[uint32]uint32 // fills per table key, to map only tables filled again
	clock  uint64
	keys   []uint32 // 0..n-1, the slot numbers of batch fills
}

type mapped struct {
	mem  []byte
	used uint64
}

// maxMapped bounds the table mapping cache.
const maxMapped = 256

// New wraps loaded maps. inner is the Maglev inner map template
// (pb_maglev's InnerMap spec) used to create new tables.
func New(m *bpf.LbMaps, inner *ebpf.MapSpec) (*Maps, error) {
	n, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, fmt.Errorf("maps: %w", err)
	}
	return &Maps{m: m, inner: inner.Copy(), ncpu: n, tables: map[uint32]*mapped{}, fills: map[uint32]uint32{}}, nil
}

// Close releases the cached table mappings.
func (m *Maps) Close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	for k := range m.tables {
		m.unmapTable(k)
	}
}

// Raw exposes the underlying maps for tests and tools.
func (m *Maps) Raw() *bpf.LbMaps { return m.m }

// Addr16 is an IPv4 address as a union addr's bytes: the four address
// bytes, then zeroes (IPv6 will use all sixteen).
func Addr16(a netip.Addr) [16]uint8 {
	var b [16]uint8
	v4 := a.As4()
	copy(b[:], v4[:])
	return b
}

// AddrFrom16 is the inverse of Addr16 for IPv4.
func AddrFrom16(b [16]uint8) netip.Addr {
	return netip.AddrFrom4([4]byte(b[:4]))
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

// ServiceKey builds a pb_services key.
func ServiceKey(vip netip.Addr, port uint16, proto uint8) bpf.LbSvcKey {
	var k bpf.LbSvcKey
	k.Vip.Bytes = Addr16(vip)
	k.Port = Port(port)
	k.Proto = proto
	k.Family = FamilyIPv4
	return k
}

// UpsertService writes a pb_services entry.
func (m *Maps) UpsertService(k bpf.LbSvcKey, v bpf.LbSvcValue) error {
	if err := m.m.PbServices.Put(k, v); err != nil {
		return fmt.Errorf("pb_services: put: %w", err)
	}
	return nil
}

// DeleteService removes a pb_services entry and the service's tables.
func (m *Maps) DeleteService(k bpf.LbSvcKey, id uint32) error {
	err := m.m.PbServices.Delete(k)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("pb_services: delete: %w", err)
	}
	m.DeleteTables(id)
	return nil
}

func (m *Maps) deleteOuter(outer *ebpf.Map, id uint32) {
	_ = outer.Delete(id) // absent is fine
}

// Services returns every pb_services entry.
func (m *Maps) Services() (map[bpf.LbSvcKey]bpf.LbSvcValue, error) {
	out := map[bpf.LbSvcKey]bpf.LbSvcValue{}
	var k bpf.LbSvcKey
	var v bpf.LbSvcValue
	it := m.m.PbServices.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	return out, it.Err()
}

// SetBackend writes pb_backends[id].
func (m *Maps) SetBackend(id uint32, b bpf.LbBackend) error {
	if err := m.m.PbBackends.Put(id, b); err != nil {
		return fmt.Errorf("pb_backends[%d]: %w", id, err)
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
	const chunk = 8192
	keys := make([]uint32, chunk)
	vals := make([]bpf.LbBackend, chunk)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.m.PbBackends.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			if vals[i].Family != 0 {
				out[keys[i]] = vals[i]
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("pb_backends: %w", err)
		}
	}
}

// NewBackend builds a pb_backends value.
func NewBackend(addr netip.AddrPort, svcID uint32, state BackendState, grants int32) bpf.LbBackend {
	var b bpf.LbBackend
	b.Addr.Bytes = Addr16(addr.Addr())
	b.Port = Port(addr.Port())
	b.Family = FamilyIPv4
	b.State = uint8(state)
	b.SvcId = svcID
	b.ProbeGrants = grants
	return b
}

// TableKey is the pb_maglev key of a service's table n (0 or 1).
func TableKey(svcID, n uint32) uint32 { return svcID*2 + n&1 }

// TableInstall asks for an empty table of Size slots as table N of a
// service.
type TableInstall struct {
	SvcID, N, Size uint32
}

// InstallTables creates empty tables and puts them in pb_maglev with one
// batch update. Replacing an inner map makes the kernel wait for an RCU
// grace period (milliseconds) once per update call: batching is what
// makes programming thousands of services fast. A table must not be live
// when it is replaced.
func (m *Maps) InstallTables(reqs []TableInstall) error {
	if len(reqs) == 0 {
		return nil
	}
	keys := make([]uint32, 0, len(reqs))
	fds := make([]uint32, 0, len(reqs)) // a map-in-map update takes the inner map's fd
	inners := make([]*ebpf.Map, 0, len(reqs))
	defer func() {
		for _, in := range inners {
			in.Close() // the outer map holds its own reference
		}
	}()
	for _, r := range reqs {
		in, err := m.newTable(r.Size)
		if err != nil {
			return fmt.Errorf("maglev table %d of service %d: create: %w", r.N, r.SvcID, err)
		}
		inners = append(inners, in)
		fds = append(fds, uint32(in.FD()))
		keys = append(keys, TableKey(r.SvcID, r.N))
	}
	if _, err := m.m.PbMaglev.BatchUpdate(keys, fds, nil); err != nil {
		return fmt.Errorf("pb_maglev: install %d tables: %w", len(keys), err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, k := range keys {
		m.unmapTable(k)
		delete(m.fills, k)
	}
	return nil
}

// unmapTable drops a cached table mapping (the table was replaced or
// deleted). Called with mu held.
// slotKeys returns the keys 0..n-1. Called with mu held.
func (m *Maps) slotKeysLocked(n int) []uint32 {
	for len(m.keys) < n {
		m.keys = append(m.keys, uint32(len(m.keys)))
	}
	return m.keys[:n]
}

func (m *Maps) unmapTable(key uint32) {
	if t, ok := m.tables[key]; ok {
		unix.Munmap(t.mem)
		delete(m.tables, key)
	}
}

// mapTable returns the (cached) mapping of the table at key. Called with
// mu held.
func (m *Maps) mapTable(key uint32) ([]byte, error) {
	m.clock++
	if t, ok := m.tables[key]; ok {
		t.used = m.clock
		return t.mem, nil
	}
	in, err := m.innerAt(m.m.PbMaglev, key)
	if err != nil {
		return nil, err
	}
	mem, err := mmapArray(in)
	in.Close() // the mapping keeps the table alive until it is unmapped
	if err != nil {
		return nil, err
	}
	if len(m.tables) >= maxMapped {
		oldest, at := uint32(0), ^uint64(0)
		for k, t := range m.tables {
			if t.used < at {
				oldest, at = k, t.used
			}
		}
		m.unmapTable(oldest)
	}
	m.tables[key] = &mapped{mem: mem, used: m.clock}
	return mem, nil
}

func (m *Maps) newTable(size uint32) (*ebpf.Map, error) {
	if size == 0 {
		return nil, errors.New("empty table")
	}
	spec := *m.inner
	spec.MaxEntries = size
	spec.Contents = nil
	// No BTF: loading a BTF blob per table costs more than the table, and
	// bpftool shows the outer map's types anyway.
	spec.Key, spec.Value = nil, nil
	return ebpf.NewMap(&spec)
}

// FillTable writes slots into table n of a service, which must have
// exactly len(slots) slots and must not be live: the caller flips the
// service to it afterwards.
func (m *Maps) FillTable(svcID, n uint32, slots []uint32) error {
	key := TableKey(svcID, n)
	m.mu.Lock()
	defer m.mu.Unlock()
	// A table filled for the first time (thousands of them when the agent
	// starts) is written with one batch update; one filled again (a
	// service whose endpoints come and go) is mapped and kept mapped.
	m.fills[key]++
	if _, hot := m.tables[key]; !hot && m.fills[key] < 2 {
		in, err := m.innerAt(m.m.PbMaglev, key)
		if err != nil {
			return fmt.Errorf("maglev table %d of service %d: %w", n, svcID, err)
		}
		defer in.Close()
		if in.MaxEntries() != uint32(len(slots)) {
			return fmt.Errorf("maglev table %d of service %d: has %d slots, want %d", n, svcID, in.MaxEntries(), len(slots))
		}
		if _, err := in.BatchUpdate(m.slotKeysLocked(len(slots)), slots, nil); err != nil {
			return fmt.Errorf("maglev table %d of service %d: fill: %w", n, svcID, err)
		}
		return nil
	}
	mem, err := m.mapTable(key)
	if err != nil {
		return fmt.Errorf("maglev table %d of service %d: %w", n, svcID, err)
	}
	if len(mem) < len(slots)*8 || len(mem) >= (len(slots)+512)*8 {
		return fmt.Errorf("maglev table %d of service %d: %d bytes mapped, want %d slots", n, svcID, len(mem), len(slots))
	}
	writeSlots(mem, slots)
	return nil
}

// TableSizes are the slot counts of a service's two tables (0: none).
func (m *Maps) TableSizes(svcID uint32) ([2]uint32, error) {
	var out [2]uint32
	for n := range uint32(2) {
		in, err := m.innerAt(m.m.PbMaglev, TableKey(svcID, n))
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			continue
		}
		if err != nil {
			return out, err
		}
		out[n] = in.MaxEntries()
		in.Close()
	}
	return out, nil
}

// SetFallback writes the service's table without probation backends,
// in place when one of the right size exists (it is only read for flows
// that land on a spent probation grant, and every slot always holds a
// valid backend id), else by installing a new one.
func (m *Maps) SetFallback(svcID uint32, slots []uint32) error {
	in, err := m.innerAt(m.m.PbMaglevFb, svcID)
	if err == nil {
		defer in.Close()
		if in.MaxEntries() == uint32(len(slots)) {
			return fillMmap(in, slots)
		}
	}
	fresh, err := m.newTable(uint32(len(slots)))
	if err != nil {
		return fmt.Errorf("fallback table of service %d: create: %w", svcID, err)
	}
	defer fresh.Close()
	if err := fillMmap(fresh, slots); err != nil {
		return fmt.Errorf("fallback table of service %d: fill: %w", svcID, err)
	}
	if err := m.m.PbMaglevFb.Put(svcID, fresh); err != nil {
		return fmt.Errorf("fallback table of service %d: install: %w", svcID, err)
	}
	return nil
}

// DeleteTables removes a service's tables and fallback table.
func (m *Maps) DeleteTables(svcID uint32) {
	m.mu.Lock()
	for n := range uint32(2) {
		m.unmapTable(TableKey(svcID, n))
		delete(m.fills, TableKey(svcID, n))
	}
	m.mu.Unlock()
	_, _ = m.m.PbMaglev.BatchDelete([]uint32{TableKey(svcID, 0), TableKey(svcID, 1)}, nil)
	m.deleteOuter(m.m.PbMaglev, TableKey(svcID, 0)) // in case the batch stopped at a missing key
	m.deleteOuter(m.m.PbMaglev, TableKey(svcID, 1))
	m.deleteOuter(m.m.PbMaglevFb, svcID)
}

func (m *Maps) innerAt(outer *ebpf.Map, key uint32) (*ebpf.Map, error) {
	var id ebpf.MapID
	if err := outer.Lookup(key, &id); err != nil {
		return nil, err
	}
	return ebpf.NewMapFromID(id)
}

// fillMmap writes a table through a memory map of the array: one copy
// instead of a syscall's worth of work per slot.
func fillMmap(m *ebpf.Map, slots []uint32) error {
	mem, err := mmapArray(m)
	if err != nil {
		return err
	}
	defer unix.Munmap(mem)
	writeSlots(mem, slots)
	return nil
}

// writeSlots stores slot values into a mapped array. The kernel lays
// array elements out 8 bytes apart, whatever their size; each store is a
// single aligned word, so a reader never sees a torn id.
func writeSlots(mem []byte, slots []uint32) {
	for i, id := range slots {
		binary.NativeEndian.PutUint32(mem[i*8:], id)
	}
}

// Table reads table n of a service (nil when it has none).
func (m *Maps) Table(svcID, n uint32) ([]uint32, error) {
	return m.readTable(m.m.PbMaglev, TableKey(svcID, n))
}

// LiveTable reads the table a service's pb_services entry points at.
func (m *Maps) LiveTable(k bpf.LbSvcKey) ([]uint32, error) {
	var v bpf.LbSvcValue
	if err := m.m.PbServices.Lookup(k, &v); err != nil {
		return nil, err
	}
	if v.TableSize == 0 {
		return nil, nil
	}
	return m.Table(v.Id, v.Table)
}

// Fallback reads a service's fallback table (nil when it has none).
func (m *Maps) Fallback(svcID uint32) ([]uint32, error) {
	return m.readTable(m.m.PbMaglevFb, svcID)
}

func (m *Maps) readTable(outer *ebpf.Map, key uint32) ([]uint32, error) {
	inner, err := m.innerAt(outer, key)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer inner.Close()
	n := int(inner.MaxEntries())
	out := make([]uint32, n)
	var cursor ebpf.MapBatchCursor
	ks := make([]uint32, n)
	got, err := inner.BatchLookup(&cursor, ks, out, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, err
	}
	return out[:got], nil
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
	n := int(m.m.PbPorts.MaxEntries())
	keys := make([]uint32, n)
	vals := make([]uint8, n)
	var cursor ebpf.MapBatchCursor
	got, err := m.m.PbPorts.BatchLookup(&cursor, keys, vals, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, fmt.Errorf("pb_ports: %w", err)
	}
	out := map[uint16]uint8{}
	for i := range got {
		if vals[i] != 0 {
			out[uint16(keys[i])] = vals[i]
		}
	}
	return out, nil
}

// SetConfig writes pb_config[0].
func (m *Maps) SetConfig(flags uint32) error {
	return m.m.PbConfig.Put(uint32(0), bpf.LbConfig{Flags: flags})
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

// PutHealth writes pb_health[id].
func (m *Maps) PutHealth(id uint32, h bpf.LbEndpointHealth) error {
	if err := m.m.PbHealth.Put(id, h); err != nil {
		return fmt.Errorf("pb_health[%d]: %w", id, err)
	}
	return nil
}

// DeleteHealth removes pb_health[id]; absence is not an error.
func (m *Maps) DeleteHealth(id uint32) error {
	if err := m.m.PbHealth.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("pb_health[%d]: %w", id, err)
	}
	return nil
}

// Health reads every pb_health entry.
func (m *Maps) Health() (map[uint32]bpf.LbEndpointHealth, error) {
	out := map[uint32]bpf.LbEndpointHealth{}
	var k uint32
	var v bpf.LbEndpointHealth
	it := m.m.PbHealth.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	return out, it.Err()
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

// SetPartialIfaces makes pb_partial_ifaces hold exactly ifindexes: the
// interfaces (veths) on which a local sender may hand the datapath a packet
// whose L4 checksum the device is still to finish.
func (m *Maps) SetPartialIfaces(ifindexes []uint32) error {
	want := map[uint32]bool{}
	for _, i := range ifindexes {
		want[i] = true
	}
	var k uint32
	var v uint8
	var stale []uint32
	it := m.m.PbPartialIfaces.Iterate()
	for it.Next(&k, &v) {
		if !want[k] {
			stale = append(stale, k)
		}
	}
	for _, k := range stale {
		_ = m.m.PbPartialIfaces.Delete(k)
	}
	for i := range want {
		if err := m.m.PbPartialIfaces.Put(i, uint8(1)); err != nil {
			return fmt.Errorf("pb_partial_ifaces[%d]: %w", i, err)
		}
	}
	return nil
}
