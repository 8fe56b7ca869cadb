package agent

import (
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// fakeMaps is an in-memory datapath: it stores what the reconciler writes
// the way the kernel holds it (two Maglev tables per service, the live one
// named by the service's value), so a test can ask which backends a new
// flow could reach. pkg/reconcile's own tests check the order of writes;
// these check the decisions.
type fakeMaps struct {
	services  map[bpf.LbSvcKey]bpf.LbSvcValue
	backends  map[uint32]bpf.LbBackend
	tables    map[uint32][]uint32 // pbmaps.TableKey(svc, n) → slots
	fallbacks map[uint32][]uint32
	listed    map[uint32][]uint32
	ports     map[uint16]uint8
	vipSlots  map[uint32]bool
	health    map[uint32]bpf.LbEndpointHealth
	partial   []uint32
	masters   map[uint32]uint32 // pb_ifaces masters
	redirect  []uint32
	config    pbmaps.Config
	lost      uint64 // pb_stats events_lost
	// guards: the SYN guard as written, in order; guardDropped its drops.
	guards                   []pbmaps.SYNGuard
	guardDropped, guardArmed uint64
	// fail makes the next n calls of a method fail.
	fail map[string]int
	// tableWrites records every table a service went live with, in order;
	// stateWrites every state written to a backend's entry.
	tableWrites map[uint32][][]uint32
	stateWrites map[uint32][]pbmaps.BackendState
	// trips are the pb_svc_trip settings written, by service.
	trips map[uint32]bpf.LbSvcTrip
}

func newFakeMaps() *fakeMaps {
	return &fakeMaps{
		services: map[bpf.LbSvcKey]bpf.LbSvcValue{}, backends: map[uint32]bpf.LbBackend{},
		tables: map[uint32][]uint32{}, fallbacks: map[uint32][]uint32{}, listed: map[uint32][]uint32{},
		ports: map[uint16]uint8{}, vipSlots: map[uint32]bool{}, health: map[uint32]bpf.LbEndpointHealth{},
		fail: map[string]int{}, tableWrites: map[uint32][][]uint32{}, stateWrites: map[uint32][]pbmaps.BackendState{},
	}
}

func (f *fakeMaps) failing(method string) error {
	if f.fail[method] > 0 {
		f.fail[method]--
		return fmt.Errorf("%s: injected failure", method)
	}
	return nil
}

func (f *fakeMaps) UpsertService(k bpf.LbSvcKey, v bpf.LbSvcValue) error {
	if err := f.failing("UpsertService"); err != nil {
		return err
	}
	f.services[k] = v
	if v.TableSize > 0 {
		f.tableWrites[v.Id] = append(f.tableWrites[v.Id], slices.Clone(f.tables[pbmaps.TableKey(v.Id, v.Table)]))
	}
	return nil
}

func (f *fakeMaps) ForgetAffinity(uint32) error { return f.failing("ForgetAffinity") }

func (f *fakeMaps) DeleteService(k bpf.LbSvcKey, id uint32) error {
	if err := f.failing("DeleteService"); err != nil {
		return err
	}
	delete(f.services, k)
	delete(f.tables, pbmaps.TableKey(id, 0))
	delete(f.tables, pbmaps.TableKey(id, 1))
	delete(f.fallbacks, id)
	return nil
}

func (f *fakeMaps) Services() (map[bpf.LbSvcKey]bpf.LbSvcValue, error) {
	return maps.Clone(f.services), f.failing("Services")
}

func (f *fakeMaps) SetBackend(id uint32, b bpf.LbBackend) error {
	if err := f.failing("SetBackend"); err != nil {
		return err
	}
	f.backends[id] = b
	f.stateWrites[id] = append(f.stateWrites[id], pbmaps.BackendState(b.State))
	return nil
}

func (f *fakeMaps) SetBackends(ids []uint32, vals []bpf.LbBackend) error {
	if err := f.failing("SetBackends"); err != nil {
		return err
	}
	for i, id := range ids {
		f.backends[id] = vals[i]
		f.stateWrites[id] = append(f.stateWrites[id], pbmaps.BackendState(vals[i].State))
	}
	return nil
}

func (f *fakeMaps) ClearBackend(id uint32) error {
	if err := f.failing("ClearBackend"); err != nil {
		return err
	}
	delete(f.backends, id)
	return nil
}

func (f *fakeMaps) Backends() (map[uint32]bpf.LbBackend, error) {
	return maps.Clone(f.backends), f.failing("Backends")
}

func (f *fakeMaps) Backend(id uint32) (bpf.LbBackend, error) {
	return f.backends[id], f.failing("Backend")
}

func (f *fakeMaps) InstallTables(reqs []pbmaps.TableInstall) error {
	if err := f.failing("InstallTables"); err != nil {
		return err
	}
	for _, r := range reqs {
		f.tables[pbmaps.TableKey(r.SvcID, r.N)] = make([]uint32, r.Size)
	}
	return nil
}

func (f *fakeMaps) FillTable(svcID, n uint32, slots []uint32) error {
	if err := f.failing("FillTable"); err != nil {
		return err
	}
	t, ok := f.tables[pbmaps.TableKey(svcID, n)]
	if !ok || len(t) != len(slots) {
		return fmt.Errorf("fill table %d/%d: %d slots into %d", svcID, n, len(slots), len(t))
	}
	copy(t, slots)
	return nil
}

func (f *fakeMaps) TableSizes(svcID uint32) ([2]uint32, error) {
	return [2]uint32{uint32(len(f.tables[pbmaps.TableKey(svcID, 0)])), uint32(len(f.tables[pbmaps.TableKey(svcID, 1)]))},
		f.failing("TableSizes")
}

func (f *fakeMaps) SetFallback(svcID uint32, slots []uint32) error {
	if err := f.failing("SetFallback"); err != nil {
		return err
	}
	f.fallbacks[svcID] = slices.Clone(slots)
	return nil
}

func (f *fakeMaps) SetPorts(_, roles map[uint16]uint8) error {
	if err := f.failing("SetPorts"); err != nil {
		return err
	}
	f.ports = maps.Clone(roles)
	return nil
}

func (f *fakeMaps) Ports() (map[uint16]uint8, error) { return maps.Clone(f.ports), f.failing("Ports") }

func (f *fakeMaps) SetVIPSlots(_, want map[uint32]bool) error {
	if err := f.failing("SetVIPSlots"); err != nil {
		return err
	}
	f.vipSlots = maps.Clone(want)
	return nil
}

func (f *fakeMaps) VIPSlots() (map[uint32]bool, error) {
	return maps.Clone(f.vipSlots), f.failing("VIPSlots")
}

func (f *fakeMaps) ResetServiceStats(uint32) error   { return f.failing("ResetServiceStats") }
func (f *fakeMaps) ResetBackendStats([]uint32) error { return f.failing("ResetBackendStats") }

func (f *fakeMaps) SetServiceBackends(svcID uint32, _, ids []uint32) error {
	if err := f.failing("SetServiceBackends"); err != nil {
		return err
	}
	f.listed[svcID] = slices.Clone(ids)
	return nil
}

func (f *fakeMaps) ServiceBackends(svcID uint32, n uint32) ([]uint32, error) {
	l := f.listed[svcID]
	return slices.Clone(l[:min(int(n), len(l))]), f.failing("ServiceBackends")
}

func (f *fakeMaps) PutHealth(id uint32, h bpf.LbEndpointHealth) error {
	if err := f.failing("PutHealth"); err != nil {
		return err
	}
	f.health[id] = h
	return nil
}

func (f *fakeMaps) DeleteHealth(id uint32) error {
	if err := f.failing("DeleteHealth"); err != nil {
		return err
	}
	delete(f.health, id)
	return nil
}

func (f *fakeMaps) Health() (map[uint32]bpf.LbEndpointHealth, error) {
	return maps.Clone(f.health), f.failing("Health")
}

func (f *fakeMaps) SetIfaces(ifs []pbmaps.Iface) error {
	f.partial, f.masters = nil, map[uint32]uint32{}
	for _, i := range ifs {
		if i.Partial {
			f.partial = append(f.partial, i.Index)
		}
		if i.Master != 0 {
			f.masters[i.Index] = i.Master
		}
	}
	return f.failing("SetIfaces")
}

func (f *fakeMaps) SetRedirect(ids []uint32) error {
	f.redirect = slices.Clone(ids)
	return f.failing("SetRedirect")
}

func (f *fakeMaps) SetConfig(c pbmaps.Config) error {
	f.config = c
	return f.failing("SetConfig")
}

func (f *fakeMaps) SetSYNGuard(g pbmaps.SYNGuard) error {
	f.guards = append(f.guards, g)
	return f.failing("SetSYNGuard")
}

func (f *fakeMaps) NFForgotten() (pbmaps.NFForgotten, error) { return pbmaps.NFForgotten{}, nil }

func (f *fakeMaps) AffinityFill() (entries, capacity int, err error) { return 0, 65536, nil }

func (f *fakeMaps) SYNGuardStats() (bpf.LbSynGuardCpu, error) {
	return bpf.LbSynGuardCpu{Dropped: f.guardDropped, Armed: f.guardArmed}, nil
}

// Stats, all zero.
func (f *fakeMaps) GlobalStats() (bpf.LbGlobalStats, error) {
	return bpf.LbGlobalStats{EventsLost: f.lost}, nil
}
func (f *fakeMaps) ServiceStats(uint32) (bpf.LbSvcStats, error) { return bpf.LbSvcStats{}, nil }
func (f *fakeMaps) BackendStats(uint32) (bpf.LbBeStats, error)  { return bpf.LbBeStats{}, nil }

// reachable is what a new flow to the service could be sent to: the
// distinct backends of its live table whose entry admits new flows.
func (f *fakeMaps) reachable(k bpf.LbSvcKey) []uint32 {
	v, ok := f.services[k]
	if !ok || v.TableSize == 0 {
		return nil
	}
	return admitting(f, f.tables[pbmaps.TableKey(v.Id, v.Table)])
}

func admitting(f *fakeMaps, table []uint32) []uint32 {
	seen := map[uint32]bool{}
	for _, id := range table {
		b := f.backends[id]
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

// fakeSweeper reports inUse as live.
type fakeSweeper struct{ inUse conntrack.InUse }

func (s *fakeSweeper) Sweep() (conntrack.Result, error) {
	return conntrack.Result{InUse: s.inUse}, nil
}

type noInflight struct{}

func (noInflight) Service(uint32) int64 { return 0 }
func (noInflight) Backend(uint32) int64 { return 0 }

// fakeHooks are XDP attachments to the interfaces of links.
type fakeHooks struct{ attached map[string]bool }

func (h *fakeHooks) Attach(n string) error { h.attached[n] = true; return nil }
func (h *fakeHooks) Detach(n string) error { delete(h.attached, n); return nil }
func (h *fakeHooks) Attached() []string    { return slices.Sorted(maps.Keys(h.attached)) }

// fakeEvents is the ring buffer reader; caught, when set, is how far it
// has read (else it is always caught up).
type fakeEvents struct {
	bad    uint64
	caught *time.Time
	clk    interface{ Now() time.Time }
}

func (e *fakeEvents) CaughtUp() time.Time {
	if e.caught != nil {
		return *e.caught
	}
	return time.Unix(1<<40, 0)
}

// Offset puts the events' clock on the test's (a millisecond early, so the
// agent's start is before the first event a test sends).
func (e *fakeEvents) Offset() int64 {
	return e.clk.Now().Add(-time.Millisecond).UnixNano() - outcomes.MonoNow()
}
func (e *fakeEvents) Undecodable() uint64 { return e.bad }

func (f *fakeMaps) SetServiceTrip(id uint32, s pbmaps.TripSettings, budget int64) {
	if f.trips == nil {
		f.trips = map[uint32]bpf.LbSvcTrip{}
	}
	t := f.trips[id]
	t.MaxFailures, t.Kinds, t.SettleNs, t.Budget = s.MaxFailures, s.Kinds, uint64(s.Settle), budget
	f.trips[id] = t
}

// ServiceTrip is what the datapath would hold: the settings, and the trips
// the tests count in (kernelTrip).
func (f *fakeMaps) ServiceTrip(id uint32) bpf.LbSvcTrip { return f.trips[id] }

func (f *fakeMaps) BackendTrip(id uint32) bpf.LbBeTrip { return bpf.LbBeTrip{} }

func (f *fakeMaps) ResetServiceTrip(id uint32) { delete(f.trips, id) }

func (f *fakeMaps) ResetBackendTrip(id uint32) {}
