// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/metrics"
)

// labelServiceProxyName marks Services (and their slices) that another
// proxy implementation handles; kube-proxy skips them, and so do we.
const labelServiceProxyName = "service.kubernetes.io/service-proxy-name"

// LabelEnabled opts a Service, or every Service of a namespace, in to
// penaltybox ("true"); on a Service, "false" opts it out whatever its
// namespace says (and under ScopeAll too).
const LabelEnabled = "penaltybox.io/enabled"

// Scope says which Services the agent serves. The rest are left to
// kube-proxy: the datapath passes their packets untouched.
type Scope string

const (
	// ScopeOptIn serves the Services that ask: labelled LabelEnabled
	// "true", in a namespace so labelled, or targeted by a BackendPolicy.
	ScopeOptIn Scope = "opt-in"
	// ScopeAll serves every eligible Service (but those labelled "false").
	ScopeAll Scope = "all"
)

// Why a Service is served (desired.Service.Served): the scope, its own
// label, its namespace's, or "backend-policy:" and the policy's key.
const (
	ServedAll       = "scope-all"
	ServedService   = "service-label"
	ServedNamespace = "namespace-label"
	ServedPolicy    = "backend-policy:"
)

// Event reasons on Services.
const (
	ReasonInvalidAnnotation  = "InvalidAnnotation"
	ReasonEndpointEjected    = "EndpointEjected"
	ReasonEndpointRestored   = "EndpointRestored"
	ReasonEjectionSuppressed = "EjectionSuppressed"
	ReasonFailingOpen        = "FailingOpen"
	ReasonFailOpenEnded      = "FailOpenEnded"
)

// Options configure a Controller.
type Options struct {
	// NodeName is this node's name: the source of the Events the agent
	// writes, and the filter for internalTrafficPolicy: Local.
	NodeName string
	// Debounce is how long a change waits for more before the desired
	// state is handed over (default 30ms): a rollout touching many slices
	// costs one reprogramming, and no change waits longer than this (the
	// agent programs only what changed, so a short wait costs little; a
	// change must reach the maps within 100 ms).
	Debounce time.Duration
	// Resync re-reads every Service from the informers' caches this often
	// (default 5m): a safety net that, computing from scratch, reaches the
	// same answer and so changes nothing when all is well.
	Resync time.Duration
	// MaxInflight is the circuit-breaker limit of Services without a
	// penaltybox.io/max-inflight annotation (the --max-inflight-default).
	MaxInflight uint32
	// Policies reads BackendPolicies when set (nil: the CRD is not
	// installed, and Services are configured by annotations alone).
	Policies dynamic.Interface
	// Status, when set, has the policies' status written by whichever
	// agent holds a Lease (see StatusOptions).
	Status *StatusOptions
	// Recorder writes Events; nil means one writing to the API server with
	// client-go's spam filter and aggregation (see NewRecorder).
	Recorder record.EventRecorder
	// Scope: which Services are served (default ScopeOptIn).
	Scope  Scope
	Logger *slog.Logger
}

// Metrics are the controller's counters (SetMetrics); any may be nil.
type Metrics struct {
	// InvalidSettings counts rejected annotations by service and key, and
	// rejected policies by service and "BackendPolicy namespace/name"
	// (penaltybox_invalid_settings_total).
	InvalidSettings *metrics.ServiceCounterVec
	// PolicyStatusLeader is 1 while this agent writes the policies'
	// status; PolicyStatusWrites counts those writes by result ("ok",
	// "error"). Used with Options.Status only.
	PolicyStatusLeader prometheus.Gauge
	PolicyStatusWrites *prometheus.CounterVec
}

// Controller turns Services and EndpointSlices into the agent's desired
// state, the way client-go's sample-controller does: informers feed a
// rate-limited work queue of Service keys, and each key is recomputed from
// the listers from scratch, never from the order of events. The full
// desired state is handed over first; after that, what changed (a delta of
// the Services recomputed), and the full state again every Resync.
type Controller struct {
	opts     Options
	metrics  Metrics
	log      *slog.Logger
	started  sync.Once // Start
	factory  informers.SharedInformerFactory
	services serviceCache
	// sliceIndex holds the EndpointSlices, indexed by their Service's key
	// (sliceServiceIndex).
	sliceIndex cache.Indexer
	// namespaces are watched for LabelEnabled (ScopeOptIn only; nil
	// otherwise).
	nsFactory  informers.SharedInformerFactory
	namespaces corelisters.NamespaceLister
	synced     []cache.InformerSynced
	queue      workqueue.TypedRateLimitingInterface[string]
	recorder   record.EventRecorder
	stopRec    func()
	notes      chan Transition
	// policyStore holds the BackendPolicies as the API server has them
	// (nil without Options.Policies); statusQueue has the keys of those
	// whose status may need a write.
	policyStore cache.Store
	dynFactory  dynamicinformer.DynamicSharedInformerFactory
	statusQueue workqueue.TypedRateLimitingInterface[string]

	// nodeFactory watches this node (Options.NodeName) for its zone
	// label; nil without a node name.
	nodeFactory informers.SharedInformerFactory

	mu      sync.Mutex
	local   map[netip.Addr]bool // the node's own addresses (SetLocalAddrs)
	zone    string              // the node's topology.kubernetes.io/zone (watchNode)
	entries map[string]*entry   // by Service key "namespace/name"
	// order is entries in the order of their services' names
	// ("namespace/name:port" sorts as "namespace/name:"); nil when a key
	// came or went, or an entry was replaced, since it was last sorted.
	order []*entry
	owner map[string]string // desired service name → Service key
	// policies are the decoded BackendPolicies, by key.
	policies map[string]*BackendPolicy
	dirty    chan struct{} // capacity 1: something changed since the last snapshot
	// pending: the Service keys whose services changed since the last
	// hand-over, each with the services it had then (what the next delta
	// compares with); keyCount: how many entries list each desired key
	// (a key an entry dropped is gone only when none lists it).
	pending  map[string][]desired.Service
	keyCount map[desired.Key]int
	// initialServed counts the Services served, by reason, while Run
	// computes the first complete state (nil after it), which logs them
	// in one line; later changes log a line each.
	initialServed map[string]int
	// handBack is every entry's unserved keys, sorted (State.HandBack);
	// nil when an entry's changed since it was last built.
	handBack []desired.Key
}

// entry is what the controller knows of one Service.
type entry struct {
	uid       types.UID
	services  []desired.Service
	hostLocal []string // ports left to kube-proxy (see Translate)
	// lastGood are the Service's annotations the last time all of them
	// were valid; an invalid edit leaves their settings in force. The
	// cached Service's own map (never changed in place) is held, not the
	// parsed Settings: nil for most Services, 8 bytes instead of 184.
	lastGood map[string]string
	// reported are the invalid "key=value"s already announced by Event and
	// metric, so each is announced once, not on every recomputation.
	reported map[string]bool
	// goodPolicy is the last version of the winning policy that applied
	// cleanly; while the winner is invalid, it stays in force over the
	// Service's current annotations.
	goodPolicy *BackendPolicy
	// badPolicy is the "namespace/name@generation" of the invalid policy
	// last announced, so it is announced once.
	badPolicy string
	// served says why the Service is served ("": it is not, kube-proxy
	// has it), as last logged.
	served string
	// unserved are the keys of the Service's ports while it is not served
	// (desired.State.HandBack).
	unserved []desired.Key
	// badSections: per port name, the invalid sectionName policy last
	// announced ("namespace/name@generation"); see withSections.
	badSections map[string]string
}

// New builds a controller on client. Nothing runs until Start or Run.
func New(client kubernetes.Interface, opts Options) *Controller {
	if opts.Debounce <= 0 {
		opts.Debounce = 30 * time.Millisecond
	}
	if opts.Resync <= 0 {
		opts.Resync = 5 * time.Minute
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Scope == "" {
		opts.Scope = ScopeOptIn
	}
	// kube-proxy's selection: Services another proxy handles, and the
	// slices of headless Services, never reach us.
	noProxyName, _ := labels.NewRequirement(labelServiceProxyName, selection.DoesNotExist, nil)
	noHeadless, _ := labels.NewRequirement(corev1.IsHeadlessService, selection.DoesNotExist, nil)
	selector := labels.NewSelector().Add(*noProxyName, *noHeadless).String()
	factory := informers.NewSharedInformerFactoryWithOptions(client, opts.Resync,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = selector }),
		informers.WithTransform(stripForCache))

	c := &Controller{
		opts:     opts,
		log:      opts.Logger,
		factory:  factory,
		services: serviceCache{factory.Core().V1().Services().Informer().GetIndexer()},
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "services"}),
		recorder: opts.Recorder,
		notes:    make(chan Transition, 1024),
		entries:  map[string]*entry{},
		owner:    map[string]string{},
		policies: map[string]*BackendPolicy{},
		dirty:    make(chan struct{}, 1),
		pending:  map[string][]desired.Service{},
		keyCount: map[desired.Key]int{},
	}
	if c.recorder == nil {
		c.recorder, c.stopRec = NewRecorder(client, opts.NodeName)
	}

	svcInformer := factory.Core().V1().Services().Informer()
	svcInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueueService,
		UpdateFunc: func(_, obj any) { c.enqueueService(obj) },
		DeleteFunc: c.enqueueService,
	})
	sliceInformer := factory.Discovery().V1().EndpointSlices().Informer()
	// A Service's slices by index, not by listing its namespace's: with
	// 10,000 Services in a namespace, every sync would match 10,000
	// slices' labels (the cold start quadratic in the Services).
	if err := sliceInformer.AddIndexers(cache.Indexers{sliceServiceIndex: sliceService}); err != nil {
		panic(err) // only before the informer runs, and it has not
	}
	c.sliceIndex = sliceInformer.GetIndexer()
	sliceInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: c.enqueueSlice,
		UpdateFunc: func(old, obj any) {
			// A slice relabelled to another Service changes both.
			c.enqueueSlice(old)
			c.enqueueSlice(obj)
		},
		DeleteFunc: c.enqueueSlice,
	})
	c.synced = []cache.InformerSynced{svcInformer.HasSynced, sliceInformer.HasSynced}
	if opts.Scope == ScopeOptIn {
		// A namespace labelled or unlabelled changes all its Services.
		c.nsFactory = informers.NewSharedInformerFactory(client, opts.Resync)
		nsInformer := c.nsFactory.Core().V1().Namespaces().Informer()
		c.namespaces = c.nsFactory.Core().V1().Namespaces().Lister()
		nsInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc: c.enqueueNamespace,
			UpdateFunc: func(old, obj any) {
				o, _ := old.(*corev1.Namespace)
				n, _ := obj.(*corev1.Namespace)
				if o == nil || n == nil || o.Labels[LabelEnabled] != n.Labels[LabelEnabled] {
					c.enqueueNamespace(obj)
				}
			},
			DeleteFunc: c.enqueueNamespace,
		})
		c.synced = append(c.synced, nsInformer.HasSynced)
	}
	if opts.Policies != nil {
		c.watchPolicies(opts.Policies)
	}
	if opts.NodeName != "" {
		c.watchNode(client)
	}
	return c
}

// watchNode follows this node's zone label, for topology hints. Not
// among the caches Run waits for: without the label (or the permission to
// read the node) Services are served over all their endpoints, and they
// are recomputed when the zone arrives or changes.
func (c *Controller) watchNode(client kubernetes.Interface) {
	name := c.opts.NodeName
	c.nodeFactory = informers.NewSharedInformerFactoryWithOptions(client, c.opts.Resync,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
		}))
	onNode := func(obj any) {
		if n, ok := obj.(*corev1.Node); ok && n.Name == name {
			c.setZone(n.Labels[corev1.LabelTopologyZone])
		}
	}
	c.nodeFactory.Core().V1().Nodes().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    onNode,
		UpdateFunc: func(_, obj any) { onNode(obj) },
	})
}

// setZone records the node's zone and recomputes every Service when it
// changed.
func (c *Controller) setZone(zone string) {
	c.mu.Lock()
	changed := zone != c.zone
	c.zone = zone
	c.mu.Unlock()
	if !changed {
		return
	}
	c.log.Info("node zone", "zone", zone, "node", c.opts.NodeName)
	for _, key := range c.services.keys() {
		c.queue.Add(key)
	}
}

func (c *Controller) enqueueService(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		utilruntime.HandleError(err)
		return
	}
	c.queue.Add(key)
	// A Service appearing, going or changing its annotations can change
	// the verdicts of the policies that target it.
	c.policyStatusFor(key)
}

// enqueueNamespace queues every Service of a namespace whose label may
// have changed.
func (c *Controller) enqueueNamespace(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	ns, ok := obj.(*corev1.Namespace)
	if !ok {
		return
	}
	for _, key := range c.services.keysIn(ns.Name) {
		c.queue.Add(key)
	}
}

// servedBecause says why the Service is served under the controller's
// scope, or "" when it is left to kube-proxy. Called with mu held.
func (c *Controller) servedBecause(svc *corev1.Service, key string) string {
	switch svc.Labels[LabelEnabled] {
	case "false":
		return ""
	case "true":
		return ServedService
	}
	if c.opts.Scope == ScopeAll {
		return ServedAll
	}
	if c.namespaces != nil {
		if ns, err := c.namespaces.Get(svc.Namespace); err == nil && ns.Labels[LabelEnabled] == "true" {
			return ServedNamespace
		}
	}
	if p := Winner(c.targetingLocked(key)); p != nil {
		return ServedPolicy + p.Key()
	}
	return ""
}

// enqueueSlice queues the Service a slice belongs to.
func (c *Controller) enqueueSlice(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	sl, ok := obj.(*endpointSlice)
	if !ok {
		return
	}
	if sl.service != "" {
		c.queue.Add(sl.Namespace + "/" + sl.service)
	}
}

// Start starts the informers: the lists of Services, EndpointSlices and
// the rest begin, and the caller does its other start-up work while they
// arrive (the agent loads its maps meanwhile). It returns at once; Run
// starts them itself if Start was not called. ctx must end no sooner
// than Run's.
func (c *Controller) Start(ctx context.Context) {
	c.started.Do(func() {
		c.log.Info("listing Services, EndpointSlices and BackendPolicies", "policies", c.dynFactory != nil)
		for _, f := range []interface{ Start(<-chan struct{}) }{c.factory, c.nsFactory, c.dynFactory, c.nodeFactory} {
			if f != nil { // a nil factory converts to a nil interface
				f.Start(ctx.Done())
			}
		}
	})
}

// SetMetrics gives the controller its counters. Call it before Run: the
// agent's metrics exist once its maps are loaded, after Start.
func (c *Controller) SetMetrics(m Metrics) { c.metrics = m }

// Run starts the informers (see Start), waits for their caches, sends the first
// complete desired state on out, then, after every change, what changed
// (a delta: desired.State.Delta), and the complete state again every
// Resync, until ctx ends (then it returns nil). The receiver must apply
// every state in order. Sends block: a delta holds every change since the
// last one sent, computed after the receiver was last ready to take one.
func (c *Controller) Run(ctx context.Context, out chan<- desired.State) error {
	defer utilruntime.HandleCrash()
	defer c.queue.ShutDown()
	if c.stopRec != nil {
		defer c.stopRec()
	}
	go c.eventLoop(ctx)
	c.Start(ctx)
	defer c.factory.Shutdown()
	if c.nsFactory != nil {
		defer c.nsFactory.Shutdown()
	}
	if c.dynFactory != nil {
		defer c.dynFactory.Shutdown()
	}
	if c.nodeFactory != nil {
		defer c.nodeFactory.Shutdown()
	}
	c.log.Info("waiting for the Service, EndpointSlice and BackendPolicy caches", "policies", c.dynFactory != nil)
	if !cache.WaitForCacheSync(ctx.Done(), c.synced...) {
		return nil // ctx ended
	}
	// The informers queued the key of every object they listed. The pass
	// below computes each Service from the caches, which held the object
	// before its key was queued: the worker would only compute them all a
	// second time, beside the agent's first write (5% of a cold start's
	// CPU at 10,000 Services). Keys queued from here on are worked off.
	for c.queue.Len() > 0 {
		key, _ := c.queue.Get()
		c.queue.Forget(key)
		c.queue.Done(key)
	}
	// Compute everything once before the first hand-over: the agent must
	// never see a partial state, which would remove the services not yet
	// computed (and their established flows' backends) from the maps.
	// Counted, not logged one by one: at 10,000 Services a line each
	// was 10,000 lines and writes in the cold start, saying one thing.
	c.initialServed = map[string]int{}
	keys := c.services.keys()
	for _, key := range keys {
		if err := c.sync(key); err != nil {
			return err
		}
	}
	served := c.initialServed
	c.initialServed = nil
	// The snapshot holds every change so far: no hand-over is pending.
	select {
	case <-c.dirty:
	default:
	}
	first := c.snapshot()
	c.log.Info("kubernetes caches synced", "services", len(keys), "ports", len(first.Services), "served_because", served)
	select {
	case out <- first:
	case <-ctx.Done():
		return nil
	}

	go func() {
		for c.processNext() {
		}
	}()
	if c.statusQueue != nil && c.opts.Status != nil {
		// On the way out: the worker stops, then the election gives the
		// Lease back (ReleaseOnCancel) before Run returns, so the next
		// leader need not wait for it to expire.
		var wg sync.WaitGroup
		defer wg.Wait()
		defer c.statusQueue.ShutDown()
		wg.Go(func() { c.leadPolicyStatus(ctx) })
	}
	c.publish(ctx, out, first)
	return nil
}

// publish hands over what changed after each change, as a delta, waiting
// Debounce for more changes first; and a complete snapshot every Resync,
// a safety net that, when all is well, changes nothing. A change undone
// within the wait hands nothing over.
func (c *Controller) publish(ctx context.Context, out chan<- desired.State, last desired.State) {
	resync := time.NewTicker(c.opts.Resync)
	defer resync.Stop()
	lastBack := last.HandBack
	for {
		full := false
		select {
		case <-ctx.Done():
			return
		case <-c.dirty:
		case <-resync.C:
			full = true
		}
		if !full {
			select {
			case <-ctx.Done():
				return
			case <-time.After(c.opts.Debounce):
			}
		}
		// Changes that arrived during the wait are in this hand-over.
		select {
		case <-c.dirty:
		default:
		}
		var st desired.State
		if full {
			st = c.snapshot()
		} else if st = c.delta(); len(st.Services) == 0 && len(st.Gone) == 0 && slices.Equal(st.HandBack, lastBack) {
			continue
		}
		select {
		case out <- st:
			lastBack = st.HandBack
		case <-ctx.Done():
			return
		}
	}
}

func (c *Controller) processNext() bool {
	key, shutdown := c.queue.Get()
	if shutdown {
		return false
	}
	defer c.queue.Done(key)
	if err := c.sync(key); err != nil {
		c.log.Warn("sync service, retrying", "service", key, "err", err)
		c.queue.AddRateLimited(key)
		return true
	}
	c.queue.Forget(key)
	return true
}

// sync recomputes one Service's desired services from the listers.
func (c *Controller) sync(key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil // a malformed key will not get better
	}
	cached := c.services.get(ns, name)
	if cached == nil {
		c.mu.Lock()
		defer c.mu.Unlock()
		if e, ok := c.entries[key]; ok {
			c.forget(key, e)
			c.setServices(key, e, nil)
			c.setUnserved(e, nil)
			delete(c.entries, key)
			c.order = nil
			c.markDirty()
		}
		return nil
	}
	svc := cached.object()
	objs, err := c.sliceIndex.ByIndex(sliceServiceIndex, key)
	if err != nil {
		return err
	}
	epSlices := make([]*endpointSlice, 0, len(objs))
	for _, o := range objs {
		if sl, ok := o.(*endpointSlice); ok {
			epSlices = append(epSlices, sl)
		}
	}
	// The index's order is a set's: Translate reads them in a fixed one.
	slices.SortFunc(epSlices, func(a, b *endpointSlice) int { return cmp.Compare(a.Name, b.Name) })

	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[key]
	if e == nil || e.uid != svc.UID {
		// A new Service, or one deleted and recreated under the same name:
		// nothing carries over.
		if e != nil {
			c.forget(key, e)
			c.setServices(key, e, nil)
			c.setUnserved(e, nil)
		}
		e = &entry{uid: svc.UID}
		c.entries[key] = e
		c.order = nil
	}
	settings := c.withSections(svc, key, c.withPolicy(key, c.settings(svc, key, e), e), e)
	served := c.servedBecause(svc, key)
	if served != e.served {
		switch {
		case c.initialServed != nil:
			if served != "" {
				c.initialServed[served]++
			}
		case served == "":
			c.log.Info("service left to kube-proxy: not opted in", "service", key)
		default:
			c.log.Info("service served", "service", key, "because", served)
		}
		e.served = served
	}
	var services []desired.Service
	var hostLocal []string
	var unserved []desired.Key
	if served == "" {
		unserved = Keys(svc)
	} else {
		services, hostLocal = translate(svc, epSlices, settings, Node{Name: c.opts.NodeName, Zone: c.zone, Addrs: c.local})
		for i := range services {
			services[i].Served = served
		}
	}
	if !slices.Equal(hostLocal, e.hostLocal) {
		if len(hostLocal) > 0 {
			c.log.Info("ports with a backend in this node's own network namespace are left to kube-proxy",
				"service", key, "ports", hostLocal)
		}
		e.hostLocal = hostLocal
	}
	if !slices.Equal(unserved, e.unserved) {
		c.setUnserved(e, unserved)
		c.markDirty()
	}
	if slices.EqualFunc(services, e.services, func(a, b desired.Service) bool { return a.Equal(&b) }) {
		return nil
	}
	for _, s := range e.services {
		delete(c.owner, s.Name)
	}
	for _, s := range services {
		c.owner[s.Name] = key
	}
	// In name order: the snapshot lists entries in order, and each one's
	// services in order, without sorting them all.
	slices.SortFunc(services, func(a, b desired.Service) int { return cmp.Compare(a.Name, b.Name) })
	c.setServices(key, e, services)
	c.markDirty()
	return nil
}

// setServices replaces the services of entry e (key), noting the change
// for the next delta. Called with mu held.
func (c *Controller) setServices(key string, e *entry, services []desired.Service) {
	if _, ok := c.pending[key]; !ok {
		c.pending[key] = e.services
	}
	for _, s := range e.services {
		if c.keyCount[s.Key]--; c.keyCount[s.Key] <= 0 {
			delete(c.keyCount, s.Key)
		}
	}
	for _, s := range services {
		c.keyCount[s.Key]++
	}
	e.services = services
}

// setUnserved replaces the unserved keys of entry e. Called with mu held.
func (c *Controller) setUnserved(e *entry, unserved []desired.Key) {
	if len(e.unserved) > 0 || len(unserved) > 0 {
		c.handBack = nil
	}
	e.unserved = unserved
}

// settings returns the Service's settings: from its annotations when they
// are all valid, else the last good ones. Each
// invalid key=value is announced once, by a Warning Event, a log line and
// the invalid-settings metric. Called with mu held.
func (c *Controller) settings(svc *corev1.Service, key string, e *entry) Settings {
	s, errs := ParseAnnotations(svc.Annotations, DefaultSettings(c.opts.MaxInflight))
	if len(errs) == 0 {
		e.lastGood = svc.Annotations
		e.reported = nil
		return s
	}
	now := map[string]bool{}
	for _, ae := range errs {
		id := ae.Key + "=" + ae.Value
		now[id] = true
		if e.reported[id] {
			continue
		}
		c.log.Warn("invalid annotation; the last good settings stay in force",
			"service", key, "key", ae.Key, "value", ae.Value, "err", ae.Msg)
		if c.metrics.InvalidSettings != nil {
			c.metrics.InvalidSettings.WithLabelValues(key, ae.Key).Inc()
		}
		c.recorder.Eventf(svc, corev1.EventTypeWarning, ReasonInvalidAnnotation,
			"%s; the last good settings stay in force", ae.Error())
	}
	e.reported = now
	// They parsed without error before, and parse the same again.
	good, _ := ParseAnnotations(e.lastGood, DefaultSettings(c.opts.MaxInflight))
	return good
}

// forget drops what the controller holds for a Service, its
// invalid-settings series included (a deleted Service's series would
// otherwise stay forever). Called with mu held.
func (c *Controller) forget(key string, e *entry) {
	for _, s := range e.services {
		if c.owner[s.Name] == key {
			delete(c.owner, s.Name)
		}
	}
	if c.metrics.InvalidSettings != nil {
		c.metrics.InvalidSettings.DeleteService(key)
	}
}

// withPolicy returns the settings in force on a Service: the winning
// BackendPolicy's fields over annotated (the settings from its
// annotations), or annotated when no policy targets it. While the winner is
// invalid, its last version that applied cleanly stays in force over the
// current annotations (none after a restart: then the annotations alone),
// and the invalid one is announced once, by a log line and the
// invalid-settings metric; its status says why (written by the status
// leader). Called with mu held.
func (c *Controller) withPolicy(key string, annotated Settings, e *entry) Settings {
	p := WinnerFor(c.targetingLocked(key), key, "")
	if p == nil {
		e.goodPolicy, e.badPolicy = nil, ""
		return annotated
	}
	s, err := ApplyPolicy(p, annotated)
	if err == nil {
		e.goodPolicy, e.badPolicy = p, ""
		return s
	}
	// By generation: a status write changes the resourceVersion, not the
	// spec.
	if id := fmt.Sprintf("%s@%d", p.Key(), p.Generation); e.badPolicy != id {
		e.badPolicy = id
		c.log.Warn("invalid BackendPolicy; its last valid version, or the annotations, stay in force",
			"service", key, "policy", p.Key(), "err", err)
		if c.metrics.InvalidSettings != nil {
			c.metrics.InvalidSettings.WithLabelValues(key, PolicyKind+" "+p.Key()).Inc()
		}
	}
	if e.goodPolicy != nil && e.goodPolicy.Key() == p.Key() {
		if s, err := ApplyPolicy(e.goodPolicy, annotated); err == nil {
			return s
		}
	}
	return annotated
}

func (c *Controller) markDirty() {
	select {
	case c.dirty <- struct{}{}:
	default:
	}
}

// snapshot assembles the full desired state, ordered by name. It walks the
// entries in their kept order (sorted again only when Services came or
// went): a complete hand-over of 10,000 services is a copy, not a sort.
// Changes pending for the next delta are in it.
func (c *Controller) snapshot() desired.State {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.resetPending()
	n := 0
	for _, e := range c.sorted() {
		n += len(e.services)
	}
	st := desired.State{Services: make([]desired.Service, 0, n), HandBack: c.handBackLocked()}
	for _, e := range c.order {
		st.Services = append(st.Services, e.services...)
	}
	if len(st.Services) == 0 {
		st.Services = nil
	}
	return st
}

// delta assembles what changed since the last hand-over (a desired.State
// with Delta set): the services of each Service that changed, in name
// order, and the keys no Service lists any more. A Service changed and
// changed back is left out. Its cost is the changes', not the Services'.
func (c *Controller) delta() desired.State {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys := make([]string, 0, len(c.pending))
	for k := range c.pending {
		keys = append(keys, k)
	}
	// Service keys in this order list their services in name order.
	slices.SortFunc(keys, cmpKeys)
	st := desired.State{Delta: true, HandBack: c.handBackLocked()}
	for _, k := range keys {
		was := c.pending[k]
		var now []desired.Service
		if e := c.entries[k]; e != nil {
			now = e.services
		}
		if slices.EqualFunc(was, now, func(a, b desired.Service) bool { return a.Equal(&b) }) {
			continue
		}
		st.Services = append(st.Services, now...)
		for _, s := range was {
			if c.keyCount[s.Key] == 0 {
				st.Gone = append(st.Gone, s.Key)
			}
		}
	}
	c.resetPending()
	return st
}

// resetPending empties pending after a hand-over. A map keeps the room its
// largest contents took, so after the first complete state (every Service
// pending) it is made anew rather than cleared: megabytes at 10,000
// Services, for the few keys a change has.
func (c *Controller) resetPending() {
	if len(c.pending) > 256 {
		c.pending = map[string][]desired.Service{}
		return
	}
	clear(c.pending)
}

// sorted returns the entries in the order of their Service keys, sorting
// them only when Services came or went. Called with mu held.
func (c *Controller) sorted() []*entry {
	if c.order == nil {
		keys := make([]string, 0, len(c.entries))
		for k := range c.entries {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, cmpKeys)
		c.order = make([]*entry, len(keys))
		for i, k := range keys {
			c.order[i] = c.entries[k]
		}
	}
	return c.order
}

// handBackLocked returns every entry's unserved keys, sorted, built again
// only when one changed. Called with mu held.
func (c *Controller) handBackLocked() []desired.Key {
	if c.handBack == nil {
		back := []desired.Key{}
		for _, e := range c.entries {
			back = append(back, e.unserved...)
		}
		slices.SortFunc(back, func(a, b desired.Key) int { return cmp.Compare(a.String(), b.String()) })
		c.handBack = back
	}
	if len(c.handBack) == 0 {
		return nil
	}
	return c.handBack
}

// SetLocalAddrs tells the controller the node's own addresses; Services
// are recomputed when they change (see Translate). Call it before Run for
// the first desired state to take them into account.
func (c *Controller) SetLocalAddrs(addrs []netip.Addr) {
	m := make(map[netip.Addr]bool, len(addrs))
	for _, a := range addrs {
		m[a] = true
	}
	c.mu.Lock()
	changed := !maps.Equal(m, c.local)
	c.local = m
	c.mu.Unlock()
	if !changed {
		return
	}
	// Before Run has synced the caches this lists nothing, and Run's
	// first pass computes everything anyway.
	for _, key := range c.services.keys() {
		c.queue.Add(key)
	}
}

// serviceOf returns the Service a desired service name belongs to.
func (c *Controller) serviceOf(name string) (*corev1.Service, error) {
	c.mu.Lock()
	key, ok := c.owner[name]
	c.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("no Service for %q", name)
	}
	ns, n, _ := strings.Cut(key, "/")
	svc := c.services.get(ns, n)
	if svc == nil {
		return nil, fmt.Errorf("no Service %s in the cache", key)
	}
	return svc.object(), nil
}

// stripForCache is the informers' transform: each object is cached as the
// controller's compact copy of what the agent reads, not as decoded. An
// EndpointSlice as an endpointSlice, a Service as a cachedService (the
// labels and annotations the agent reads, penaltybox.io/ ones and the
// Linkerd spellings of our annotations, and the spec fields Translate
// reads). Neither keeps managedFields, kubectl's last-applied copy of the
// whole object, a Service's selector (the slices say where its endpoints
// are) or its status. With 10,000 Services and their EndpointSlices that
// is tens of megabytes of the agent's memory. Anything else (a tombstone)
// passes as it is.
func stripForCache(obj any) (any, error) {
	switch o := obj.(type) {
	case *discoveryv1.EndpointSlice:
		return compactSlice(o), nil
	case *corev1.Service:
		return compactService(o), nil
	}
	return obj, nil
}

// keepOnly returns m's entries whose key keep accepts: m itself when it
// has no other, nil when it has none.
func keepOnly(m map[string]string, keep func(string) bool) map[string]string {
	n := 0
	for k := range m {
		if keep(k) {
			n++
		}
	}
	switch {
	case n == len(m):
		return m
	case n == 0:
		return nil
	}
	out := make(map[string]string, n)
	for k, v := range m {
		if keep(k) {
			out[k] = v
		}
	}
	return out
}

// sliceServiceIndex indexes EndpointSlices by their Service's key,
// "namespace/name" (the kubernetes.io/service-name label).
const sliceServiceIndex = "service"

func sliceService(obj any) ([]string, error) {
	sl, ok := obj.(*endpointSlice)
	if !ok || sl.service == "" {
		return nil, nil
	}
	return []string{sl.Namespace + "/" + sl.service}, nil
}

// cmpKeys orders Service keys as their services' names sort: as
// cmp.Compare(a+":", b+":"), without building the strings (a key,
// "namespace/name", holds no colon).
func cmpKeys(a, b string) int {
	n := min(len(a), len(b))
	if c := strings.Compare(a[:n], b[:n]); c != 0 {
		return c
	}
	switch {
	case len(a) == len(b):
		return 0
	case len(a) < len(b):
		return cmp.Compare(':', b[n])
	default:
		return cmp.Compare(a[n], ':')
	}
}
