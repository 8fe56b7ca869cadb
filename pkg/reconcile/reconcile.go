// Package reconcile turns the desired state and each endpoint's admission
// (from failure accrual) into the contents of the datapath's maps: service
// entries, backend entries with their states, Maglev tables, port roles.
// It owns the service and backend ids, adopting those a previous agent left
// in the pinned maps so that a restart changes nothing in the kernel.
package reconcile

import (
	"errors"
	"fmt"
	"iter"
	"log/slog"
	stdmaps "maps"
	"net/netip"
	"slices"
	"sort"
	"time"

	"k8s.io/utils/clock"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maglev"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// ProbeGrants is how many new flows the kernel admits to an endpoint in
// probation before the agent hears how the probe went.
const ProbeGrants = 1

// Writer is the part of pkg/maps the reconciler uses; tests fake it.
type Writer interface {
	UpsertService(bpf.LbSvcKey, bpf.LbSvcValue) error
	DeleteService(bpf.LbSvcKey, uint32) error
	Services() (map[bpf.LbSvcKey]bpf.LbSvcValue, error)
	SetBackend(uint32, bpf.LbBackend) error
	SetBackends(ids []uint32, vals []bpf.LbBackend) error
	ClearBackend(uint32) error
	Backends() (map[uint32]bpf.LbBackend, error)
	InstallTables([]maps.TableInstall) error
	FillTable(svcID, n uint32, slots []uint32) error
	TableSizes(svcID uint32) ([2]uint32, error)
	SetFallback(uint32, []uint32) error
	SetPorts(old, roles map[uint16]uint8) error
	Ports() (map[uint16]uint8, error)
	SetVIPSlots(old, want map[uint32]bool) error
	VIPSlots() (map[uint32]bool, error)
	ResetServiceStats(uint32) error
	ResetBackendStats(ids []uint32) error
	SetServiceBackends(svcID uint32, old, ids []uint32) error
	ServiceBackends(svcID uint32, n uint32) ([]uint32, error)
}

// Service is the reconciler's view of one programmed service.
type Service struct {
	ID   uint32
	Spec desired.Service
	// Backends maps each endpoint to its backend id, in Spec order.
	Backends []uint32
	// Admission last written to the kernel.
	Active, Probation []uint32
	FailOpen          bool

	value  bpf.LbSvcValue // last written pb_services value
	listed []uint32       // last written pb_svc_backends list
	sizes  [2]uint32      // slots of the service's two installed tables (0: none)
	// hasFallback: the service has a fallback table, holding a table over
	// fallback (the active backends when it was last written).
	hasFallback  bool
	fallback     []uint32
	fallbackSize uint32
}

// Backend is one (service, endpoint) pair's kernel entry.
type Backend struct {
	ID        uint32
	Service   uint32
	Addr      netip.AddrPort
	Name      string
	State     maps.BackendState
	RemovedAt time.Time // when it left the desired state
}

// Reconciler programs maps. Not safe for concurrent use: the agent's loop
// owns it.
type Reconciler struct {
	w        Writer
	log      *slog.Logger
	clk      clock.PassiveClock
	cooldown time.Duration

	maxTableSize uint32
	builders     map[uint32]*maglev.Builder
	slots        map[uint32][]int32
	keys         []string

	services map[desired.Key]*Service
	byID     map[uint32]*Service
	backends map[uint32]*Backend
	// retired: ids of removed services and backends, reusable once their
	// cooldown passed and no flow refers to them (see Sweep).
	retiredSvc map[uint32]time.Time
	// retiredKey: the key of each retired service whose key is known. Its
	// VIP port (pb_ports) and address (pb_vip_slots) stay marked until the
	// id is freed, so a removed service's established flows keep their NAT
	// (as conntrack keeps kube-proxy's) whether or not another service
	// shares the port or address.
	retiredKey map[uint32]desired.Key
	// inUseVIPs: the VIPs conntrack held live flows to at the last sweep;
	// they stay marked too (flows outlive the cooldown, and an agent
	// restart forgets retiredKey).
	inUseVIPs map[netip.AddrPort]bool
	// vipSlots is what pb_vip_slots holds.
	vipSlots map[uint32]bool
	// prefiltersDirty: the last write of pb_ports or pb_vip_slots failed.
	// ports and vipSlots were then re-read from the kernel (or, unreadable,
	// set to everything, so the next write rewrites every entry);
	// PrepareTables retries.
	prefiltersDirty bool
	// fresh: backends created by this Apply, written by flushBackends.
	fresh []*Backend
	// deleting: removed services whose pb_services entry could not be
	// deleted yet (retried; their ids stay out of reuse).
	deleting map[uint32]desired.Key
	// spare: services whose spare table must be (re)installed before
	// their next change (after a flip to a new size, or at start).
	spare  map[uint32]bool
	svcIDs idPool
	beIDs  idPool
	ports  map[uint16]uint8
}

// Options configure a Reconciler.
type Options struct {
	MaxServices, MaxBackends uint32
	// TableSize is the largest Maglev table a service gets (a prime).
	TableSize uint32
	// Cooldown keeps removed ids out of reuse, so a quickly re-added service
	// or endpoint never inherits a stale count or a late event.
	Cooldown time.Duration
	// InUse are ids live flows refer to at start. Service ids among them
	// that no pinned service holds (removed before a restart) stay out of
	// reuse like retired ones.
	InUse  InUse
	Clock  clock.PassiveClock
	Logger *slog.Logger
}

// New adopts what the maps hold and returns a reconciler ready for Apply.
func New(w Writer, opts Options) (*Reconciler, error) {
	if err := maglev.ValidateTableSize(opts.TableSize); err != nil {
		return nil, err
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Cooldown == 0 {
		opts.Cooldown = time.Minute
	}
	r := &Reconciler{
		w:            w,
		log:          opts.Logger,
		clk:          opts.Clock,
		cooldown:     opts.Cooldown,
		maxTableSize: opts.TableSize,
		builders:     map[uint32]*maglev.Builder{},
		slots:        map[uint32][]int32{},
		services:     map[desired.Key]*Service{},
		byID:         map[uint32]*Service{},
		backends:     map[uint32]*Backend{},
		retiredSvc:   map[uint32]time.Time{},
		retiredKey:   map[uint32]desired.Key{},
		inUseVIPs:    opts.InUse.VIPs,
		deleting:     map[uint32]desired.Key{},
		spare:        map[uint32]bool{},
		svcIDs:       newIDPool(opts.MaxServices),
		beIDs:        newIDPool(opts.MaxBackends),
	}
	if err := r.adopt(); err != nil {
		return nil, err
	}
	for id := range opts.InUse.Services {
		if _, ok := r.byID[id]; !ok && r.svcIDs.take(id) {
			r.retiredSvc[id] = r.clk.Now()
		}
	}
	return r, nil
}

// adopt reads the pinned maps a previous agent wrote. Services and backends
// found there keep their ids; the first Apply then rewrites only what the
// desired state changed.
func (r *Reconciler) adopt() error {
	svcs, err := r.w.Services()
	if err != nil {
		return fmt.Errorf("adopt services: %w", err)
	}
	for k, v := range svcs {
		key := desired.Key{VIP: maps.AddrFrom16(k.Vip.Bytes), Port: maps.Port(k.Port), Protocol: desired.Protocol(k.Proto)}
		if !r.svcIDs.take(v.Id) {
			r.log.Warn("pinned service with an unusable id, dropping it", "service", key, "id", v.Id)
			r.w.DeleteService(k, v.Id)
			continue
		}
		s := &Service{ID: v.Id, Spec: desired.Service{Key: key}, value: v}
		if s.sizes, err = r.w.TableSizes(v.Id); err != nil {
			return fmt.Errorf("adopt service %s: tables: %w", key, err)
		}
		if s.listed, err = r.w.ServiceBackends(v.Id, v.BackendCount); err != nil {
			r.log.Warn("pinned service's backend list unreadable, rewriting it", "service", key, "err", err)
			s.listed, s.value.BackendCount = nil, 0
		}
		r.services[key] = s
		r.byID[v.Id] = s
	}
	bes, err := r.w.Backends()
	if err != nil {
		return fmt.Errorf("adopt backends: %w", err)
	}
	ids := make([]uint32, 0, len(bes))
	for id := range bes {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		v := bes[id]
		if !r.beIDs.take(id) {
			continue
		}
		b := &Backend{ID: id, Service: v.SvcId, State: maps.BackendState(v.State),
			Addr: netip.AddrPortFrom(maps.AddrFrom16(v.Addr.Bytes), maps.Port(v.Port))}
		r.backends[id] = b
		if s, ok := r.byID[v.SvcId]; ok && b.State != maps.BackendRemoved {
			s.Backends = append(s.Backends, id)
			s.Spec.Endpoints = append(s.Spec.Endpoints, desired.Endpoint{Addr: b.Addr})
		} else {
			// An orphan (its service is gone or was dropped above): mark it
			// removed in the kernel too, as retire would have.
			b.State = maps.BackendRemoved
			b.RemovedAt = r.clk.Now()
			if v.State != uint8(maps.BackendRemoved) || v.ProbeGrants != 0 {
				if err := r.w.SetBackend(id, maps.NewBackend(b.Addr, b.Service, maps.BackendRemoved, 0)); err != nil {
					r.log.Error("mark orphaned backend removed", "backend", b.Addr, "id", id, "err", err)
				}
			}
		}
	}
	ports, err := r.w.Ports()
	if err != nil {
		return fmt.Errorf("adopt ports: %w", err)
	}
	r.ports = ports
	if r.vipSlots, err = r.w.VIPSlots(); err != nil {
		return fmt.Errorf("adopt VIP slots: %w", err)
	}
	if len(svcs) > 0 || len(bes) > 0 {
		r.log.Info("adopted pinned state", "services", len(r.services), "backends", len(r.backends))
	}
	return nil
}

// Adopted returns what the pinned maps held at start, for restoring
// accrual state: backend id by (service key, endpoint).
func (r *Reconciler) Adopted() map[desired.Key]map[netip.AddrPort]uint32 {
	out := map[desired.Key]map[netip.AddrPort]uint32{}
	for k, s := range r.services {
		m := map[netip.AddrPort]uint32{}
		for _, id := range s.Backends {
			m[r.backends[id].Addr] = id
		}
		out[k] = m
	}
	return out
}

// Change is a service whose endpoint set Apply changed: failure accrual
// must hear of it, then ProgramService must run.
type Change struct {
	Service *Service
	Removed bool
	// Retired are backend ids whose endpoints left the service.
	Retired []uint32
}

// Apply makes the services and backends match st. It does not write
// Maglev tables: admission depends on accrual, so the caller follows up
// with ProgramService for each changed service.
func (r *Reconciler) Apply(st desired.State) ([]Change, error) {
	now := r.clk.Now()
	var changes []Change
	var errs []error
	seen := map[desired.Key]bool{}

	// New VIPs get past the prefilters before any entry of theirs is
	// written; what is no longer needed is cleared at the end.
	if err := r.markPrefilters(st); err != nil {
		errs = append(errs, err)
	}

	for i := range st.Services {
		spec := st.Services[i]
		seen[spec.Key] = true
		s, existed := r.services[spec.Key]
		if !existed {
			id, ok := r.svcIDs.get()
			if !ok {
				errs = append(errs, fmt.Errorf("service %s: no free service id (max %d)", spec.Name, r.svcIDs.max))
				continue
			}
			delete(r.retiredSvc, id)
			r.w.ResetServiceStats(id)
			s = &Service{ID: id}
			r.services[spec.Key] = s
			r.byID[id] = s
		}
		endpointsChanged := !existed || !sameEndpoints(s, spec.Endpoints, r.backends)
		s.Spec = spec
		// The caller's slice stays the caller's: this one may be edited.
		s.Spec.Endpoints = slices.Clone(spec.Endpoints)
		var retired []uint32
		if endpointsChanged {
			var err error
			if retired, err = r.syncBackends(s, now); err != nil {
				errs = append(errs, err)
			}
		} else {
			r.renameBackends(s)
		}
		// A service with endpoints gets its first entry from its first
		// ProgramService, with its table: one write, not two.
		if s.value.Id == 0 && len(s.Backends) > 0 {
			// not yet
		} else if err := r.writeService(s, s.value.Table, s.value.TableSize); err != nil {
			// Report the change anyway: the backends it retired are gone
			// from the kernel's view whatever happened to the service entry,
			// and no later Apply would report them again.
			errs = append(errs, err)
		}
		if endpointsChanged {
			changes = append(changes, Change{Service: s, Retired: retired})
		}
	}

	if err := r.flushBackends(); err != nil {
		errs = append(errs, err)
	}

	for key, s := range r.services {
		if seen[key] {
			continue
		}
		if err := r.w.DeleteService(maps.ServiceKey(key.VIP, key.Port, uint8(key.Protocol)), s.ID); err != nil {
			// Retried by every later Apply and PrepareTables; until then
			// the id stays out of reuse.
			errs = append(errs, err)
			r.deleting[s.ID] = key
		}
		for _, id := range s.Backends {
			r.retire(r.backends[id], now)
		}
		retired := s.Backends
		s.Backends, s.Active, s.Probation = nil, nil, nil
		delete(r.services, key)
		delete(r.byID, s.ID)
		r.retiredSvc[s.ID] = now
		r.retiredKey[s.ID] = key
		changes = append(changes, Change{Service: s, Removed: true, Retired: retired})
		r.log.Info("service removed", "service", s.Spec.Name, "key", key.String())
	}

	errs = append(errs, r.retryDeletes(), r.prepareTables())
	if err := r.syncPrefilters(); err != nil {
		errs = append(errs, err)
	}
	sort.Slice(changes, func(i, j int) bool { return changes[i].Service.ID < changes[j].Service.ID })
	return changes, errors.Join(errs...)
}

func sameEndpoints(s *Service, eps []desired.Endpoint, bes map[uint32]*Backend) bool {
	if len(s.Backends) != len(eps) {
		return false
	}
	for i, id := range s.Backends {
		if bes[id].Addr != eps[i].Addr {
			return false
		}
	}
	return true
}

func (r *Reconciler) renameBackends(s *Service) {
	for i, id := range s.Backends {
		r.backends[id].Name = s.Spec.Endpoints[i].Name
	}
}

// syncBackends gives every endpoint of s a backend id, keeping the ids of
// endpoints it already had, and retires the rest.
func (r *Reconciler) syncBackends(s *Service, now time.Time) (retired []uint32, _ error) {
	have := map[netip.AddrPort]uint32{}
	for _, id := range s.Backends {
		have[r.backends[id].Addr] = id
	}
	var errs []error
	ids := make([]uint32, 0, len(s.Spec.Endpoints))
	for _, ep := range s.Spec.Endpoints {
		id, ok := have[ep.Addr]
		if ok {
			delete(have, ep.Addr)
			r.backends[id].Name = ep.Name
			ids = append(ids, id)
			continue
		}
		id, ok = r.beIDs.get()
		if !ok {
			errs = append(errs, fmt.Errorf("service %s: endpoint %s: no free backend id (max %d)", s.Spec.Name, ep.Addr, r.beIDs.max))
			continue
		}
		// New endpoints start active, as failure accrual starts them ready:
		// the kernel only reaches a backend through a table, so one that is
		// in none yet is harmless. Written in one batch by flushBackends.
		b := &Backend{ID: id, Service: s.ID, Addr: ep.Addr, Name: ep.Name, State: maps.BackendActive}
		r.backends[id] = b
		r.fresh = append(r.fresh, b)
		ids = append(ids, id)
	}
	for _, id := range have {
		r.retire(r.backends[id], now)
		retired = append(retired, id)
	}
	slices.Sort(retired)
	s.Backends = ids
	// Keep Spec.Endpoints aligned with Backends when an id was unavailable.
	if len(ids) != len(s.Spec.Endpoints) {
		eps := make([]desired.Endpoint, 0, len(ids))
		for _, id := range ids {
			eps = append(eps, desired.Endpoint{Addr: r.backends[id].Addr, Name: r.backends[id].Name})
		}
		s.Spec.Endpoints = eps
	}
	return retired, errors.Join(errs...)
}

// flushBackends writes the backends syncBackends created, in batches: the
// counters of their (possibly recycled) ids zeroed, then their entries.
// An entry that cannot be written leaves its service.
func (r *Reconciler) flushBackends() error {
	if len(r.fresh) == 0 {
		return nil
	}
	fresh := r.fresh
	r.fresh = nil
	ids := make([]uint32, len(fresh))
	vals := make([]bpf.LbBackend, len(fresh))
	for i, b := range fresh {
		ids[i] = b.ID
		vals[i] = maps.NewBackend(b.Addr, b.Service, b.State, 0)
	}
	var errs []error
	if err := r.w.ResetBackendStats(ids); err != nil {
		errs = append(errs, err)
	}
	if r.w.SetBackends(ids, vals) == nil {
		return errors.Join(errs...)
	}
	// Find the entries that fail, one by one.
	for i, b := range fresh {
		if err := r.w.SetBackend(b.ID, vals[i]); err != nil {
			name := fmt.Sprint(b.Service)
			if s, ok := r.byID[b.Service]; ok {
				name = s.Spec.Name
			}
			errs = append(errs, fmt.Errorf("service %s: endpoint %s: %w", name, b.Addr, err))
			if s, ok := r.byID[b.Service]; ok {
				idx := slices.Index(s.Backends, b.ID)
				s.Backends = slices.Delete(s.Backends, idx, idx+1)
				s.Spec.Endpoints = slices.Delete(s.Spec.Endpoints, idx, idx+1)
			}
			delete(r.backends, b.ID)
			r.beIDs.put(b.ID)
		}
	}
	return errors.Join(errs...)
}

// retire marks a backend removed. Its entry stays (live flows carry their
// backend's address in conntrack, so they keep working) until Sweep finds
// its cooldown over and no flow referring to it.
func (r *Reconciler) retire(b *Backend, now time.Time) {
	if b == nil || b.State == maps.BackendRemoved {
		return
	}
	b.State = maps.BackendRemoved
	b.RemovedAt = now
	if err := r.w.SetBackend(b.ID, maps.NewBackend(b.Addr, b.Service, maps.BackendRemoved, 0)); err != nil {
		r.log.Error("mark backend removed", "backend", b.Addr, "id", b.ID, "err", err)
	}
}

// syncPrefilters makes the datapath's two prefilters match the services:
// pb_ports marks every VIP port and every backend port (removed backends
// included: their flows' replies still need reverse NAT), pb_vip_slots the
// slot of every VIP address. Removed services whose flows may live on keep
// theirs.
func (r *Reconciler) syncPrefilters() error {
	want := prefilterSet{ports: map[uint16]uint8{}, slots: map[uint32]bool{}}
	for key := range r.services {
		want.vip(key.VIP, key.Port)
	}
	for _, key := range r.retiredKey {
		want.vip(key.VIP, key.Port)
	}
	for ap := range r.inUseVIPs {
		want.vip(ap.Addr(), ap.Port())
	}
	for _, b := range r.backends {
		want.ports[b.Addr.Port()] |= maps.PortBackend
	}
	return r.writePrefilters(want.ports, want.slots)
}

// markPrefilters marks the VIP ports, address slots and backend ports of
// st's services on top of what is marked, clearing nothing.
func (r *Reconciler) markPrefilters(st desired.State) error {
	want := prefilterSet{ports: stdmaps.Clone(r.ports), slots: stdmaps.Clone(r.vipSlots)}
	if want.ports == nil {
		want.ports = map[uint16]uint8{}
	}
	if want.slots == nil {
		want.slots = map[uint32]bool{}
	}
	for _, spec := range st.Services {
		want.vip(spec.Key.VIP, spec.Key.Port)
		for _, ep := range spec.Endpoints {
			want.ports[ep.Addr.Port()] |= maps.PortBackend
		}
	}
	return r.writePrefilters(want.ports, want.slots)
}

// prefilterSet is what pb_ports and pb_vip_slots are to mark.
type prefilterSet struct {
	ports map[uint16]uint8
	slots map[uint32]bool
}

// vip marks a VIP: its port and its address's slot.
func (p prefilterSet) vip(addr netip.Addr, port uint16) {
	p.ports[port] |= maps.PortVIP
	p.slots[maps.VIPSlot(addr)] = true
}

// writePrefilters writes what differs from what the kernel holds. After a
// failed write the kernel's state is read back: a batch may have stopped
// part way, and a stale record would make later diffs skip entries.
func (r *Reconciler) writePrefilters(ports map[uint16]uint8, slots map[uint32]bool) error {
	var errs []error
	if !stdmaps.Equal(ports, r.ports) {
		if err := r.w.SetPorts(r.ports, ports); err != nil {
			errs = append(errs, err)
			if r.ports, err = r.w.Ports(); err != nil {
				r.ports = everyPort()
			}
		} else {
			r.ports = ports
		}
	}
	if !stdmaps.Equal(slots, r.vipSlots) {
		if err := r.w.SetVIPSlots(r.vipSlots, slots); err != nil {
			errs = append(errs, err)
			if r.vipSlots, err = r.w.VIPSlots(); err != nil {
				r.vipSlots = everySlot()
			}
		} else {
			r.vipSlots = slots
		}
	}
	r.prefiltersDirty = len(errs) > 0
	return errors.Join(errs...)
}

// everyPort and everySlot stand for a prefilter whose content is unknown:
// diffed against them, a write covers every entry.
func everyPort() map[uint16]uint8 {
	m := make(map[uint16]uint8, 1<<16)
	for p := range 1 << 16 {
		m[uint16(p)] = maps.PortVIP | maps.PortBackend
	}
	return m
}

func everySlot() map[uint32]bool {
	m := make(map[uint32]bool, maps.VIPSlots)
	for k := range uint32(maps.VIPSlots) {
		m[k] = true
	}
	return m
}

// PrefiltersDirty reports whether the last write of the prefilters failed
// (PrepareTables retries it): until it succeeds, packets of a new VIP may
// pass the datapath without being balanced.
func (r *Reconciler) PrefiltersDirty() bool { return r.prefiltersDirty }

// TableSize is the largest Maglev table size.
func (r *Reconciler) TableSize() uint32 { return r.maxTableSize }

// SetTableSize changes the largest Maglev table size. Services whose size
// changes get new tables at their next ProgramService (forced here).
func (r *Reconciler) SetTableSize(n uint32) error {
	if err := maglev.ValidateTableSize(n); err != nil {
		return err
	}
	r.maxTableSize = n
	for _, s := range r.byID {
		s.Active, s.Probation = nil, nil // force a rebuild
	}
	return r.prepareTables()
}

// sizeLadder are the table sizes services get: primes, each about twice
// the last, so a service's size changes only when its endpoint count
// doubles.
var sizeLadder = []uint32{1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071, 262139, 524287, 1048573}

// sizeFor picks the table size for n endpoints: the smallest size of the
// ladder with at least 100 slots per endpoint (Maglev's rule for shares
// within 1%), capped at the configured maximum. Small services thus cost
// 4 KiB per table, not 64 KiB.
func (r *Reconciler) sizeFor(n int) uint32 {
	want := uint64(n) * 100
	for _, p := range sizeLadder {
		if p > r.maxTableSize {
			break
		}
		if uint64(p) >= want {
			return p
		}
	}
	return r.maxTableSize
}

// nextTable is which of s's two tables the next ProgramService fills:
// the one not live.
func nextTable(s *Service) uint32 {
	if s.value.TableSize == 0 {
		return s.value.Table & 1
	}
	return 1 - s.value.Table&1
}

// prepareTables installs, in one batch, the empty tables the next
// ProgramService of each service will fill, where they are missing or of
// the wrong size: replacing an inner map costs an RCU grace period per
// update call, so doing it here for all services at once keeps it off
// the path of an ejection and makes programming many services fast.
func (r *Reconciler) prepareTables() error {
	return r.prepare(func(yield func(*Service) bool) {
		for _, s := range r.byID {
			if !yield(s) {
				return
			}
		}
	})
}

// PrepareTables installs, in one batch, the spare tables that flips since
// the last call left missing or of the wrong size, and retries deletions
// that failed. The agent calls it after programming and periodically, so
// an ejection finds its spare table ready.
func (r *Reconciler) PrepareTables() error {
	pending := r.spare
	r.spare = map[uint32]bool{}
	err := r.prepare(func(yield func(*Service) bool) {
		for id := range pending {
			if s, ok := r.byID[id]; ok && !yield(s) {
				return
			}
		}
	})
	if r.prefiltersDirty {
		err = errors.Join(err, r.syncPrefilters())
	}
	return errors.Join(r.retryDeletes(), err)
}

func (r *Reconciler) retryDeletes() error {
	var errs []error
	for id, key := range r.deleting {
		if err := r.w.DeleteService(maps.ServiceKey(key.VIP, key.Port, uint8(key.Protocol)), id); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(r.deleting, id)
		r.retiredSvc[id] = r.clk.Now()
		r.retiredKey[id] = key
	}
	return errors.Join(errs...)
}

func (r *Reconciler) prepare(services iter.Seq[*Service]) error {
	var reqs []maps.TableInstall
	var svcs []*Service
	for s := range services {
		if len(s.Backends) == 0 {
			continue
		}
		size, n := r.sizeFor(len(s.Backends)), nextTable(s)
		if s.sizes[n] != size {
			reqs = append(reqs, maps.TableInstall{SvcID: s.ID, N: n, Size: size})
			svcs = append(svcs, s)
		}
	}
	if err := r.w.InstallTables(reqs); err != nil {
		return err
	}
	for i, s := range svcs {
		s.sizes[reqs[i].N] = reqs[i].Size
	}
	return nil
}

// Service returns the programmed service with id.
func (r *Reconciler) Service(id uint32) (*Service, bool) {
	s, ok := r.byID[id]
	return s, ok
}

// ServiceByKey returns the programmed service for key.
func (r *Reconciler) ServiceByKey(k desired.Key) (*Service, bool) {
	s, ok := r.services[k]
	return s, ok
}

// Services returns programmed services ordered by id.
func (r *Reconciler) Services() []*Service {
	out := make([]*Service, 0, len(r.byID))
	for _, s := range r.byID {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Backend returns the backend with id (removed ones included).
func (r *Reconciler) Backend(id uint32) (*Backend, bool) {
	b, ok := r.backends[id]
	return b, ok
}

// ProgramService writes a service's admission into the kernel: backend
// states, the fallback table and the Maglev table. active and probation
// are backend ids of the service; failOpen admits every endpoint.
//
// Writes are ordered so that no new flow can reach an endpoint the agent
// is taking out, and none is turned away from one it is putting in:
// endpoints leaving are marked ejected first (the kernel steers around
// them at once), the fallback table exists before any endpoint enters
// probation, and the new table goes in last.
func (r *Reconciler) ProgramService(id uint32, active, probation []uint32, failOpen bool) error {
	s, ok := r.byID[id]
	if !ok {
		return fmt.Errorf("program service %d: unknown", id)
	}
	if failOpen {
		active, probation = s.Backends, nil
	}
	if s.FailOpen == failOpen && slices.Equal(s.Active, active) && slices.Equal(s.Probation, probation) && s.Active != nil {
		return nil
	}
	in := map[uint32]maps.BackendState{}
	for _, b := range active {
		in[b] = maps.BackendActive
	}
	for _, b := range probation {
		in[b] = maps.BackendProbation
	}

	var errs []error
	// 1. Out first.
	for _, bid := range s.Backends {
		if _, ok := in[bid]; !ok {
			errs = append(errs, r.setState(bid, maps.BackendEjected))
		}
	}
	// 2. The fallback table, whenever a probe shares the table with others,
	// and kept current once it exists (it must never hold a backend the
	// service no longer has). Without it, no endpoint may enter probation.
	size := r.sizeFor(len(s.Backends))
	if len(active) > 0 && (len(probation) > 0 || s.hasFallback) &&
		(!slices.Equal(s.fallback, active) || s.fallbackSize != size) {
		slots, err := r.build(active, size)
		if err == nil {
			err = r.w.SetFallback(id, slots)
		}
		if err != nil {
			return fmt.Errorf("program service %s: fallback table: %w", s.Spec.Name, errors.Join(append(errs, err)...))
		}
		s.hasFallback = true
		s.fallback = append([]uint32(nil), active...)
		s.fallbackSize = size
	}
	// 3. States of the endpoints going in.
	for _, bid := range s.Backends {
		if st, ok := in[bid]; ok {
			errs = append(errs, r.setState(bid, st))
		}
	}
	// 4. The active backends a circuit breaker scans for room. Entries go
	// first; the service's backend_count, written with the table below,
	// makes them visible.
	if !slices.Equal(s.listed, active) {
		err := r.w.SetServiceBackends(id, s.listed, active)
		if err == nil {
			s.listed = append(make([]uint32, 0, len(active)), active...)
		}
		errs = append(errs, err)
	}
	// 5. The table: fill the one not live, then flip the service to it
	// (its table index and size change in one value update). A table is
	// only installed here if prepareTables could not do it beforehand.
	all := append(append([]uint32(nil), active...), probation...)
	if len(all) > 0 {
		n := nextTable(s)
		var err error
		if s.sizes[n] != size {
			err = r.w.InstallTables([]maps.TableInstall{{SvcID: id, N: n, Size: size}})
			if err == nil {
				s.sizes[n] = size
			}
		}
		var slots []uint32
		if err == nil {
			slots, err = r.build(all, size)
		}
		if err == nil {
			err = r.w.FillTable(id, n, slots)
		}
		if err == nil {
			err = r.writeService(s, n, size)
		}
		if err == nil && s.sizes[1-n] != size {
			r.spare[id] = true
		}
		errs = append(errs, err)
	} else {
		// No endpoint at all: no table, the service drops new flows (counted).
		errs = append(errs, r.writeService(s, s.value.Table, 0))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("program service %s: %w", s.Spec.Name, err)
	}
	s.Active = append(make([]uint32, 0, len(active)), active...)
	s.Probation = append([]uint32(nil), probation...)
	s.FailOpen = failOpen
	return nil
}

// setState writes a backend's kernel state when it changes. Entering
// probation grants ProbeGrants flows; staying in probation grants nothing
// new, so a probe the kernel already admitted is not repeated.
func (r *Reconciler) setState(id uint32, st maps.BackendState) error {
	b := r.backends[id]
	if b.State == st {
		return nil
	}
	grants := int32(0)
	if st == maps.BackendProbation {
		grants = ProbeGrants
	}
	if err := r.w.SetBackend(id, maps.NewBackend(b.Addr, b.Service, st, grants)); err != nil {
		return fmt.Errorf("backend %s: %w", b.Addr, err)
	}
	b.State = st
	return nil
}

// writeService writes s's pb_services entry when it changed: table n of
// tableSize slots is live (tableSize 0: none).
func (r *Reconciler) writeService(s *Service, n, tableSize uint32) error {
	spec := &s.Spec
	v := bpf.LbSvcValue{Id: s.ID, Table: n, TableSize: tableSize, MaxInflight: spec.MaxInflight,
		MaxInflightPerBackend: spec.MaxInflightPerEndpoint, BackendCount: uint32(len(s.listed))}
	if spec.RetryRefused {
		v.Flags |= maps.ServiceRetryRefused
	}
	if v == s.value {
		return nil
	}
	if err := r.w.UpsertService(maps.ServiceKey(spec.Key.VIP, spec.Key.Port, uint8(spec.Key.Protocol)), v); err != nil {
		return fmt.Errorf("service %s: %w", spec.Name, err)
	}
	s.value = v
	return nil
}

// Regrant gives an endpoint in probation a fresh probe: its last probe
// ended without a verdict (a failure of a kind that does not count, or
// events lost), or the kernel's entry drifted. It rewrites the entry
// whatever the reconciler believes it holds.
func (r *Reconciler) Regrant(id uint32) error {
	b, ok := r.backends[id]
	if !ok || b.State != maps.BackendProbation {
		return nil
	}
	return r.w.SetBackend(id, maps.NewBackend(b.Addr, b.Service, maps.BackendProbation, ProbeGrants))
}

// build computes a Maglev table over the given backends. Keys are the
// endpoint addresses, so the table depends only on the set, not on ids or
// order, and a restarted agent rebuilds it byte for byte.
func (r *Reconciler) build(ids []uint32, size uint32) ([]uint32, error) {
	r.keys = r.keys[:0]
	for _, id := range ids {
		r.keys = append(r.keys, r.backends[id].Addr.String())
	}
	b := r.builders[size]
	if b == nil {
		b = maglev.NewBuilder(size)
		r.builders[size] = b
	}
	slots, err := b.Build(r.keys, r.slots[size])
	if err != nil {
		return nil, err
	}
	r.slots[size] = slots
	out := make([]uint32, len(slots))
	for i, idx := range slots {
		out[i] = ids[idx]
	}
	return out, nil
}

// Sweep frees ids of removed services and backends whose cooldown is over
// and that no conntrack entry refers to, and drops their port roles.
func (r *Reconciler) Sweep(inUse InUse) {
	if inUse.Incomplete {
		return
	}
	now := r.clk.Now()
	freed := 0
	for id, b := range r.backends {
		if b.State != maps.BackendRemoved || now.Sub(b.RemovedAt) < r.cooldown || inUse.Backends[id] {
			continue
		}
		if err := r.w.ClearBackend(id); err != nil {
			r.log.Error("clear backend", "id", id, "err", err)
			continue
		}
		delete(r.backends, id)
		r.beIDs.put(id)
		freed++
	}
	for id, at := range r.retiredSvc {
		if _, pending := r.deleting[id]; pending {
			continue
		}
		if now.Sub(at) >= r.cooldown && !inUse.Services[id] {
			delete(r.retiredSvc, id)
			delete(r.retiredKey, id)
			r.svcIDs.put(id)
		}
	}
	r.inUseVIPs = inUse.VIPs
	if err := r.syncPrefilters(); err != nil {
		r.log.Error("sync prefilters", "err", err)
	}
}

// InUse are the ids live conntrack entries refer to: their events and
// counters would be misattributed if the ids were handed out again.
type InUse struct {
	Services, Backends map[uint32]bool
	// VIPs are the forward entries' destinations: VIP address and port.
	VIPs map[netip.AddrPort]bool
	// Incomplete: the scan failed part way; nothing may be freed.
	Incomplete bool
}

// idPool hands out ids 1..max-1 (0 means "none" in the maps), reusing
// freed ones before fresh ones.
type idPool struct {
	max  uint32
	next uint32
	free []uint32
	used map[uint32]bool
}

func newIDPool(max uint32) idPool {
	return idPool{max: max, next: 1, used: map[uint32]bool{}}
}

func (p *idPool) get() (uint32, bool) {
	for len(p.free) > 0 {
		id := p.free[len(p.free)-1]
		p.free = p.free[:len(p.free)-1]
		if !p.used[id] {
			p.used[id] = true
			return id, true
		}
	}
	for p.next < p.max {
		id := p.next
		p.next++
		if !p.used[id] {
			p.used[id] = true
			return id, true
		}
	}
	return 0, false
}

// take reserves a specific id (adoption).
func (p *idPool) take(id uint32) bool {
	if id == 0 || id >= p.max || p.used[id] {
		return false
	}
	p.used[id] = true
	return true
}

func (p *idPool) put(id uint32) {
	if p.used[id] {
		delete(p.used, id)
		p.free = append(p.free, id)
	}
}
