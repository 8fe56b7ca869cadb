// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maglev"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/maps/mapsfake"
)

// The shared fake kernel's names, short: the tests read as the writes
// they expect.
type op = mapsfake.Op

const (
	opUpsertService   = mapsfake.OpUpsertService
	opDeleteService   = mapsfake.OpDeleteService
	opForgetAff       = mapsfake.OpForgetAff
	opSetBackend      = mapsfake.OpSetBackend
	opClearBackend    = mapsfake.OpClearBackend
	opInstallTables   = mapsfake.OpInstallTables
	opFillTable       = mapsfake.OpFillTable
	opSetFallback     = mapsfake.OpSetFallback
	opSetPorts        = mapsfake.OpSetPorts
	opResetSvcStats   = mapsfake.OpResetSvcStats
	opResetBeStats    = mapsfake.OpResetBeStats
	opSetSvcBes       = mapsfake.OpSetSvcBes
	opSetBackends     = mapsfake.OpSetBackends
	opSetVIPSlots     = mapsfake.OpSetVIPSlots
	opServices        = mapsfake.OpServices
	opBackends        = mapsfake.OpBackends
	opPorts           = mapsfake.OpPorts
	opVIPSlots        = mapsfake.OpVIPSlots
	opTableSizes      = mapsfake.OpTableSizes
	opServiceBackends = mapsfake.OpServiceBackends
)

var (
	errInjected = mapsfake.ErrInjected
	opsString   = mapsfake.OpsString
)

var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

const (
	testTableSize = 31
	testCooldown  = time.Minute
)

// Addresses: 198.18.0.0/16 for VIPs, 198.19.0.0/16 for backends.
const (
	vip1 = "198.18.0.10"
	vip2 = "198.18.0.11"
	vip3 = "198.18.0.12"
)

type env struct {
	t *testing.T
	f *mapsfake.Maps
	// acc is the accrual the tests' Apply hears from: it admits nothing
	// itself, so that each test programs the services step by step
	// (e.program) and reads the writes of each step apart.
	acc  heard
	clk  *testingclock.FakeClock
	opts Options
	r    *Reconciler
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// sweep hands the reconciler the result of a conntrack walk begun now.
func (e *env) sweep(inUse InUse) { e.r.Sweep(inUse, e.r.BeginSweep()) }

// svcFreed says whether service id is back in the pool.
func (e *env) svcFreed(id uint32) bool {
	_, retired := e.r.retiredSvc[id]
	return !retired && !e.r.svcIDs.isUsed(id)
}

func newEnv(t *testing.T, mut ...func(*Options)) *env {
	t.Helper()
	e := &env{t: t, f: mapsfake.New(t), clk: testingclock.NewFakeClock(t0)}
	e.opts = Options{
		MaxServices: 64, MaxBackends: 256, TableSize: testTableSize,
		Cooldown: testCooldown, Clock: e.clk, Logger: testLogger(t),
	}
	for _, m := range mut {
		m(&e.opts)
	}
	e.restart()
	if ops := e.f.TakeOps(); len(ops) != 0 {
		t.Fatalf("New over empty maps wrote %s", opsString(ops))
	}
	return e
}

// restart replaces the reconciler with a new one over the same maps, as a
// restarted agent would get.
func (e *env) restart() {
	e.t.Helper()
	r, err := New(e.f, e.opts)
	if err != nil {
		e.t.Fatalf("New: %v", err)
	}
	e.r = r
}

func ep(s string) desired.Endpoint { return desired.Endpoint{Addr: netip.MustParseAddrPort(s)} }

func epn(s, name string) desired.Endpoint {
	return desired.Endpoint{Addr: netip.MustParseAddrPort(s), Name: name}
}

func svc(name, vip string, port uint16, eps ...desired.Endpoint) desired.Service {
	return desired.Service{
		Name:      name,
		Key:       desired.Key{VIP: netip.MustParseAddr(vip), Port: port, Protocol: desired.TCP},
		Endpoints: eps,
	}
}

func state(svcs ...desired.Service) desired.State { return desired.State{Services: svcs} }

func keyOf(k desired.Key) bpf.LbSvcKey {
	return pbmaps.ServiceKey(k.VIP, k.Port, uint8(k.Protocol))
}

// heard is failure accrual that leaves the tables to the test: Apply's
// programming of every service is e.program's, one step at a time.
type heard struct{}

func (heard) Adopt([]Change, []*Service) {}
func (heard) Program(uint32)             {}

// applyBack applies the services, with back handed back (they exist, no
// longer served), and fails the test on error.
func (e *env) applyBack(back []desired.Key, svcs ...desired.Service) []Change {
	e.t.Helper()
	st := state(svcs...)
	st.HandBack = back
	ch, err := e.r.Apply(st, e.acc)
	if err != nil {
		e.t.Fatalf("Apply: %v", err)
	}
	return ch
}

// apply applies the services and fails the test on error.
func (e *env) apply(svcs ...desired.Service) []Change {
	e.t.Helper()
	ch, err := e.r.Apply(state(svcs...), e.acc)
	if err != nil {
		e.t.Fatalf("Apply: %v", err)
	}
	return ch
}

func (e *env) service(k desired.Key) *Service {
	e.t.Helper()
	s, ok := e.r.ServiceByKey(k)
	if !ok {
		e.t.Fatalf("service %s not programmed", k)
	}
	return s
}

// bid is the backend id of the endpoint addr of the service with key k.
func (e *env) bid(k desired.Key, addr string) uint32 {
	e.t.Helper()
	a := netip.MustParseAddrPort(addr)
	for _, id := range e.service(k).Backends {
		if b, _ := e.r.Backend(id); b.Addr == a {
			return id
		}
	}
	e.t.Fatalf("service %s has no endpoint %s", k, addr)
	return 0
}

func (e *env) bids(k desired.Key, addrs ...string) []uint32 {
	e.t.Helper()
	out := make([]uint32, 0, len(addrs))
	for _, a := range addrs {
		out = append(out, e.bid(k, a))
	}
	return out
}

func (e *env) program(id uint32, active, probation []uint32, failOpen bool) {
	e.t.Helper()
	if err := e.r.ProgramService(id, active, probation, failOpen, 0); err != nil {
		e.t.Fatalf("ProgramService(%d, %v, %v, %v): %v", id, active, probation, failOpen, err)
	}
}

// prepare runs PrepareTables, as the agent does after programming.
func (e *env) prepare() {
	e.t.Helper()
	if err := e.r.PrepareTables(); err != nil {
		e.t.Fatalf("PrepareTables: %v", err)
	}
}

// wantTable is the Maglev table over the backends ids, computed here
// independently of Reconciler.build.
func (e *env) wantTable(size uint32, ids []uint32) []uint32 {
	e.t.Helper()
	keys := make([]string, len(ids))
	for i, id := range ids {
		b, ok := e.r.Backend(id)
		if !ok {
			e.t.Fatalf("no backend %d", id)
		}
		keys[i] = b.Addr.String()
	}
	idx, err := maglev.NewBuilder(size).Build(keys, nil)
	if err != nil {
		e.t.Fatalf("maglev: %v", err)
	}
	out := make([]uint32, len(idx))
	for i, x := range idx {
		out[i] = ids[x]
	}
	return out
}

// idsIn is the sorted set of ids a table holds.
func idsIn(table []uint32) []uint32 {
	m := map[uint32]bool{}
	for _, id := range table {
		m[id] = true
	}
	return slices.Sorted(maps.Keys(m))
}

func sorted(ids []uint32) []uint32 {
	out := slices.Clone(ids)
	slices.Sort(out)
	return out
}

func (e *env) kernelState(id uint32) (pbmaps.BackendState, int32) {
	b := e.f.PbBackends[id]
	return pbmaps.BackendState(b.State), b.ProbeGrants
}

func (e *env) wantKernelState(id uint32, st pbmaps.BackendState, grants int32) {
	e.t.Helper()
	if gs, gg := e.kernelState(id); gs != st || gg != grants {
		e.t.Errorf("pb_backends[%d]: state %s grants %d, want %s grants %d", id, gs, gg, st, grants)
	}
	if b, ok := e.r.Backend(id); !ok || b.State != st {
		e.t.Errorf("Backend(%d).State = %v (found %v), want %s", id, b, ok, st)
	}
}

// --- operation order ---

type opMatch func(op) bool

func is(kind string, id uint32) opMatch {
	return func(o op) bool { return o.Kind == kind && o.ID == id }
}

func setState(id uint32, st pbmaps.BackendState) opMatch {
	return func(o op) bool { return o.Kind == opSetBackend && o.ID == id && o.State == st }
}

func upsertSize(id, size uint32) opMatch {
	return func(o op) bool { return o.Kind == opUpsertService && o.ID == id && o.Size == size }
}

// flip matches the pb_services write that makes table n of size slots
// the service's live table.
func flip(id, n, size uint32) opMatch {
	return func(o op) bool { return o.Kind == opUpsertService && o.ID == id && o.Table == n && o.Size == size }
}

// flipAny matches any pb_services write of the service with a table.
func flipAny(id uint32) opMatch {
	return func(o op) bool { return o.Kind == opUpsertService && o.ID == id && o.Size != 0 }
}

// fill matches a FillTable of table n of the service.
func fill(id, n uint32) opMatch {
	return func(o op) bool { return o.Kind == opFillTable && o.ID == id && o.Table == n }
}

// installs matches an InstallTables call with a table of the service.
func installs(id uint32) opMatch {
	return func(o op) bool {
		return o.Kind == opInstallTables && slices.ContainsFunc(o.Reqs, func(r pbmaps.TableInstall) bool { return r.SvcID == id })
	}
}

func kindIs(kinds ...string) opMatch {
	return func(o op) bool { return slices.Contains(kinds, o.Kind) }
}

func index(ops []op, m opMatch) int { return slices.IndexFunc(ops, m) }

// lastIndex is the index of the last op m matches, -1 if none.
func lastIndex(ops []op, m opMatch) int {
	for i := len(ops) - 1; i >= 0; i-- {
		if m(ops[i]) {
			return i
		}
	}
	return -1
}

func count(ops []op, m opMatch) int {
	n := 0
	for _, o := range ops {
		if m(o) {
			n++
		}
	}
	return n
}

// inOrder asserts that each matcher matches an operation, and that the
// first matches of consecutive matchers come in the given order.
func inOrder(t *testing.T, ops []op, what string, ms ...opMatch) {
	t.Helper()
	prev := -1
	for i, m := range ms {
		at := index(ops, m)
		if at < 0 {
			t.Errorf("%s: step %d not written; ops: %s", what, i, opsString(ops))
			return
		}
		if at < prev {
			t.Errorf("%s: step %d written at %d, before step %d at %d; ops: %s", what, i, at, i-1, prev, opsString(ops))
		}
		prev = at
	}
}

// installed is every table the InstallTables calls among ops installed.
func installed(ops []op) []pbmaps.TableInstall {
	var out []pbmaps.TableInstall
	for _, o := range ops {
		if o.Kind == opInstallTables {
			out = append(out, o.Reqs...)
		}
	}
	return out
}

// liveTable is the service's live table in the fake kernel, failing the
// test when it has none.
func (e *env) liveTable(k desired.Key) []uint32 {
	e.t.Helper()
	t, ok := e.f.Live(keyOf(k))
	if !ok {
		e.t.Fatalf("service %s: no live table (%+v)", k, e.f.PbServices[keyOf(k)])
	}
	return t
}

// mixes tells whether a table holds both an active backend and one in
// probation, as the kernel's pb_backends says.
func mixes(f *mapsfake.Maps, t []uint32) bool {
	var active, probation bool
	for _, id := range t {
		switch pbmaps.BackendState(f.PbBackends[id].State) {
		case pbmaps.BackendActive:
			active = true
		case pbmaps.BackendProbation:
			probation = true
		}
	}
	return active && probation
}

// checkKernel asserts that the fake kernel holds exactly what the
// reconciler believes it programmed and that the datapath can use it:
// service values, the two tables of each service as the reconciler
// sized them, a live table whose size is table_size and that holds only
// the service's admitted backends (none: table_size 0), fallbacks of
// active backends only where the datapath needs them, backend entries
// matching the reconciler's, and port roles.
// Call it after every service was programmed.
func (e *env) checkKernel() {
	t, r, f := e.t, e.r, e.f
	t.Helper()
	if len(f.PbServices) != len(r.byID)+len(r.handingBack) {
		t.Errorf("pb_services has %d entries, reconciler %d services and %d handed back", len(f.PbServices), len(r.byID), len(r.handingBack))
	}
	for id, hb := range r.handingBack {
		if v, ok := f.PbServices[keyOf(hb.key)]; !ok || v.Id != id || v.Flags&pbmaps.ServiceHandedBack == 0 {
			t.Errorf("service %d handed back: pb_services entry %+v (present %v), want it flagged", id, v, ok)
		}
	}
	for _, s := range r.Services() {
		v, ok := f.PbServices[keyOf(s.Spec.Key)]
		if !ok {
			t.Errorf("service %s (%d): no pb_services entry", s.Spec.Name, s.ID)
			continue
		}
		if v != s.value || v.Id != s.ID {
			t.Errorf("service %s: pb_services value %+v, reconciler wrote %+v (id %d)", s.Spec.Name, v, s.value, s.ID)
		}
		if v.MaxInflight != s.Spec.MaxInflight || v.MaxInflightPerBackend != s.Spec.MaxInflightPerEndpoint {
			t.Errorf("service %s: limits %d/%d, want %d/%d", s.Spec.Name, v.MaxInflight, v.MaxInflightPerBackend,
				s.Spec.MaxInflight, s.Spec.MaxInflightPerEndpoint)
		}
		if v.Table > 1 {
			t.Errorf("service %s: table index %d", s.Spec.Name, v.Table)
		}
		if len(s.Backends) != len(s.Spec.Endpoints) {
			t.Errorf("service %s: %d backends for %d endpoints", s.Spec.Name, len(s.Backends), len(s.Spec.Endpoints))
		}
		for i, id := range s.Backends {
			b, ok := r.Backend(id)
			if !ok {
				t.Errorf("service %s: backend %d unknown", s.Spec.Name, id)
				continue
			}
			if i < len(s.Spec.Endpoints) && b.Addr != s.Spec.Endpoints[i].Addr {
				t.Errorf("service %s: backend %d is %s, endpoint %d is %s", s.Spec.Name, id, b.Addr, i, s.Spec.Endpoints[i].Addr)
			}
			if b.State == pbmaps.BackendRemoved || b.Service != s.ID {
				t.Errorf("service %s: backend %d: state %s service %d", s.Spec.Name, id, b.State, b.Service)
			}
		}
		// The reconciler's idea of the tables' sizes is the kernel's, but
		// for tables whose handle it released (it cannot write them).
		for n := range uint32(2) {
			tbl, _ := f.Installed(s.ID, n)
			if f.Released[pbmaps.TableKey(s.ID, n)] {
				tbl = nil
			}
			if s.sizes[n] != uint32(len(tbl)) {
				t.Errorf("service %s: reconciler believes table %d has %d slots, kernel %d", s.Spec.Name, n, s.sizes[n], len(tbl))
			}
		}
		if s.Active != nil && (len(s.Active)+len(s.Probation) > 0) != (v.TableSize > 0) {
			t.Errorf("service %s: admitted %v/%v, table_size %d", s.Spec.Name, s.Active, s.Probation, v.TableSize)
		}
		if s.Active != nil {
			if l := f.PbSvcBackends[s.ID]; int(v.BackendCount) > len(l) || !slices.Equal(l[:v.BackendCount], s.Active) {
				t.Errorf("service %s: backend_count %d, pb_svc_backends %v, want the active %v", s.Spec.Name, v.BackendCount, l, s.Active)
			}
		}
		tbl, hasTable := f.Live(keyOf(s.Spec.Key))
		if v.TableSize > 0 && !hasTable {
			t.Errorf("service %s: table_size %d but no table %d", s.Spec.Name, v.TableSize, v.Table)
		}
		if hasTable {
			if int(v.TableSize) != len(tbl) {
				t.Errorf("service %s: table_size %d, table has %d slots", s.Spec.Name, v.TableSize, len(tbl))
			}
			for _, id := range idsIn(tbl) {
				st := pbmaps.BackendState(f.PbBackends[id].State)
				if !slices.Contains(s.Backends, id) || f.PbBackends[id].Family == 0 ||
					(st != pbmaps.BackendActive && st != pbmaps.BackendProbation) {
					t.Errorf("service %s: table holds backend %d (state %s), not one of its admitted backends %v", s.Spec.Name, id, st, s.Backends)
				}
			}
		}
		if fb, ok := f.PbMaglevFb[s.ID]; hasTable && mixes(f, tbl) {
			if !ok {
				t.Errorf("service %s: table mixes active and probation backends, no fallback", s.Spec.Name)
			}
			if int(v.TableSize) != len(fb) {
				t.Errorf("service %s: table_size %d, fallback has %d slots", s.Spec.Name, v.TableSize, len(fb))
			}
			for _, id := range idsIn(fb) {
				if !slices.Contains(s.Backends, id) || pbmaps.BackendState(f.PbBackends[id].State) != pbmaps.BackendActive {
					t.Errorf("service %s: fallback holds backend %d (state %d), want active ones only", s.Spec.Name, id, f.PbBackends[id].State)
				}
			}
		}
	}
	known := func(id uint32) bool { _, ok := r.byID[id]; return ok || r.handingBack[id] != nil }
	for key := range f.PbMaglev {
		if !known(key / 2) {
			t.Errorf("pb_maglev[%d] holds table %d for unknown service %d", key, key%2, key/2)
		}
	}
	for id := range f.PbMaglevFb {
		if !known(id) {
			t.Errorf("pb_maglev_fb holds a table for unknown service %d", id)
		}
	}
	kb, _ := f.Backends()
	for id, b := range r.backends.all() {
		k, ok := kb[id]
		if !ok {
			t.Errorf("backend %d (%s): no pb_backends entry", id, b.Addr)
			continue
		}
		want := pbmaps.NewBackend(b.Addr, b.Service, b.State, k.ProbeGrants)
		if k != want {
			t.Errorf("pb_backends[%d] = %+v, want %+v", id, k, want)
		}
		if b.State != pbmaps.BackendProbation && k.ProbeGrants != 0 {
			t.Errorf("pb_backends[%d]: %d grants in state %s", id, k.ProbeGrants, b.State)
		}
	}
	for id := range kb {
		if _, ok := r.backends.lookup(id); !ok {
			t.Errorf("pb_backends[%d] used but unknown to the reconciler", id)
		}
	}
	want := map[uint16]uint8{}
	slots := map[uint32]bool{}
	for k := range r.services {
		want[k.Port] |= pbmaps.PortVIP
		slots[pbmaps.VIPSlot(k.VIP)] = true
	}
	// Removed services keep their VIP port and address marked until their
	// id is freed, and any VIP conntrack held flows to at either of the
	// last two sweeps.
	for id, k := range r.retiredKey {
		if _, ok := r.retiredSvc[id]; !ok && r.handingBack[id] == nil {
			t.Errorf("retired key %v kept for service %d, whose id is free", k, id)
		}
		want[k.Port] |= pbmaps.PortVIP
		slots[pbmaps.VIPSlot(k.VIP)] = true
	}
	for ap := range r.inUseVIPs {
		want[ap.Port()] |= pbmaps.PortVIP
		slots[pbmaps.VIPSlot(ap.Addr())] = true
	}
	if !maps.Equal(f.PbVIPSlots, slots) {
		t.Errorf("pb_vip_slots = %v, want %v", f.PbVIPSlots, slots)
	}
	for _, b := range kb {
		want[pbmaps.Port(b.Port)] |= pbmaps.PortBackend
	}
	if got := f.NonZeroPorts(); !maps.Equal(got, want) {
		t.Errorf("pb_ports = %v, want %v", got, want)
	}
}

// snapshot is a deep copy of the fake kernel's maps.
type snapshot struct {
	services  map[bpf.LbSvcKey]bpf.LbSvcValue
	backends  map[uint32]bpf.LbBackend
	tables    map[uint32][]uint32
	fallbacks map[uint32][]uint32
	ports     map[uint16]uint8
}

func snapshotOf(f *mapsfake.Maps) snapshot {
	cl := func(m map[uint32][]uint32) map[uint32][]uint32 {
		out := map[uint32][]uint32{}
		for k, v := range m {
			out[k] = slices.Clone(v)
		}
		return out
	}
	return snapshot{maps.Clone(f.PbServices), maps.Clone(f.PbBackends), cl(f.PbMaglev), cl(f.PbMaglevFb), maps.Clone(f.PbPorts)}
}

func (s snapshot) diff(t *testing.T, o snapshot) {
	t.Helper()
	if !maps.Equal(s.services, o.services) {
		t.Errorf("pb_services changed: %v -> %v", s.services, o.services)
	}
	if !maps.Equal(s.backends, o.backends) {
		t.Errorf("pb_backends changed: %v -> %v", s.backends, o.backends)
	}
	if !maps.EqualFunc(s.tables, o.tables, slices.Equal) {
		t.Errorf("pb_maglev changed: %v -> %v", s.tables, o.tables)
	}
	if !maps.EqualFunc(s.fallbacks, o.fallbacks, slices.Equal) {
		t.Errorf("pb_maglev_fb changed: %v -> %v", s.fallbacks, o.fallbacks)
	}
	if !maps.Equal(s.ports, o.ports) {
		t.Errorf("pb_ports changed: %v -> %v", s.ports, o.ports)
	}
}

// wantUnreachable asserts that no new flow can reach backend id, whatever
// its state: no service's live table or fallback table holds it, and the
// datapath, picking for every service the kernel has, never returns it.
// New backends are written active by Apply: this is what makes that
// harmless until ProgramService puts them in a table.
func (e *env) wantUnreachable(id uint32) {
	e.t.Helper()
	f := e.f
	for k, v := range f.PbServices {
		if tbl, ok := f.Live(k); ok && slices.Contains(tbl, id) {
			e.t.Errorf("backend %d is in the live table %d of service %d", id, v.Table, v.Id)
		}
		if slices.Contains(f.PbMaglevFb[v.Id], id) {
			e.t.Errorf("backend %d is in the fallback table of service %d", id, v.Id)
		}
		for h := range 4 * max(v.TableSize, 1) {
			if got, _, ok := f.Pick(k, h*2654435761+99, false); ok && got == id {
				e.t.Errorf("a new flow to service %d reached backend %d", v.Id, id)
				break
			}
		}
	}
}

// rejectAddrs makes the fake kernel refuse every pb_backends write of the
// given endpoints (a batch stops at the first one).
func rejectAddrs(f *mapsfake.Maps, addrs ...string) {
	bad := map[netip.AddrPort]bool{}
	for _, a := range addrs {
		bad[netip.MustParseAddrPort(a)] = true
	}
	f.RejectBackend = func(id uint32, b bpf.LbBackend) error {
		if bad[netip.AddrPortFrom(pbmaps.AddrFromFamily(b.Family, b.Addr.Bytes), pbmaps.Port(b.Port))] {
			return fmt.Errorf("pb_backends[%d]: %w", id, errInjected)
		}
		return nil
	}
}
