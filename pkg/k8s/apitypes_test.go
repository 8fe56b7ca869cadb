// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"

	v1alpha1 "github.com/penaltybox/penaltybox/pkg/apis/policy/v1alpha1"
)

// The CRD is generated from pkg/apis/policy/v1alpha1, and the agent reads
// policies with the dynamic client (DecodePolicy, then
// config.ResolveFailureAccrual, which refuses fields it does not know). A
// policy with every field of the typed API set must read back whole: a
// field added to the types (and so to the CRD) that the agent ignores or
// refuses fails here.
func TestTypedPolicyReadsBack(t *testing.T) {
	// A valid, non-default value for each failureAccrual field, by its
	// JSON name; a field missing here fails the test.
	values := map[string]any{
		"mode": "unified", "maxFailures": int64(9), "minPenalty": "2s", "maxPenalty": "3m", "jitterRatio": 0.25,
		"connectTimeout": "2s", "failureKinds": []v1alpha1.FailureKind{"refused", "reset-after-data"}, "maxEjectionPercent": int64(50),
		"window": "20s", "windowCalls": int64(200), "minCalls": int64(7), "failureRateThreshold": 0.3,
		"slowConnectThreshold": "500ms", "slowConnectRateThreshold": 0.4, "outliers": true,
		"outlierStdevFactor": 2.5, "outlierMinHosts": int64(6), "outlierMinCalls": int64(150),
		// Linkerd's spelling of failureRateThreshold: set apart below (the
		// schema refuses both at once).
		"successRateThreshold": nil,
	}
	var fa v1alpha1.FailureAccrual
	v := reflect.ValueOf(&fa).Elem()
	for i := range v.NumField() {
		name, _, _ := strings.Cut(v.Type().Field(i).Tag.Get("json"), ",")
		val, ok := values[name]
		if !ok {
			t.Errorf("failureAccrual.%s: no test value (add one, and make sure the agent reads it)", name)
			continue
		}
		if val == nil {
			continue
		}
		f := v.Field(i)
		switch x := val.(type) {
		case []v1alpha1.FailureKind:
			f.Set(reflect.ValueOf(x))
		default:
			p := reflect.New(f.Type().Elem())
			p.Elem().Set(reflect.ValueOf(val).Convert(f.Type().Elem()))
			f.Set(p)
		}
	}
	sec := v1alpha1.SectionName("http")
	typed := &v1alpha1.BackendPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: "policy.penaltybox.io/v1alpha1", Kind: "BackendPolicy"},
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "every-field"},
		Spec: v1alpha1.BackendPolicySpec{
			TargetRefs:     []v1alpha1.LocalPolicyTargetReferenceWithSectionName{{Kind: "Service", Name: "web", SectionName: &sec}},
			FailureAccrual: &fa,
			CircuitBreaker: &v1alpha1.CircuitBreaker{MaxInflightRequests: ptr.To[int64](30), MaxInflightRequestsPerEndpoint: ptr.To[int64](5)},
			RetryRefused:   ptr.To(false),
		},
	}
	read := func(typed *v1alpha1.BackendPolicy) (*BackendPolicy, Settings) {
		t.Helper()
		j, err := json.Marshal(typed)
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(j); err != nil {
			t.Fatal(err)
		}
		p, err := DecodePolicy(u)
		if err != nil {
			t.Fatal(err)
		}
		s, err := ApplyPolicy(p, DefaultSettings(0))
		if err != nil {
			t.Fatalf("the agent refuses a policy the CRD accepts: %v", err)
		}
		return p, s
	}
	p, s := read(typed)
	if got := p.Refs(); len(got) != 1 || got[0] != (Target{Service: "shop/web", Section: "http"}) {
		t.Errorf("targets %+v", got)
	}
	a := s.Accrual
	if a.MaxFailures != 9 || a.JitterRatio != 0.25 || a.MaxEjectionPercent != 50 || a.MinCalls != 7 || a.WindowCalls != 200 ||
		a.FailureRateThreshold != 0.3 || a.OutlierMinHosts != 6 || a.OutlierMinCalls != 150 || !a.Outliers ||
		s.MaxInflight != 30 || s.MaxInflightPerEndpoint != 5 || s.RetryRefused {
		t.Errorf("settings read back: %+v", s)
	}
	fa.FailureRateThreshold, fa.SuccessRateThreshold = nil, ptr.To(0.9)
	if _, s := read(typed); s.Accrual.FailureRateThreshold < 0.0999 || s.Accrual.FailureRateThreshold > 0.1001 {
		t.Errorf("successRateThreshold 0.9: failureRateThreshold %v, want 0.1", s.Accrual.FailureRateThreshold)
	}
}
