package reconcile

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
)

// Kinds of mutating operations the fake records, one per Writer method.
const (
	opUpsertService = "UpsertService"
	opDeleteService = "DeleteService"
	opForgetAff     = "ForgetAffinity"
	opSetBackend    = "SetBackend"
	opClearBackend  = "ClearBackend"
	opInstallTables = "InstallTables"
	opFillTable     = "FillTable"
	opSetFallback   = "SetFallback"
	opSetPorts      = "SetPorts"
	opResetSvcStats = "ResetServiceStats"
	opResetBeStats  = "ResetBackendStats"
	opSetSvcBes     = "SetServiceBackends"
	opSetBackends   = "SetBackends"
	opSetVIPSlots   = "SetVIPSlots"
)

// Kinds of read-only calls, for failure injection only.
const (
	opServices        = "Services"
	opBackends        = "Backends"
	opPorts           = "Ports"
	opVIPSlots        = "VIPSlots"
	opTableSizes      = "TableSizes"
	opServiceBackends = "ServiceBackends"
)

// op is one recorded mutation of the fake kernel.
type op struct {
	Kind string
	// ID is the service id (services, tables, service stats) or the backend
	// id (backends, backend stats). Zero for SetPorts and InstallTables.
	ID uint32
	// SetBackend: the state and grants written.
	State  pbmaps.BackendState
	Grants int32
	// UpsertService: the table index and table_size written (the live
	// table). FillTable: the table index and the number of slots.
	// SetFallback: the number of slots.
	Table uint32
	Size  uint32
	// InstallTables: the tables the call installed (one call, one op, one
	// RCU grace period in the kernel, however many tables).
	Reqs []pbmaps.TableInstall
}

func (o op) String() string {
	switch o.Kind {
	case opSetBackend:
		return fmt.Sprintf("%s(%d, %s, grants=%d)", o.Kind, o.ID, o.State, o.Grants)
	case opUpsertService:
		return fmt.Sprintf("%s(%d, table=%d, table_size=%d)", o.Kind, o.ID, o.Table, o.Size)
	case opFillTable:
		return fmt.Sprintf("%s(%d, table=%d, %d slots)", o.Kind, o.ID, o.Table, o.Size)
	case opSetFallback:
		return fmt.Sprintf("%s(%d, %d slots)", o.Kind, o.ID, o.Size)
	case opInstallTables:
		s := make([]string, len(o.Reqs))
		for i, r := range o.Reqs {
			s[i] = fmt.Sprintf("%d/%d:%d", r.SvcID, r.N, r.Size)
		}
		return fmt.Sprintf("%s(%s)", o.Kind, strings.Join(s, " "))
	case opSetPorts:
		return o.Kind
	}
	return fmt.Sprintf("%s(%d)", o.Kind, o.ID)
}

// fakeWriter is an in-memory kernel: it holds the maps the way the kernel
// does (pb_backends and pb_ports are arrays, so a cleared entry is a zero
// value, not an absent one; pb_maglev holds two tables per service, at
// keys 2*id and 2*id+1; deleting a service deletes its tables) and records
// every mutation in order.
type fakeWriter struct {
	t testing.TB

	services  map[bpf.LbSvcKey]bpf.LbSvcValue
	backends  map[uint32]bpf.LbBackend // array: absent == zero value
	tables    map[uint32][]uint32      // pb_maglev: TableKey(svc, n) -> inner array
	fallbacks map[uint32][]uint32      // pb_maglev_fb: service id -> inner array
	ports     map[uint16]uint8         // array: absent == 0
	vipSlots  map[uint32]bool          // array: absent == 0
	listed    map[uint32][]uint32      // pb_svc_backends: service id -> active backends
	health    map[uint32]bpf.LbEndpointHealth
	partial   []uint32          // pb_ifaces entries with PB_IF_PARTIAL
	masters   map[uint32]uint32 // pb_ifaces masters
	redirect  []uint32          // pb_redirect
	config    pbmaps.Config     // pb_config_v2
	// trips are the pb_svc_trip settings written; tripResets counts the
	// pb_be_trip streaks started afresh, by backend.
	trips      map[uint32]tripSetting
	tripResets map[uint32]int

	ops []op
	// calls counts the calls of each Writer method by kind, failed ones
	// included: a batch (SetBackends, ResetBackendStats) records one op per
	// entry, so only calls tell how many batches there were.
	calls map[string]int
	// fail makes the next call of a kind return the error (once).
	fail map[string]error
	// failAfter makes the next SetVIPSlots write its entries and then
	// return the error (once), as a batch that failed part way may.
	failAfter error
	// rejectBackend, when set, makes every write of a pb_backends entry
	// for which it returns an error fail, as the kernel fails an update it
	// cannot apply: SetBackend returns the error; SetBackends writes the
	// entries before the rejected one, in order, and returns the error
	// (as BPF_MAP_UPDATE_BATCH stops at the first failing entry).
	rejectBackend func(id uint32, b bpf.LbBackend) error
	// check runs after every mutation: invariants that must hold at every
	// instant the datapath could look at the maps.
	check func(f *fakeWriter, after op)
}

func newFakeWriter(t testing.TB) *fakeWriter {
	return &fakeWriter{
		t:         t,
		services:  map[bpf.LbSvcKey]bpf.LbSvcValue{},
		backends:  map[uint32]bpf.LbBackend{},
		tables:    map[uint32][]uint32{},
		fallbacks: map[uint32][]uint32{},
		ports:     map[uint16]uint8{},
		vipSlots:  map[uint32]bool{},
		listed:    map[uint32][]uint32{},
		health:    map[uint32]bpf.LbEndpointHealth{},
		calls:     map[string]int{},
		fail:      map[string]error{},
		check:     kernelInvariants,
	}
}

// failing is called first by every method with its kind: it counts the
// call and returns the injected failure, if any.
func (f *fakeWriter) failing(kind string) error {
	f.calls[kind]++
	if err, ok := f.fail[kind]; ok {
		delete(f.fail, kind)
		return err
	}
	return nil
}

func (f *fakeWriter) record(o op) {
	f.ops = append(f.ops, o)
	if f.check != nil {
		f.check(f, o)
	}
}

// liveBy returns the service whose live table is pb_maglev[key], if any:
// the table the datapath reads for that service's new flows.
func (f *fakeWriter) liveBy(key uint32) (bpf.LbSvcValue, bool) {
	for _, v := range f.services {
		if v.TableSize != 0 && pbmaps.TableKey(v.Id, v.Table) == key {
			return v, true
		}
	}
	return bpf.LbSvcValue{}, false
}

func (f *fakeWriter) UpsertService(k bpf.LbSvcKey, v bpf.LbSvcValue) error {
	if err := f.failing(opUpsertService); err != nil {
		return err
	}
	f.services[k] = v
	f.record(op{Kind: opUpsertService, ID: v.Id, Table: v.Table, Size: v.TableSize})
	return nil
}

// DeleteService removes the entry and the service's tables, like
// maps.Maps.DeleteService.
func (f *fakeWriter) DeleteService(k bpf.LbSvcKey, id uint32) error {
	if err := f.failing(opDeleteService); err != nil {
		return err
	}
	delete(f.services, k)
	delete(f.tables, pbmaps.TableKey(id, 0))
	delete(f.tables, pbmaps.TableKey(id, 1))
	delete(f.fallbacks, id)
	f.record(op{Kind: opDeleteService, ID: id})
	return nil
}

// ForgetAffinity is recorded: the fake keeps no affinity entries.
func (f *fakeWriter) ForgetAffinity(id uint32) error {
	if err := f.failing(opForgetAff); err != nil {
		return err
	}
	f.record(op{Kind: opForgetAff, ID: id})
	return nil
}

func (f *fakeWriter) Services() (map[bpf.LbSvcKey]bpf.LbSvcValue, error) {
	if err := f.failing(opServices); err != nil {
		return nil, err
	}
	return maps.Clone(f.services), nil
}

func (f *fakeWriter) SetBackend(id uint32, b bpf.LbBackend) error {
	if err := f.failing(opSetBackend); err != nil {
		return err
	}
	if id == 0 {
		f.t.Errorf("SetBackend(0): id 0 means \"no backend\" in the tables")
	}
	if f.rejectBackend != nil {
		if err := f.rejectBackend(id, b); err != nil {
			return err
		}
	}
	f.backends[id] = b
	f.record(op{Kind: opSetBackend, ID: id, State: pbmaps.BackendState(b.State), Grants: b.ProbeGrants})
	return nil
}

// SetBackends is the batch: it fails as a whole (injected with the
// SetBackends kind), else records one SetBackend op per entry; an entry
// rejectBackend rejects ends the batch there.
func (f *fakeWriter) SetBackends(ids []uint32, vals []bpf.LbBackend) error {
	if err := f.failing(opSetBackends); err != nil {
		return err
	}
	if len(ids) != len(vals) {
		f.t.Errorf("SetBackends: %d ids, %d values", len(ids), len(vals))
	}
	for i, id := range ids {
		if id == 0 {
			f.t.Errorf("SetBackends: id 0 means \"no backend\" in the tables")
		}
		if f.rejectBackend != nil {
			if err := f.rejectBackend(id, vals[i]); err != nil {
				return fmt.Errorf("pb_backends: batch of %d: entry %d: %w", len(ids), i, err)
			}
		}
		f.backends[id] = vals[i]
		f.record(op{Kind: opSetBackend, ID: id, State: pbmaps.BackendState(vals[i].State), Grants: vals[i].ProbeGrants})
	}
	return nil
}

func (f *fakeWriter) ClearBackend(id uint32) error {
	if err := f.failing(opClearBackend); err != nil {
		return err
	}
	delete(f.backends, id)
	f.record(op{Kind: opClearBackend, ID: id})
	return nil
}

// Backends returns the used entries (those with a family), like maps.Maps.
func (f *fakeWriter) Backends() (map[uint32]bpf.LbBackend, error) {
	if err := f.failing(opBackends); err != nil {
		return nil, err
	}
	out := map[uint32]bpf.LbBackend{}
	for id, b := range f.backends {
		if b.Family != 0 {
			out[id] = b
		}
	}
	return out, nil
}

// InstallTables puts new, zero-filled tables into pb_maglev in one batch
// update, like maps.Maps.InstallTables: an empty batch makes no system
// call and records nothing; otherwise one op however many tables.
// Replacing a live table is the bug the double buffer exists to avoid:
// the datapath would read an empty table (every new flow dropped) until
// it is filled.
func (f *fakeWriter) InstallTables(reqs []pbmaps.TableInstall) error {
	if len(reqs) == 0 {
		return nil
	}
	if err := f.failing(opInstallTables); err != nil {
		return err
	}
	seen := map[uint32]bool{}
	for _, r := range reqs {
		if r.Size == 0 {
			return fmt.Errorf("maglev table %d of service %d: create: empty table", r.N, r.SvcID)
		}
		if r.N > 1 {
			f.t.Errorf("InstallTables: table %d of service %d: a service has tables 0 and 1", r.N, r.SvcID)
		}
		key := pbmaps.TableKey(r.SvcID, r.N)
		if seen[key] {
			f.t.Errorf("InstallTables: table %d of service %d twice in one batch", r.N, r.SvcID)
		}
		seen[key] = true
		if v, live := f.liveBy(key); live {
			f.t.Errorf("InstallTables replaces table %d of service %d, which is live (%+v): new flows would see an empty table",
				r.N, r.SvcID, v)
		}
	}
	for _, r := range reqs {
		f.tables[pbmaps.TableKey(r.SvcID, r.N)] = make([]uint32, r.Size)
	}
	f.record(op{Kind: opInstallTables, Reqs: slices.Clone(reqs)})
	return nil
}

// FillTable writes every slot of an existing table in place, like
// maps.Maps.FillTable (which fails unless the table exists with the
// number of slots given). Filling the live table is a bug: the datapath
// would read a half-written table.
func (f *fakeWriter) FillTable(svcID, n uint32, slots []uint32) error {
	if err := f.failing(opFillTable); err != nil {
		return err
	}
	if n > 1 {
		f.t.Errorf("FillTable: table %d of service %d: a service has tables 0 and 1", n, svcID)
	}
	key := pbmaps.TableKey(svcID, n)
	t, ok := f.tables[key]
	if !ok {
		return fmt.Errorf("maglev table %d of service %d: key does not exist", n, svcID)
	}
	if len(t) != len(slots) {
		return fmt.Errorf("maglev table %d of service %d: %d slots, want %d", n, svcID, len(t), len(slots))
	}
	if v, live := f.liveBy(key); live {
		f.t.Errorf("FillTable writes table %d of service %d, which is live (%+v)", n, svcID, v)
	}
	copy(t, slots)
	f.record(op{Kind: opFillTable, ID: svcID, Table: n, Size: uint32(len(slots))})
	return nil
}

// TableSizes are the slot counts of a service's two tables (0: none).
func (f *fakeWriter) TableSizes(svcID uint32) ([2]uint32, error) {
	if err := f.failing(opTableSizes); err != nil {
		return [2]uint32{}, err
	}
	var out [2]uint32
	for n := range uint32(2) {
		out[n] = uint32(len(f.tables[pbmaps.TableKey(svcID, n)]))
	}
	return out, nil
}

func (f *fakeWriter) SetFallback(id uint32, slots []uint32) error {
	if err := f.failing(opSetFallback); err != nil {
		return err
	}
	if len(slots) == 0 {
		return fmt.Errorf("fallback table of service %d: create: empty table", id)
	}
	f.fallbacks[id] = slices.Clone(slots)
	f.record(op{Kind: opSetFallback, ID: id, Size: uint32(len(slots))})
	return nil
}

// SetPorts behaves like maps.Maps.SetPorts, which trusts old to be what
// pb_ports holds: the fake checks that it is.
func (f *fakeWriter) SetPorts(old, roles map[uint16]uint8) error {
	if err := f.failing(opSetPorts); err != nil {
		return err
	}
	if have := f.nonZeroPorts(); !maps.Equal(have, nonZero(old)) {
		f.t.Errorf("SetPorts: old = %v, but pb_ports holds %v", old, have)
	}
	for p := range old {
		if _, ok := roles[p]; !ok {
			delete(f.ports, p)
		}
	}
	for p, r := range roles {
		if r == 0 {
			delete(f.ports, p)
		} else {
			f.ports[p] = r
		}
	}
	f.record(op{Kind: opSetPorts})
	return nil
}

// SetVIPSlots behaves like maps.Maps.SetVIPSlots, which trusts old to be
// what pb_vip_slots holds: the fake checks that it is.
func (f *fakeWriter) SetVIPSlots(old, want map[uint32]bool) error {
	if err := f.failing(opSetVIPSlots); err != nil {
		return err
	}
	if !maps.Equal(f.vipSlots, old) {
		f.t.Errorf("SetVIPSlots: old = %v, but pb_vip_slots holds %v", old, f.vipSlots)
	}
	f.vipSlots = maps.Clone(want)
	f.record(op{Kind: opSetVIPSlots})
	if err := f.failAfter; err != nil {
		f.failAfter = nil
		return err
	}
	return nil
}

func (f *fakeWriter) VIPSlots() (map[uint32]bool, error) {
	if err := f.failing(opVIPSlots); err != nil {
		return nil, err
	}
	return maps.Clone(f.vipSlots), nil
}

func nonZero(m map[uint16]uint8) map[uint16]uint8 {
	out := map[uint16]uint8{}
	for k, v := range m {
		if v != 0 {
			out[k] = v
		}
	}
	return out
}

func (f *fakeWriter) nonZeroPorts() map[uint16]uint8 { return nonZero(f.ports) }

func (f *fakeWriter) Ports() (map[uint16]uint8, error) {
	if err := f.failing(opPorts); err != nil {
		return nil, err
	}
	return f.nonZeroPorts(), nil
}

func (f *fakeWriter) ResetServiceStats(id uint32) error {
	if err := f.failing(opResetSvcStats); err != nil {
		return err
	}
	f.record(op{Kind: opResetSvcStats, ID: id})
	return nil
}

func (f *fakeWriter) ResetBackendStats(ids []uint32) error {
	if err := f.failing(opResetBeStats); err != nil {
		return err
	}
	for _, id := range ids {
		f.record(op{Kind: opResetBeStats, ID: id})
	}
	return nil
}

func (f *fakeWriter) SetServiceBackends(id uint32, old, ids []uint32) error {
	if err := f.failing(opSetSvcBes); err != nil {
		return err
	}
	f.listed[id] = slices.Clone(ids)
	f.record(op{Kind: opSetSvcBes, ID: id})
	return nil
}

func (f *fakeWriter) ServiceBackends(id uint32, n uint32) ([]uint32, error) {
	if err := f.failing(opServiceBackends); err != nil {
		return nil, err
	}
	l := f.listed[id]
	if int(n) > len(l) {
		return nil, fmt.Errorf("pb_svc_backends[%d]: %d entries, want %d", id, len(l), n)
	}
	return slices.Clone(l[:n]), nil
}

// --- Inspection helpers ---

// takeCalls returns the call counts since the last call.
func (f *fakeWriter) takeCalls() map[string]int {
	c := f.calls
	f.calls = map[string]int{}
	return c
}

// takeOps returns the operations recorded since the last call.
func (f *fakeWriter) takeOps() []op {
	o := f.ops
	f.ops = nil
	return o
}

func opsString(ops []op) string {
	s := make([]string, len(ops))
	for i, o := range ops {
		s[i] = o.String()
	}
	return "[" + strings.Join(s, ", ") + "]"
}

// backend reads pb_backends[id] as the kernel would: an array entry,
// zero when never written or cleared.
func (f *fakeWriter) backend(id uint32) bpf.LbBackend { return f.backends[id] }

// table reads table n of a service (nil, false when it has none).
func (f *fakeWriter) table(svcID, n uint32) ([]uint32, bool) {
	t, ok := f.tables[pbmaps.TableKey(svcID, n)]
	return t, ok
}

// live reads the table the service's pb_services entry points at (nil,
// false when table_size is 0 or the table is missing).
func (f *fakeWriter) live(k bpf.LbSvcKey) ([]uint32, bool) {
	v, ok := f.services[k]
	if !ok || v.TableSize == 0 {
		return nil, false
	}
	return f.table(v.Id, v.Table)
}

// lookup is the datapath's table_lookup: outer[key] -> slot -> backend id
// -> entry; a missing table, an out-of-range slot, an empty slot or an
// unused backend entry (family 0) is no backend.
func (f *fakeWriter) lookup(outer map[uint32][]uint32, key, slot, svcID uint32) (uint32, bpf.LbBackend, bool) {
	t, ok := outer[key]
	if !ok || slot >= uint32(len(t)) || t[slot] == 0 {
		return 0, bpf.LbBackend{}, false
	}
	be := f.backends[t[slot]]
	// As lb.c's table_lookup: a cleared entry or another service's
	// backend is no backend.
	if be.Family == 0 || be.SvcId != svcID {
		return 0, bpf.LbBackend{}, false
	}
	return t[slot], be, true
}

// pick mirrors pick_backend in bpf/lb.c for a new flow with the given hash:
// slot = hash % table_size in the live table pb_maglev[2*id + (table&1)];
// the slot's backend if active, or if in probation with a grant left
// (which it consumes); otherwise the same slot of the fallback table
// pb_maglev_fb[id], then a few rehashed slots of the live table, and
// finally the slot's backend anyway. ok is false when the flow is dropped
// (no service, table_size 0, no table, no backend in the slot).
func (f *fakeWriter) pick(k bpf.LbSvcKey, hash uint32, mayProbe bool) (id uint32, probe, ok bool) {
	svc, found := f.services[k]
	if !found || svc.TableSize == 0 {
		return 0, false, false
	}
	key := pbmaps.TableKey(svc.Id, svc.Table)
	slot := hash % svc.TableSize
	id, be, found := f.lookup(f.tables, key, slot, svc.Id)
	if !found {
		return 0, false, false
	}
	if pbmaps.BackendState(be.State) == pbmaps.BackendActive {
		return id, false, true
	}
	if pbmaps.BackendState(be.State) == pbmaps.BackendProbation && mayProbe && be.ProbeGrants > 0 {
		be.ProbeGrants--
		f.backends[id] = be
		return id, true, true
	}
	if alt, abe, found := f.lookup(f.fallbacks, svc.Id, slot, svc.Id); found && pbmaps.BackendState(abe.State) == pbmaps.BackendActive {
		return alt, false, true
	}
	for i := uint32(1); i <= 3; i++ {
		if alt, abe, found := f.lookup(f.tables, key, rehash(hash, i)%svc.TableSize, svc.Id); found && pbmaps.BackendState(abe.State) == pbmaps.BackendActive {
			return alt, false, true
		}
	}
	return id, false, true
}

// rehash stands in for jhash_3words(hash, i, 0, seed): any mixing will do.
func rehash(h, i uint32) uint32 {
	x := uint64(h)<<32 | uint64(i)
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	return uint32(x)
}

// kernelInvariants must hold after every single map write, since the
// datapath may look at the maps between any two of them. For every
// pb_services entry with table_size > 0:
//
//   - its live table pb_maglev[2*id+table] exists, has exactly table_size
//     slots (every slot hash % table_size exists, and the Maglev table of
//     that size is the one in it) and no empty slot (0: flow dropped);
//   - the live table holds no backend of another service, nor an unused
//     (cleared) entry;
//   - a live table mixing active backends and ones in probation has a
//     fallback table, so flows a spent probe does not take are steered on
//     the same slot rather than left to rehashing;
//   - the datapath reads the fallback for any slot whose backend is not
//     active (ejected and removed ones too, not only spent probes), so
//     whatever it holds, however old, must never steer a flow to an
//     active backend of another service.
//
// The fallback is exactly the size of the live table and holds active
// backends only once a ProgramService is done (checkKernel asserts it);
// not at every instant, by design: leaving endpoints are ejected before
// the fallback is rewritten (their ejection is what stops new flows, so
// it goes first), a backend leaving probation for active is in the new
// fallback a write before its state says so, and when the table size
// changes while a probe runs, the one fallback is written at the new size
// before the flip. In those windows a flow on a spent probe's slot may
// miss the fallback and be rehashed, as the datapath does for any slot
// without an active fallback; it is never steered outside the service.
//
// (FillTable and InstallTables assert, on their own, that they never
// touch a live table.)
func kernelInvariants(f *fakeWriter, after op) {
	for k, v := range f.services {
		// A service's packets must get past both prefilters (also one
		// without endpoints: its new flows are dropped, not passed).
		if !f.vipSlots[pbmaps.VIPSlot(pbmaps.AddrFromFamily(k.Family, k.Vip.Bytes))] || f.ports[pbmaps.Port(k.Port)]&pbmaps.PortVIP == 0 {
			f.t.Errorf("after %s: service %d has an entry but its VIP's slot (%v) or port (%#x) is not marked",
				after, v.Id, f.vipSlots[pbmaps.VIPSlot(pbmaps.AddrFromFamily(k.Family, k.Vip.Bytes))], f.ports[pbmaps.Port(k.Port)])
		}
		if v.TableSize == 0 {
			continue
		}
		t, ok := f.table(v.Id, v.Table)
		if !ok {
			f.t.Errorf("after %s: service %d: live table %d (pb_maglev[%d]) does not exist", after, v.Id, v.Table, pbmaps.TableKey(v.Id, v.Table))
			continue
		}
		if int(v.TableSize) != len(t) {
			f.t.Errorf("after %s: service %d: table_size %d, live table %d has %d slots", after, v.Id, v.TableSize, v.Table, len(t))
		}
		var active, probation bool
		for i, id := range t {
			if id == 0 {
				f.t.Errorf("after %s: service %d: live table %d: slot %d empty", after, v.Id, v.Table, i)
				break
			}
			be := f.backends[id]
			if be.Family == 0 || be.SvcId != v.Id {
				f.t.Errorf("after %s: service %d: live table %d: slot %d holds backend %d of service %d (family %d)",
					after, v.Id, v.Table, i, id, be.SvcId, be.Family)
				break
			}
			switch pbmaps.BackendState(be.State) {
			case pbmaps.BackendActive:
				active = true
			case pbmaps.BackendProbation:
				probation = true
			}
		}
		fb, hasFb := f.fallbacks[v.Id]
		if active && probation && !hasFb {
			f.t.Errorf("after %s: service %d: live table mixes active and probation backends but has no fallback table", after, v.Id)
		}
		for i, id := range fb {
			be := f.backends[id]
			if id == 0 {
				f.t.Errorf("after %s: service %d: fallback slot %d empty", after, v.Id, i)
				break
			}
			if be.Family != 0 && be.SvcId != v.Id && pbmaps.BackendState(be.State) == pbmaps.BackendActive {
				f.t.Errorf("after %s: service %d: fallback slot %d holds backend %d, active in service %d: flows would be steered to another service",
					after, v.Id, i, id, be.SvcId)
				break
			}
		}
	}
}

var errInjected = errors.New("injected failure")

// Persisted accrual state and the interface maps are not part of what the
// datapath looks up for a packet: they are stored, not recorded as ops.

func (f *fakeWriter) Backend(id uint32) (bpf.LbBackend, error) {
	if err := f.failing("Backend"); err != nil {
		return bpf.LbBackend{}, err
	}
	return f.backends[id], nil
}

func (f *fakeWriter) PutHealth(id uint32, h bpf.LbEndpointHealth) error {
	if err := f.failing("PutHealth"); err != nil {
		return err
	}
	f.health[id] = h
	return nil
}

func (f *fakeWriter) DeleteHealth(id uint32) error {
	if err := f.failing("DeleteHealth"); err != nil {
		return err
	}
	delete(f.health, id)
	return nil
}

func (f *fakeWriter) Health() (map[uint32]bpf.LbEndpointHealth, error) {
	if err := f.failing("Health"); err != nil {
		return nil, err
	}
	return maps.Clone(f.health), nil
}

func (f *fakeWriter) SetIfaces(ifs []pbmaps.Iface) error {
	if err := f.failing("SetIfaces"); err != nil {
		return err
	}
	f.partial, f.masters = nil, map[uint32]uint32{}
	for _, i := range ifs {
		if i.Partial {
			f.partial = append(f.partial, i.Index)
		}
		if i.Master != 0 {
			f.masters[i.Index] = i.Master
		}
	}
	return nil
}

func (f *fakeWriter) SetRedirect(ids []uint32) error {
	if err := f.failing("SetRedirect"); err != nil {
		return err
	}
	f.redirect = slices.Clone(ids)
	return nil
}

func (f *fakeWriter) SetConfig(c pbmaps.Config) error {
	if err := f.failing("SetConfig"); err != nil {
		return err
	}
	f.config = c
	return nil
}

func (f *fakeWriter) SetSYNGuard(pbmaps.SYNGuard) error { return f.failing("SetSYNGuard") }

// tripSetting is a pb_svc_trip entry as the agent writes it.
type tripSetting struct {
	pbmaps.TripSettings
	budget int64
}

func (f *fakeWriter) SetServiceTrip(id uint32, s pbmaps.TripSettings, budget int64) {
	if f.trips == nil {
		f.trips = map[uint32]tripSetting{}
	}
	f.trips[id] = tripSetting{s, budget}
}

func (f *fakeWriter) ServiceTrip(id uint32) bpf.LbSvcTrip { return bpf.LbSvcTrip{} }

func (f *fakeWriter) BackendTrip(id uint32) bpf.LbBeTrip { return bpf.LbBeTrip{} }

func (f *fakeWriter) ResetServiceTrip(id uint32) { delete(f.trips, id) }

func (f *fakeWriter) ResetBackendTrip(id uint32) {
	if f.tripResets == nil {
		f.tripResets = map[uint32]int{}
	}
	f.tripResets[id]++
}
