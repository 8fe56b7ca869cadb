// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

func TestParseAnnotations(t *testing.T) {
	def := DefaultSettings(0)
	with := func(f func(*Settings)) Settings {
		s := def
		f(&s)
		return s
	}
	tests := []struct {
		name string
		ann  map[string]string
		want Settings
	}{
		{"none: defaults", nil, def},
		{"unrelated annotations ignored", map[string]string{"example.com/x": "y", "penaltybox.io/other": "z"}, def},
		{"every key of ours", map[string]string{
			AnnotationMode:                     "consecutive",
			AnnotationMaxFailures:              "5",
			AnnotationMinPenalty:               "2s",
			AnnotationMaxPenalty:               "90s",
			AnnotationJitterRatio:              "0.25",
			AnnotationConnectTimeout:           "300ms",
			AnnotationFailureKinds:             "refused, reset-after-data",
			AnnotationMaxEjectionPercent:       "50",
			AnnotationMaxInflight:              "1000",
			AnnotationMaxInflightPerEndpoint:   "100",
			AnnotationWindow:                   "30s",
			AnnotationWindowCalls:              "200",
			AnnotationMinCalls:                 "20",
			AnnotationFailureRateThreshold:     "0.3",
			AnnotationSlowConnectThreshold:     "50ms",
			AnnotationSlowConnectRateThreshold: "0.4",
			AnnotationOutliers:                 "true",
			AnnotationOutlierStdevFactor:       "2.5",
			AnnotationOutlierMinHosts:          "3",
			AnnotationOutlierMinCalls:          "50",
			AnnotationFleetEvidence:            "false",
		}, Settings{
			Accrual: accrual.Settings{Mode: accrual.ModeConsecutive, MaxFailures: 5, MinPenalty: 2 * time.Second,
				MaxPenalty: 90 * time.Second, JitterRatio: 0.25, ConnectTimeout: 300 * time.Millisecond,
				FailureKinds:       accrual.KindsOf(accrual.KindRefused, accrual.KindResetAfterData),
				MaxEjectionPercent: 50,
				Window:             30 * time.Second, WindowCalls: 200, MinCalls: 20, FailureRateThreshold: 0.3,
				SlowConnectThreshold: 50 * time.Millisecond, SlowConnectRateThreshold: 0.4,
				Outliers: true, OutlierStdevFactor: 2.5, OutlierMinHosts: 3, OutlierMinCalls: 50},
			MaxInflight: 1000, MaxInflightPerEndpoint: 100, RetryRefused: true,
		}},
		{"Linkerd's unified breaker", map[string]string{
			"balancer.linkerd.io/failure-accrual":                                 "unified",
			"balancer.alpha.linkerd.io/failure-accrual-success-rate-threshold":    "0.9",
			"balancer.alpha.linkerd.io/failure-accrual-success-rate-window":       "1m",
			"balancer.alpha.linkerd.io/failure-accrual-success-rate-min-requests": "10",
		}, with(func(s *Settings) {
			s.Accrual.Mode, s.Accrual.FailureRateThreshold, s.Accrual.Window, s.Accrual.MinCalls = accrual.ModeUnified, 0.1, time.Minute, 10
		})},
		{"failure-rate mode", map[string]string{AnnotationMode: "failure-rate"}, with(func(s *Settings) { s.Accrual.Mode = accrual.ModeFailureRate })},
		{"mode none", map[string]string{AnnotationMode: "none"}, with(func(s *Settings) { s.Accrual.Mode = accrual.ModeNone })},
		{"Linkerd's spellings", map[string]string{
			"balancer.linkerd.io/failure-accrual":                          "consecutive",
			"balancer.linkerd.io/failure-accrual-consecutive-max-failures": "3",
			"balancer.linkerd.io/failure-accrual-consecutive-min-penalty":  "10s",
			"balancer.linkerd.io/failure-accrual-consecutive-max-penalty":  "10m",
			"balancer.linkerd.io/failure-accrual-consecutive-jitter-ratio": "0",
		}, with(func(s *Settings) {
			s.Accrual.MaxFailures, s.Accrual.MinPenalty, s.Accrual.MaxPenalty, s.Accrual.JitterRatio = 3, 10*time.Second, 10*time.Minute, 0
		})},
		{"ours win over Linkerd's", map[string]string{
			AnnotationMaxFailures: "4",
			"balancer.linkerd.io/failure-accrual-consecutive-max-failures": "9",
		}, with(func(s *Settings) { s.Accrual.MaxFailures = 4 })},
		{"ours win even when Linkerd's is invalid", map[string]string{
			AnnotationMaxFailures: "4",
			"balancer.linkerd.io/failure-accrual-consecutive-max-failures": "many",
		}, with(func(s *Settings) { s.Accrual.MaxFailures = 4 })},
		{"surrounding spaces trimmed", map[string]string{AnnotationMinPenalty: " 3s\n"}, with(func(s *Settings) { s.Accrual.MinPenalty = 3 * time.Second })},
		{"max-inflight 0 means no limit", map[string]string{AnnotationMaxInflight: "0"}, def},
		{"retry-refused off", map[string]string{AnnotationRetryRefused: "false"}, with(func(s *Settings) { s.RetryRefused = false })},
		{"fleet evidence off", map[string]string{AnnotationFleetEvidence: "false"}, with(func(s *Settings) { s.Accrual.FleetEvidence = false })},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, errs := ParseAnnotations(tt.ann, def)
			if len(errs) > 0 {
				t.Fatalf("errors: %v", errs)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestParseAnnotationsDefaultLimit(t *testing.T) {
	got, errs := ParseAnnotations(nil, DefaultSettings(250))
	if len(errs) > 0 || got.MaxInflight != 250 {
		t.Fatalf("got %+v %v, want the default limit 250", got, errs)
	}
	got, errs = ParseAnnotations(map[string]string{AnnotationMaxInflight: "0"}, DefaultSettings(250))
	if len(errs) > 0 || got.MaxInflight != 0 {
		t.Fatalf("got %+v %v, want 0: the annotation lifts the default limit", got, errs)
	}
}

// Every way an annotation can be wrong names the key as written and its
// value, and leaves the base settings whole.
func TestParseAnnotationsErrors(t *testing.T) {
	base := DefaultSettings(7)
	base.Accrual.MaxFailures = 3 // not the default: proves base is what comes back
	tests := []struct {
		name string
		ann  map[string]string
		want []AnnotationError // Msg is a substring
	}{
		{"unknown mode", map[string]string{AnnotationMode: "sometimes"},
			[]AnnotationError{{AnnotationMode, "sometimes", "unknown mode"}}},
		{"max-failures not a number", map[string]string{AnnotationMaxFailures: "five"},
			[]AnnotationError{{AnnotationMaxFailures, "five", "whole number"}}},
		{"max-failures zero", map[string]string{AnnotationMaxFailures: "0"},
			[]AnnotationError{{AnnotationMaxFailures, "0", "at least 1"}}},
		{"min-penalty not a duration", map[string]string{AnnotationMinPenalty: "10"},
			[]AnnotationError{{AnnotationMinPenalty, "10", "invalid duration"}}},
		{"min-penalty negative", map[string]string{AnnotationMinPenalty: "-1s"},
			[]AnnotationError{{AnnotationMinPenalty, "-1s", "must be positive"}}},
		{"max-penalty zero", map[string]string{AnnotationMaxPenalty: "0s"},
			[]AnnotationError{{AnnotationMaxPenalty, "0s", "must be positive"}}},
		{"min above max, both set", map[string]string{AnnotationMinPenalty: "2m", AnnotationMaxPenalty: "1m"},
			[]AnnotationError{{AnnotationMinPenalty, "2m", "must not exceed maxPenalty"}}},
		{"max below the default min: the error lands on the key that was set", map[string]string{AnnotationMaxPenalty: "500ms"},
			[]AnnotationError{{AnnotationMaxPenalty, "500ms", "conflicts with the default of " + AnnotationMinPenalty}}},
		{"min above the default max", map[string]string{AnnotationMinPenalty: "2m"},
			[]AnnotationError{{AnnotationMinPenalty, "2m", "must not exceed maxPenalty"}}},
		{"jitter not a number", map[string]string{AnnotationJitterRatio: "half"},
			[]AnnotationError{{AnnotationJitterRatio, "half", "want a number"}}},
		{"jitter above 1", map[string]string{AnnotationJitterRatio: "1.5"},
			[]AnnotationError{{AnnotationJitterRatio, "1.5", "within [0, 1]"}}},
		{"jitter NaN", map[string]string{AnnotationJitterRatio: "NaN"},
			[]AnnotationError{{AnnotationJitterRatio, "NaN", "within [0, 1]"}}},
		{"connect timeout zero", map[string]string{AnnotationConnectTimeout: "0s"},
			[]AnnotationError{{AnnotationConnectTimeout, "0s", "must be positive"}}},
		{"connect timeout not a duration", map[string]string{AnnotationConnectTimeout: "fast"},
			[]AnnotationError{{AnnotationConnectTimeout, "fast", "invalid duration"}}},
		{"unknown failure kind", map[string]string{AnnotationFailureKinds: "refused,slow"},
			[]AnnotationError{{AnnotationFailureKinds, "refused,slow", `unknown failure kind "slow"`}}},
		{"failure kind twice", map[string]string{AnnotationFailureKinds: "reset,reset"},
			[]AnnotationError{{AnnotationFailureKinds, "reset,reset", "listed twice"}}},
		{"failure kinds with an empty item", map[string]string{AnnotationFailureKinds: "refused,,reset"},
			[]AnnotationError{{AnnotationFailureKinds, "refused,,reset", `unknown failure kind ""`}}},
		{"max-ejection-percent above 100", map[string]string{AnnotationMaxEjectionPercent: "150"},
			[]AnnotationError{{AnnotationMaxEjectionPercent, "150", "within [0, 100]"}}},
		{"max-ejection-percent with a percent sign", map[string]string{AnnotationMaxEjectionPercent: "50%"},
			[]AnnotationError{{AnnotationMaxEjectionPercent, "50%", "whole percentage"}}},
		{"max-inflight negative", map[string]string{AnnotationMaxInflight: "-1"},
			[]AnnotationError{{AnnotationMaxInflight, "-1", "whole number of flows"}}},
		{"max-inflight-per-endpoint too big", map[string]string{AnnotationMaxInflightPerEndpoint: "4294967296"},
			[]AnnotationError{{AnnotationMaxInflightPerEndpoint, "4294967296", "whole number of flows"}}},
		{"retry-refused not a bool", map[string]string{AnnotationRetryRefused: "sometimes"},
			[]AnnotationError{{AnnotationRetryRefused, "sometimes", `want "true" or "false"`}}},
		{"retry-refused spelled like Go's ParseBool", map[string]string{AnnotationRetryRefused: "1"},
			[]AnnotationError{{AnnotationRetryRefused, "1", `want "true" or "false"`}}},
		{"empty value", map[string]string{AnnotationMaxFailures: ""},
			[]AnnotationError{{AnnotationMaxFailures, "", "empty value"}}},
		{"Linkerd spelling is named as written", map[string]string{"balancer.linkerd.io/failure-accrual-consecutive-jitter-ratio": "2"},
			[]AnnotationError{{"balancer.linkerd.io/failure-accrual-consecutive-jitter-ratio", "2", "within [0, 1]"}}},
		{"both rate thresholds", map[string]string{AnnotationFailureRateThreshold: "0.2", AnnotationSuccessRateThreshold: "0.8"},
			[]AnnotationError{{AnnotationSuccessRateThreshold, "0.8", "not both"}}},
		{"success rate as a percentage", map[string]string{"balancer.alpha.linkerd.io/failure-accrual-success-rate-threshold": "80"},
			[]AnnotationError{{"balancer.alpha.linkerd.io/failure-accrual-success-rate-threshold", "80", "within (0, 1)"}}},
		{"failure rate of 0", map[string]string{AnnotationFailureRateThreshold: "0"},
			[]AnnotationError{{AnnotationFailureRateThreshold, "0", "within (0, 1)"}}},
		{"window too short", map[string]string{AnnotationWindow: "1ms"},
			[]AnnotationError{{AnnotationWindow, "1ms", "at least 10ms"}}},
		{"min calls beyond the count window", map[string]string{AnnotationWindowCalls: "3"},
			[]AnnotationError{{AnnotationWindowCalls, "3", "conflicts with the default of " + AnnotationMinCalls}}},
		{"slow connect not below the connect timeout", map[string]string{AnnotationSlowConnectThreshold: "2s"},
			[]AnnotationError{{AnnotationSlowConnectThreshold, "2s", "below connectTimeout"}}},
		{"max-penalty beyond a day", map[string]string{AnnotationMaxPenalty: "2562047h"},
			[]AnnotationError{{AnnotationMaxPenalty, "2562047h", "must be at most 24h0m0s"}}},
		{"max-penalty beyond a day, Linkerd's spelling", map[string]string{"balancer.linkerd.io/failure-accrual-consecutive-max-penalty": "25h"},
			[]AnnotationError{{"balancer.linkerd.io/failure-accrual-consecutive-max-penalty", "25h", "must be at most 24h0m0s"}}},
		{"max-failures beyond the limit", map[string]string{AnnotationMaxFailures: "9223372036854775807"},
			[]AnnotationError{{AnnotationMaxFailures, "9223372036854775807", "must be at most 1000000"}}},
		{"connect timeout beyond 30s", map[string]string{AnnotationConnectTimeout: "10m"},
			[]AnnotationError{{AnnotationConnectTimeout, "10m", "must be at most 30s"}}},
		{"window beyond an hour", map[string]string{AnnotationWindow: "24h"},
			[]AnnotationError{{AnnotationWindow, "24h", "must be at most 1h0m0s"}}},
		{"outliers not a bool", map[string]string{AnnotationOutliers: "on"},
			[]AnnotationError{{AnnotationOutliers, "on", `want "true" or "false"`}}},
		{"outlier hosts 1", map[string]string{AnnotationOutlierMinHosts: "1"},
			[]AnnotationError{{AnnotationOutlierMinHosts, "1", "at least 2"}}},
		{"several bad keys are all reported, valid ones not applied", map[string]string{
			AnnotationMode: "consecutive", AnnotationMaxFailures: "x", AnnotationMinPenalty: "y", AnnotationMaxPenalty: "30s",
		}, []AnnotationError{{AnnotationMaxFailures, "x", "whole number"}, {AnnotationMinPenalty, "y", "invalid duration"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, errs := ParseAnnotations(tt.ann, base)
			if !reflect.DeepEqual(got, base) {
				t.Errorf("settings = %+v, want base unchanged", got)
			}
			if len(errs) != len(tt.want) {
				t.Fatalf("errors = %v, want %d", errs, len(tt.want))
			}
			for i, w := range tt.want {
				e := errs[i]
				if e.Key != w.Key || e.Value != w.Value || !strings.Contains(e.Msg, w.Msg) {
					t.Errorf("error %d = {%q %q %q}, want {%q %q ...%q...}", i, e.Key, e.Value, e.Msg, w.Key, w.Value, w.Msg)
				}
				if !strings.Contains(e.Error(), e.Key) || !strings.Contains(e.Error(), `"`+e.Value+`"`) {
					t.Errorf("Error() = %q does not name key and value", e.Error())
				}
			}
		})
	}
}
