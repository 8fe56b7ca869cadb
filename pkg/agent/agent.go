// Package agent is penaltybox's decision loop as a library: it applies a
// desired state to the datapath, judges the outcome events the datapath
// reports, and writes failure accrual's decisions back, through
// pkg/reconcile, the one writer of the maps.
//
//	desired state ─► Apply ─► reconcile ─► maps ─► kernel
//	kernel ─► HandleEvents ─► outcomes ─► accrual ─► reconcile ─► maps
//	Advance (deadlines), Maintain (retries, probe watchdog), Sweep (ids)
//
// Every entry point (Apply, ApplyConfig, HandleEvents, Advance, Maintain,
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
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/metrics"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
)

// Stats reads the datapath's counters (pkg/maps implements it).
type Stats interface {
	GlobalStats() (bpf.LbGlobalStats, error)
	ServiceStats(id uint32) (bpf.LbSvcStats, error)
	BackendStats(id uint32) (bpf.LbBeStats, error)
	SYNGuardStats() (bpf.LbSynGuardCpu, error)
	NFForgotten() (maps.NFForgotten, error)
	AffinityFill() (entries, capacity int, err error)
}

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

// Events is the ring buffer reader, as far as the agent needs it.
type Events interface {
	// Offset converts the kernel's CLOCK_MONOTONIC timestamps to Unix time.
	Offset() int64
	// Undecodable counts records that did not decode.
	Undecodable() uint64
	// CaughtUp is a time up to which every event has been handed over.
	CaughtUp() time.Time
}

// Transition is an accrual transition with the names of what it concerns.
type Transition struct {
	Service  string
	Endpoint string // the endpoint's name (a pod), if it has one
	Addr     netip.AddrPort
	accrual.Transition
}

// Notify hears of every accrual transition of a service that still exists,
// after the maps were written (Kubernetes Events). It must not block.
type Notify func(Transition)

// Config is what an Agent is built from.
type Config struct {
	Log      *slog.Logger
	Clock    clock.WithTicker
	Writer   reconcile.Writer
	Stats    Stats
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

// Replayer replays the SYN client sent to vip, which backend refused
// (pkg/replay).
type Replayer interface {
	Replay(client, vip, backend netip.AddrPort) error
}

// Agent owns the reconciler, the accrual engine and the outcome tracker.
type Agent struct {
	log      *slog.Logger
	clk      clock.WithTicker
	stats    Stats
	inflight Inflight
	sweeper  Sweeper
	hooks    Hooks
	link     func(string) (LinkInfo, error)
	metrics  *metrics.Metrics
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

	mu      sync.RWMutex
	rec     *reconcile.Reconciler
	engine  *accrual.Engine
	tracker *outcomes.Tracker
	// policy[backend id] judges that backend's outcomes (dense, hot path).
	policy     []outcomes.Policy
	interfaces []string
	events     Events
	monoOffset int64
	// heartbeatErr: the last heartbeat write failed (logged once).
	heartbeatErr bool
	eventTypes   [16]interface{ Inc() }
	replayer     Replayer
	// replayErr: a replay failure has been logged (the metric counts the
	// rest).
	replayErr bool
	// tripNow is the backend whose kernel trip is being handled (noTrip:
	// none), so its ejection's log line says so.
	tripNow uint32
	// tripsHandled counts, per service, the kernel trips the agent has
	// dealt with, against pb_svc_trip.trips: the difference is trips whose
	// events are unread (or lost).
	tripsHandled map[uint32]uint64
	// handshakes: per service, recent handshake times (unanswered.go).
	handshakes map[uint32]*handshakes
	// deadlines tells Run that handled events brought a deadline earlier
	// than the one its timer is armed for (armed).
	deadlines chan struct{}
	armed     time.Time
	// probeSeen: when each backend's last probe flow started (watchdog).
	probeSeen map[uint32]time.Time
	// retry: services whose last programming failed (Maintain retries).
	retry              map[uint32]bool
	overflowSeen       uint64
	badSeen            uint64
	maxInflightDefault uint32
	notify             Notify
	// restored: the first Apply adopted the persisted accrual state.
	restored bool
	// begun: when Begin ran, on the events' clock.
	begun time.Time
	// lostSeen: pb_stats events_lost at the last look; withheldSeen the
	// tracker's Withheld carried into the metric.
	lostSeen, withheldSeen, withheldOldSeen uint64
	withheldHere                            uint64 // withheld by observe: flood, service-wide
	// timeouts: per service, which endpoints timed out lately (peers.go).
	timeouts map[uint32]*svcTimeouts
	// shedding: services whose new flows the tracker's caps leave
	// untracked lately (outcomes.go).
	shedding map[shedKey]*shedSpell
	flood    struct {
		on          bool
		since, last time.Time
		withheld    uint64
		// dropped: the SYN guard's drops at the last look (looked), and
		// when flood mode began.
		dropped, droppedAtStart uint64
		looked                  time.Time
		// armed: the datapath's own armings at the last look.
		armed uint64
	}
	// guard: the SYN guard's settings (evidence.go); guardErr: its last
	// write failed (logged once).
	guard    maps.SYNGuard
	guardErr bool
}

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
	rec, err := reconcile.New(c.Writer, reconcile.Options{
		MaxServices: c.MaxServices, MaxBackends: c.MaxBackends, TableSize: c.TableSize,
		Clock: c.Clock, Logger: c.Log, InUse: swept.InUse, NoKernelTrips: c.NoKernelTrips,
		TakeoverGrace: c.TakeoverGrace, HandBack: handBack,
	})
	if err != nil {
		return nil, err
	}
	a := &Agent{
		log:                c.Log,
		clk:                c.Clock,
		stats:              c.Stats,
		inflight:           c.Inflight,
		sweeper:            c.Sweeper,
		hooks:              c.Hooks,
		link:               c.Link,
		links:              map[string]int{},
		rec:                rec,
		engine:             accrual.New(c.Clock, nil),
		probeSeen:          map[uint32]time.Time{},
		deadlines:          make(chan struct{}, 1),
		retry:              map[uint32]bool{},
		timeouts:           map[uint32]*svcTimeouts{},
		shedding:           map[shedKey]*shedSpell{},
		maxInflightDefault: c.MaxInflightDefault,
		replayer:           c.Replayer,
		tripsHandled:       map[uint32]uint64{},
		handshakes:         map[uint32]*handshakes{},
		monoOffset:         outcomes.MonoOffset(),
		guard:              c.SYNGuard,
	}
	a.every.probes, a.every.sweep = c.ProbeCheck, c.SweepEvery
	if swept.Expired > 0 || swept.Released > 0 {
		a.log.Info("expired stale flows", "flows", swept.Expired, "released", swept.Released)
	}
	a.tracker = outcomes.NewTracker(a.policyOf)
	a.tracker.OnUnanswered = a.unansweredDatagram
	a.tracker.MaxPending, a.tracker.MaxPendingPerService = TrackerLimits(c.TrackerMemory)
	a.tracker.SetConnectShare(floodShare)
	a.metrics = metrics.New(a, a.log)
	a.metrics.TrackedFlowsLimit.Set(float64(a.tracker.MaxPending))
	a.metrics.MaxInflightDefault.Set(float64(a.maxInflightDefault))
	for _, t := range []outcomes.Type{outcomes.NewFlow, outcomes.Established, outcomes.Refused,
		outcomes.Reset, outcomes.SynRetrans, outcomes.FlowEnd, outcomes.FirstData} {
		a.eventTypes[t] = a.metrics.Events.WithLabelValues(t.String())
	}
	return a, nil
}

// Metrics are the agent's Prometheus metrics and registry.
func (a *Agent) Metrics() *metrics.Metrics { return a.metrics }

// SetNotify sets who hears of transitions (before Begin).
func (a *Agent) SetNotify(n Notify) {
	a.mu.Lock()
	a.notify = n
	a.mu.Unlock()
}

// Begin is called once the first desired state is programmed (with the
// accrual state from before a restart, which the first Apply adopts) and
// XDP is attached: it reports ready. Outcome events are handed to
// HandleEvents from then on.
func (a *Agent) Begin(ev Events) {
	a.mu.Lock()
	a.events = ev
	a.monoOffset = ev.Offset()
	// A pinned ring may hold events from while no agent ran: they are
	// evidence as they come, but a connect deadline of a connection that
	// started then is not (events may have been lost unseen), and a
	// failure seen then has no reaction time of this agent's.
	a.begun = time.Unix(0, outcomes.MonoNow()+ev.Offset())
	a.tracker.NotBefore = a.begun
	// Losses before this process are no news to it.
	if gs, err := a.stats.GlobalStats(); err == nil {
		a.lostSeen = gs.EventsLost
	}
	// A guard a previous agent left on is not this one's flood; a CPU
	// that sees one arms it meanwhile. Armings before now are no news.
	a.setGuard(false)
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
	failing, dirty := len(a.retry), a.rec.PrefiltersDirty()
	a.mu.RUnlock()
	if failing > 0 {
		return fmt.Errorf("%d services could not be programmed (retrying; see the log)", failing)
	}
	if dirty {
		return fmt.Errorf("the prefilter maps (pb_ports, pb_vip_slots) could not be written (retrying; see the log)")
	}
	return nil
}

func (a *Agent) policyOf(backend uint32) outcomes.Policy {
	if int(backend) < len(a.policy) {
		return a.policy[backend]
	}
	return outcomes.Policy{}
}

func (a *Agent) endpointName(id uint32) string {
	b, ok := a.rec.Backend(id)
	if !ok {
		return fmt.Sprintf("backend-%d", id)
	}
	if b.Name != "" {
		return b.Name + " (" + b.Addr.String() + ")"
	}
	return b.Addr.String()
}
