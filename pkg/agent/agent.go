// SPDX-License-Identifier: Apache-2.0

// Package agent is penaltybox's decision loop as a library: it applies a
// desired state to the datapath, judges the outcome events the datapath
// reports, and writes failure accrual's decisions back, through
// pkg/reconcile, the one writer of the maps.
//
//	desired state ─► Apply ─► reconcile ─► maps ─► kernel
//	kernel ─► HandleEvents ─► outcomes ─► accrual ─► reconcile ─► maps
//	Advance (deadlines), Maintain (retries, probe watchdog), Sweep (ids)
//
// The entry points are Agent's (events.go, loop.go, apply.go, maintain.go,
// attach.go, views.go, fleetsource.go); what they decide is done by the
// loop's features, each a small type in the file named for it, calling
// only downwards:
//
//	events.go       HandleEvents: one event's path, step by step
//	counts.go       events and the tracker's counts into Prometheus
//	shedding.go     spells of new flows left untracked
//	trips.go        the kernel-trip hand-off: adopt, undo, lost trips, budget
//	observe.go      an outcome weighed before accrual hears of it
//	transitions.go  accrual's decisions written, logged, persisted, reported
//	replays.go      refused and unanswered SYNs replayed; replay deadlines
//	servicewide.go  a service's trouble told from an endpoint's
//	flood.go        flood mode and the SYN guard
//	probes.go       the probation watchdog
//	persist.go      accrual state kept across restarts
//	core.go         what they all share: reconciler, engine, tracker, policy
//
// Every entry point (Apply, HandleEvents, Advance, Maintain,
// SweepDone, the views) takes the agent's one mutex, mu, for as long as it
// looks at or changes the reconciler, the accrual engine or the outcome
// tracker: the ring-buffer reader's goroutine calls HandleEvents itself (a
// hand-off to the loop would put a goroutine wake-up on every ejection's
// path), Run's goroutine calls the rest. Attaching XDP to interfaces is
// serialised by a second lock, hooksMu, taken before mu and never while
// holding it: attachments (milliseconds each) run without mu, so outcomes
// do not wait for them, and mu is taken only to publish the result.
package agent

import (
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/metrics"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
)

// Inflight reads the circuit breaker's live flow counts (maps.Inflight).
type Inflight interface {
	Service(id uint32) int64
	Backend(id uint32) int64
}

// Sweeper expires idle flows and reports the ids live flows use
// (conntrack.Reaper). Its sweeps never overlap.
type Sweeper interface {
	Sweep() (conntrack.Result, error)
}

// Hooks are the datapath's XDP attachments (datapath.Datapath).
type Hooks interface {
	Attach(ifname string) error
	Detach(ifname string) error
	Attached() []string
}

// Config is what an Agent is built from.
type Config struct {
	Log      *slog.Logger
	Clock    clock.WithTicker
	Writer   reconcile.Writer
	Stats    maps.Counters
	Inflight Inflight
	Sweeper  Sweeper
	Hooks    Hooks
	// Link resolves an interface by name (nil: netlink).
	Link func(name string) (LinkInfo, error)

	MaxServices, MaxBackends uint32
	// TableSize is the largest Maglev table a service gets.
	TableSize uint32
	// MaxInflightDefault is the circuit-breaker limit of services that set
	// none (a config file's defaults.maxInflight replaces it).
	MaxInflightDefault uint32
	// Replayer sends a refused flow's SYN again at once (nil: the client's
	// own retransmission does, about a second later).
	Replayer Replayer
	// NoKernelTrips: the datapath never ejects a backend itself (see
	// reconcile.Options).
	NoKernelTrips bool
	// ProbeCheck is how often Run looks for stalled probation and retries
	// failed writes (default 2s); SweepEvery how often it sweeps conntrack
	// (default 10s).
	ProbeCheck, SweepEvery time.Duration
	// SYNGuard is the SYN guard's budget and trust, on while the agent is
	// in flood mode (Rate 0: never on). Its Lease is the agent's to set.
	SYNGuard maps.SYNGuard
	// TrackerMemory is the node's ceiling on the memory of the flows the
	// agent tracks, in bytes (0: DefaultTrackerMemory); see TrackerLimits.
	TrackerMemory int64
	// TakeoverGrace: see reconcile.Options.TakeoverGrace.
	TakeoverGrace time.Duration
	// Fresh: the maps were created empty (reconcile.Options.Fresh).
	Fresh bool
}

// DefaultTrackerMemory is the default ceiling of the tracked flows'
// memory: 104,857 flows at outcomes.EntryBytes, ten times the connects a
// flood mode needs and far more than a busy node waits on, within the
// agent's default soft memory limit (96 MiB).
const DefaultTrackerMemory = 64 << 20

// servicesToFill is how many services at their cap fill the node's
// tracker: each service may have this fraction of the ceiling waiting
// for a verdict.
const servicesToFill = 16

// TrackerLimits are the tracker's ceiling (flows) for memory bytes, and
// each service's cap on flows waiting for a verdict.
func TrackerLimits(memory int64) (flows, perService int) {
	if memory <= 0 {
		memory = DefaultTrackerMemory
	}
	flows = int(max(memory/outcomes.EntryBytes, 1))
	return flows, max(flows/servicesToFill, 1)
}

// Agent owns the decision loop: the lock every entry point takes, Run,
// the wiring of the loop's features, and the views. What it decides is in
// the features, each in the file named for it (see core.go).
type Agent struct {
	// core: what every feature works with (under mu).
	core
	inflight Inflight
	sweeper  Sweeper
	hooks    Hooks
	link     func(string) (LinkInfo, error)
	every    struct{ probes, sweep time.Duration }

	// ready: the first desired state is programmed and XDP attached.
	ready atomic.Bool
	// eventsErr: why the ring buffer reader stopped (no more outcomes).
	eventsErr atomic.Pointer[error]
	// hooksMu serialises XDP attachment (see the package comment).
	hooksMu sync.Mutex
	// links: the Kubernetes attacher's attached links, name → ifindex
	// (under hooksMu).
	links map[string]int

	mu sync.RWMutex
	// The loop's features (under mu).
	counts    eventCounts
	observer  observer
	trips     kernelTrips
	trans     transitions
	flood     floodMode
	wide      serviceWide
	replays   replays
	probes    probes
	persisted persisted
	shed      shedding
	// applied: a desired state was applied (the first one's spare tables
	// are left to PrepareTables; see apply).
	applied bool

	interfaces []string
	// listed: the config file's interfaces as last applied (FollowInterfaces).
	listed listed
	// heartbeatErr: the last heartbeat write failed (logged once).
	heartbeatErr bool
	// deadlines tells Run that handled events brought a deadline earlier
	// than the one its timer is armed for (armed).
	deadlines          chan struct{}
	armed              time.Time
	maxInflightDefault uint32
}

// handBack is how long a service no longer served keeps its entry after
// its last flow, handing new flows to kube-proxy (reconcile.Options
// HandBack): the kernel's conntrack keeps an entry its datapath's
// rewritten replies made, never answered, for
// nf_conntrack_tcp_timeout_unacknowledged (300s) after the flow's last
// packet.
const handBack = 6 * time.Minute

// New builds an agent over maps that may hold a previous agent's state:
// it first sweeps conntrack, so that ids live flows still use are not
// handed out, then adopts what the maps hold.
func New(c Config) (*Agent, error) {
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Clock == nil {
		c.Clock = clock.RealClock{}
	}
	if c.Link == nil {
		c.Link = netlinkLink
	}
	if c.ProbeCheck == 0 {
		c.ProbeCheck = 2 * time.Second
	}
	if c.SweepEvery == 0 {
		c.SweepEvery = 10 * time.Second
	}
	// Expire what went stale while no agent ran, and learn which ids live
	// flows still use before any id is handed out.
	swept, err := c.Sweeper.Sweep()
	if err != nil {
		return nil, err
	}
	logSweepErrs(c.Log, swept)
	rec, err := reconcile.New(c.Writer, reconcile.Options{
		MaxServices: c.MaxServices, MaxBackends: c.MaxBackends, TableSize: c.TableSize,
		Clock: c.Clock, Logger: c.Log, InUse: swept.InUse, NoKernelTrips: c.NoKernelTrips,
		TakeoverGrace: c.TakeoverGrace, HandBack: handBack, SYNGuard: c.SYNGuard, Fresh: c.Fresh,
	})
	if err != nil {
		return nil, err
	}
	a := &Agent{
		core: core{
			log:      c.Log,
			clk:      c.Clock,
			stats:    c.Stats,
			tripMaps: c.Writer,
			rec:      rec,
			engine:   accrual.New(c.Clock, nil),
		},
		inflight:           c.Inflight,
		sweeper:            c.Sweeper,
		hooks:              c.Hooks,
		link:               c.Link,
		links:              map[string]int{},
		deadlines:          make(chan struct{}, 1),
		maxInflightDefault: c.MaxInflightDefault,
	}
	a.every.probes, a.every.sweep = c.ProbeCheck, c.SweepEvery
	if swept.Expired > 0 || swept.Released > 0 {
		a.log.Info("expired stale flows", "flows", swept.Expired, "released", swept.Released)
	}
	a.metrics = metrics.New(a, c.Stats, a.log)
	a.wire(c)
	a.tracker = outcomes.NewTracker(a.policyOf)
	a.tracker.OnUnanswered = a.counts.unansweredDatagram
	a.tracker.MaxPending, a.tracker.MaxPendingPerService = TrackerLimits(c.TrackerMemory)
	a.tracker.SetConnectShare(floodShare)
	a.metrics.TrackedFlowsLimit.Set(float64(a.tracker.MaxPending))
	a.metrics.MaxInflightDefault.Set(float64(a.maxInflightDefault))
	for _, t := range []outcomes.Type{outcomes.NewFlow, outcomes.Established, outcomes.Refused,
		outcomes.Reset, outcomes.SynRetrans, outcomes.FlowEnd, outcomes.FirstData} {
		a.counts.types[t] = a.metrics.Events.WithLabelValues(t.String())
	}
	return a, nil
}

// wire gives each feature the core and the features it works with. The
// features call downwards only: events and trips use transitions, which
// use probes, the service-wide outliers and persisted state; replays and
// the counts read flood mode.
func (a *Agent) wire(c Config) {
	k := &a.core
	a.flood = floodMode{core: k, guard: c.SYNGuard, lease: guardLease(c.ProbeCheck)}
	a.wide = serviceWide{core: k, timeouts: map[uint32]*svcTimeouts{}}
	a.probes = probes{core: k, seen: map[uint32]time.Time{}}
	a.persisted = persisted{core: k}
	a.shed = shedding{core: k, spells: map[shedKey]*shedSpell{}}
	a.replays = replays{core: k, replayer: c.Replayer, handshakes: map[uint32]*handshakes{}, flood: &a.flood}
	a.trans = transitions{core: k, wide: &a.wide, probes: &a.probes, persisted: &a.persisted,
		retry: map[uint32]bool{}, monoOffset: outcomes.MonoOffset()}
	a.trips = kernelTrips{core: k, trans: &a.trans, handled: map[uint32]uint64{}}
	a.trans.budget = a.trips.budget
	a.counts = eventCounts{core: k, flood: &a.flood, shed: &a.shed}
	a.observer = observer{core: k, flood: &a.flood, wide: &a.wide, replays: &a.replays, trans: &a.trans}
}

// Metrics are the agent's Prometheus metrics and registry.
func (a *Agent) Metrics() *metrics.Metrics { return a.metrics }

// SetNotify sets who hears of transitions (before Begin).
func (a *Agent) SetNotify(n Notify) {
	a.mu.Lock()
	a.trans.notify = n
	a.mu.Unlock()
}

// Begin is called once the first desired state is programmed (with the
// accrual state from before a restart, which the first Apply adopts) and
// XDP is attached: it reports ready. Outcome events are handed to
// HandleEvents from then on.
func (a *Agent) Begin(ev Events) {
	a.mu.Lock()
	a.events = ev
	// The reader runs the replay deadlines as it reads (see caughtUp).
	ev.OnCaughtUp(a.caughtUp)
	a.trans.monoOffset = ev.Offset()
	// A pinned ring may hold events from while no agent ran: they are
	// evidence as they come, but a connect deadline of a connection that
	// started then is not (events may have been lost unseen), and a
	// failure seen then has no reaction time of this agent's.
	a.trans.begun = time.Unix(0, outcomes.MonoNow()+ev.Offset())
	a.tracker.NotBefore = a.trans.begun
	// Losses before this process are no news to it.
	if gs, err := a.stats.GlobalStats(); err == nil {
		a.flood.lostSeen = gs.EventsLost
	}
	// A guard a previous agent left on is not this one's flood; a CPU
	// that sees one arms it meanwhile. Armings before now are no news.
	a.flood.setGuard(false)
	if s, err := a.stats.SYNGuardStats(); err == nil {
		a.flood.armed = s.Armed
	}
	a.mu.Unlock()
	a.ready.Store(true)
}

// EventsStopped records that the ring buffer reader stopped for good:
// the datapath still forwards, but no endpoint is judged any more, so the
// agent is not ready (the kubelet restarts it).
func (a *Agent) EventsStopped(err error) {
	a.eventsErr.Store(&err)
	a.log.Error("ring buffer reader stopped", "err", err)
}

// Ready is /readyz: nil once the datapath is attached and programmed and
// every write went through.
func (a *Agent) Ready() error {
	if !a.ready.Load() {
		return fmt.Errorf("datapath not attached and programmed yet")
	}
	if err := a.eventsErr.Load(); err != nil {
		return fmt.Errorf("outcome events no longer read (no failure accrual): %w", *err)
	}
	a.mu.RLock()
	failing, dirty := len(a.trans.retry), a.rec.PrefiltersDirty()
	a.mu.RUnlock()
	if failing > 0 {
		return fmt.Errorf("%d services could not be programmed (retrying; see the log)", failing)
	}
	if dirty {
		return fmt.Errorf("the prefilter maps (pb_ports, pb_vip_slots) could not be written (retrying; see the log)")
	}
	return nil
}
