// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
)

// Maglev tables are inner maps of pb_maglev (two per service) and
// pb_maglev_fb (one fallback per service). The agent keeps a handle on
// every table it creates: reaching a table through its id (what bpftool
// does) needs CAP_SYS_ADMIN, which the agent does not have in its
// DaemonSet. Tables a previous agent created are never written: a
// restarted agent installs fresh spares and flips to them.

// TableKey is the pb_maglev key of a service's table n (0 or 1).
func TableKey(svcID, n uint32) uint32 { return svcID*2 + n&1 }

// TableInstall asks for an empty table of Size slots as table N of a
// service.
type TableInstall struct {
	SvcID, N, Size uint32
}

// maxMapped bounds how many tables stay memory-mapped.
const maxMapped = 256

type table struct {
	m     *ebpf.Map
	mem   []byte // mapped when filled more than once; nil otherwise
	fills uint32
	used  uint64
}

type tables struct {
	mu       sync.Mutex
	main     map[uint32]*table // by pb_maglev key
	fallback map[uint32]*table // by service id
	mapped   int
	clock    uint64
	keys     []uint32 // 0..n-1: slot numbers for batch fills
}

// InstalledTables lists the pb_maglev keys and the pb_maglev_fb service
// ids of the tables installed through m.
func (m *Maps) InstalledTables() (main, fallback []uint32) {
	m.t.mu.Lock()
	defer m.t.mu.Unlock()
	for k := range m.t.main {
		main = append(main, k)
	}
	for k := range m.t.fallback {
		fallback = append(fallback, k)
	}
	return main, fallback
}

func (t *tables) init() {
	t.main = map[uint32]*table{}
	t.fallback = map[uint32]*table{}
}

func (t *tables) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, tb := range t.main {
		t.drop(tb)
		delete(t.main, k)
	}
	for k, tb := range t.fallback {
		t.drop(tb)
		delete(t.fallback, k)
	}
}

// drop releases a table's mapping and handle. Called with mu held.
func (t *tables) drop(tb *table) {
	t.unmap(tb)
	tb.m.Close()
}

func (t *tables) unmap(tb *table) {
	if tb.mem != nil {
		unix.Munmap(tb.mem)
		tb.mem = nil
		t.mapped--
	}
}

func (t *tables) slotKeys(n int) []uint32 {
	for len(t.keys) < n {
		t.keys = append(t.keys, uint32(len(t.keys)))
	}
	return t.keys[:n]
}

// write fills tb with slots. The first fill of a table (thousands when
// the agent starts) is one batch update; a table filled again (a service
// whose endpoints come and go) is memory-mapped and kept mapped, least
// recently used out, so a refill is a copy: unmapping costs a TLB
// shootdown on every CPU, the bulk of an ejection's work otherwise.
// Called with mu held.
func (t *tables) write(tb *table, slots []uint32) error {
	if tb.m.MaxEntries() != uint32(len(slots)) {
		return fmt.Errorf("has %d slots, want %d", tb.m.MaxEntries(), len(slots))
	}
	t.clock++
	tb.used = t.clock
	tb.fills++
	if tb.mem == nil && tb.fills < 2 {
		// Mapped, copied, unmapped: a tenth of a batch update's cost
		// (which writes slot by slot, after marshalling them), and what
		// 10,000 services' first tables cost at start.
		mem, err := mmapArray(tb.m)
		if err != nil {
			_, err := tb.m.BatchUpdate(t.slotKeys(len(slots)), slots, nil)
			return err
		}
		writeSlots(mem, slots)
		return unix.Munmap(mem)
	}
	if tb.mem == nil {
		if t.mapped >= maxMapped {
			t.evict()
		}
		mem, err := mmapArray(tb.m)
		if err != nil {
			return err
		}
		tb.mem = mem
		t.mapped++
	}
	writeSlots(tb.mem, slots)
	return nil
}

// evict unmaps the least recently used mapped table. Called with mu held.
func (t *tables) evict() {
	var oldest *table
	for _, all := range []map[uint32]*table{t.main, t.fallback} {
		for _, tb := range all {
			if tb.mem != nil && (oldest == nil || tb.used < oldest.used) {
				oldest = tb
			}
		}
	}
	if oldest != nil {
		t.unmap(oldest)
	}
}

// writeSlots stores slot values into a mapped array. The kernel lays
// array elements out 8 bytes apart, whatever their size; each store is a
// single aligned word, so a reader never sees a torn id.
func writeSlots(mem []byte, slots []uint32) {
	for i, id := range slots {
		binary.NativeEndian.PutUint32(mem[i*8:], id)
	}
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
	made := make([]*ebpf.Map, 0, len(reqs))
	for _, r := range reqs {
		in, err := m.newTable(r.Size)
		if err != nil {
			for _, x := range made {
				x.Close()
			}
			return fmt.Errorf("maglev table %d of service %d: create: %w", r.N, r.SvcID, err)
		}
		made = append(made, in)
		fds = append(fds, uint32(in.FD()))
		keys = append(keys, TableKey(r.SvcID, r.N))
	}
	if _, err := m.m.PbMaglev.BatchUpdate(keys, fds, nil); err != nil {
		for _, x := range made {
			x.Close()
		}
		return fmt.Errorf("pb_maglev: install %d tables: %w", len(keys), err)
	}
	m.t.mu.Lock()
	defer m.t.mu.Unlock()
	for i, k := range keys {
		if old, ok := m.t.main[k]; ok {
			m.t.drop(old)
		}
		m.t.main[k] = &table{m: made[i]}
	}
	return nil
}

// FillTable writes slots into table n of a service, which this agent must
// have installed with exactly len(slots) slots, and which must not be
// live: the caller flips the service to it afterwards.
func (m *Maps) FillTable(svcID, n uint32, slots []uint32) error {
	m.t.mu.Lock()
	defer m.t.mu.Unlock()
	tb, ok := m.t.main[TableKey(svcID, n)]
	if !ok {
		return fmt.Errorf("maglev table %d of service %d: not installed by this agent", n, svcID)
	}
	if err := m.t.write(tb, slots); err != nil {
		return fmt.Errorf("maglev table %d of service %d: fill: %w", n, svcID, err)
	}
	return nil
}

// TableSizes are the slot counts of a service's two tables that this
// agent installed (0: none, or one a previous agent installed: it will be
// replaced before it is written).
func (m *Maps) TableSizes(svcID uint32) ([2]uint32, error) {
	m.t.mu.Lock()
	defer m.t.mu.Unlock()
	var out [2]uint32
	for n := range uint32(2) {
		if tb, ok := m.t.main[TableKey(svcID, n)]; ok {
			out[n] = tb.m.MaxEntries()
		}
	}
	return out, nil
}

// SetFallback writes the service's table without probation backends,
// in place when this agent installed one of the right size (it is only
// read for flows that land on a spent probation grant, and every slot
// always holds a valid backend id), else by installing a new one.
func (m *Maps) SetFallback(svcID uint32, slots []uint32) error {
	m.t.mu.Lock()
	defer m.t.mu.Unlock()
	if tb, ok := m.t.fallback[svcID]; ok && tb.m.MaxEntries() == uint32(len(slots)) {
		return m.t.write(tb, slots)
	}
	fresh, err := m.newTable(uint32(len(slots)))
	if err != nil {
		return fmt.Errorf("fallback table of service %d: create: %w", svcID, err)
	}
	tb := &table{m: fresh}
	if err := m.t.write(tb, slots); err != nil {
		fresh.Close()
		return fmt.Errorf("fallback table of service %d: fill: %w", svcID, err)
	}
	if err := m.m.PbMaglevFb.Put(svcID, fresh); err != nil {
		m.t.drop(tb)
		return fmt.Errorf("fallback table of service %d: install: %w", svcID, err)
	}
	if old, ok := m.t.fallback[svcID]; ok {
		m.t.drop(old)
	}
	m.t.fallback[svcID] = tb
	return nil
}

// TableHandles is how many tables (main and fallback) this agent holds a
// handle on: an open file each.
func (m *Maps) TableHandles() int {
	m.t.mu.Lock()
	defer m.t.mu.Unlock()
	return len(m.t.main) + len(m.t.fallback)
}

// ReleaseTable closes this agent's handle on table n of a service, which
// stays in pb_maglev (the outer map holds it) and keeps serving; it can no
// longer be written (FillTable fails), so it must be installed afresh
// before it is filled again. The agent has no CAP_SYS_ADMIN to reach it by
// id: releasing is how it bounds its open files, one per table otherwise.
func (m *Maps) ReleaseTable(svcID, n uint32) {
	m.t.mu.Lock()
	defer m.t.mu.Unlock()
	if tb, ok := m.t.main[TableKey(svcID, n)]; ok {
		m.t.drop(tb)
		delete(m.t.main, TableKey(svcID, n))
	}
}

// DeleteTables removes a service's tables and fallback table.
func (m *Maps) DeleteTables(svcID uint32) {
	_, _ = m.m.PbMaglev.BatchDelete([]uint32{TableKey(svcID, 0), TableKey(svcID, 1)}, nil)
	m.deleteOuter(m.m.PbMaglev, TableKey(svcID, 0)) // in case the batch stopped at a missing key
	m.deleteOuter(m.m.PbMaglev, TableKey(svcID, 1))
	m.deleteOuter(m.m.PbMaglevFb, svcID)
	m.t.mu.Lock()
	defer m.t.mu.Unlock()
	for n := range uint32(2) {
		if tb, ok := m.t.main[TableKey(svcID, n)]; ok {
			m.t.drop(tb)
			delete(m.t.main, TableKey(svcID, n))
		}
	}
	if tb, ok := m.t.fallback[svcID]; ok {
		m.t.drop(tb)
		delete(m.t.fallback, svcID)
	}
}

// Table reads table n of a service (nil when it has none). It reads the
// agent's own handle, or (for tests and tools, with CAP_SYS_ADMIN) the
// table by id.
func (m *Maps) Table(svcID, n uint32) ([]uint32, error) {
	m.t.mu.Lock()
	tb, ok := m.t.main[TableKey(svcID, n)]
	m.t.mu.Unlock()
	if ok {
		return readArray(tb.m)
	}
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
	m.t.mu.Lock()
	tb, ok := m.t.fallback[svcID]
	m.t.mu.Unlock()
	if ok {
		return readArray(tb.m)
	}
	return m.readTable(m.m.PbMaglevFb, svcID)
}

func (m *Maps) readTable(outer *ebpf.Map, key uint32) ([]uint32, error) {
	var id ebpf.MapID
	if err := outer.Lookup(key, &id); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil, nil
		}
		return nil, err
	}
	inner, err := ebpf.NewMapFromID(id)
	if err != nil {
		return nil, err
	}
	defer inner.Close()
	return readArray(inner)
}

func readArray(inner *ebpf.Map) ([]uint32, error) {
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
