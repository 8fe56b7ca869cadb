package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"k8s.io/utils/clock"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/admin"
	"github.com/penaltybox/penaltybox/pkg/config"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/metrics"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
)

// run starts the agent in the mode the flags select and runs its loop
// until ctx ends.
func run(ctx context.Context, o options, log *slog.Logger) error {
	if o.configPath != "" {
		return runStandalone(ctx, o, log)
	}
	return runKubernetes(ctx, o, log)
}

// runStandalone is the agent fed by a config file: SIGHUP reloads it.
func runStandalone(ctx context.Context, o options, log *slog.Logger) error {
	// 1. Desired state: a bad config file stops the start, naming the field.
	load := func() (*config.Config, error) {
		cfg, err := config.Load(o.configPath)
		if err == nil && cfg.MaxInflight == nil && o.maxInflightDefault > 0 {
			cfg.MaxInflight = &o.maxInflightDefault
		}
		return cfg, err
	}
	cfg, err := load()
	if err != nil {
		return err
	}
	// 2. Datapath, agent, HTTP.
	a, err := start(ctx, o, log, cfg.MaglevTableSize)
	if err != nil {
		return err
	}
	defer a.close()
	// 3. Maps first, then the XDP hooks, then accrual state from before a
	// restart; then outcomes start flowing.
	if err := a.applyConfig(cfg); err != nil {
		return err
	}
	if err := a.begin(); err != nil {
		return err
	}
	log.Info("datapath ready", "interfaces", cfg.Interfaces, "services", len(cfg.Services))

	// 4. SIGHUP reloads the config file; a bad one leaves the last good one
	// in force.
	reloads := make(chan *config.Config, 1)
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				cfg, err := load()
				if err != nil {
					a.metrics.ConfigReloads.WithLabelValues("error").Inc()
					a.metrics.ConfigLastOK.Set(0)
					log.Error("config reload rejected; the last good config stays in force", "err", err)
					continue
				}
				reloads <- cfg
			}
		}
	}()

	// 5. The loop.
	a.loop(ctx, reloads, nil)
	return a.stop()
}

// start loads (or adopts) the datapath, builds the agent and serves HTTP.
func start(ctx context.Context, o options, log *slog.Logger, tableSize uint32) (*agent, error) {
	o.dp.Logger = log
	dp, err := datapath.Load(o.dp)
	if err != nil {
		return nil, err
	}
	m, err := maps.New(&dp.LbMaps, dp.InnerSpec)
	if err != nil {
		dp.Close()
		return nil, err
	}
	a, err := newAgent(log, clock.RealClock{}, dp, m, dp.Opts, tableSize, o.maxInflightDefault)
	if err != nil {
		dp.Close()
		return nil, err
	}
	srv := admin.New(a.metrics.Registry, a.ready, log)
	srv.JSON("/admin/services", a.servicesView)
	srv.JSON("/admin/endpoints", a.endpointsView)
	srv.JSON("/admin/circuit_breakers", a.circuitBreakersView)
	addr, httpDone, err := srv.Serve(ctx, o.metricsAddr)
	if err != nil {
		dp.Close()
		return nil, fmt.Errorf("--metrics-addr %s: %w", o.metricsAddr, err)
	}
	a.httpDone = httpDone
	log.Info("serving metrics and admin", "addr", addr.String())
	return a, nil
}

// begin is called once the first desired state is programmed: it restores
// accrual state from before a restart, reports ready, and starts reading
// outcomes.
func (a *agent) begin() error {
	a.restoreHealth()
	reader, err := outcomes.NewReader(a.dp.PbEvents)
	if err != nil {
		return err
	}
	a.reader = reader
	a.monoOffset = reader.Offset()
	// The reader's goroutine runs each batch through classification and
	// accrual itself (under the agent's lock, like everything that changes
	// state): a hand-off to the loop would put a goroutine wake-up on the
	// path of every ejection.
	go func() {
		if err := reader.Run(a.handleEvents); err != nil {
			a.log.Error("ring buffer reader stopped", "err", err)
		}
	}()
	a.readyAt.Store(true)
	return nil
}

// stop waits for the HTTP server after the loop returned.
func (a *agent) stop() error {
	a.log.Info("agent stopping; pinned datapath keeps forwarding", "bpffs_root", a.dp.Opts.Root)
	if a.httpDone != nil {
		return <-a.httpDone
	}
	return nil
}

// close releases the agent's handles; pins stay.
func (a *agent) close() {
	if a.reader != nil {
		a.reader.Close()
	}
	a.inflight.Close()
	a.maps.Close()
	a.dp.Close()
}

// agent owns the reconciler, the accrual engine and the outcome tracker.
// Only the loop goroutine changes them; HTTP views read under mu.
type agent struct {
	log     *slog.Logger
	clk     clock.WithTicker
	dp      *datapath.Datapath
	maps    *maps.Maps
	metrics *metrics.Metrics

	mu      sync.RWMutex
	rec     *reconcile.Reconciler
	engine  *accrual.Engine
	tracker *outcomes.Tracker
	// policy[backend id] judges that backend's outcomes (dense, hot path).
	policy []outcomes.Policy

	interfaces []string
	readyAt    atomic.Bool
	monoOffset int64
	eventTypes [16]prometheusCounter
	reader     *outcomes.Reader
	// deadlines tells the loop that handled events brought a deadline
	// earlier than armed, when the loop's timer fires (under mu).
	deadlines chan struct{}
	armed     time.Time
	httpDone  <-chan error
	// probeSeen: when each backend's last probe flow started (watchdog).
	probeSeen map[uint32]time.Time
	// retry: services whose last programming failed (retried every 2s).
	retry              map[uint32]bool
	overflowSeen       uint64
	badSeen            uint64
	inflight           *maps.Inflight
	reaper             *conntrack.Reaper
	maxInflightDefault uint32
	// notify, when set, hears of every accrual transition after the maps
	// were programmed (Kubernetes Events). It must not block.
	notify func(s *reconcile.Service, b *reconcile.Backend, t accrual.Transition)
}

type prometheusCounter interface{ Inc() }

func newAgent(log *slog.Logger, clk clock.WithTicker, dp *datapath.Datapath, m *maps.Maps, o datapath.Options, tableSize, maxInflightDefault uint32) (*agent, error) {
	inflight, err := m.OpenInflight()
	if err != nil {
		return nil, err
	}
	reaper := &conntrack.Reaper{Maps: m, Inflight: inflight, Timeouts: conntrack.DefaultTimeouts(), Clocks: conntrack.KernelClocks()}
	// Expire what went stale while no agent ran, and learn which ids live
	// flows still use before any id is handed out.
	swept, err := reaper.Sweep()
	if err != nil {
		inflight.Close()
		return nil, err
	}
	rec, err := reconcile.New(m, reconcile.Options{
		MaxServices: o.MaxServices, MaxBackends: o.MaxBackends, TableSize: tableSize,
		Clock: clk, Logger: log, InUse: swept.InUse,
	})
	if err != nil {
		inflight.Close()
		return nil, err
	}
	a := &agent{
		log:                log,
		clk:                clk,
		dp:                 dp,
		maps:               m,
		rec:                rec,
		engine:             accrual.New(clk, nil),
		policy:             make([]outcomes.Policy, o.MaxBackends),
		inflight:           inflight,
		reaper:             reaper,
		probeSeen:          map[uint32]time.Time{},
		deadlines:          make(chan struct{}, 1),
		retry:              map[uint32]bool{},
		maxInflightDefault: maxInflightDefault,
	}
	if swept.Expired > 0 || swept.Released > 0 {
		log.Info("expired stale flows", "flows", swept.Expired, "released", swept.Released)
	}
	a.tracker = outcomes.NewTracker(a.policyOf)
	a.metrics = metrics.New(a, log)
	for _, t := range []outcomes.Type{outcomes.NewFlow, outcomes.Established, outcomes.Refused,
		outcomes.Reset, outcomes.SynRetrans, outcomes.FlowEnd, outcomes.FirstData} {
		a.eventTypes[t] = a.metrics.Events.WithLabelValues(t.String())
	}
	return a, nil
}

func (a *agent) policyOf(backend uint32) outcomes.Policy {
	if int(backend) < len(a.policy) {
		return a.policy[backend]
	}
	return outcomes.Policy{}
}

func (a *agent) ready() error {
	if !a.readyAt.Load() {
		return fmt.Errorf("datapath not attached and programmed yet")
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

// loop is the agent: it applies desired state as it changes, feeds kernel
// outcomes to failure accrual, and writes accrual's decisions back into the
// maps. Everything that changes state happens here, one thing at a time.
func (a *agent) loop(ctx context.Context, reloads <-chan *config.Config, states <-chan desired.State) {
	timer := a.clk.NewTimer(time.Hour)
	defer timer.Stop()
	a.rearm(timer) // sets armed, which handleEvents compares against
	sweep := a.clk.NewTicker(10 * time.Second)
	defer sweep.Stop()
	sweepDone := make(chan reconcile.InUse, 1)
	sweeping := false
	probes := a.clk.NewTicker(2 * time.Second)
	defer probes.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case cfg := <-reloads:
			if err := a.applyConfig(cfg); err != nil {
				a.log.Error("config reload failed to apply", "err", err)
			}
		case st := <-states:
			a.applyDesired(st)
		case <-timer.C():
			a.advance()
		case <-a.deadlines:
			// Events brought new deadlines: rearm below.
		case <-sweep.C():
			// Scanning conntrack takes a while on a big table: off the loop,
			// one at a time (two would release a flow's slot twice).
			if !sweeping {
				sweeping = true
				go func() { sweepDone <- a.sweepConntrack() }()
			}
		case <-probes.C():
			a.watchProbes()
			a.maintain()
		case inUse := <-sweepDone:
			sweeping = false
			a.mu.Lock()
			a.rec.Sweep(inUse)
			a.mu.Unlock()
		}
		a.rearm(timer)
	}
}

// nextDeadline is the next accrual or connect deadline, or an hour from
// now when there is none. Called with mu held.
func (a *agent) nextDeadline() time.Time {
	next, ok := a.engine.NextDeadline()
	if t, tok := a.tracker.NextDeadline(); tok && (!ok || t.Before(next)) {
		next, ok = t, true
	}
	if !ok {
		return a.clk.Now().Add(time.Hour)
	}
	return next
}

// rearm points the timer at the next accrual or connect deadline.
func (a *agent) rearm(timer clock.Timer) {
	a.mu.Lock()
	a.armed = a.nextDeadline()
	d := max(a.armed.Sub(a.clk.Now()), 0)
	a.mu.Unlock()
	if !timer.Stop() {
		select {
		case <-timer.C():
		default:
		}
	}
	timer.Reset(d)
}

// applyConfig applies a config file (services, then interfaces) and
// counts the outcome.
func (a *agent) applyConfig(cfg *config.Config) error {
	if err := a.applyConfigParts(cfg); err != nil {
		a.metrics.ConfigReloads.WithLabelValues("error").Inc()
		a.metrics.ConfigLastOK.Set(0)
		return err
	}
	a.metrics.ConfigReloads.WithLabelValues("success").Inc()
	a.metrics.ConfigLastOK.Set(1)
	a.metrics.ConfigLastSuccess.SetToCurrentTime()
	return nil
}

func (a *agent) applyConfigParts(cfg *config.Config) error {
	// What the file cannot promise (that its interfaces exist) is checked
	// before anything is applied: a typo leaves the running config whole.
	if err := checkInterfaces(cfg); err != nil {
		return err
	}
	a.mu.Lock()
	if cfg.MaglevTableSize != a.rec.TableSize() {
		if err := a.rec.SetTableSize(cfg.MaglevTableSize); err != nil {
			a.mu.Unlock()
			return fmt.Errorf("maglev.tableSize: %d: %w", cfg.MaglevTableSize, err)
		}
	}
	// The file's defaults.maxInflight, else the flag's (load fills it in).
	a.maxInflightDefault = 0
	if cfg.MaxInflight != nil {
		a.maxInflightDefault = *cfg.MaxInflight
	}
	a.mu.Unlock()
	a.applyDesired(cfg.Desired())
	if err := a.prefiltersWritten(); err != nil {
		return err
	}
	return a.applyInterfaces(cfg.Interfaces, cfg.RedirectInterfaces)
}

// prefiltersWritten retries a failed write of the prefilter maps once and
// fails if it fails again. It runs before XDP is attached: a program that
// finds a VIP's slot unmarked passes its packets unbalanced (after an
// upgrade that added pb_vip_slots, established flows too), so the agent
// would rather not attach (the program already attached keeps working).
func (a *agent) prefiltersWritten() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.rec.PrefiltersDirty() {
		return nil
	}
	if err := a.rec.PrepareTables(); err != nil && a.rec.PrefiltersDirty() {
		return fmt.Errorf("writing the prefilter maps: %w", err)
	}
	return nil
}

// checkInterfaces resolves every interface a config file names.
func checkInterfaces(cfg *config.Config) error {
	var errs []error
	for _, f := range []struct {
		field string
		names []string
	}{{"interfaces", cfg.Interfaces}, {"redirectInterfaces", cfg.RedirectInterfaces}} {
		for i, n := range f.names {
			if _, err := net.InterfaceByName(n); err != nil {
				errs = append(errs, fmt.Errorf("%s[%d]: %q: %w", f.field, i, n, err))
			}
		}
	}
	return errors.Join(errs...)
}

// applyInterfaces attaches XDP where listed and detaches it elsewhere.
func (a *agent) applyInterfaces(ifaces, redirect []string) error {
	want := map[string]bool{}
	for _, n := range ifaces {
		want[n] = true
		if err := a.dp.Attach(n); err != nil {
			return err
		}
	}
	for _, n := range a.dp.Attached() {
		if !want[n] {
			if err := a.dp.Detach(n); err != nil {
				a.log.Error("detach", "interface", n, "err", err)
			}
		}
	}
	var partial []uint32
	for _, n := range ifaces {
		if l, err := netlink.LinkByName(n); err == nil && l.Type() == "veth" {
			partial = append(partial, uint32(l.Attrs().Index))
		}
	}
	if err := a.maps.SetPartialIfaces(partial); err != nil {
		return err
	}
	var idx []uint32
	for _, n := range redirect {
		ifc, err := net.InterfaceByName(n)
		if err != nil {
			return fmt.Errorf("redirectInterfaces: %q: %w", n, err)
		}
		idx = append(idx, uint32(ifc.Index))
	}
	if err := a.maps.SetRedirect(idx); err != nil {
		return err
	}
	var flags uint32
	if len(idx) > 0 {
		flags |= maps.ConfigRedirect
	}
	a.interfaces = ifaces
	return a.maps.SetConfig(flags)
}

// applyDesired programs a desired state: services and backends, accrual's
// view of them, then each service's table.
func (a *agent) applyDesired(st desired.State) {
	a.mu.Lock()
	defer a.mu.Unlock()
	changes, err := a.rec.Apply(st)
	if err != nil {
		a.metrics.ProgramErrors.Inc()
		a.log.Error("programming services", "err", err)
	}
	gone := map[uint32]bool{}
	for _, c := range changes {
		for _, id := range c.Retired {
			gone[id] = true
			delete(a.probeSeen, id)
			a.policy[id] = outcomes.Policy{}
			a.maps.DeleteHealth(id)
		}
		if c.Removed {
			a.handleTransitions(a.engine.RemoveService(c.Service.ID))
		}
	}
	a.tracker.Forget(gone)
	for _, s := range a.rec.Services() {
		pol := outcomes.PolicyFor(s.Spec.Accrual, s.Spec.Key.Protocol == desired.TCP)
		for _, id := range s.Backends {
			a.policy[id] = pol
		}
		a.handleTransitions(a.engine.SetService(s.ID, s.Spec.Name, s.Spec.Accrual, s.Backends))
		a.program(s.ID)
	}
	// Spare tables for the changes to come, in one batch.
	if err := a.rec.PrepareTables(); err != nil {
		a.metrics.ProgramErrors.Inc()
		a.log.Error("preparing spare tables", "err", err)
	}
}

// handleEvents feeds one batch of kernel events through classification
// and accrual. A decision is written to the maps before the next event is
// looked at, so an ejection is never delayed by the rest of a batch.
func (a *agent) handleEvents(batch []outcomes.Event) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := range batch {
		ev := &batch[i]
		if int(ev.Type) < len(a.eventTypes) && a.eventTypes[ev.Type] != nil {
			a.eventTypes[ev.Type].Inc()
		}
		if ev.Type == outcomes.NewFlow && ev.Flags&outcomes.FlagProbe != 0 {
			a.probeSeen[ev.Backend] = a.clk.Now()
		}
		if o, ok := a.tracker.Classify(*ev); ok {
			a.handleTransitions(a.engine.Observe(o))
		}
	}
	a.metrics.PendingConnects.Set(float64(a.tracker.Pending()))
	a.syncCounters()
	// Wake the loop only when its timer would now be late: new connects
	// end after the pending ones, so under load this is rare (a wake-up
	// per batch cost the agent measurable CPU in the e2e benchmark).
	if a.nextDeadline().Before(a.armed) {
		select {
		case a.deadlines <- struct{}{}:
		default:
		}
	}
}

// syncCounters carries counts kept outside Prometheus into it.
func (a *agent) syncCounters() {
	if d := a.tracker.Overflow - a.overflowSeen; d > 0 {
		a.metrics.PendingOverflow.Add(float64(d))
		a.overflowSeen = a.tracker.Overflow
	}
	if bad := a.reader.Bad.Load(); bad > a.badSeen {
		a.metrics.EventsUndecodable.Add(float64(bad - a.badSeen))
		a.badSeen = bad
	}
}

// advance runs due deadlines: penalties ending, connects timing out.
func (a *agent) advance() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.handleTransitions(a.engine.Advance())
	a.tracker.Expire(a.clk.Now(), func(o accrual.Outcome) {
		a.handleTransitions(a.engine.Observe(o))
	})
	a.metrics.PendingConnects.Set(float64(a.tracker.Pending()))
}

// handleTransitions logs, counts and persists accrual's decisions, then
// reprograms the services they touch. Called with mu held.
func (a *agent) handleTransitions(trs []accrual.Transition) {
	if len(trs) == 0 {
		return
	}
	var dirty []uint32
	for _, t := range trs {
		if t.To == accrual.Probation && t.From != accrual.Probation {
			a.probeSeen[t.Endpoint] = a.clk.Now() // granted now
		}
		if t.Reason == accrual.ReasonProbeInconclusive {
			if err := a.rec.Regrant(t.Endpoint); err != nil {
				a.log.Error("grant a new probe", "endpoint", a.endpointName(t.Endpoint), "err", err)
			}
		}
		if len(dirty) == 0 || dirty[len(dirty)-1] != t.Service {
			dirty = append(dirty, t.Service)
		}
	}
	for _, id := range dirty {
		a.program(id)
	}
	// The maps are written: an ejection's reaction time ends here.
	now := outcomes.MonoNow()
	for _, t := range trs {
		s, ok := a.rec.Service(t.Service)
		name := fmt.Sprint(t.Service)
		if ok {
			name = s.Spec.Name
		}
		a.metrics.Transitions.WithLabelValues(name, string(t.Reason)).Inc()
		var reaction time.Duration
		if t.To == accrual.Ejected && t.From != accrual.Ejected && !t.FailureAt.IsZero() {
			reaction = time.Duration(now - (t.FailureAt.UnixNano() - a.monoOffset))
			a.metrics.Reaction.Observe(reaction.Seconds())
		}
		if !t.ServiceLevel() {
			a.persist(t)
		}
		a.logTransition(name, t, reaction)
		if a.notify != nil {
			b, _ := a.rec.Backend(t.Endpoint)
			a.notify(s, b, t)
		}
	}
}

// program writes one service's admission to the maps.
func (a *agent) program(id uint32) {
	if _, ok := a.rec.Service(id); !ok {
		delete(a.retry, id)
		return
	}
	active, probation, failOpen := a.engine.Admitted(id)
	if err := a.rec.ProgramService(id, active, probation, failOpen); err != nil {
		a.metrics.ProgramErrors.Inc()
		a.log.Error("programming table; retrying", "err", err)
		a.retry[id] = true
		return
	}
	delete(a.retry, id)
}

func (a *agent) logTransition(service string, t accrual.Transition, reaction time.Duration) {
	switch t.Reason {
	case accrual.ReasonFailOpenStart:
		a.log.Warn("service failing open: no endpoint ready, new flows go to all endpoints", "service", service)
		return
	case accrual.ReasonFailOpenEnd:
		a.log.Info("service no longer failing open", "service", service)
		return
	}
	attrs := []any{"service", service, "endpoint", a.endpointName(t.Endpoint),
		"from", t.From.String(), "to", t.To.String(), "reason", string(t.Reason)}
	if t.Kind != 0 {
		attrs = append(attrs, "failure_kind", t.Kind.String(), "consecutive_failures", t.Failures)
	}
	// The penalty: drawn (ejected), served (probation), reset (ready: 0s).
	attrs = append(attrs, "penalty", t.Penalty.String())
	if t.To == accrual.Ejected {
		attrs = append(attrs, "probation_at", t.ProbationAt.Format(time.RFC3339Nano))
	}
	if reaction > 0 {
		// Kernel's timestamp of the deciding failure -> maps written.
		attrs = append(attrs, "reaction_us", reaction.Microseconds())
	}
	level := slog.LevelInfo
	if t.To == accrual.Ejected || t.Reason == accrual.ReasonEjectionSuppressed {
		level = slog.LevelWarn
	}
	a.log.Log(context.Background(), level, "endpoint "+t.To.String(), attrs...)
}

func (a *agent) endpointName(id uint32) string {
	b, ok := a.rec.Backend(id)
	if !ok {
		return fmt.Sprintf("backend-%d", id)
	}
	if b.Name != "" {
		return b.Name + " (" + b.Addr.String() + ")"
	}
	return b.Addr.String()
}

// maintain retries services whose programming failed and prepares the
// spare tables the next changes will fill.
func (a *agent) maintain() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for id := range a.retry {
		a.program(id)
	}
	if err := a.rec.PrepareTables(); err != nil {
		a.metrics.ProgramErrors.Inc()
		a.log.Error("preparing spare tables", "err", err)
	}
}

// watchProbes keeps probation from stalling. An endpoint in probation
// must either hold an unused grant or have a probe whose verdict is on
// its way; if the kernel's entry disagrees with the agent (state drifted)
// or the grant is spent and no verdict came within the connect timeout
// (its events were lost), the endpoint gets a fresh grant. Without this,
// one lost probe would keep a healed endpoint out for good.
func (a *agent) watchProbes() {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.clk.Now()
	for _, s := range a.rec.Services() {
		for _, id := range s.Probation {
			kb, err := a.maps.Backend(id)
			if err != nil {
				continue
			}
			reason := ""
			switch {
			case maps.BackendState(kb.State) != maps.BackendProbation:
				reason = "the datapath's entry is " + maps.BackendState(kb.State).String()
			case kb.ProbeGrants <= 0:
				seen, ok := a.probeSeen[id]
				wait := a.policyOf(id).ConnectTimeout*2 + time.Second
				if !ok || now.Sub(seen) > wait {
					reason = "its probe was admitted but no verdict came"
				}
			}
			if reason == "" {
				continue
			}
			a.log.Warn("probation stalled, granting a new probe", "service", s.Spec.Name,
				"endpoint", a.endpointName(id), "reason", reason)
			if err := a.rec.Regrant(id); err != nil {
				a.log.Error("grant a new probe", "endpoint", a.endpointName(id), "err", err)
			}
			a.probeSeen[id] = now
		}
	}
}

// sweepConntrack expires idle flows, releasing their circuit-breaker
// slots, and returns the ids live flows use so they are not recycled.
func (a *agent) sweepConntrack() reconcile.InUse {
	res, err := a.reaper.Sweep()
	if err != nil {
		// A partial view must not free ids that live flows may still use.
		a.log.Warn("conntrack sweep", "err", err)
		return reconcile.InUse{Services: map[uint32]bool{}, Backends: map[uint32]bool{}, Incomplete: true}
	}
	if res.Expired > 0 || res.Released > 0 {
		a.log.Debug("conntrack sweep", "entries", res.Entries, "expired", res.Expired, "released", res.Released)
	}
	a.metrics.ConntrackEntries.Set(float64(res.Entries))
	a.metrics.ConntrackExpired.Add(float64(res.Expired))
	return res.InUse
}
