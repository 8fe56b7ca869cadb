// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	clienttesting "k8s.io/client-go/testing"
)

// policyHarness is a harness whose controller reads BackendPolicies from a
// fake dynamic client and, holding the Lease, writes their status.
type policyHarness struct {
	*harness
	dyn    *dynamicfake.FakeDynamicClient
	leader prometheus.Gauge
	writes *prometheus.CounterVec
}

func newPolicyHarness(t *testing.T, policies []*BackendPolicy, objs ...any) *policyHarness {
	return newPolicyHarnessScope(t, ScopeAll, policies, objs...)
}

func newPolicyHarnessScope(t *testing.T, scope Scope, policies []*BackendPolicy, objs ...any) *policyHarness {
	ph := &policyHarness{
		dyn: dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
			map[schema.GroupVersionResource]string{PolicyGVR: "BackendPolicyList"}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{Name: "leader"}),
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "writes"}, []string{"result"}),
	}
	for _, p := range policies {
		ph.createPolicy(t, p)
	}
	// The fake stores whatever an update sends, status or not, so a
	// status write made from a copy older than a spec update would put
	// the old spec back. The API server's status subresource keeps the
	// stored spec and takes only the status: do the same.
	ph.dyn.PrependReactor("update", PolicyGVR.Resource, func(a clienttesting.Action) (bool, runtime.Object, error) {
		up, ok := a.(clienttesting.UpdateAction)
		if !ok || up.GetSubresource() != "status" {
			return false, nil, nil
		}
		sent, ok := up.GetObject().(*unstructured.Unstructured)
		if !ok {
			return false, nil, nil
		}
		cur, err := ph.dyn.Tracker().Get(up.GetResource(), up.GetNamespace(), sent.GetName())
		if err != nil {
			return true, nil, err
		}
		stored := cur.(*unstructured.Unstructured).DeepCopy()
		if st, ok := sent.Object["status"]; ok {
			stored.Object["status"] = st
		} else {
			delete(stored.Object, "status")
		}
		return true, stored, ph.dyn.Tracker().Update(up.GetResource(), stored, up.GetNamespace())
	})
	ph.harness = newHarnessWith(t, debounce, func(h *harness, o *Options) {
		o.Policies = ph.dyn
		o.Scope = scope
		o.Status = &StatusOptions{Client: h.client, Namespace: "penaltybox-system", Identity: "n1"}
		h.metrics.PolicyStatusLeader, h.metrics.PolicyStatusWrites = ph.leader, ph.writes
	}, objs...)
	return ph
}

func toUnstructured(t *testing.T, p *BackendPolicy) *unstructured.Unstructured {
	t.Helper()
	j, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	var obj map[string]any
	if err := json.Unmarshal(j, &obj); err != nil {
		t.Fatal(err)
	}
	u := &unstructured.Unstructured{Object: obj}
	u.SetAPIVersion(PolicyGroup + "/" + PolicyVersion)
	u.SetKind(PolicyKind)
	unstructured.RemoveNestedField(u.Object, "metadata", "resourceVersion")
	return u
}

func (ph *policyHarness) createPolicy(t *testing.T, p *BackendPolicy) {
	t.Helper()
	if _, err := ph.dyn.Resource(PolicyGVR).Namespace(p.Namespace).Create(t.Context(), toUnstructured(t, p), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (ph *policyHarness) deletePolicy(t *testing.T, name string) {
	t.Helper()
	if err := ph.dyn.Resource(PolicyGVR).Namespace("shop").Delete(t.Context(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// status polls a policy's status until cond holds (5s at most).
func (ph *policyHarness) status(t *testing.T, name string, cond func(PolicyStatus) bool) PolicyStatus {
	t.Helper()
	var st PolicyStatus
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		u, err := ph.dyn.Resource(PolicyGVR).Namespace("shop").Get(t.Context(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p, err := DecodePolicy(u)
		if err != nil {
			t.Fatal(err)
		}
		if st = p.Status; cond(st) {
			return st
		}
	}
	t.Fatalf("status of %s: %+v", name, st)
	return st
}

// statusWrites counts the status updates sent to the fake. The fake
// records an action before its effect is visible, so the count never lags
// a status the test has seen (the writes metric is counted after the call
// returns, and could).
func (ph *policyHarness) statusWrites() int {
	n := 0
	for _, a := range ph.dyn.Actions() {
		if a.GetVerb() == "update" && a.GetSubresource() == "status" {
			n++
		}
	}
	return n
}

func accepted(reason string) func(PolicyStatus) bool {
	return func(st PolicyStatus) bool {
		return len(st.Ancestors) == 1 && len(st.Ancestors[0].Conditions) == 1 && st.Ancestors[0].Conditions[0].Reason == reason
	}
}

func TestControllerPolicyOverAnnotationOverDefault(t *testing.T) {
	svc := service()
	svc.Annotations = map[string]string{AnnotationMaxInflight: "50", AnnotationMaxFailures: "3"}
	p := policy("limits", 0, `{"minPenalty":"10s"}`, "web")
	p.Spec.CircuitBreaker = &PolicyCircuitBreaker{MaxInflightRequests: new(int64(20))}
	ph := newPolicyHarness(t, []*BackendPolicy{p}, svc, slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")))

	// The first state already has the policy: a restarted agent never
	// programs the annotation's limit for a moment.
	s := byName(ph.next())["shop/web:http"]
	if s.MaxInflight != 20 || s.Accrual.MinPenalty != 10*time.Second || s.Accrual.MaxFailures != 3 {
		t.Fatalf("with the policy: maxInflight %d, minPenalty %v, maxFailures %d; want 20 (policy), 10s (policy), 3 (annotation)",
			s.MaxInflight, s.Accrual.MinPenalty, s.Accrual.MaxFailures)
	}
	ph.status(t, "limits", accepted(ReasonAccepted))

	// Without the policy, the annotation; without that, the default.
	ph.deletePolicy(t, "limits")
	if s := byName(ph.next())["shop/web:http"]; s.MaxInflight != 50 || s.Accrual.MinPenalty != time.Second {
		t.Fatalf("policy deleted: maxInflight %d, minPenalty %v; want the annotation's 50 and the default 1s", s.MaxInflight, s.Accrual.MinPenalty)
	}
	svc.Annotations = nil
	ph.updateService(svc)
	if s := byName(ph.next())["shop/web:http"]; s.MaxInflight != 0 || s.Accrual.MaxFailures != 7 {
		t.Fatalf("annotations removed: maxInflight %d, maxFailures %d; want the defaults", s.MaxInflight, s.Accrual.MaxFailures)
	}
}

func TestControllerInvalidPolicyKeepsSettingsInForce(t *testing.T) {
	svc := service()
	svc.Annotations = map[string]string{AnnotationMaxPenalty: "30s"}
	good := policy("good", 0, `{"minPenalty":"10s"}`, "web")
	ph := newPolicyHarness(t, []*BackendPolicy{good}, svc, slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")))
	if s := byName(ph.next())["shop/web:http"]; s.Accrual.MinPenalty != 10*time.Second {
		t.Fatalf("minPenalty %v", s.Accrual.MinPenalty)
	}
	// Valid alone, invalid over the Service's maxPenalty annotation.
	bad := toUnstructured(t, policy("good", 0, `{"minPenalty":"1m"}`, "web"))
	bad.SetResourceVersion("")
	if _, err := ph.dyn.Resource(PolicyGVR).Namespace("shop").Update(t.Context(), bad, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	st := ph.status(t, "good", accepted(ReasonInvalid))
	if m := st.Ancestors[0].Conditions[0].Message; !strings.Contains(m, "spec.failureAccrual.minPenalty") || !strings.Contains(m, `"1m"`) {
		t.Errorf("Invalid message %q does not name the field and value", m)
	}
	ph.quiet() // the 10s minimum penalty stays in force
	if got := testutil.ToFloat64(ph.invalid.WithLabelValues("shop/web", "BackendPolicy shop/good")); got != 1 {
		t.Errorf("invalid-settings metric = %v, want 1", got)
	}
}

func TestControllerConflictingPolicies(t *testing.T) {
	older := policy("older", 0, `{"maxFailures":4}`, "web")
	newer := policy("newer", time.Hour, `{"maxFailures":9}`, "web")
	// Listed newest first: the order of events must not matter.
	ph := newPolicyHarness(t, []*BackendPolicy{newer, older}, service(), slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")))
	if s := byName(ph.next())["shop/web:http"]; s.Accrual.MaxFailures != 4 {
		t.Fatalf("maxFailures %d, want the older policy's 4", s.Accrual.MaxFailures)
	}
	ph.status(t, "older", accepted(ReasonAccepted))
	st := ph.status(t, "newer", accepted(ReasonConflicted))
	if c := st.Ancestors[0].Conditions[0]; c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "shop/older") {
		t.Errorf("newer: %+v", c)
	}
	if got := testutil.ToFloat64(ph.leader); got != 1 {
		t.Errorf("leader gauge %v, want 1", got)
	}
	// The older one goes: the newer one is in force and says so.
	ph.deletePolicy(t, "older")
	if s := byName(ph.next())["shop/web:http"]; s.Accrual.MaxFailures != 9 {
		t.Fatalf("maxFailures %d, want the newer policy's 9", s.Accrual.MaxFailures)
	}
	ph.status(t, "newer", accepted(ReasonAccepted))
	// A target that does not exist.
	ph.createPolicy(t, policy("stray", 0, "", "nope"))
	ph.status(t, "stray", accepted(ReasonTargetNotFound))
	// Writes happen only on change.
	before := ph.statusWrites()
	ph.ctrl.policyStatusFor("shop/web")
	time.Sleep(100 * time.Millisecond)
	if after := ph.statusWrites(); after != before {
		t.Errorf("status writes went from %v to %v with nothing changed", before, after)
	}
}

// A fresh entry (a restarted agent, a recreated Service) whose winning
// policy is invalid gets the Service's annotations, not the defaults: every
// agent then programs the same, whatever it saw before.
func TestControllerInvalidPolicyAtStartKeepsAnnotations(t *testing.T) {
	svc := service()
	svc.Annotations = map[string]string{AnnotationMaxPenalty: "30s", AnnotationMaxInflight: "50"}
	bad := policy("bad", 0, `{"minPenalty":"1m"}`, "web")
	ph := newPolicyHarness(t, []*BackendPolicy{bad}, svc, slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")))
	s := byName(ph.next())["shop/web:http"]
	if s.MaxInflight != 50 || s.Accrual.MaxPenalty != 30*time.Second {
		t.Fatalf("maxInflight %d, maxPenalty %v; want the annotations' 50 and 30s", s.MaxInflight, s.Accrual.MaxPenalty)
	}
	ph.status(t, "bad", accepted(ReasonInvalid))
	// An annotation edit still applies while the policy is invalid.
	svc.Annotations[AnnotationMaxInflight] = "60"
	ph.updateService(svc)
	if s := byName(ph.next())["shop/web:http"]; s.MaxInflight != 60 {
		t.Fatalf("maxInflight %d after the annotation edit, want 60", s.MaxInflight)
	}
}

func TestAncestorStatusFitsTheLimit(t *testing.T) {
	var others []PolicyAncestorStatus
	for i := range 3 {
		others = append(others, PolicyAncestorStatus{ControllerName: "example.com/other",
			AncestorRef: AncestorRef{Kind: "Service", Name: fmt.Sprint("s", i)}})
	}
	var verdicts []Verdict
	for i := range maxAncestors {
		verdicts = append(verdicts, Verdict{Target: fmt.Sprint("shop/t", i), Accepted: true, Reason: ReasonAccepted})
	}
	if got := ancestorStatus(others, verdicts, 1, metav1.NewTime(t0)); len(got) != maxAncestors {
		t.Errorf("%d ancestors, want the CRD's limit %d", len(got), maxAncestors)
	}
}

// A policy with sectionName sets only that port's settings, layered over
// the policy that targets the whole Service; the Service's other ports
// keep the whole Service's.
func TestControllerSectionNamePolicy(t *testing.T) {
	svc := service(ports(
		corev1.ServicePort{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)},
		corev1.ServicePort{Name: "admin", Port: 81, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8081)}))
	svc.Annotations = map[string]string{AnnotationMaxFailures: "3"}
	whole := policy("whole", 0, `{"minPenalty":"10s"}`, "web")
	port := sectionPolicy("http-only", time.Minute, `{"maxFailures":9}`, "web:http")
	port.Spec.CircuitBreaker = &PolicyCircuitBreaker{MaxInflightRequests: new(int64(20))}
	sp := []discoveryv1.EndpointPort{sport("http", 8080, corev1.ProtocolTCP), sport("admin", 8081, corev1.ProtocolTCP)}
	ph := newPolicyHarness(t, []*BackendPolicy{whole, port}, svc, slice("web-1", sp, readyEP("198.18.1.2", "web-a")))

	got := byName(ph.next())
	http, admin := got["shop/web:http"], got["shop/web:admin"]
	if http.MaxInflight != 20 || http.Accrual.MaxFailures != 9 || http.Accrual.MinPenalty != 10*time.Second {
		t.Errorf("port http: maxInflight %d, maxFailures %d, minPenalty %v; want 20 and 9 (its policy), 10s (the whole Service's)",
			http.MaxInflight, http.Accrual.MaxFailures, http.Accrual.MinPenalty)
	}
	if admin.MaxInflight != 0 || admin.Accrual.MaxFailures != 3 || admin.Accrual.MinPenalty != 10*time.Second {
		t.Errorf("port admin: maxInflight %d, maxFailures %d, minPenalty %v; want 0 (default), 3 (annotation), 10s (the whole Service's policy)",
			admin.MaxInflight, admin.Accrual.MaxFailures, admin.Accrual.MinPenalty)
	}
	st := ph.status(t, "http-only", accepted(ReasonAccepted))
	if st.Ancestors[0].AncestorRef.SectionName != "http" {
		t.Errorf("status ancestorRef %+v, want sectionName http", st.Ancestors[0].AncestorRef)
	}
	ph.status(t, "whole", accepted(ReasonAccepted))

	// The port's policy deleted: the port has the whole Service's again.
	ph.deletePolicy(t, "http-only")
	if s := byName(ph.next())["shop/web:http"]; s.MaxInflight != 0 || s.Accrual.MaxFailures != 3 {
		t.Errorf("port policy deleted: maxInflight %d, maxFailures %d; want 0 and 3", s.MaxInflight, s.Accrual.MaxFailures)
	}
}
