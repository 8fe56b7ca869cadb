// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/metrics"
)

// harness runs a Controller on a fake clientset.
type harness struct {
	t       *testing.T
	ctx     context.Context
	client  *fake.Clientset
	ctrl    *Controller
	rec     *record.FakeRecorder
	invalid *metrics.ServiceCounterVec
	states  chan desired.State
	done    chan error
	// metrics are the controller's (InvalidSettings: invalid); a tweak
	// may add to them. beforeRun, if set, runs between New and Run.
	metrics   Metrics
	beforeRun func(*harness)
	// handed is the complete state handed over so far (next).
	handed *desired.State
}

// debounce is the controller's Debounce in tests, short so they run fast.
var debounce = 10 * time.Millisecond

func newHarness(t *testing.T, objs ...any) *harness {
	return newHarnessDebounce(t, debounce, objs...)
}

func newHarnessDebounce(t *testing.T, debounce time.Duration, objs ...any) *harness {
	t.Helper()
	return newHarnessWith(t, debounce, nil, objs...)
}

// newHarnessWith lets a test add to the controller's options; the fake
// clientset is built before tweak is called.
func newHarnessWith(t *testing.T, debounce time.Duration, tweak func(*harness, *Options), objs ...any) *harness {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h := &harness{
		t: t, ctx: ctx,
		rec:     record.NewFakeRecorder(100),
		invalid: metrics.NewServiceCounterVec(prometheus.CounterOpts{Name: "invalid_settings_total"}, "key"),
		states:  make(chan desired.State),
		done:    make(chan error, 1),
	}
	h.metrics.InvalidSettings = h.invalid
	h.client = fake.NewClientset()
	for _, o := range objs {
		h.create(o)
	}
	// Every Service, as before opt-in scope existed: the scope has tests
	// of its own (TestControllerOptInScope).
	opts := Options{
		NodeName: "n1", Debounce: debounce, Scope: ScopeAll,
		Recorder: h.rec, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	if tweak != nil {
		tweak(h, &opts)
	}
	h.ctrl = New(h.client, opts)
	h.ctrl.SetMetrics(h.metrics)
	if h.beforeRun != nil {
		h.beforeRun(h)
	}
	go func() { h.done <- h.ctrl.Run(ctx, h.states) }()
	t.Cleanup(func() {
		cancel()
		if err := <-h.done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return h
}

func (h *harness) create(o any) {
	h.t.Helper()
	var err error
	switch o := o.(type) {
	case *corev1.Service:
		_, err = h.client.CoreV1().Services(o.Namespace).Create(h.ctx, o, metav1.CreateOptions{})
	case *discoveryv1.EndpointSlice:
		_, err = h.client.DiscoveryV1().EndpointSlices(o.Namespace).Create(h.ctx, o, metav1.CreateOptions{})
	case *corev1.Namespace:
		_, err = h.client.CoreV1().Namespaces().Create(h.ctx, o, metav1.CreateOptions{})
	}
	if err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) updateService(s *corev1.Service) {
	h.t.Helper()
	if _, err := h.client.CoreV1().Services(s.Namespace).Update(h.ctx, s, metav1.UpdateOptions{}); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) updateSlice(s *discoveryv1.EndpointSlice) {
	h.t.Helper()
	if _, err := h.client.DiscoveryV1().EndpointSlices(s.Namespace).Update(h.ctx, s, metav1.UpdateOptions{}); err != nil {
		h.t.Fatal(err)
	}
}

// next waits for the next desired state and returns the complete state
// it stands for (a delta merged into the ones before).
func (h *harness) next() desired.State {
	h.t.Helper()
	select {
	case st := <-h.states:
		if st.Delta && h.handed == nil {
			h.t.Fatal("a delta before any complete desired state")
		}
		if h.handed == nil {
			h.handed = &desired.State{}
		}
		*h.handed = h.handed.Merge(st)
		return *h.handed
	case <-time.After(5 * time.Second):
		h.t.Fatal("no desired state within 5s")
	}
	return desired.State{}
}

// quiet asserts no desired state is sent for a while.
func (h *harness) quiet() {
	h.t.Helper()
	select {
	case st := <-h.states:
		h.t.Fatalf("unexpected desired state %+v", st)
	case <-time.After(200 * time.Millisecond):
	}
}

func (h *harness) event() string {
	h.t.Helper()
	select {
	case e := <-h.rec.Events:
		return e
	case <-time.After(5 * time.Second):
		h.t.Fatal("no Event within 5s")
	}
	return ""
}

func (h *harness) noEvent() {
	h.t.Helper()
	select {
	case e := <-h.rec.Events:
		h.t.Fatalf("unexpected Event %q", e)
	default:
	}
}

func byName(st desired.State) map[string]desired.Service {
	out := map[string]desired.Service{}
	for _, s := range st.Services {
		out[s.Name] = s
	}
	return out
}

func addrs(s desired.Service) []string {
	var out []string
	for _, e := range s.Endpoints {
		out = append(out, e.Addr.String())
	}
	return out
}

func TestControllerFirstStateIsComplete(t *testing.T) {
	other := service()
	other.Name, other.UID, other.Spec.ClusterIP, other.Spec.ClusterIPs = "api", "uid-api", "198.19.0.11", []string{"198.19.0.11"}
	otherSlice := slice("api-1", httpPort, readyEP("198.18.7.2", "api-a"))
	otherSlice.Labels[discoveryv1.LabelServiceName] = "api"
	skipped := service()
	skipped.Name, skipped.UID, skipped.Labels = "mesh", "uid-mesh", map[string]string{labelServiceProxyName: "other-proxy"}
	skipped.Spec.ClusterIP, skipped.Spec.ClusterIPs = "198.19.0.12", []string{"198.19.0.12"}

	h := newHarness(t, service(), other, skipped,
		slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")),
		slice("web-2", httpPort, readyEP("198.18.2.2", "web-b")),
		otherSlice)
	st := h.next()
	got := byName(st)
	if len(got) != 2 {
		t.Fatalf("services %v, want shop/api:http and shop/web:http (shop/mesh belongs to another proxy)", got)
	}
	if a := addrs(got["shop/web:http"]); strings.Join(a, ",") != "198.18.1.2:8080,198.18.2.2:8080" {
		t.Errorf("web endpoints %v: want both slices' endpoints", a)
	}
	if a := addrs(got["shop/api:http"]); strings.Join(a, ",") != "198.18.7.2:8080" {
		t.Errorf("api endpoints %v", a)
	}
	if st.Services[0].Name != "shop/api:http" {
		t.Errorf("services not sorted by name: %v", st.Services)
	}
	h.quiet() // the initial adds queued by the informers change nothing
}

// The cold start's Services are logged served in one line, with their
// count by reason; a Service served later gets a line of its own.
func TestControllerLogsInitialServicesOnce(t *testing.T) {
	var logs lockedBuffer
	other := service()
	other.Name, other.UID, other.Spec.ClusterIP, other.Spec.ClusterIPs = "api", "uid-api", "198.19.0.11", []string{"198.19.0.11"}
	otherSlice := slice("api-1", httpPort, readyEP("198.18.7.2", "api-a"))
	otherSlice.Labels[discoveryv1.LabelServiceName] = "api"
	h := newHarnessWith(t, debounce, func(_ *harness, o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	}, service(), other, slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")), otherSlice)
	h.next()
	first := logs.String()
	if n := strings.Count(first, "msg=\"service served\""); n != 0 {
		t.Errorf("%d service served lines at the start, want the summary only:\n%s", n, first)
	}
	if !strings.Contains(first, "msg=\"kubernetes caches synced\"") || !strings.Contains(first, "served_because=map[scope-all:2]") {
		t.Errorf("no summary of the 2 Services served:\n%s", first)
	}
	late := service()
	late.Name, late.UID, late.Spec.ClusterIP, late.Spec.ClusterIPs = "cart", "uid-cart", "198.19.0.12", []string{"198.19.0.12"}
	lateSlice := slice("cart-1", httpPort, readyEP("198.18.8.2", "cart-a"))
	lateSlice.Labels[discoveryv1.LabelServiceName] = "cart"
	h.create(late)
	h.create(lateSlice)
	h.next()
	if rest := strings.TrimPrefix(logs.String(), first); !strings.Contains(rest, "msg=\"service served\" service=shop/cart") {
		t.Errorf("the Service added later has no line of its own:\n%s", rest)
	}
}

// lockedBuffer is a bytes.Buffer a logger on another goroutine writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// After the first, complete state, a hand-over carries what changed: the
// services of the Service whose slice changed, not the others'; a Service
// deleted is its keys gone.
func TestControllerHandsOverDeltas(t *testing.T) {
	other := service()
	other.Name, other.UID, other.Spec.ClusterIP, other.Spec.ClusterIPs = "api", "uid-api", "198.19.0.11", []string{"198.19.0.11"}
	otherSlice := slice("api-1", httpPort, readyEP("198.18.7.2", "api-a"))
	otherSlice.Labels[discoveryv1.LabelServiceName] = "api"
	sl := slice("web-1", httpPort, readyEP("198.18.1.2", "web-a"))
	h := newHarness(t, service(), sl, other, otherSlice)
	raw := func() desired.State {
		t.Helper()
		select {
		case st := <-h.states:
			return st
		case <-time.After(5 * time.Second):
			t.Fatal("no desired state within 5s")
		}
		return desired.State{}
	}
	if first := raw(); first.Delta || len(first.Services) != 2 {
		t.Fatalf("first state %+v: want both services, complete", first)
	}

	h.updateSlice(slice("web-1", httpPort, readyEP("198.18.1.2", "web-a"), readyEP("198.18.2.2", "web-b")))
	d := raw()
	if !d.Delta || len(d.Services) != 1 || d.Services[0].Name != "shop/web:http" || len(d.Gone) != 0 {
		t.Fatalf("after web's slice changed: %+v; want a delta of shop/web:http alone", d)
	}
	if a := addrs(d.Services[0]); strings.Join(a, ",") != "198.18.1.2:8080,198.18.2.2:8080" {
		t.Fatalf("web endpoints %v", a)
	}

	if err := h.client.CoreV1().Services("shop").Delete(h.ctx, "api", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	d = raw()
	want := desired.Key{VIP: netip.MustParseAddr("198.19.0.11"), Port: 80, Protocol: desired.TCP}
	if !d.Delta || len(d.Services) != 0 || !slices.Equal(d.Gone, []desired.Key{want}) {
		t.Fatalf("after api was deleted: %+v; want a delta with %s gone", d, want)
	}
	h.quiet()
}

func TestControllerFollowsChanges(t *testing.T) {
	sl := slice("web-1", httpPort, readyEP("198.18.1.2", "web-a"), readyEP("198.18.2.2", "web-b"))
	h := newHarness(t, service(), sl)
	h.next()

	// An endpoint goes not-ready: it leaves the backends.
	sl.Endpoints[1].Conditions.Ready = new(bool)
	start := time.Now()
	h.updateSlice(sl)
	st := h.next()
	if d := time.Since(start); d > time.Second {
		t.Errorf("change took %v to reach the desired state, want well under 1s", d)
	}
	if a := addrs(byName(st)["shop/web:http"]); strings.Join(a, ",") != "198.18.1.2:8080" {
		t.Fatalf("endpoints %v after web-b went not ready", a)
	}

	// A second slice appears.
	h.create(slice("web-2", httpPort, readyEP("198.18.3.2", "web-c")))
	if a := addrs(byName(h.next())["shop/web:http"]); strings.Join(a, ",") != "198.18.1.2:8080,198.18.3.2:8080" {
		t.Fatalf("endpoints %v after web-2 was created", a)
	}

	// A port is added to the Service.
	svc, _ := h.client.CoreV1().Services("shop").Get(h.ctx, "web", metav1.GetOptions{})
	svc.Spec.Ports = append(svc.Spec.Ports, corev1.ServicePort{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP})
	h.updateService(svc)
	if got := byName(h.next()); len(got) != 2 || len(got["shop/web:dns"].Endpoints) != 0 {
		t.Fatalf("after adding port dns: %v", got)
	}

	// A slice is deleted, then the Service.
	if err := h.client.DiscoveryV1().EndpointSlices("shop").Delete(h.ctx, "web-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if a := addrs(byName(h.next())["shop/web:http"]); strings.Join(a, ",") != "198.18.3.2:8080" {
		t.Fatalf("endpoints %v after web-1 was deleted", a)
	}
	if err := h.client.CoreV1().Services("shop").Delete(h.ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if st := h.next(); len(st.Services) != 0 {
		t.Fatalf("services after the Service was deleted: %v", st.Services)
	}
}

// A burst of changes inside the debounce window is one hand-over.
func TestControllerDebounces(t *testing.T) {
	sl := slice("web-1", httpPort, readyEP("198.18.1.2", "web-a"))
	h := newHarnessDebounce(t, 300*time.Millisecond, service(), sl)
	h.next()
	for i := 2; i <= 5; i++ {
		sl.Endpoints = append(sl.Endpoints, discoveryv1.Endpoint{Addresses: []string{fmt.Sprintf("198.18.%d.2", i)}})
		h.updateSlice(sl)
	}
	if n := len(byName(h.next())["shop/web:http"].Endpoints); n != 5 {
		t.Errorf("first hand-over after the burst has %d endpoints, want all 5", n)
	}
	h.quiet()
}

func TestControllerInvalidAnnotationKeepsLastGood(t *testing.T) {
	svc := service()
	svc.Annotations = map[string]string{AnnotationMaxFailures: "3"}
	h := newHarness(t, svc, slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")))
	if got := byName(h.next())["shop/web:http"].Accrual.MaxFailures; got != 3 {
		t.Fatalf("maxFailures = %d, want 3", got)
	}

	// An invalid value: settings stay, one Warning Event, metric +1.
	svc.Annotations = map[string]string{AnnotationMaxFailures: "three", AnnotationMinPenalty: "5s"}
	h.updateService(svc)
	ev := h.event()
	for _, want := range []string{"Warning", ReasonInvalidAnnotation, AnnotationMaxFailures, `"three"`, "last good"} {
		if !strings.Contains(ev, want) {
			t.Errorf("Event %q does not contain %q", ev, want)
		}
	}
	if v := testutil.ToFloat64(h.invalid.WithLabelValues("shop/web", AnnotationMaxFailures)); v != 1 {
		t.Errorf("invalid_settings_total = %v, want 1", v)
	}
	h.quiet() // nothing changed for the datapath: min-penalty waits with the rest

	// Recomputing (a label change, a resync) does not announce it again.
	svc.Labels = map[string]string{"touched": "yes"}
	h.updateService(svc)
	h.quiet()
	h.noEvent()
	if v := testutil.ToFloat64(h.invalid.WithLabelValues("shop/web", AnnotationMaxFailures)); v != 1 {
		t.Errorf("invalid_settings_total = %v after a recomputation, want still 1", v)
	}

	// Another invalid value is announced.
	svc.Annotations[AnnotationMaxFailures] = "-2"
	h.updateService(svc)
	if ev := h.event(); !strings.Contains(ev, `"-2"`) {
		t.Errorf("Event %q does not name the new value", ev)
	}

	// Fixed: everything applies.
	svc.Annotations[AnnotationMaxFailures] = "4"
	h.updateService(svc)
	acc := byName(h.next())["shop/web:http"].Accrual
	if acc.MaxFailures != 4 || acc.MinPenalty != 5*time.Second {
		t.Errorf("accrual %+v, want maxFailures 4 and minPenalty 5s", acc)
	}
	if v := testutil.ToFloat64(h.invalid.WithLabelValues("shop/web", AnnotationMaxFailures)); v != 2 {
		t.Errorf("invalid_settings_total = %v, want 2", v)
	}

	// Deleting the Service drops its series.
	if err := h.client.CoreV1().Services("shop").Delete(h.ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	h.next()
	if n := testutil.CollectAndCount(h.invalid); n != 0 {
		t.Errorf("%d invalid_settings_total series left after the Service was deleted", n)
	}
}

// A Service created with an invalid annotation gets the defaults, and a
// recreated Service does not inherit its predecessor's last good settings.
func TestControllerInvalidFromTheStart(t *testing.T) {
	svc := service()
	svc.Annotations = map[string]string{AnnotationMode: "none"}
	h := newHarness(t, svc)
	if got := byName(h.next())["shop/web:http"].Accrual.Mode; got != accrual.ModeNone {
		t.Fatalf("mode %q, want none", got)
	}
	if err := h.client.CoreV1().Services("shop").Delete(h.ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	h.next()
	svc = service()
	svc.UID = "uid-web-2"
	svc.Annotations = map[string]string{AnnotationMode: "off"}
	h.create(svc)
	if got := byName(h.next())["shop/web:http"].Accrual; got != accrual.Defaults() {
		t.Fatalf("accrual %+v, want the defaults", got)
	}
	if ev := h.event(); !strings.Contains(ev, `"off"`) {
		t.Errorf("Event %q", ev)
	}
}

func TestControllerNotify(t *testing.T) {
	h := newHarness(t, service(), slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")))
	h.next()
	addr := netip.MustParseAddrPort("198.18.1.2:8080")
	h.ctrl.Notify(Transition{Service: "shop/web:http", Endpoint: "shop/web-a", Addr: addr, Transition: accrual.Transition{
		From: accrual.Ready, To: accrual.Ejected, Reason: accrual.ReasonConsecutiveFailures, Kind: accrual.KindRefused, Failures: 7,
	}})
	ev := h.event()
	for _, want := range []string{"Warning", ReasonEndpointEjected, "pod shop/web-a (198.18.1.2:8080)", "port http", "node n1", "7 consecutive failures", "refused"} {
		if !strings.Contains(ev, want) {
			t.Errorf("Event %q does not contain %q", ev, want)
		}
	}
	// Transitions that get no Event, and those of unknown services.
	h.ctrl.Notify(Transition{Service: "shop/web:http", Addr: addr, Transition: accrual.Transition{
		From: accrual.Ejected, To: accrual.Probation, Reason: accrual.ReasonPenaltyOver}})
	h.ctrl.Notify(Transition{Service: "shop/gone:http", Addr: addr, Transition: accrual.Transition{
		From: accrual.Ready, To: accrual.Ejected, Reason: accrual.ReasonConsecutiveFailures}})
	h.ctrl.Notify(Transition{Service: "shop/web:http", Endpoint: "shop/web-a", Addr: addr, Transition: accrual.Transition{
		From: accrual.Probation, To: accrual.Ready, Reason: accrual.ReasonProbeSucceeded}})
	if ev := h.event(); !strings.Contains(ev, "Normal "+ReasonEndpointRestored) || !strings.Contains(ev, "probe connection succeeded") {
		t.Errorf("Event %q, want the restore", ev)
	}
	h.noEvent()
}

// Notify never blocks, however many transitions come at once.
func TestNotifyDoesNotBlock(t *testing.T) {
	c := New(fake.NewClientset(), Options{Recorder: record.NewFakeRecorder(1),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	done := make(chan struct{})
	go func() {
		for range 5000 {
			c.Notify(Transition{Service: "shop/web:http", Transition: accrual.Transition{
				From: accrual.Ready, To: accrual.Ejected, Reason: accrual.ReasonConsecutiveFailures}})
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Notify blocked with nobody draining the queue")
	}
}

// The node's own addresses decide which ports are left to kube-proxy, and
// a change of them recomputes the Services.
func TestControllerLocalAddrs(t *testing.T) {
	h := newHarness(t, service(), slice("web-1", httpPort, readyEP("198.18.1.1", "web-hostnet")))
	if got := byName(h.next()); len(got) != 1 {
		t.Fatalf("services %v, want shop/web:http while 198.18.1.1 is not the node's", got)
	}
	h.ctrl.SetLocalAddrs([]netip.Addr{netip.MustParseAddr("198.18.1.1")})
	if got := h.next(); len(got.Services) != 0 {
		t.Fatalf("services %v, want none: the backend is on the node's own address", got.Services)
	}
	h.ctrl.SetLocalAddrs([]netip.Addr{netip.MustParseAddr("198.18.1.1")})
	h.quiet()
	h.ctrl.SetLocalAddrs(nil)
	if got := h.next(); len(got.Services) != 1 {
		t.Fatalf("services %v, want shop/web:http back", got.Services)
	}
}

// The agent starts the informers before its maps load, and learns the
// node's addresses and gives the controller its metrics after: the first
// state still counts both.
func TestControllerStartedBeforeRun(t *testing.T) {
	bad := service()
	bad.Annotations = map[string]string{AnnotationMaxInflight: "lots"}
	h := newHarnessWith(t, debounce, func(h *harness, _ *Options) {
		h.beforeRun = func(h *harness) {
			h.ctrl.Start(h.ctx)
			if !cache.WaitForCacheSync(h.ctx.Done(), h.ctrl.synced...) {
				t.Fatal("caches not synced")
			}
			h.ctrl.SetLocalAddrs([]netip.Addr{netip.MustParseAddr("198.18.1.1")})
		}
	}, bad, slice("web-1", httpPort, readyEP("198.18.1.1", "web-hostnet")))
	if got := h.next(); len(got.Services) != 0 {
		t.Fatalf("services %v, want none: the backend is on the node's own address", got.Services)
	}
	if n := testutil.ToFloat64(h.invalid.WithLabelValues("shop/web", AnnotationMaxInflight)); n != 1 {
		t.Errorf("invalid settings counted %v times, want 1", n)
	}
}

// countingQueue counts the keys taken from the queue once it was first
// found empty: after Run's drain, before its first pass (a Run without
// the drain never looks, and then every key is counted).
type countingQueue struct {
	workqueue.TypedRateLimitingInterface[string]
	mu      sync.Mutex
	drained bool
	got     map[string]int
}

func (q *countingQueue) Len() int {
	n := q.TypedRateLimitingInterface.Len()
	q.mu.Lock()
	q.drained = q.drained || n == 0
	q.mu.Unlock()
	return n
}

func (q *countingQueue) Get() (string, bool) {
	key, shutdown := q.TypedRateLimitingInterface.Get()
	q.mu.Lock()
	if q.drained {
		q.got[key]++
	}
	q.mu.Unlock()
	return key, shutdown
}

// The first state computes every Service the informers listed; the worker
// then computes only what changes after, not every listed key again.
func TestControllerSyncsListedServicesOnce(t *testing.T) {
	var q *countingQueue
	other := service(func(s *corev1.Service) {
		s.Name, s.UID = "api", "uid-api"
		s.Spec.ClusterIP, s.Spec.ClusterIPs = "198.19.0.11", []string{"198.19.0.11"}
	})
	apiSlice := slice("api-1", httpPort, readyEP("198.18.1.2", "b"))
	apiSlice.Labels[discoveryv1.LabelServiceName] = "api"
	h := newHarnessWith(t, debounce, func(h *harness, _ *Options) {
		h.beforeRun = func(h *harness) {
			q = &countingQueue{TypedRateLimitingInterface: h.ctrl.queue, got: map[string]int{}}
			h.ctrl.queue = q
		}
	}, service(), other, slice("web-1", httpPort, readyEP("198.18.1.1", "a")))
	if got := h.next(); len(got.Services) != 2 {
		t.Fatalf("first state %v, want shop/web:http and shop/api:http", got.Services)
	}
	// A change after the first state: the worker takes its key, after any
	// queued before it.
	h.create(apiSlice)
	if got := byName(h.next()); len(got["shop/api:http"].Endpoints) != 1 {
		t.Fatalf("delta %v, want shop/api:http with its endpoint", got)
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	// After the first pass, shop/api for its new slice, and shop/web
	// never: the first state had it.
	if !q.drained || q.got["shop/web"] != 0 || q.got["shop/api"] != 1 {
		t.Errorf("keys taken after the first pass %v (drained %v), want shop/api once", q.got, q.drained)
	}
}

// The node's zone label reaches the topology hints: before the node is
// known all endpoints are used, then the zone's, following the label.
func TestControllerFollowsTheNodeZone(t *testing.T) {
	a, b := readyEP("198.18.211.2", "a"), readyEP("198.18.211.3", "b")
	a.zones, b.zones = []string{"zone-a"}, []string{"zone-b"}
	h := newHarness(t, service(), slice("web-1", httpPort, a, b))
	if got := addrs(byName(h.next())["shop/web:http"]); len(got) != 2 {
		t.Fatalf("endpoints %v before the node's zone is known, want both", got)
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{corev1.LabelTopologyZone: "zone-a"}}}
	if _, err := h.client.CoreV1().Nodes().Create(h.ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := addrs(byName(h.next())["shop/web:http"]); !slices.Equal(got, []string{"198.18.211.2:8080"}) {
		t.Fatalf("endpoints %v in zone-a, want a's", got)
	}
	node.Labels[corev1.LabelTopologyZone] = "zone-b"
	if _, err := h.client.CoreV1().Nodes().Update(h.ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := addrs(byName(h.next())["shop/web:http"]); !slices.Equal(got, []string{"198.18.211.3:8080"}) {
		t.Fatalf("endpoints %v in zone-b, want b's", got)
	}
}

// The caches hold Services and EndpointSlices without their managedFields
// and kubectl's last-applied copy; what the agent reads stays.
func TestStripForCache(t *testing.T) {
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{
		Name: "web", Namespace: "shop",
		Annotations: map[string]string{
			corev1.LastAppliedConfigAnnotation:                       `{"big":"copy"}`,
			"penaltybox.io/failure-accrual-consecutive-max-failures": "3",
		},
		ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}},
	}}
	out, err := stripForCache(svc)
	if err != nil {
		t.Fatal(err)
	}
	got := out.(*cachedService).object()
	// (cachedService has no managedFields, selector or status to keep.)
	if got.Annotations[corev1.LastAppliedConfigAnnotation] != "" {
		t.Errorf("last-applied %q: want it gone", got.Annotations[corev1.LastAppliedConfigAnnotation])
	}
	if got.Annotations["penaltybox.io/failure-accrual-consecutive-max-failures"] != "3" || got.Name != "web" {
		t.Errorf("what the agent reads changed: %+v", got.ObjectMeta)
	}
	// A Service keeps only our labels and annotations.
	svc = &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop",
			Labels:      map[string]string{"app": "web", LabelEnabled: "true"},
			Annotations: map[string]string{"team": "shop", AnnotationMaxFailures: "3"}},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "web"}, ClusterIP: "198.19.0.1",
			Ports: []corev1.ServicePort{{Name: "http", Port: 80}}},
		Status: corev1.ServiceStatus{LoadBalancer: corev1.LoadBalancerStatus{Ingress: []corev1.LoadBalancerIngress{{IP: "198.18.9.9"}}}},
	}
	out, _ = stripForCache(svc)
	got = out.(*cachedService).object()
	if !maps.Equal(got.Labels, map[string]string{LabelEnabled: "true"}) ||
		!maps.Equal(got.Annotations, map[string]string{AnnotationMaxFailures: "3"}) {
		t.Errorf("kept: labels %v, annotations %v", got.Labels, got.Annotations)
	}
	if got.Spec.ClusterIP != "198.19.0.1" || len(got.Spec.Ports) != 1 {
		t.Errorf("what Translate reads changed: %+v", got.Spec)
	}
	// The settings a Service's annotations give are the same cached: the
	// Linkerd spellings ParseAnnotations reads are kept too, and so are
	// their errors.
	for _, ann := range []map[string]string{{
		"balancer.linkerd.io/failure-accrual":                                 "consecutive",
		"balancer.linkerd.io/failure-accrual-consecutive-max-failures":        "3",
		"balancer.alpha.linkerd.io/failure-accrual-success-rate-window":       "30s",
		"balancer.alpha.linkerd.io/failure-accrual-success-rate-min-requests": "9",
		AnnotationMaxInflight: "100",
		"team":                "shop",
	}, {
		"balancer.linkerd.io/failure-accrual-consecutive-max-failures": "many",
		"team": "shop",
	}} {
		want, wantErrs := ParseAnnotations(ann, DefaultSettings(0))
		out, _ = stripForCache(&corev1.Service{ObjectMeta: metav1.ObjectMeta{Annotations: maps.Clone(ann)}})
		cached := out.(*cachedService).object().Annotations
		if _, ok := cached["team"]; ok {
			t.Errorf("kept an annotation nothing reads: %v", cached)
		}
		got, gotErrs := ParseAnnotations(cached, DefaultSettings(0))
		if !reflect.DeepEqual(got, want) || len(gotErrs) != len(wantErrs) {
			t.Errorf("%v: settings from the cached annotations %+v (%d errors), from the Service's %+v (%d errors)", ann, got, len(gotErrs), want, len(wantErrs))
		}
		if len(wantErrs) == 0 && (want.Accrual.MaxFailures != 3 || want.Accrual.Window != 30*time.Second || want.Accrual.MinCalls != 9 || want.MaxInflight != 100) {
			t.Errorf("the test's annotations do not say what it means: %+v", want)
		}
	}
	svc = &corev1.Service{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "web"}}}
	if out, _ = stripForCache(svc); out.(*cachedService).object().Labels != nil {
		t.Errorf("labels none of which are ours: %v, want nil", out.(*cachedService).object().Labels)
	}
	// A tombstone passes as it is.
	tomb := cache.DeletedFinalStateUnknown{Key: "shop/web", Obj: svc}
	if out, err := stripForCache(tomb); err != nil || out != any(tomb) {
		t.Errorf("tombstone: %v, %v", out, err)
	}
}

// EndpointSlices are indexed by their Service's key; a slice without the
// service-name label belongs to none.
func TestSliceServiceIndex(t *testing.T) {
	sl := &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web-abc",
		Labels: map[string]string{discoveryv1.LabelServiceName: "web"}}}
	// The index sees slices as the transform caches them.
	cached, err := stripForCache(sl)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := sliceService(cached); err != nil || !slices.Equal(got, []string{"shop/web"}) {
		t.Errorf("sliceService = %v, %v; want [shop/web]", got, err)
	}
	sl.Labels = nil
	if got, _ := sliceService(compactSlice(sl)); len(got) != 0 {
		t.Errorf("unlabelled slice indexed as %v", got)
	}
	if got, _ := sliceService(&discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web-abc",
		Labels: map[string]string{discoveryv1.LabelServiceName: "web"}}}); len(got) != 0 {
		t.Errorf("an API slice, which the cache never holds, indexed as %v", got)
	}
	if got, _ := sliceService(&corev1.Service{}); len(got) != 0 {
		t.Errorf("a Service indexed as %v", got)
	}
}

// Entries are kept in the order of their services' names: "ns/a:http"
// after "ns/a-b:http" ('-' sorts before ':'), before "ns/a0:http".
func TestCmpKeys(t *testing.T) {
	keys := []string{"ns/a", "ns/a-b", "ns/a0", "ns/ab", "n/z", "ns/", "nt/a", "ns/a.b", "ns/aa"}
	for _, a := range keys {
		for _, b := range keys {
			want := strings.Compare(a+":", b+":")
			if got := cmpKeys(a, b); got != want {
				t.Errorf("cmpKeys(%q, %q) = %d, want %d", a, b, got, want)
			}
		}
	}
}
