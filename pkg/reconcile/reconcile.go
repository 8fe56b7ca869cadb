// SPDX-License-Identifier: Apache-2.0

// Package reconcile turns the desired state and each endpoint's admission
// (from failure accrual) into the contents of the datapath's maps: service
// entries, backend entries with their states, Maglev tables, the
// prefilters, the interface maps and the accrual state persisted for a
// restart. It is the agent's one writer of the maps. It owns the service and backend ids, adopting those a previous agent left
// in the pinned maps so that a restart changes nothing in the kernel.
package reconcile

import (
	"cmp"
	"log/slog"
	"net/netip"
	"slices"
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

// Writer is the maps the reconciler writes, one small interface per map
// (pkg/maps); *maps.Maps implements it, and tests use pkg/maps/mapsfake.
// The reconciler is the agent's only writer of the maps: whatever the
// agent decides reaches the kernel through it. (The conntrack sweep,
// pkg/conntrack, expires the datapath's own flow entries, as Cilium's
// conntrack GC does.)
type Writer interface {
	maps.ServiceMap
	maps.BackendMap
	maps.TableMap
	maps.PrefilterMap
	maps.TripMap        // kernel trips (program.go): the datapath's own ejections
	maps.PersistedState // accrual state kept across restarts (persist.go)
	maps.InterfaceMap   // interfaces and settings (interfaces.go)
	maps.SYNGuardMap    // the SYN guard (synguard.go)
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

	value bpf.LbSvcValue // last written pb_services value
	// takenOver: when the service was taken from kube-proxy (first served,
	// or adopted with ServiceTakenOver set); zero once the grace is over.
	takenOver time.Time
	listed    []uint32  // last written pb_svc_backends list
	sizes     [2]uint32 // slots of the service's two installed tables (0: none)
	// hasFallback: the service has a fallback table, holding a table over
	// fallback (the active backends when it was last written).
	hasFallback  bool
	fallback     []uint32
	fallbackSize uint32
	// mark is the Reconciler's gen of the last Apply that listed it.
	mark uint64
	// given is the endpoints slice of the desired state Spec came from
	// (Spec shares it until an endpoint it could not write is dropped):
	// the same slice again is the same endpoints.
	given []desired.Endpoint
}

// Backend is one (service, endpoint) pair's kernel entry.
type Backend struct {
	ID      uint32
	Service uint32
	Addr    netip.AddrPort
	Name    string
	// State: BackendRemoved once it left the desired state (when:
	// Reconciler.removedAt).
	State maps.BackendState
	// Tripped: the datapath ejected it on its own (a kernel trip) since
	// its entry was last written here, so the kernel holds "ejected"
	// whatever State says; the next write of its state is not skipped.
	Tripped bool
	// clean: its id's counters were never written (idPool.get), so
	// flushBackends need not zero them.
	clean bool
}

// Reconciler programs maps. Not safe for concurrent use: the agent's loop
// owns it.
type Reconciler struct {
	w        Writer
	config   maps.Config // pb_config_v2 as last written
	log      *slog.Logger
	clk      clock.PassiveClock
	cooldown time.Duration
	noTrips  bool
	takeover time.Duration // Options.TakeoverGrace
	guard    maps.SYNGuard // Options.SYNGuard

	maxTableSize uint32
	maxHandles   int // Options.MaxTableHandles, resolved
	builders     map[uint32]*maglev.Builder
	slots        map[uint32][]int32
	tables       map[uint32][]uint32 // build's output by size, reused (the writes copy it)
	keys         []string

	services map[desired.Key]*Service
	byID     map[uint32]*Service
	backends backendTable
	// removedAt: when each removed backend left the desired state (Sweep
	// frees its id: see free). Kept beside Backend, not in it: removed
	// backends are few, and the field took each of 100,000 records from
	// 64 to 96 bytes.
	removedAt map[uint32]retirement
	// retired: ids of removed services and backends, reusable once Sweep
	// frees them (see free).
	retiredSvc map[uint32]retirement
	// retiredBe: backend ids live flows referred to at start that no
	// pinned backend holds (pb_backends recreated for a new
	// --max-backends beside a kept conntrack table). Handed out again,
	// such an id would take the old flows' outcome events and kernel
	// trips for another endpoint; kept like removed backends' until no
	// flow refers to them.
	retiredBe map[uint32]retirement
	// retiredKey: the key of each retired service whose key is known. Its
	// VIP port (pb_ports) and address (pb_vip_slots) stay marked until the
	// id is freed, so a removed service's established flows keep their NAT
	// (as conntrack keeps kube-proxy's) whether or not another service
	// shares the port or address.
	retiredKey map[uint32]desired.Key
	// inUseVIPs: the VIPs conntrack held live flows to at either of the
	// last two sweeps (lastVIPs: the last one's; see free for why one is
	// not enough); they stay marked too (flows outlive the cooldown, and
	// an agent restart forgets retiredKey).
	inUseVIPs, lastVIPs map[netip.AddrPort]bool
	// walks: the conntrack walks begun (BeginSweep).
	walks SweepMark
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
	// handingBack: removed services whose pb_services entry stays, flagged
	// maps.ServiceHandedBack, until the kernel's conntrack has forgotten
	// their flows (see handBack); by id.
	handingBack map[uint32]*handBack
	handBackFor time.Duration // Options.HandBack
	// spare: services whose spare table must be (re)installed before
	// their next change (after a flip to a new size, or at start).
	spare map[uint32]bool
	// applied: Apply ran once (it adopts every service the first time);
	// touched: the services the running Apply found new or changed.
	applied bool
	touched []*Service
	gen     uint64
	// dropped: a backend marked in the prefilters could not be written
	// and was dropped (the next sync rebuilds them).
	dropped bool
	svcIDs  idPool
	beIDs   idPool
	ports   map[uint16]uint8
}

// Options configure a Reconciler.
type Options struct {
	MaxServices, MaxBackends uint32
	// TableSize is the largest Maglev table a service gets (a prime).
	TableSize uint32
	// Cooldown keeps removed ids out of reuse, so a quickly re-added service
	// or endpoint never inherits a stale count or a late event.
	Cooldown time.Duration
	// InUse are ids live flows refer to at start. Ids among them that no
	// pinned service or backend holds (removed before a restart, or their
	// map recreated at a new size) stay out of reuse like retired ones.
	InUse InUse
	// NoKernelTrips keeps the datapath from ejecting backends itself: the
	// agent's accrual alone decides (an operator's switch, and the
	// baseline kernel trips are measured against).
	NoKernelTrips bool
	// TakeoverGrace is how long a service newly served (taken from
	// kube-proxy) leaves the TCP flows it has no entry for to kube-proxy:
	// they are kube-proxy's, begun before (maps.ServiceTakenOver). 0: none
	// (standalone: no kube-proxy to leave them to).
	TakeoverGrace time.Duration
	// HandBack is how long a removed service's entry stays after its last
	// live flow, flagged maps.ServiceHandedBack: its new flows pass to
	// kube-proxy, and the datapath clears the kernel's conntrack of its
	// finished flows on their tuples. The kernel keeps a flow it picked up
	// unacknowledged for 5 minutes. 0: deleted at once.
	HandBack time.Duration
	// SYNGuard is the SYN guard's budget and trust (GuardSYNs); its Lease
	// is set at each write.
	SYNGuard maps.SYNGuard
	// MaxTableHandles bounds the Maglev tables the agent keeps a handle
	// on (an open file each; two per service by default, so that a change
	// fills the spare table in place). Past it, live tables' handles are
	// released: those services get a fresh spare at their next change.
	// 0: from RLIMIT_NOFILE, less a reserve for everything else.
	MaxTableHandles int
	// Fresh: the maps were created empty for this reconciler, with no
	// pin kept from before (datapath.Fresh): there is nothing to adopt,
	// and an id's counters need no zeroing before its first use. Reading
	// and zeroing 262,144 backends' worth of empty maps was a tenth of a
	// cold start's first write.
	Fresh  bool
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
		noTrips:      opts.NoKernelTrips,
		takeover:     opts.TakeoverGrace,
		guard:        opts.SYNGuard,
		maxTableSize: opts.TableSize,
		maxHandles:   cmp.Or(opts.MaxTableHandles, handlesFromLimit()),
		builders:     map[uint32]*maglev.Builder{},
		slots:        map[uint32][]int32{},
		tables:       map[uint32][]uint32{},
		services:     map[desired.Key]*Service{},
		byID:         map[uint32]*Service{},
		removedAt:    map[uint32]retirement{},
		retiredSvc:   map[uint32]retirement{},
		retiredBe:    map[uint32]retirement{},
		retiredKey:   map[uint32]desired.Key{},
		inUseVIPs:    opts.InUse.VIPs,
		lastVIPs:     opts.InUse.VIPs,
		deleting:     map[uint32]desired.Key{},
		handingBack:  map[uint32]*handBack{},
		handBackFor:  opts.HandBack,
		spare:        map[uint32]bool{},
		svcIDs:       newIDPool(opts.MaxServices, opts.Fresh),
		beIDs:        newIDPool(opts.MaxBackends, opts.Fresh),
	}
	if opts.Fresh {
		r.ports, r.vipSlots = map[uint16]uint8{}, map[uint32]bool{}
	} else if err := r.adopt(); err != nil {
		return nil, err
	}
	for id := range opts.InUse.Services {
		if _, ok := r.byID[id]; !ok && r.svcIDs.take(id) {
			r.retiredSvc[id] = r.retiredAt(r.clk.Now())
		}
	}
	for id := range opts.InUse.Backends {
		if _, ok := r.backends.lookup(id); !ok && r.beIDs.take(id) {
			r.retiredBe[id] = r.retiredAt(r.clk.Now())
		}
	}
	return r, nil
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
	return r.ServicesWhere(func(*Service) bool { return true })
}

// ServicesWhere returns the programmed services keep accepts, ordered by
// id. Only those are sorted: the periodic scans that act on a few of
// 10,000 services (sorting them all, every two seconds, was most of an
// idle agent's CPU).
func (r *Reconciler) ServicesWhere(keep func(*Service) bool) []*Service {
	var out []*Service
	for _, s := range r.byID {
		if keep(s) {
			out = append(out, s)
		}
	}
	slices.SortFunc(out, func(a, b *Service) int { return cmp.Compare(a.ID, b.ID) })
	return out
}

// Backend returns the backend with id (removed ones included).
func (r *Reconciler) Backend(id uint32) (*Backend, bool) {
	return r.backends.lookup(id)
}
