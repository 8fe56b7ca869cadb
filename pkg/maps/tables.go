// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
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
	// fbPending: fallback tables being installed in the background
	// (prepareFallback), by service id.
	fbPending map[uint32]*pendingFallback
	// installing, if set (tests), runs in a background install between
	// the table's creation and its update of the outer map.
	installing func()
}

// pendingFallback is a fallback table being installed in the background.
type pendingFallback struct {
	done chan struct{} // closed when the install ended
	// tb: the table, once created (nil before, and when the service turned
	// out to have one already); SetFallback may fill it meanwhile.
	tb *table
}

// InstalledTables lists the pb_maglev keys and the pb_maglev_fb service
// ids of the tables installed through m.
func (m *Maps) InstalledTables() (main, fallback []uint32) {
	m.t.lockSettled(allFallbacks) // a fallback being installed is listed too
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
	t.fbPending = map[uint32]*pendingFallback{}
}

// lockSettled takes mu once no fallback install of service svcID is
// under way (any service's, for svcID allFallbacks).
func (t *tables) lockSettled(svcID uint32) {
	for {
		t.mu.Lock()
		var wait *pendingFallback
		if svcID == allFallbacks {
			for _, p := range t.fbPending {
				wait = p
				break
			}
		} else {
			wait = t.fbPending[svcID]
		}
		if wait == nil {
			return
		}
		t.mu.Unlock()
		<-wait.done
	}
}

// allFallbacks asks lockSettled to wait for every install (service ids
// are below PB_MAX_SERVICES).
const allFallbacks = ^uint32(0)

func (t *tables) close() {
	t.lockSettled(allFallbacks)
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

// tablesPerWorker: below this many tables per CPU, newTables creates
// them on the caller's goroutine alone (a goroutine costs more than a few
// map creations). tableCPUs is how many CPUs it may use.
var (
	tablesPerWorker = 512
	tableCPUs       = func() int { return runtime.GOMAXPROCS(0) }
)

// newTables creates the empty tables reqs ask for, on every CPU when they
// are many (a cold start's 10,000 take a tenth of a second on one): the
// kernel creates maps side by side. On an error, none is left open.
func (m *Maps) newTables(reqs []TableInstall) ([]*ebpf.Map, error) {
	made := make([]*ebpf.Map, len(reqs))
	errs := make([]error, len(reqs))
	create := func(lo, hi int) {
		for i := lo; i < hi; i++ {
			made[i], errs[i] = m.newTable(reqs[i].Size)
		}
	}
	workers := min(tableCPUs(), len(reqs)/tablesPerWorker)
	if workers < 2 {
		create(0, len(reqs))
	} else {
		var wg sync.WaitGroup
		per := (len(reqs) + workers - 1) / workers
		for lo := 0; lo < len(reqs); lo += per {
			wg.Go(func() { create(lo, min(lo+per, len(reqs))) })
		}
		wg.Wait()
	}
	for i, err := range errs {
		if err == nil {
			continue
		}
		for _, x := range made {
			if x != nil {
				x.Close()
			}
		}
		return nil, fmt.Errorf("maglev table %d of service %d: create: %w", reqs[i].N, reqs[i].SvcID, err)
	}
	return made, nil
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
	made, err := m.newTables(reqs)
	if err != nil {
		return err
	}
	keys := make([]uint32, len(reqs))
	fds := make([]uint32, len(reqs)) // a map-in-map update takes the inner map's fd
	for i, r := range reqs {
		keys[i] = TableKey(r.SvcID, r.N)
		fds[i] = uint32(made[i].FD())
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
//
// Installing one costs an RCU grace period (milliseconds, tens of them on
// a busy machine), and the first SetFallback of a service comes with its
// first probation, on the agent's loop, where every ejection on the node
// would wait for it. So a service's first ejection (SetBackend) installs
// an empty fallback table of its tables' size in the background
// (prepareFallback), and the probation, a penalty later, finds it ready
// and fills it in place. A probation that comes while the install is
// still under way (a penalty shorter than a grace period) fills the table
// being installed and does not wait: until the install ends, milliseconds
// later, a flow that lands on a spent grant is steered as without a
// fallback table (other picks of the live table, then a scan of the
// service's active backends), never to a backend that is not active.
func (m *Maps) SetFallback(svcID uint32, slots []uint32) error {
	m.t.mu.Lock()
	if p := m.t.fbPending[svcID]; p != nil && p.tb != nil && p.tb.m.MaxEntries() == uint32(len(slots)) {
		defer m.t.mu.Unlock()
		return m.t.write(p.tb, slots)
	}
	m.t.mu.Unlock()
	m.t.lockSettled(svcID)
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

// prepareFallback installs an empty fallback table for service svcID in
// the background, of the size of the tables this agent installed for it,
// unless the service has one (this agent's, one being installed, or a
// previous agent's, which SetFallback replaces as before). Until
// SetFallback fills it, every slot holds backend id 0, which is no
// backend of any service: the datapath, were it to look, would steer as
// it does without a fallback table.
func (m *Maps) prepareFallback(svcID uint32) {
	if m.inner == nil {
		return // read-only
	}
	m.t.mu.Lock()
	defer m.t.mu.Unlock()
	if _, ok := m.t.fallback[svcID]; ok || m.t.fbPending[svcID] != nil {
		return
	}
	var size uint32
	for n := range uint32(2) {
		if tb, ok := m.t.main[TableKey(svcID, n)]; ok {
			size = max(size, tb.m.MaxEntries())
		}
	}
	if size == 0 {
		return
	}
	p := &pendingFallback{done: make(chan struct{})}
	m.t.fbPending[svcID] = p
	go m.installFallback(svcID, size, p)
}

// installFallback is prepareFallback's background work. The outer map's
// update runs without mu: it waits for an RCU grace period. If it fails,
// a table SetFallback filled meanwhile is lost and the service has no
// fallback table until SetFallback next writes one (steering as
// without); the next ejection tries again.
func (m *Maps) installFallback(svcID, size uint32, p *pendingFallback) {
	var tb *table
	defer func() {
		m.t.mu.Lock()
		defer m.t.mu.Unlock()
		delete(m.t.fbPending, svcID)
		if tb != nil {
			m.t.fallback[svcID] = tb
		}
		close(p.done)
	}()
	var id ebpf.MapID
	if err := m.m.PbMaglevFb.Lookup(svcID, &id); !errors.Is(err, ebpf.ErrKeyNotExist) {
		return // a previous agent's, or the lookup failed
	}
	fresh, err := m.newTable(size)
	if err != nil {
		return
	}
	m.t.mu.Lock()
	p.tb = &table{m: fresh}
	hook := m.t.installing
	m.t.mu.Unlock()
	if hook != nil {
		hook()
	}
	if err := m.m.PbMaglevFb.Update(svcID, fresh, ebpf.UpdateAny); err != nil {
		m.t.mu.Lock()
		m.t.drop(p.tb)
		p.tb = nil
		m.t.mu.Unlock()
		return
	}
	tb = p.tb
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
	m.t.lockSettled(svcID)
	m.t.mu.Unlock()
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
