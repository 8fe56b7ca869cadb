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
	opSetBackend    = "SetBackend"
	opClearBackend  = "ClearBackend"
	opSwapTable     = "SwapTable"
	opClearTable    = "ClearTable"
	opSetFallback   = "SetFallback"
	opClearFallback = "ClearFallback"
	opSetPorts      = "SetPorts"
	opResetSvcStats = "ResetServiceStats"
	opResetBeStats  = "ResetBackendStats"
	opSetSvcBes     = "SetServiceBackends"
)

// op is one recorded mutation of the fake kernel.
type op struct {
	Kind string
	// ID is the service id (services, tables, service stats) or the backend
	// id (backends, backend stats). Zero for SetPorts.
	ID uint32
	// SetBackend: the state and grants written.
	State  pbmaps.BackendState
	Grants int32
	// UpsertService: the table_size written. SwapTable/SetFallback: the
	// number of slots.
	Size uint32
}

func (o op) String() string {
	switch o.Kind {
	case opSetBackend:
		return fmt.Sprintf("%s(%d, %s, grants=%d)", o.Kind, o.ID, o.State, o.Grants)
	case opUpsertService:
		return fmt.Sprintf("%s(%d, table_size=%d)", o.Kind, o.ID, o.Size)
	case opSwapTable, opSetFallback:
		return fmt.Sprintf("%s(%d, %d slots)", o.Kind, o.ID, o.Size)
	case opSetPorts:
		return o.Kind
	}
	return fmt.Sprintf("%s(%d)", o.Kind, o.ID)
}

// fakeWriter is an in-memory kernel: it holds the maps the way the kernel
// does (pb_backends and pb_ports are arrays, so a cleared entry is a zero
// value, not an absent one; deleting a service deletes its tables) and
// records every mutation in order.
type fakeWriter struct {
	t testing.TB

	services  map[bpf.LbSvcKey]bpf.LbSvcValue
	backends  map[uint32]bpf.LbBackend // array: absent == zero value
	tables    map[uint32][]uint32      // pb_maglev: service id -> inner map
	fallbacks map[uint32][]uint32      // pb_maglev_fb
	ports     map[uint16]uint8         // array: absent == 0
	listed    map[uint32][]uint32      // pb_svc_backends: service id -> active backends

	ops []op
	// fail makes the next call of a kind return the error (once).
	fail map[string]error
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
		fail:      map[string]error{},
		check:     kernelInvariants,
	}
}

func (f *fakeWriter) failing(kind string) error {
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

func (f *fakeWriter) UpsertService(k bpf.LbSvcKey, v bpf.LbSvcValue) error {
	if err := f.failing(opUpsertService); err != nil {
		return err
	}
	f.services[k] = v
	f.record(op{Kind: opUpsertService, ID: v.Id, Size: v.TableSize})
	return nil
}

func (f *fakeWriter) DeleteService(k bpf.LbSvcKey, id uint32) error {
	if err := f.failing(opDeleteService); err != nil {
		return err
	}
	delete(f.services, k)
	delete(f.tables, id)
	delete(f.fallbacks, id)
	f.record(op{Kind: opDeleteService, ID: id})
	return nil
}

func (f *fakeWriter) Services() (map[bpf.LbSvcKey]bpf.LbSvcValue, error) {
	if err := f.failing("Services"); err != nil {
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
	f.backends[id] = b
	f.record(op{Kind: opSetBackend, ID: id, State: pbmaps.BackendState(b.State), Grants: b.ProbeGrants})
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
	if err := f.failing("Backends"); err != nil {
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

func (f *fakeWriter) SwapTable(id uint32, slots []uint32) error {
	if err := f.failing(opSwapTable); err != nil {
		return err
	}
	if len(slots) == 0 {
		return fmt.Errorf("maglev table for service %d: empty", id)
	}
	f.tables[id] = slices.Clone(slots)
	f.record(op{Kind: opSwapTable, ID: id, Size: uint32(len(slots))})
	return nil
}

func (f *fakeWriter) ClearTable(id uint32) {
	delete(f.tables, id)
	f.record(op{Kind: opClearTable, ID: id})
}

func (f *fakeWriter) SetFallback(id uint32, slots []uint32) error {
	if err := f.failing(opSetFallback); err != nil {
		return err
	}
	if len(slots) == 0 {
		return fmt.Errorf("maglev table for service %d: empty", id)
	}
	f.fallbacks[id] = slices.Clone(slots)
	f.record(op{Kind: opSetFallback, ID: id, Size: uint32(len(slots))})
	return nil
}

func (f *fakeWriter) ClearFallback(id uint32) {
	delete(f.fallbacks, id)
	f.record(op{Kind: opClearFallback, ID: id})
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
	if err := f.failing("Ports"); err != nil {
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

func (f *fakeWriter) ResetBackendStats(id uint32) error {
	if err := f.failing(opResetBeStats); err != nil {
		return err
	}
	f.record(op{Kind: opResetBeStats, ID: id})
	return nil
}

func (f *fakeWriter) SetServiceBackends(id uint32, old, ids []uint32) error {
	if err := f.failing(opSetSvcBes); err != nil {
		return err
	}
	f.record(op{Kind: opSetSvcBes, ID: id})
	if f.listed == nil {
		f.listed = map[uint32][]uint32{}
	}
	f.listed[id] = append([]uint32(nil), ids...)
	return nil
}

func (f *fakeWriter) ServiceBackends(id uint32, n uint32) ([]uint32, error) {
	l := f.listed[id]
	if int(n) > len(l) {
		return nil, fmt.Errorf("pb_svc_backends[%d]: %d entries, want %d", id, len(l), n)
	}
	return append([]uint32(nil), l[:n]...), nil
}

// --- Inspection helpers ---

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

// lookup is the datapath's table_lookup: slot -> backend id -> entry.
func (f *fakeWriter) lookup(tables map[uint32][]uint32, svcID, slot uint32) (uint32, bpf.LbBackend, bool) {
	t, ok := tables[svcID]
	if !ok || slot >= uint32(len(t)) || t[slot] == 0 {
		return 0, bpf.LbBackend{}, false
	}
	return t[slot], f.backends[t[slot]], true
}

// pick mirrors pick_backend in bpf/lb.c for a new flow with the given hash:
// the slot's backend if active, or if in probation with a grant left (which
// it consumes); otherwise the same slot of the fallback table, then a few
// rehashed slots, and finally the slot's backend anyway. ok is false when
// the flow is dropped (no service, no table_size, no table entry).
func (f *fakeWriter) pick(k bpf.LbSvcKey, hash uint32, mayProbe bool) (id uint32, probe, ok bool) {
	svc, found := f.services[k]
	if !found || svc.TableSize == 0 {
		return 0, false, false
	}
	slot := hash % svc.TableSize
	id, be, found := f.lookup(f.tables, svc.Id, slot)
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
	if alt, abe, found := f.lookup(f.fallbacks, svc.Id, slot); found && pbmaps.BackendState(abe.State) == pbmaps.BackendActive {
		return alt, false, true
	}
	for i := uint32(1); i <= 3; i++ {
		if alt, abe, found := f.lookup(f.tables, svc.Id, rehash(hash, i)%svc.TableSize); found && pbmaps.BackendState(abe.State) == pbmaps.BackendActive {
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
// datapath may look at the maps between any two of them:
//
//   - every slot the kernel computes (hash % table_size) exists in the
//     service's table: table_size never exceeds the table's length;
//   - a table holding both an active backend and one in probation has a
//     fallback table, so flows the probe does not take are steered to an
//     active backend on the same slot rather than rehashed.
func kernelInvariants(f *fakeWriter, after op) {
	for _, v := range f.services {
		t, ok := f.tables[v.Id]
		if !ok {
			continue
		}
		if int(v.TableSize) > len(t) {
			f.t.Errorf("after %s: service %d: table_size %d > %d slots in its table", after, v.Id, v.TableSize, len(t))
		}
		var active, probation bool
		for _, id := range t {
			switch pbmaps.BackendState(f.backends[id].State) {
			case pbmaps.BackendActive:
				active = true
			case pbmaps.BackendProbation:
				probation = true
			}
		}
		if active && probation {
			if _, ok := f.fallbacks[v.Id]; !ok {
				f.t.Errorf("after %s: service %d: table mixes active and probation backends but has no fallback table", after, v.Id)
			}
		}
	}
}

var errInjected = errors.New("injected failure")
