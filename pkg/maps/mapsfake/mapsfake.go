// SPDX-License-Identifier: Apache-2.0

// Package mapsfake is the pinned maps in memory, for tests: one fake of
// every interface pkg/maps names, shared by the tests of the packages
// that write or read the maps (pkg/reconcile, pkg/agent). It holds the
// maps as the kernel does, mirrors the datapath's pick of a backend, and
// checks after every write what the datapath must never see.
package mapsfake

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

// Kinds of mutating operations recorded as ops, one per method.
const (
	OpUpsertService = "UpsertService"
	OpDeleteService = "DeleteService"
	OpForgetAff     = "ForgetAffinity"
	OpSetBackend    = "SetBackend"
	OpClearBackend  = "ClearBackend"
	OpInstallTables = "InstallTables"
	OpFillTable     = "FillTable"
	OpSetFallback   = "SetFallback"
	OpSetPorts      = "SetPorts"
	OpResetSvcStats = "ResetServiceStats"
	OpResetBeStats  = "ResetBackendStats"
	OpSetSvcBes     = "SetServiceBackends"
	OpSetBackends   = "SetBackends"
	OpSetVIPSlots   = "SetVIPSlots"
)

// Kinds of read-only calls, for failure injection only.
const (
	OpServices        = "Services"
	OpBackends        = "Backends"
	OpPorts           = "Ports"
	OpVIPSlots        = "VIPSlots"
	OpTableSizes      = "TableSizes"
	OpServiceBackends = "ServiceBackends"
)

// Op is one recorded mutation of the fake kernel.
type Op struct {
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

func (o Op) String() string {
	switch o.Kind {
	case OpSetBackend:
		return fmt.Sprintf("%s(%d, %s, grants=%d)", o.Kind, o.ID, o.State, o.Grants)
	case OpUpsertService:
		return fmt.Sprintf("%s(%d, table=%d, table_size=%d)", o.Kind, o.ID, o.Table, o.Size)
	case OpFillTable:
		return fmt.Sprintf("%s(%d, table=%d, %d slots)", o.Kind, o.ID, o.Table, o.Size)
	case OpSetFallback:
		return fmt.Sprintf("%s(%d, %d slots)", o.Kind, o.ID, o.Size)
	case OpInstallTables:
		s := make([]string, len(o.Reqs))
		for i, r := range o.Reqs {
			s[i] = fmt.Sprintf("%d/%d:%d", r.SvcID, r.N, r.Size)
		}
		return fmt.Sprintf("%s(%s)", o.Kind, strings.Join(s, " "))
	case OpSetPorts:
		return o.Kind
	}
	return fmt.Sprintf("%s(%d)", o.Kind, o.ID)
}

// Maps is an in-memory kernel: it holds the maps the way the kernel
// does (pb_backends and pb_ports are arrays, so a cleared entry is a zero
// value, not an absent one; pb_maglev holds two tables per service, at
// keys 2*id and 2*id+1; deleting a service deletes its tables), records
// every mutation in order and checks, after each, what must hold at every
// instant the datapath could look (KernelInvariants). It implements every
// interface of pkg/maps. Its fields are named for the pinned maps they
// stand for; tests read and set them directly.
type Maps struct {
	// T hears of misuse (a write the kernel would refuse or that the
	// datapath must never see) and of broken invariants.
	T testing.TB

	PbServices    map[bpf.LbSvcKey]bpf.LbSvcValue
	PbBackends    map[uint32]bpf.LbBackend // array: absent == zero value
	PbMaglev      map[uint32][]uint32      // TableKey(svc, n) -> inner array
	PbMaglevFb    map[uint32][]uint32      // service id -> inner array
	PbPorts       map[uint16]uint8         // array: absent == 0
	PbVIPSlots    map[uint32]bool          // array: absent == 0
	PbSvcBackends map[uint32][]uint32      // service id -> active backends
	PbHealth      map[uint32]bpf.LbEndpointHealth
	Partial       []uint32          // pb_ifaces entries with PB_IF_PARTIAL
	Masters       map[uint32]uint32 // pb_ifaces masters
	PbRedirect    []uint32
	PbConfig      pbmaps.Config // pb_config_v2
	// PbSvcTrip is the kernel-trip settings and budget written, by
	// service, and the trips a test says the datapath made (Trips);
	// TripResets counts the pb_be_trip streaks started afresh, by backend.
	PbSvcTrip  map[uint32]bpf.LbSvcTrip
	TripResets map[uint32]int
	// Guards is every write of pb_syn_guard, in order.
	Guards []pbmaps.SYNGuard

	// The counters, as a test sets them: pb_stats (GlobalStats), the SYN
	// guard's (SYNGuardStats), each service's and backend's, each
	// backend's kernel streak (pb_be_trip), the circuit breaker's live
	// flows (pb_inflight); what is not set reads zero.
	Global      bpf.LbGlobalStats
	GuardStats  bpf.LbSynGuardCpu
	SvcStats    map[uint32]bpf.LbSvcStats
	BeStats     map[uint32]bpf.LbBeStats
	PbBeTrip    map[uint32]bpf.LbBeTrip
	SvcInflight map[uint32]int64
	BeInflight  map[uint32]int64

	// Released are the pb_maglev keys of tables whose handle the agent
	// closed (ReleaseTable): they serve, but FillTable fails on them until
	// they are installed again.
	Released map[uint32]bool

	// TableWrites records every table a service went live with, in order;
	// StateWrites every state written to a backend's entry.
	TableWrites map[uint32][][]uint32
	StateWrites map[uint32][]pbmaps.BackendState

	Ops []Op
	// Calls counts the calls of each method by kind (its name), failed
	// ones included: a batch (SetBackends, ResetBackendStats) records one
	// op per entry, so only calls tell how many batches there were.
	Calls map[string]int
	// Fail makes the next n calls of a kind fail, changing nothing: with
	// Err's error for the kind, else ErrInjected.
	Fail map[string]int
	Err  map[string]error
	// FailAfter makes the next SetVIPSlots write its entries and then
	// return the error (once), as a batch that failed part way may.
	FailAfter error
	// RejectBackend, when set, makes every write of a pb_backends entry
	// for which it returns an error fail, as the kernel fails an update it
	// cannot apply: SetBackend returns the error; SetBackends writes the
	// entries before the rejected one, in order, and returns the error
	// (as BPF_MAP_UPDATE_BATCH stops at the first failing entry).
	RejectBackend func(id uint32, b bpf.LbBackend) error
	// Check runs after every mutation (KernelInvariants unless replaced).
	Check func(f *Maps, after Op)
}

// New returns empty maps whose misuse t hears of.
func New(t testing.TB) *Maps {
	return &Maps{
		T:             t,
		PbServices:    map[bpf.LbSvcKey]bpf.LbSvcValue{},
		PbBackends:    map[uint32]bpf.LbBackend{},
		PbMaglev:      map[uint32][]uint32{},
		PbMaglevFb:    map[uint32][]uint32{},
		PbPorts:       map[uint16]uint8{},
		PbVIPSlots:    map[uint32]bool{},
		PbSvcBackends: map[uint32][]uint32{},
		PbHealth:      map[uint32]bpf.LbEndpointHealth{},
		Masters:       map[uint32]uint32{},
		PbSvcTrip:     map[uint32]bpf.LbSvcTrip{},
		TripResets:    map[uint32]int{},
		TableWrites:   map[uint32][][]uint32{},
		Released:      map[uint32]bool{},
		StateWrites:   map[uint32][]pbmaps.BackendState{},
		SvcStats:      map[uint32]bpf.LbSvcStats{},
		BeStats:       map[uint32]bpf.LbBeStats{},
		PbBeTrip:      map[uint32]bpf.LbBeTrip{},
		SvcInflight:   map[uint32]int64{},
		BeInflight:    map[uint32]int64{},
		Calls:         map[string]int{},
		Fail:          map[string]int{},
		Err:           map[string]error{},
		Check:         KernelInvariants,
	}
}

// ErrInjected is the error of a call Fail makes fail.
var ErrInjected = errors.New("injected failure")

// failing is called first by every method with its kind: it counts the
// call and returns the injected failure, if any.
func (f *Maps) failing(kind string) error {
	f.Calls[kind]++
	if f.Fail[kind] > 0 {
		f.Fail[kind]--
		if err := f.Err[kind]; err != nil {
			return err
		}
		return fmt.Errorf("%s: %w", kind, ErrInjected)
	}
	return nil
}

func (f *Maps) record(o Op) {
	f.Ops = append(f.Ops, o)
	if f.Check != nil {
		f.Check(f, o)
	}
}

// liveBy returns the service whose live table is pb_maglev[key], if any:
// the table the datapath reads for that service's new flows.
func (f *Maps) liveBy(key uint32) (bpf.LbSvcValue, bool) {
	for _, v := range f.PbServices {
		if v.TableSize != 0 && pbmaps.TableKey(v.Id, v.Table) == key {
			return v, true
		}
	}
	return bpf.LbSvcValue{}, false
}

func (f *Maps) UpsertService(k bpf.LbSvcKey, v bpf.LbSvcValue) error {
	if err := f.failing(OpUpsertService); err != nil {
		return err
	}
	f.PbServices[k] = v
	if v.TableSize > 0 {
		f.TableWrites[v.Id] = append(f.TableWrites[v.Id], slices.Clone(f.PbMaglev[pbmaps.TableKey(v.Id, v.Table)]))
	}
	f.record(Op{Kind: OpUpsertService, ID: v.Id, Table: v.Table, Size: v.TableSize})
	return nil
}

// DeleteService removes the entry and the service's tables, like
// maps.Maps.DeleteService.
func (f *Maps) DeleteService(k bpf.LbSvcKey, id uint32) error {
	if err := f.failing(OpDeleteService); err != nil {
		return err
	}
	delete(f.PbServices, k)
	if id == 0 { // the entry alone
		f.record(Op{Kind: OpDeleteService, ID: id})
		return nil
	}
	delete(f.PbMaglev, pbmaps.TableKey(id, 0))
	delete(f.PbMaglev, pbmaps.TableKey(id, 1))
	delete(f.Released, pbmaps.TableKey(id, 0))
	delete(f.Released, pbmaps.TableKey(id, 1))
	delete(f.PbMaglevFb, id)
	f.record(Op{Kind: OpDeleteService, ID: id})
	return nil
}

// ForgetAffinity is recorded: the fake keeps no affinity entries.
func (f *Maps) ForgetAffinity(id uint32) error {
	if err := f.failing(OpForgetAff); err != nil {
		return err
	}
	f.record(Op{Kind: OpForgetAff, ID: id})
	return nil
}

func (f *Maps) Services() (map[bpf.LbSvcKey]bpf.LbSvcValue, error) {
	if err := f.failing(OpServices); err != nil {
		return nil, err
	}
	return maps.Clone(f.PbServices), nil
}

func (f *Maps) SetBackend(id uint32, b bpf.LbBackend) error {
	if err := f.failing(OpSetBackend); err != nil {
		return err
	}
	if id == 0 {
		f.T.Errorf("SetBackend(0): id 0 means \"no backend\" in the tables")
	}
	if f.RejectBackend != nil {
		if err := f.RejectBackend(id, b); err != nil {
			return err
		}
	}
	f.PbBackends[id] = b
	f.StateWrites[id] = append(f.StateWrites[id], pbmaps.BackendState(b.State))
	f.record(Op{Kind: OpSetBackend, ID: id, State: pbmaps.BackendState(b.State), Grants: b.ProbeGrants})
	return nil
}

// SetBackends is the batch: it fails as a whole (injected with the
// SetBackends kind), else records one SetBackend op per entry; an entry
// rejectBackend rejects ends the batch there.
func (f *Maps) SetBackends(ids []uint32, vals []bpf.LbBackend) error {
	if err := f.failing(OpSetBackends); err != nil {
		return err
	}
	if len(ids) != len(vals) {
		f.T.Errorf("SetBackends: %d ids, %d values", len(ids), len(vals))
	}
	for i, id := range ids {
		if id == 0 {
			f.T.Errorf("SetBackends: id 0 means \"no backend\" in the tables")
		}
		if f.RejectBackend != nil {
			if err := f.RejectBackend(id, vals[i]); err != nil {
				return fmt.Errorf("pb_backends: batch of %d: entry %d: %w", len(ids), i, err)
			}
		}
		f.PbBackends[id] = vals[i]
		f.StateWrites[id] = append(f.StateWrites[id], pbmaps.BackendState(vals[i].State))
		f.record(Op{Kind: OpSetBackend, ID: id, State: pbmaps.BackendState(vals[i].State), Grants: vals[i].ProbeGrants})
	}
	return nil
}

func (f *Maps) ClearBackend(id uint32) error {
	if err := f.failing(OpClearBackend); err != nil {
		return err
	}
	delete(f.PbBackends, id)
	f.record(Op{Kind: OpClearBackend, ID: id})
	return nil
}

// Backends returns the used entries (those with a family), like maps.Maps.
func (f *Maps) Backends() (map[uint32]bpf.LbBackend, error) {
	if err := f.failing(OpBackends); err != nil {
		return nil, err
	}
	out := map[uint32]bpf.LbBackend{}
	for id, b := range f.PbBackends {
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
func (f *Maps) InstallTables(reqs []pbmaps.TableInstall) error {
	if len(reqs) == 0 {
		return nil
	}
	if err := f.failing(OpInstallTables); err != nil {
		return err
	}
	seen := map[uint32]bool{}
	for _, r := range reqs {
		if r.Size == 0 {
			return fmt.Errorf("maglev table %d of service %d: create: empty table", r.N, r.SvcID)
		}
		if r.N > 1 {
			f.T.Errorf("InstallTables: table %d of service %d: a service has tables 0 and 1", r.N, r.SvcID)
		}
		key := pbmaps.TableKey(r.SvcID, r.N)
		if seen[key] {
			f.T.Errorf("InstallTables: table %d of service %d twice in one batch", r.N, r.SvcID)
		}
		seen[key] = true
		if v, live := f.liveBy(key); live {
			f.T.Errorf("InstallTables replaces table %d of service %d, which is live (%+v): new flows would see an empty table",
				r.N, r.SvcID, v)
		}
	}
	for _, r := range reqs {
		f.PbMaglev[pbmaps.TableKey(r.SvcID, r.N)] = make([]uint32, r.Size)
		delete(f.Released, pbmaps.TableKey(r.SvcID, r.N))
	}
	f.record(Op{Kind: OpInstallTables, Reqs: slices.Clone(reqs)})
	return nil
}

// FillTable writes every slot of an existing table in place, like
// maps.Maps.FillTable (which fails unless the table exists with the
// number of slots given). Filling the live table is a bug: the datapath
// would read a half-written table.
func (f *Maps) FillTable(svcID, n uint32, slots []uint32) error {
	if err := f.failing(OpFillTable); err != nil {
		return err
	}
	if n > 1 {
		f.T.Errorf("FillTable: table %d of service %d: a service has tables 0 and 1", n, svcID)
	}
	key := pbmaps.TableKey(svcID, n)
	t, ok := f.PbMaglev[key]
	if !ok {
		return fmt.Errorf("maglev table %d of service %d: key does not exist", n, svcID)
	}
	if f.Released[key] {
		return fmt.Errorf("maglev table %d of service %d: not installed by this agent", n, svcID)
	}
	if len(t) != len(slots) {
		return fmt.Errorf("maglev table %d of service %d: %d slots, want %d", n, svcID, len(t), len(slots))
	}
	if v, live := f.liveBy(key); live {
		f.T.Errorf("FillTable writes table %d of service %d, which is live (%+v)", n, svcID, v)
	}
	copy(t, slots)
	f.record(Op{Kind: OpFillTable, ID: svcID, Table: n, Size: uint32(len(slots))})
	return nil
}

// TableSizes are the slot counts of a service's two tables (0: none, or
// released).
func (f *Maps) TableSizes(svcID uint32) ([2]uint32, error) {
	if err := f.failing(OpTableSizes); err != nil {
		return [2]uint32{}, err
	}
	var out [2]uint32
	for n := range uint32(2) {
		if !f.Released[pbmaps.TableKey(svcID, n)] {
			out[n] = uint32(len(f.PbMaglev[pbmaps.TableKey(svcID, n)]))
		}
	}
	return out, nil
}

// TableHandles counts the tables the agent could still write: pb_maglev's
// not released, and the fallback tables.
func (f *Maps) TableHandles() int {
	return len(f.PbMaglev) - len(f.Released) + len(f.PbMaglevFb)
}

// ReleaseTable marks a table released, like maps.Maps.ReleaseTable: it
// serves on, but cannot be filled until installed again.
func (f *Maps) ReleaseTable(svcID, n uint32) {
	key := pbmaps.TableKey(svcID, n)
	if _, ok := f.PbMaglev[key]; ok {
		f.Released[key] = true
	}
}

func (f *Maps) SetFallback(id uint32, slots []uint32) error {
	if err := f.failing(OpSetFallback); err != nil {
		return err
	}
	if len(slots) == 0 {
		return fmt.Errorf("fallback table of service %d: create: empty table", id)
	}
	f.PbMaglevFb[id] = slices.Clone(slots)
	f.record(Op{Kind: OpSetFallback, ID: id, Size: uint32(len(slots))})
	return nil
}

// SetPorts behaves like maps.Maps.SetPorts, which trusts old to be what
// pb_ports holds: the fake checks that it is.
func (f *Maps) SetPorts(old, roles map[uint16]uint8) error {
	if err := f.failing(OpSetPorts); err != nil {
		return err
	}
	if have := f.NonZeroPorts(); !maps.Equal(have, nonZero(old)) {
		f.T.Errorf("SetPorts: old = %v, but pb_ports holds %v", old, have)
	}
	for p := range old {
		if _, ok := roles[p]; !ok {
			delete(f.PbPorts, p)
		}
	}
	for p, r := range roles {
		if r == 0 {
			delete(f.PbPorts, p)
		} else {
			f.PbPorts[p] = r
		}
	}
	f.record(Op{Kind: OpSetPorts})
	return nil
}

// SetVIPSlots behaves like maps.Maps.SetVIPSlots, which trusts old to be
// what pb_vip_slots holds: the fake checks that it is.
func (f *Maps) SetVIPSlots(old, want map[uint32]bool) error {
	if err := f.failing(OpSetVIPSlots); err != nil {
		return err
	}
	if !maps.Equal(f.PbVIPSlots, old) {
		f.T.Errorf("SetVIPSlots: old = %v, but pb_vip_slots holds %v", old, f.PbVIPSlots)
	}
	f.PbVIPSlots = maps.Clone(want)
	f.record(Op{Kind: OpSetVIPSlots})
	if err := f.FailAfter; err != nil {
		f.FailAfter = nil
		return err
	}
	return nil
}

func (f *Maps) VIPSlots() (map[uint32]bool, error) {
	if err := f.failing(OpVIPSlots); err != nil {
		return nil, err
	}
	return maps.Clone(f.PbVIPSlots), nil
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

func (f *Maps) NonZeroPorts() map[uint16]uint8 { return nonZero(f.PbPorts) }

func (f *Maps) Ports() (map[uint16]uint8, error) {
	if err := f.failing(OpPorts); err != nil {
		return nil, err
	}
	return f.NonZeroPorts(), nil
}

func (f *Maps) ResetServiceStats(id uint32) error {
	if err := f.failing(OpResetSvcStats); err != nil {
		return err
	}
	f.record(Op{Kind: OpResetSvcStats, ID: id})
	return nil
}

func (f *Maps) ResetBackendStats(ids []uint32) error {
	if err := f.failing(OpResetBeStats); err != nil {
		return err
	}
	for _, id := range ids {
		f.record(Op{Kind: OpResetBeStats, ID: id})
	}
	return nil
}

func (f *Maps) SetServiceBackends(id uint32, old, ids []uint32) error {
	if err := f.failing(OpSetSvcBes); err != nil {
		return err
	}
	f.PbSvcBackends[id] = slices.Clone(ids)
	f.record(Op{Kind: OpSetSvcBes, ID: id})
	return nil
}

func (f *Maps) ServiceBackends(id uint32, n uint32) ([]uint32, error) {
	if err := f.failing(OpServiceBackends); err != nil {
		return nil, err
	}
	l := f.PbSvcBackends[id]
	if int(n) > len(l) {
		return nil, fmt.Errorf("pb_svc_backends[%d]: %d entries, want %d", id, len(l), n)
	}
	return slices.Clone(l[:n]), nil
}

// --- Inspection helpers ---

// TakeCalls returns the call counts since the last call.
func (f *Maps) TakeCalls() map[string]int {
	c := f.Calls
	f.Calls = map[string]int{}
	return c
}

// TakeOps returns the operations recorded since the last call.
func (f *Maps) TakeOps() []Op {
	o := f.Ops
	f.Ops = nil
	return o
}

func OpsString(ops []Op) string {
	s := make([]string, len(ops))
	for i, o := range ops {
		s[i] = o.String()
	}
	return "[" + strings.Join(s, ", ") + "]"
}

// Installed reads table n of a service (nil, false when it has none).
func (f *Maps) Installed(svcID, n uint32) ([]uint32, bool) {
	t, ok := f.PbMaglev[pbmaps.TableKey(svcID, n)]
	return t, ok
}

// Table reads table n of a service as maps.Maps.Table does: nil when it
// has none.
func (f *Maps) Table(svcID, n uint32) ([]uint32, error) {
	if err := f.failing("Table"); err != nil {
		return nil, err
	}
	t, _ := f.Installed(svcID, n)
	return slices.Clone(t), nil
}

// Live reads the table the service's pb_services entry points at (nil,
// false when table_size is 0 or the table is missing).
func (f *Maps) Live(k bpf.LbSvcKey) ([]uint32, bool) {
	v, ok := f.PbServices[k]
	if !ok || v.TableSize == 0 {
		return nil, false
	}
	return f.Installed(v.Id, v.Table)
}

// lookup is the datapath's table_lookup: outer[key] -> slot -> backend id
// -> entry; a missing table, an out-of-range slot, an empty slot or an
// unused backend entry (family 0) is no backend.
func (f *Maps) lookup(outer map[uint32][]uint32, key, slot, svcID uint32) (uint32, bpf.LbBackend, bool) {
	t, ok := outer[key]
	if !ok || slot >= uint32(len(t)) || t[slot] == 0 {
		return 0, bpf.LbBackend{}, false
	}
	be := f.PbBackends[t[slot]]
	// As lb.c's table_lookup: a cleared entry or another service's
	// backend is no backend.
	if be.Family == 0 || be.SvcId != svcID {
		return 0, bpf.LbBackend{}, false
	}
	return t[slot], be, true
}

// Pick mirrors pick_backend in bpf/lb.c for a new flow with the given hash:
// slot = hash % table_size in the live table pb_maglev[2*id + (table&1)];
// the slot's backend if active, or if in probation with a grant left
// (which it consumes); otherwise the same slot of the fallback table
// pb_maglev_fb[id], then a few rehashed slots of the live table, and
// finally the slot's backend anyway. ok is false when the flow is dropped
// (no service, table_size 0, no table, no backend in the slot).
func (f *Maps) Pick(k bpf.LbSvcKey, hash uint32, mayProbe bool) (id uint32, probe, ok bool) {
	svc, found := f.PbServices[k]
	if !found || svc.TableSize == 0 {
		return 0, false, false
	}
	key := pbmaps.TableKey(svc.Id, svc.Table)
	slot := hash % svc.TableSize
	id, be, found := f.lookup(f.PbMaglev, key, slot, svc.Id)
	if !found {
		return 0, false, false
	}
	if pbmaps.BackendState(be.State) == pbmaps.BackendActive {
		return id, false, true
	}
	if pbmaps.BackendState(be.State) == pbmaps.BackendProbation && mayProbe && be.ProbeGrants > 0 {
		be.ProbeGrants--
		f.PbBackends[id] = be
		return id, true, true
	}
	if alt, abe, found := f.lookup(f.PbMaglevFb, svc.Id, slot, svc.Id); found && pbmaps.BackendState(abe.State) == pbmaps.BackendActive {
		return alt, false, true
	}
	for i := uint32(1); i <= 3; i++ {
		if alt, abe, found := f.lookup(f.PbMaglev, key, rehash(hash, i)%svc.TableSize, svc.Id); found && pbmaps.BackendState(abe.State) == pbmaps.BackendActive {
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

// KernelInvariants must hold after every single map write, since the
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
func KernelInvariants(f *Maps, after Op) {
	for k, v := range f.PbServices {
		// A service's packets must get past both prefilters (also one
		// without endpoints: its new flows are dropped, not passed).
		if !f.PbVIPSlots[pbmaps.VIPSlot(pbmaps.AddrFromFamily(k.Family, k.Vip.Bytes))] || f.PbPorts[pbmaps.Port(k.Port)]&pbmaps.PortVIP == 0 {
			f.T.Errorf("after %s: service %d has an entry but its VIP's slot (%v) or port (%#x) is not marked",
				after, v.Id, f.PbVIPSlots[pbmaps.VIPSlot(pbmaps.AddrFromFamily(k.Family, k.Vip.Bytes))], f.PbPorts[pbmaps.Port(k.Port)])
		}
		if v.TableSize == 0 {
			continue
		}
		t, ok := f.Installed(v.Id, v.Table)
		if !ok {
			f.T.Errorf("after %s: service %d: live table %d (pb_maglev[%d]) does not exist", after, v.Id, v.Table, pbmaps.TableKey(v.Id, v.Table))
			continue
		}
		if int(v.TableSize) != len(t) {
			f.T.Errorf("after %s: service %d: table_size %d, live table %d has %d slots", after, v.Id, v.TableSize, v.Table, len(t))
		}
		var active, probation bool
		for i, id := range t {
			if id == 0 {
				f.T.Errorf("after %s: service %d: live table %d: slot %d empty", after, v.Id, v.Table, i)
				break
			}
			be := f.PbBackends[id]
			if be.Family == 0 || be.SvcId != v.Id {
				f.T.Errorf("after %s: service %d: live table %d: slot %d holds backend %d of service %d (family %d)",
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
		fb, hasFb := f.PbMaglevFb[v.Id]
		if active && probation && !hasFb {
			f.T.Errorf("after %s: service %d: live table mixes active and probation backends but has no fallback table", after, v.Id)
		}
		for i, id := range fb {
			be := f.PbBackends[id]
			if id == 0 {
				f.T.Errorf("after %s: service %d: fallback slot %d empty", after, v.Id, i)
				break
			}
			if be.Family != 0 && be.SvcId != v.Id && pbmaps.BackendState(be.State) == pbmaps.BackendActive {
				f.T.Errorf("after %s: service %d: fallback slot %d holds backend %d, active in service %d: flows would be steered to another service",
					after, v.Id, i, id, be.SvcId)
				break
			}
		}
	}
}

// Persisted accrual state and the interface maps are not part of what the
// datapath looks up for a packet: they are stored, not recorded as ops.

func (f *Maps) Backend(id uint32) (bpf.LbBackend, error) {
	if err := f.failing("Backend"); err != nil {
		return bpf.LbBackend{}, err
	}
	return f.PbBackends[id], nil
}

func (f *Maps) PutPersisted(id uint32, h bpf.LbEndpointHealth) error {
	if err := f.failing("PutPersisted"); err != nil {
		return err
	}
	f.PbHealth[id] = h
	return nil
}

func (f *Maps) DeletePersisted(id uint32) error {
	if err := f.failing("DeletePersisted"); err != nil {
		return err
	}
	delete(f.PbHealth, id)
	return nil
}

func (f *Maps) Persisted() (map[uint32]bpf.LbEndpointHealth, error) {
	if err := f.failing("Persisted"); err != nil {
		return nil, err
	}
	return maps.Clone(f.PbHealth), nil
}

func (f *Maps) SetIfaces(ifs []pbmaps.Iface) error {
	if err := f.failing("SetIfaces"); err != nil {
		return err
	}
	f.Partial, f.Masters = nil, map[uint32]uint32{}
	for _, i := range ifs {
		if i.Partial {
			f.Partial = append(f.Partial, i.Index)
		}
		if i.Master != 0 {
			f.Masters[i.Index] = i.Master
		}
	}
	return nil
}

func (f *Maps) SetRedirect(ids []uint32) error {
	if err := f.failing("SetRedirect"); err != nil {
		return err
	}
	f.PbRedirect = slices.Clone(ids)
	return nil
}

func (f *Maps) SetConfig(c pbmaps.Config) error {
	if err := f.failing("SetConfig"); err != nil {
		return err
	}
	f.PbConfig = c
	return nil
}

func (f *Maps) SetSYNGuard(g pbmaps.SYNGuard) error {
	if err := f.failing("SetSYNGuard"); err != nil {
		return err
	}
	f.Guards = append(f.Guards, g)
	return nil
}

func (f *Maps) SetServiceTrip(id uint32, s pbmaps.TripSettings, budget int64) {
	f.Calls["SetServiceTrip"]++
	t := f.PbSvcTrip[id]
	t.MaxFailures, t.Kinds, t.SettleNs, t.Budget = s.MaxFailures, s.Kinds, uint64(max(s.Settle, 0)), budget
	f.PbSvcTrip[id] = t
}

// ServiceTrip is what the datapath would hold: the settings, and the
// trips a test counts in.
func (f *Maps) ServiceTrip(id uint32) bpf.LbSvcTrip { return f.PbSvcTrip[id] }

// BackendTrip reads a backend's streak as a test set it.
func (f *Maps) BackendTrip(id uint32) bpf.LbBeTrip { return f.PbBeTrip[id] }

func (f *Maps) ResetServiceTrip(id uint32) { delete(f.PbSvcTrip, id) }

func (f *Maps) ResetBackendTrip(id uint32) { f.TripResets[id]++ }

// The counters: those a test set, the rest zero.

func (f *Maps) GlobalStats() (bpf.LbGlobalStats, error)          { return f.Global, nil }
func (f *Maps) ServiceStats(id uint32) (bpf.LbSvcStats, error)   { return f.SvcStats[id], nil }
func (f *Maps) BackendStats(id uint32) (bpf.LbBeStats, error)    { return f.BeStats[id], nil }
func (f *Maps) SYNGuardStats() (bpf.LbSynGuardCpu, error)        { return f.GuardStats, nil }
func (f *Maps) NFForgotten() (pbmaps.NFForgotten, error)         { return pbmaps.NFForgotten{}, nil }
func (f *Maps) AffinityFill() (entries, capacity int, err error) { return 0, 65536, nil }

// InflightCounts reads the circuit breaker's live flows of a service and
// of one of its backends.
func (f *Maps) InflightCounts(svcID, backendID uint32) (svc, be int64, err error) {
	return f.SvcInflight[svcID], f.BeInflight[backendID], nil
}

// Config reads pb_config_v2.
func (f *Maps) Config() (pbmaps.Config, error) { return f.PbConfig, nil }

// Reachable is what a new flow to the service could be sent to: the
// distinct backends of its live table whose entry admits new flows.
func (f *Maps) Reachable(k bpf.LbSvcKey) []uint32 {
	t, ok := f.Live(k)
	if !ok {
		return nil
	}
	return f.Admitting(t)
}

// Admitting is the distinct backends of table whose entry admits new
// flows (active, or in probation with a grant left).
func (f *Maps) Admitting(table []uint32) []uint32 {
	seen := map[uint32]bool{}
	for _, id := range table {
		b := f.PbBackends[id]
		switch pbmaps.BackendState(b.State) {
		case pbmaps.BackendActive:
			seen[id] = true
		case pbmaps.BackendProbation:
			if b.ProbeGrants > 0 {
				seen[id] = true
			}
		}
	}
	return slices.Sorted(maps.Keys(seen))
}

var (
	_ pbmaps.ServiceMap     = (*Maps)(nil)
	_ pbmaps.BackendMap     = (*Maps)(nil)
	_ pbmaps.TableMap       = (*Maps)(nil)
	_ pbmaps.PrefilterMap   = (*Maps)(nil)
	_ pbmaps.TripMap        = (*Maps)(nil)
	_ pbmaps.PersistedState = (*Maps)(nil)
	_ pbmaps.InterfaceMap   = (*Maps)(nil)
	_ pbmaps.SYNGuardMap    = (*Maps)(nil)
	_ pbmaps.Counters       = (*Maps)(nil)
)
