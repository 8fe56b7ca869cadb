package k8s

import (
	"context"
	"encoding/json"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"github.com/penaltybox/penaltybox/pkg/fleet"
)

// FleetSource is the agent as fleet evidence sees it.
type FleetSource interface {
	// FleetWindows is what this node can report.
	FleetWindows() []fleet.Window
	// FleetJudges is how each service taking fleet evidence is judged.
	FleetJudges() map[string]fleet.Judge
	// Condemn ejects an endpoint the fleet condemns if it is ready here.
	// known: this node knows the endpoint; out: it is out of the table
	// here now (its window holds no call from before).
	Condemn(fleet.Condemned) (known, out bool)
}

// FleetOptions configure fleet evidence.
type FleetOptions struct {
	Dynamic   dynamic.Interface    // reports and verdicts
	Leases    kubernetes.Interface // the aggregator's Lease
	Namespace string               // the Lease's namespace (the agents')
	Node      string               // this node: its report's name and its Lease identity
	// Interval is how often the node reports at most (more rarely when its
	// report is big: the byte budget). Default 5s.
	Interval time.Duration
	Source   FleetSource
	Clock    clock.WithTicker
	Logger   *slog.Logger
	// Metrics; any may be nil.
	ReportWrites, VerdictWrites *prometheus.CounterVec
	Aggregator, Condemned       prometheus.Gauge
}

// Fleet evidence timings.
const (
	// reportBudget is what one node's report may cost etcd: a report of
	// size bytes is written at most every size/reportBudget seconds, so
	// 5,000 nodes write at most 1 MB/s whatever they hold
	// (docs/fleet-evidence.md).
	reportBudget = 200 // bytes per second
	// verdictTTL: a verdict no aggregator refreshes (it died, or the API
	// is unreachable) stops counting after this; it is refreshed at half.
	verdictTTL = 5 * time.Minute
	// judgeEvery is how often the aggregator sums the reports.
	judgeEvery = time.Second
	// callTimeout bounds every API call: a hung request delays the next
	// report or verdict, never the reading of the verdicts in force.
	callTimeout = 10 * time.Second
	// verdictRetry is the first wait after a failed verdict write, doubled
	// per failure up to verdictRetryMax.
	verdictRetry    = time.Second
	verdictRetryMax = time.Minute
	// FleetLease is the aggregator's Lease.
	FleetLease = "penaltybox-fleet"
	fieldOwner = "penaltybox-agent"
)

// reporter is this node's side: it writes the node's report and acts on
// the verdicts.
type reporter struct {
	o              FleetOptions
	log            *slog.Logger
	verdicts       cache.Store
	verdictsSynced func() bool
	// mu guards what the verdicts tell the reports: the suspects, and the
	// consumer, which knows for each condemned endpoint this node took out
	// the generation after which its window began (Count.Acted).
	mu       sync.Mutex
	suspects map[fleet.Key]bool
	consumer *fleet.Consumer
	// The report last written, when, and whether a write is failing (so
	// that a failing API logs once, not once per interval).
	last        []ReportEntry
	lastWrite   time.Time
	nextGap     time.Duration
	written     bool
	failing     bool
	deleteRetry time.Time // a failed delete of the report is tried again then
	badVerdicts onceLog
}

// onceLog remembers the objects whose unreadable entries were logged, by
// key, at the resourceVersion logged: each version is logged once, not at
// every read. Each goroutine has its own.
type onceLog map[string]string

func (l onceLog) warn(log *slog.Logger, kind string, u *unstructured.Unstructured, bad int, err error) {
	key := strings.TrimPrefix(u.GetNamespace()+"/"+u.GetName(), "/")
	if rv, ok := l[kind+" "+key]; ok && rv == u.GetResourceVersion() {
		return
	}
	l[kind+" "+key] = u.GetResourceVersion()
	log.Warn("unreadable "+kind+" entries ignored", "object", key, "entries", bad, "err", err)
}

// RunFleet shares this node's evidence and acts on the fleet's until ctx
// ends. It never blocks the agent: the API being slow or down only delays
// reports and verdicts, local decisions go on without them, and verdicts
// expire.
func RunFleet(ctx context.Context, o FleetOptions) {
	if o.Interval <= 0 {
		o.Interval = 5 * time.Second
	}
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	factory := dynamicinformer.NewDynamicSharedInformerFactory(o.Dynamic, 0)
	inf := factory.ForResource(VerdictGVR).Informer()
	changed := make(chan struct{}, 1)
	poke := func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { poke() },
		UpdateFunc: func(_, _ any) { poke() },
		DeleteFunc: func(any) { poke() },
	})
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	r := &reporter{o: o, log: o.Logger, verdicts: inf.GetStore(), verdictsSynced: inf.HasSynced,
		consumer: fleet.NewConsumer(), suspects: map[fleet.Key]bool{}, badVerdicts: onceLog{}}
	var wg sync.WaitGroup
	defer wg.Wait() // the Lease released and the last write done before RunFleet returns
	wg.Go(func() { r.lead(ctx) })
	// Reports on their own goroutine: a hung write must not delay acting
	// on a verdict. They are checked five times an interval, so that a new
	// suspect is reported within about an interval of the verdict naming
	// it.
	wg.Go(func() { every(ctx, o.Clock, max(o.Interval/5, 100*time.Millisecond), func() { r.report(ctx) }) })
	// Verdicts as they change, and once a second for their expiry.
	tick := o.Clock.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-changed:
		case <-tick.C():
		}
		r.readVerdicts()
	}
}

// readVerdicts takes the unexpired verdicts' suspects and acts on new
// condemnations.
func (r *reporter) readVerdicts() {
	now := r.o.Clock.Now()
	suspects := map[fleet.Key]bool{}
	var condemned []fleet.Condemned
	for _, v := range r.inForce(now, r.badVerdicts) {
		for _, k := range v.Suspects {
			suspects[k] = true
		}
		condemned = append(condemned, v.Condemned...)
	}
	setGauge(r.o.Condemned, float64(len(condemned)))
	r.mu.Lock()
	r.suspects = suspects
	fresh := r.consumer.Fresh(now, condemned)
	r.mu.Unlock()
	for _, c := range fresh {
		// One this node does not know yet (its EndpointSlices lag) is
		// tried again at the next read. The agent is called without mu:
		// the report goroutine takes the agent's lock too.
		known, out := r.o.Source.Condemn(c)
		if !known {
			continue
		}
		r.mu.Lock()
		r.consumer.Done(now, c, out)
		r.mu.Unlock()
		r.log.Info("fleet evidence condemns endpoint", "service", c.Service, "endpoint", c.Addr.String(),
			"calls", c.Calls, "failures", c.Failures, "nodes", c.Nodes, "condemnation_level", c.Level, "generation", c.Generation)
	}
}

// inForce decodes the unexpired verdicts in the cache, logging unreadable
// entries to bad (nil: not logged).
func (r *reporter) inForce(now time.Time, bad onceLog) []fleet.Verdicts {
	var out []fleet.Verdicts
	for _, obj := range r.verdicts.List() {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		v, expires, n, err := DecodeVerdict(u)
		if bad != nil && (err != nil || n > 0) {
			bad.warn(r.log, "EndpointVerdict", u, n, err)
		}
		if err == nil && expires.After(now) {
			out = append(out, v)
		}
	}
	return out
}

// report writes this node's report when it has something new to say and
// the byte budget allows, refreshes it before it expires, and deletes it
// once there is nothing to say.
func (r *reporter) report(ctx context.Context) {
	now := r.o.Clock.Now()
	// What the verdicts said, read before the windows: an ejection for a
	// condemnation clears the window before out records it, so a window
	// read after this copy never predates a generation the copy names.
	r.mu.Lock()
	suspects := r.suspects
	out := r.consumer.Out()
	r.mu.Unlock()
	ws := r.o.Source.FleetWindows()
	for i := range ws {
		ws[i].Acted = out[ws[i].Key]
	}
	counts := fleet.Select(ws, suspects)
	res := r.o.Dynamic.Resource(ReportGVR)
	if len(counts) == 0 {
		if !r.written {
			return
		}
		if now.Before(r.deleteRetry) {
			return
		}
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		err := res.Delete(cctx, r.o.Node, metav1.DeleteOptions{})
		cancel()
		if err != nil && !apierrors.IsNotFound(err) {
			r.deleteRetry = now.Add(r.o.Interval)
			r.writeFailed("delete", err)
			return
		}
		r.written, r.last = false, nil
		r.wrote("deleted")
		return
	}
	if now.Sub(r.lastWrite) < r.nextGap {
		return
	}
	spec := EncodeReport(counts, now, time.Time{})
	size := 64
	if b, err := json.Marshal(spec.Endpoints); err == nil {
		size = len(b)
	}
	gap := max(r.o.Interval, time.Duration(size)*time.Second/reportBudget)
	// Unchanged counts are only refreshed, before the report expires.
	if r.written && reflect.DeepEqual(spec.Endpoints, r.last) && now.Sub(r.lastWrite) < gap*3/2 {
		return
	}
	spec.ExpiresAt = metav1.NewTime(now.Add(3 * gap).UTC().Truncate(time.Second))
	obj, err := fleetObject("EndpointReport", "", r.o.Node, &spec)
	if err == nil {
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		_, err = res.Apply(cctx, r.o.Node, obj, metav1.ApplyOptions{FieldManager: fieldOwner, Force: true})
		cancel()
	}
	// Failed or not, the next try waits a gap: a failing API server is not
	// hammered.
	r.lastWrite, r.nextGap = now, gap
	if err != nil {
		r.writeFailed("write", err)
		return
	}
	r.written, r.last = true, spec.Endpoints
	r.wrote("ok")
}

func (r *reporter) wrote(result string) {
	if r.o.ReportWrites != nil {
		r.o.ReportWrites.WithLabelValues(result).Inc()
	}
	if r.failing {
		r.failing = false
		r.log.Info("EndpointReport writes succeed again", "report", r.o.Node)
	}
}

func (r *reporter) writeFailed(op string, err error) {
	if r.o.ReportWrites != nil {
		r.o.ReportWrites.WithLabelValues("error").Inc()
	}
	if !r.failing {
		r.failing = true
		r.log.Warn("EndpointReport "+op+" failed; local decisions go on, retrying every report interval", "report", r.o.Node, "err", err)
	}
}

// lead competes for the fleet Lease until ctx ends, aggregating while it
// holds it.
func (r *reporter) lead(ctx context.Context) {
	leaseJob{
		Client: r.o.Leases, Namespace: r.o.Namespace, Name: FleetLease, Identity: r.o.Node, Gauge: r.o.Aggregator, Log: r.log,
		Doing:     "aggregating the fleet's EndpointReports: this agent holds the lease",
		Stopped:   "no longer aggregating the fleet's EndpointReports",
		Elsewhere: "the fleet's EndpointReports are aggregated by another agent",
		Disabled:  "fleet evidence will not be aggregated by this agent",
		Work:      r.aggregate,
	}.run(ctx)
}

// written is what the aggregator last wrote for one Service object.
type written struct {
	spec VerdictSpec
	at   time.Time
}

// aggregate watches every node's report and writes the verdicts until
// ctx ends (leadership lost or the agent stopping). Only the aggregator
// watches reports: the fan-out is one watcher, not every node.
func (r *reporter) aggregate(ctx context.Context) {
	o := r.o
	factory := dynamicinformer.NewDynamicSharedInformerFactory(o.Dynamic, 0)
	inf := factory.ForResource(ReportGVR).Informer()
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced, r.verdictsSynced) {
		return
	}
	// Carry on from the verdicts in force: a change of aggregator must not
	// make every node eject again what stands, nor forget it.
	agg := fleet.NewAggregator()
	done := map[string]written{}
	now := o.Clock.Now()
	for _, v := range r.inForce(now, nil) { // readVerdicts logs them
		agg.Seed(now, v)
	}
	badReports := onceLog{}
	retry := map[string]retryState{}
	every(ctx, o.Clock, judgeEvery, func() {
		now := o.Clock.Now()
		var reports []fleet.Report
		for _, obj := range inf.GetStore().List() {
			u, ok := obj.(*unstructured.Unstructured)
			if !ok {
				continue
			}
			rep, bad, err := DecodeReport(u)
			if err != nil || bad > 0 {
				badReports.warn(r.log, "EndpointReport", u, bad, err)
			}
			if err == nil {
				reports = append(reports, rep)
			}
		}
		want := EncodeVerdicts(agg.Judge(now, reports, o.Source.FleetJudges()), now.Add(verdictTTL))
		r.writeVerdicts(ctx, now, want, done, retry)
	})
}

// every runs f every d until ctx ends.
func every(ctx context.Context, clk clock.WithTicker, d time.Duration, f func()) {
	tick := clk.NewTicker(d)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C():
			f()
		}
	}
}

// retryState is a verdict write that failed: when to try again, and how
// long the wait after the next failure is.
type retryState struct {
	next time.Time
	wait time.Duration
}

// writeVerdicts makes the EndpointVerdicts say want: it writes the ones
// that change or need a refresh, and deletes the ones with nothing left
// to say (its own and any a predecessor left). A verdict whose write
// failed waits, doubling from verdictRetry up to verdictRetryMax, and its
// failure and recovery are logged once each.
func (r *reporter) writeVerdicts(ctx context.Context, now time.Time, want map[string]VerdictSpec, done map[string]written, retry map[string]retryState) {
	count := func(result string) {
		if r.o.VerdictWrites != nil {
			r.o.VerdictWrites.WithLabelValues(result).Inc()
		}
	}
	// One pass gets callTimeout in all: a hung API server costs a judge
	// tick that long, not that long per verdict.
	pass, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	// call runs one write or delete of key unless it waits to retry, and
	// keeps its retry state; ok is false if it was not attempted or failed.
	call := func(key, op string, f func(context.Context) error) bool {
		st, failing := retry[key]
		if (failing && now.Before(st.next)) || pass.Err() != nil {
			return false // waiting to retry, or this pass is out of time: next tick
		}
		err := f(pass)
		if err != nil {
			count("error")
			if !failing {
				st.wait = verdictRetry
				r.log.Warn("EndpointVerdict "+op+" failed; retrying with backoff", "verdict", key, "err", err)
			} else {
				st.wait = min(2*st.wait, verdictRetryMax)
			}
			st.next = now.Add(st.wait)
			retry[key] = st
			return false
		}
		if failing {
			delete(retry, key)
			r.log.Info("EndpointVerdict "+op+" succeeds again", "verdict", key)
		}
		return true
	}
	for key, spec := range want {
		w, ok := done[key]
		if ok && now.Sub(w.at) < verdictTTL/2 && sameVerdict(w.spec, spec) {
			continue
		}
		ns, name, _ := strings.Cut(key, "/")
		obj, err := fleetObject("EndpointVerdict", ns, name, &spec)
		if err != nil {
			continue // unreachable: spec is ours
		}
		if !call(key, "write", func(ctx context.Context) error {
			_, err := r.o.Dynamic.Resource(VerdictGVR).Namespace(ns).Apply(ctx, name, obj,
				metav1.ApplyOptions{FieldManager: fieldOwner, Force: true})
			return err
		}) {
			continue
		}
		count("ok")
		if !ok || len(w.spec.Condemned) != len(spec.Condemned) {
			r.log.Info("EndpointVerdict written", "verdict", key, "suspects", len(spec.Suspects), "condemned", len(spec.Condemned))
		}
		done[key] = written{spec: spec, at: now}
	}
	// Whatever exists and is not wanted goes, whoever wrote it.
	stale := map[string]bool{}
	for key := range done {
		stale[key] = true
	}
	for _, obj := range r.verdicts.List() {
		if u, ok := obj.(*unstructured.Unstructured); ok {
			stale[u.GetNamespace()+"/"+u.GetName()] = true
		}
	}
	for key := range stale {
		if _, ok := want[key]; ok {
			continue
		}
		ns, name, _ := strings.Cut(key, "/")
		gone := false
		if !call(key, "delete", func(ctx context.Context) error {
			err := r.o.Dynamic.Resource(VerdictGVR).Namespace(ns).Delete(ctx, name, metav1.DeleteOptions{})
			if apierrors.IsNotFound(err) {
				gone = true
				return nil
			}
			return err
		}) {
			continue
		}
		if !gone {
			count("deleted")
			r.log.Info("EndpointVerdict deleted: nothing left to say", "verdict", key)
		}
		delete(done, key)
	}
	for key := range retry {
		if _, ok := want[key]; !ok && !stale[key] {
			delete(retry, key)
		}
	}
}

// sameVerdict compares two specs but for their expiry and the counts
// behind a condemnation (which change every report without changing what
// the nodes do).
func sameVerdict(a, b VerdictSpec) bool {
	if !reflect.DeepEqual(a.Suspects, b.Suspects) || len(a.Condemned) != len(b.Condemned) {
		return false
	}
	for i := range a.Condemned {
		if a.Condemned[i].VerdictEndpoint != b.Condemned[i].VerdictEndpoint || a.Condemned[i].Generation != b.Condemned[i].Generation {
			return false
		}
	}
	return true
}
