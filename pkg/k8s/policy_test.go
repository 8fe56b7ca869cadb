// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/config"
)

var t0 = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)

// policy builds a BackendPolicy in namespace shop, created at t0+age,
// targeting the named Services, with failureAccrual as JSON.
func policy(name string, age time.Duration, accrualJSON string, targets ...string) *BackendPolicy {
	p := &BackendPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: name,
		CreationTimestamp: metav1.NewTime(t0.Add(age)), ResourceVersion: "1", Generation: 1}}
	for _, t := range targets {
		p.Spec.TargetRefs = append(p.Spec.TargetRefs, TargetRef{Kind: "Service", Name: t})
	}
	if accrualJSON != "" {
		p.Spec.FailureAccrual = json.RawMessage(accrualJSON)
	}
	return p
}

func TestApplyPolicyPrecedence(t *testing.T) {
	// The global default: a limit of 100 from --max-inflight-default.
	def := DefaultSettings(100)
	// The annotations set maxFailures 3, minPenalty 5s and a limit of 50.
	annotated, errs := ParseAnnotations(map[string]string{
		AnnotationMaxFailures: "3", AnnotationMinPenalty: "5s", AnnotationMaxInflight: "50",
	}, def)
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	// The policy sets minPenalty 10s and the limit 20, nothing else.
	p := policy("web", 0, `{"minPenalty":"10s"}`, "web")
	p.Spec.CircuitBreaker = &PolicyCircuitBreaker{MaxInflightRequests: ptr.To[int64](20)}
	s, err := ApplyPolicy(p, annotated)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		what      string
		got, want any
	}{
		{"minPenalty (policy over annotation)", s.Accrual.MinPenalty, 10 * time.Second},
		{"maxInflight (policy over annotation)", s.MaxInflight, uint32(20)},
		{"maxFailures (annotation, the policy leaves it out)", s.Accrual.MaxFailures, 3},
		{"maxPenalty (default, set by neither)", s.Accrual.MaxPenalty, accrual.Defaults().MaxPenalty},
		{"maxInflightPerEndpoint (default)", s.MaxInflightPerEndpoint, uint32(0)},
		{"retryRefused (default)", s.RetryRefused, true},
	} {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.what, c.got, c.want)
		}
	}
	// 0 is "no limit", not "absent".
	p.Spec.CircuitBreaker.MaxInflightRequests = ptr.To[int64](0)
	p.Spec.RetryRefused = ptr.To(false)
	if s, _ := ApplyPolicy(p, annotated); s.MaxInflight != 0 || s.RetryRefused {
		t.Errorf("maxInflightRequests 0, retryRefused false: got %d, %v", s.MaxInflight, s.RetryRefused)
	}
	// No policy fields at all: the annotated settings unchanged.
	if s, err := ApplyPolicy(policy("empty", 0, "", "web"), annotated); err != nil || !reflect.DeepEqual(s, annotated) {
		t.Errorf("empty policy: %+v, %v", s, err)
	}
}

func TestApplyPolicyErrorsNameTheField(t *testing.T) {
	annotated, _ := ParseAnnotations(map[string]string{AnnotationMaxPenalty: "30s"}, DefaultSettings(0))
	for _, c := range []struct {
		name   string
		p      *BackendPolicy
		path   string
		inText string
	}{
		// Valid alone, invalid over the annotation's maxPenalty 30s.
		{"against the annotation", policy("a", 0, `{"minPenalty":"1m"}`, "web"), "spec.failureAccrual.minPenalty", "30s"},
		{"unknown mode", policy("b", 0, `{"mode":"sometimes"}`, "web"), "spec.failureAccrual.mode", `"sometimes"`},
		// Past the bounds that keep a tenant's numbers from overflowing or
		// holding node state.
		{"max penalty beyond a day", policy("d", 0, `{"maxPenalty":"2562047h"}`, "web"), "spec.failureAccrual.maxPenalty", `"2562047h"`},
		{"connect timeout beyond 30s", policy("e", 0, `{"connectTimeout":"1h"}`, "web"), "spec.failureAccrual.connectTimeout", "at most 30s"},
		{"max failures beyond the limit", policy("f", 0, `{"maxFailures":2000000}`, "web"), "spec.failureAccrual.maxFailures", "at most 1000000"},
		{"window beyond an hour", policy("g", 0, `{"window":"90m"}`, "web"), "spec.failureAccrual.window", "at most 1h0m0s"},
		{"limit out of range", func() *BackendPolicy {
			p := policy("c", 0, "", "web")
			p.Spec.CircuitBreaker = &PolicyCircuitBreaker{MaxInflightRequestsPerEndpoint: ptr.To[int64](-1)}
			return p
		}(), "spec.circuitBreaker.maxInflightRequestsPerEndpoint", "-1"},
	} {
		s, err := ApplyPolicy(c.p, annotated)
		var fe *config.FieldError
		if !errors.As(err, &fe) || fe.Path != c.path {
			t.Errorf("%s: err %v, want one at %s", c.name, err, c.path)
			continue
		}
		if !strings.Contains(err.Error(), c.inText) {
			t.Errorf("%s: %q does not mention %s", c.name, err, c.inText)
		}
		if !reflect.DeepEqual(s, annotated) {
			t.Errorf("%s: settings changed on error", c.name)
		}
	}
}

func TestWinnerIsTheOldestThenByName(t *testing.T) {
	a := policy("a", time.Minute, "", "web")
	b := policy("b", 0, "", "web")
	c := policy("c", 0, "", "web")
	for _, order := range [][]*BackendPolicy{{a, b, c}, {c, b, a}, {b, a, c}} {
		if w := Winner(order); w != b {
			t.Errorf("winner of %v: %s, want b (oldest; b before c at the same time)", keys(order), w.Key())
		}
	}
	if Winner(nil) != nil {
		t.Error("a winner among no policies")
	}
}

func keys(ps []*BackendPolicy) []string {
	var out []string
	for _, p := range ps {
		out = append(out, p.Key())
	}
	return out
}

func TestJudge(t *testing.T) {
	older := policy("older", 0, "", "web")
	newer := policy("newer", time.Hour, `{"maxFailures":3}`, "web", "api", "gone", "web")
	bad := policy("bad", 0, `{"minPenalty":"2m"}`, "api2")
	all := []*BackendPolicy{older, newer, bad}
	exists := func(s, _ string) bool { return s != "shop/gone" }
	targeting := func(s string) []*BackendPolicy {
		var out []*BackendPolicy
		for _, p := range all {
			for _, t := range p.Targets() {
				if t == s {
					out = append(out, p)
				}
			}
		}
		return out
	}
	annotated := func(string) Settings { return DefaultSettings(0) }

	got := Judge(newer, exists, targeting, annotated)
	want := []struct {
		target, reason string
		accepted       bool
	}{
		{"shop/web", ReasonConflicted, false}, // targeted twice: listed once
		{"shop/api", ReasonAccepted, true},
		{"shop/gone", ReasonTargetNotFound, false},
	}
	if len(got) != len(want) {
		t.Fatalf("verdicts %+v", got)
	}
	for i, w := range want {
		if g := got[i]; g.Target != w.target || g.Reason != w.reason || g.Accepted != w.accepted {
			t.Errorf("verdict %d: %+v, want %+v", i, g, w)
		}
	}
	if !strings.Contains(got[0].Message, "shop/older") {
		t.Errorf("conflict message %q does not name the policy in force", got[0].Message)
	}
	if v := Judge(older, exists, targeting, annotated); len(v) != 1 || !v[0].Accepted {
		t.Errorf("the older policy: %+v, want Accepted", v)
	}
	v := Judge(bad, exists, targeting, annotated)
	if len(v) != 1 || v[0].Reason != ReasonInvalid || !strings.Contains(v[0].Message, "spec.failureAccrual.minPenalty") {
		t.Errorf("minPenalty above the default maxPenalty: %+v, want Invalid naming the field", v)
	}
}

func TestAncestorStatusKeepsTransitionTimesAndOthers(t *testing.T) {
	other := PolicyAncestorStatus{AncestorRef: AncestorRef{Kind: "Service", Namespace: "shop", Name: "web"},
		ControllerName: "example.com/other"}
	first := metav1.NewTime(t0)
	st := ancestorStatus([]PolicyAncestorStatus{other},
		[]Verdict{{Target: "shop/web", Accepted: true, Reason: ReasonAccepted, Message: "in force"}}, 1, first)
	if len(st) != 2 || st[0].ControllerName != "example.com/other" || st[1].ControllerName != ControllerName {
		t.Fatalf("ancestors %+v: want the other controller's entry kept, then ours", st)
	}
	later := metav1.NewTime(t0.Add(time.Hour))
	// The same verdict at a later generation: the transition time stays.
	again := ancestorStatus(st, []Verdict{{Target: "shop/web", Accepted: true, Reason: ReasonAccepted, Message: "in force"}}, 2, later)
	c := again[1].Conditions[0]
	if !c.LastTransitionTime.Equal(&first) || c.ObservedGeneration != 2 {
		t.Errorf("unchanged verdict: %+v, want lastTransitionTime kept and generation 2", c)
	}
	// A new verdict: it moves.
	lost := ancestorStatus(again, []Verdict{{Target: "shop/web", Reason: ReasonConflicted, Message: "older one"}}, 2, later)
	c = lost[1].Conditions[0]
	if c.Status != metav1.ConditionFalse || c.Reason != ReasonConflicted || !c.LastTransitionTime.Equal(&later) {
		t.Errorf("conflicted: %+v", c)
	}
	// A target dropped from targetRefs loses its entry.
	if none := ancestorStatus(lost, nil, 3, later); len(none) != 1 {
		t.Errorf("no verdicts: %+v, want only the other controller's entry", none)
	}
}

func TestDecodePolicy(t *testing.T) {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": PolicyGroup + "/" + PolicyVersion, "kind": PolicyKind,
		"metadata": map[string]any{"namespace": "shop", "name": "web"},
		"spec": map[string]any{
			"targetRefs":     []any{map[string]any{"group": "", "kind": "Service", "name": "web"}},
			"failureAccrual": map[string]any{"maxFailures": int64(3), "jitterRatio": 0.25},
			"circuitBreaker": map[string]any{"maxInflightRequests": int64(20)},
		},
	}}
	p, err := DecodePolicy(u)
	if err != nil {
		t.Fatal(err)
	}
	s, err := ApplyPolicy(p, DefaultSettings(0))
	if err != nil {
		t.Fatal(err)
	}
	if s.Accrual.MaxFailures != 3 || s.Accrual.JitterRatio != 0.25 || s.MaxInflight != 20 || p.Key() != "shop/web" {
		t.Errorf("decoded %+v → %+v", p, s)
	}
	if got := p.Targets(); len(got) != 1 || got[0] != "shop/web" {
		t.Errorf("targets %v", got)
	}
}

// sectionPolicy is policy with each target "name:port" a targetRef with
// sectionName port.
func sectionPolicy(name string, age time.Duration, accrualJSON string, targets ...string) *BackendPolicy {
	p := policy(name, age, accrualJSON)
	for _, t := range targets {
		n, sec, _ := strings.Cut(t, ":")
		p.Spec.TargetRefs = append(p.Spec.TargetRefs, TargetRef{Kind: "Service", Name: n, SectionName: sec})
	}
	return p
}

// GEP-713's sectionName: a policy on a port conflicts only with another
// policy on the same port; the whole Service's policy and a port's are
// both in force (layered); a port the Service lacks is TargetNotFound.
func TestJudgeSectionName(t *testing.T) {
	whole := policy("whole", 0, "", "web")
	httpOld := sectionPolicy("http-old", time.Minute, "", "web:http")
	httpNew := sectionPolicy("http-new", time.Hour, "", "web:http", "web:grpc", "web:nope")
	all := []*BackendPolicy{whole, httpOld, httpNew}
	exists := func(svc, section string) bool {
		return svc == "shop/web" && (section == "" || section == "http" || section == "grpc")
	}
	targeting := func(s string) []*BackendPolicy {
		var out []*BackendPolicy
		for _, p := range all {
			if slices.Contains(p.Targets(), s) {
				out = append(out, p)
			}
		}
		return out
	}
	annotated := func(string) Settings { return DefaultSettings(0) }
	for _, p := range []*BackendPolicy{whole, httpOld} {
		if v := Judge(p, exists, targeting, annotated); len(v) != 1 || !v[0].Accepted {
			t.Errorf("%s: %+v, want Accepted (a whole-Service and a port's policy do not conflict)", p.Name, v)
		}
	}
	got := Judge(httpNew, exists, targeting, annotated)
	want := []struct{ section, reason string }{{"http", ReasonConflicted}, {"grpc", ReasonAccepted}, {"nope", ReasonTargetNotFound}}
	if len(got) != len(want) {
		t.Fatalf("verdicts %+v", got)
	}
	for i, w := range want {
		if g := got[i]; g.Target != "shop/web" || g.Section != w.section || g.Reason != w.reason {
			t.Errorf("verdict %d: %+v, want section %s %s", i, g, w.section, w.reason)
		}
	}
	if !strings.Contains(got[0].Message, "port http") || !strings.Contains(got[0].Message, "shop/http-old") {
		t.Errorf("conflict message %q", got[0].Message)
	}
	if !strings.Contains(got[2].Message, "no port named nope") {
		t.Errorf("not-found message %q", got[2].Message)
	}
	// The status names the port.
	st := ancestorStatus(nil, got, 1, metav1.NewTime(t0))
	if st[1].AncestorRef.SectionName != "grpc" || st[1].AncestorRef.Name != "web" {
		t.Errorf("ancestorRef %+v, want web, sectionName grpc", st[1].AncestorRef)
	}
}
