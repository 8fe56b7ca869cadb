// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

func TestKinds(t *testing.T) {
	for _, k := range []Kind{KindRefused, KindTimeout, KindReset, KindResetAfterData} {
		got, err := ParseKind(k.String())
		if err != nil || got != k {
			t.Fatalf("ParseKind(%q) = %v, %v", k.String(), got, err)
		}
	}
	if _, err := ParseKind("rst"); err == nil {
		t.Fatal("ParseKind accepted an unknown kind")
	}
	if got := Kind(9).String(); got != "kind(9)" {
		t.Fatalf("Kind(9) = %q", got)
	}
	if got := Defaults().FailureKinds.String(); got != "[refused, timeout, reset]" {
		t.Fatalf("default kinds %q", got)
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		field string
		mut   func(*Settings)
	}{
		{"", func(*Settings) {}},
		{"mode", func(s *Settings) { s.Mode = "sometimes" }},
		{"maxFailures", func(s *Settings) { s.MaxFailures = 0 }},
		{"minPenalty", func(s *Settings) { s.MinPenalty = 0 }},
		{"maxPenalty", func(s *Settings) { s.MaxPenalty = -time.Second }},
		{"minPenalty", func(s *Settings) { s.MinPenalty = 2 * time.Minute }},
		{"jitterRatio", func(s *Settings) { s.JitterRatio = 1.5 }},
		{"connectTimeout", func(s *Settings) { s.ConnectTimeout = 0 }},
		{"failureKinds", func(s *Settings) { s.FailureKinds = 0 }},
		{"", func(s *Settings) { s.FailureKinds, s.Mode = 0, ModeNone }},
		{"maxEjectionPercent", func(s *Settings) { s.MaxEjectionPercent = 101 }},
		{"", func(s *Settings) { s.Mode = ModeFailureRate }},
		{"", func(s *Settings) { s.Mode = ModeUnified }},
		{"window", func(s *Settings) { s.Window = 9 * time.Millisecond }},
		{"windowCalls", func(s *Settings) { s.WindowCalls = -1 }},
		{"windowCalls", func(s *Settings) { s.WindowCalls = maxWindowCalls + 1 }},
		{"minCalls", func(s *Settings) { s.MinCalls = 0 }},
		{"minCalls", func(s *Settings) { s.WindowCalls, s.MinCalls = 4, 5 }},
		{"", func(s *Settings) { s.WindowCalls, s.MinCalls = 5, 5 }},
		{"failureRateThreshold", func(s *Settings) { s.FailureRateThreshold = 0 }},
		{"failureRateThreshold", func(s *Settings) { s.FailureRateThreshold = 1 }},
		{"slowConnectThreshold", func(s *Settings) { s.SlowConnectThreshold = -time.Millisecond }},
		{"slowConnectThreshold", func(s *Settings) { s.SlowConnectThreshold = s.ConnectTimeout }},
		{"", func(s *Settings) { s.SlowConnectThreshold = s.ConnectTimeout - 1 }},
		{"slowConnectRateThreshold", func(s *Settings) { s.SlowConnectRateThreshold = 1.5 }},
		{"outlierStdevFactor", func(s *Settings) { s.OutlierStdevFactor = 0 }},
		{"outlierMinHosts", func(s *Settings) { s.OutlierMinHosts = 1 }},
		{"outlierMinCalls", func(s *Settings) { s.OutlierMinCalls = 0 }},
	}
	for _, tc := range tests {
		s := Defaults()
		tc.mut(&s)
		err := s.Validate()
		var fe *FieldError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("unexpected error %v", err)
		case tc.field != "" && (!errors.As(err, &fe) || fe.Field != tc.field):
			t.Errorf("want error on %s, got %v", tc.field, err)
		}
	}
}

// TestValidateBounds: every field a tenant sets has an upper bound, so no
// arithmetic on it (doubling, jitter, deadline products) can wrap, and the
// error names the field and the value.
func TestValidateBounds(t *testing.T) {
	tests := []struct {
		field string
		mut   func(*Settings)
	}{
		{"maxPenalty", func(s *Settings) { s.MaxPenalty = MaxPenaltyLimit + time.Nanosecond }},
		{"maxPenalty", func(s *Settings) { s.MaxPenalty = time.Duration(math.MaxInt64) }},
		{"", func(s *Settings) { s.MinPenalty, s.MaxPenalty = MaxPenaltyLimit, MaxPenaltyLimit }},
		{"maxFailures", func(s *Settings) { s.MaxFailures = MaxFailuresLimit + 1 }},
		{"maxFailures", func(s *Settings) { s.MaxFailures = math.MaxInt }},
		{"", func(s *Settings) { s.MaxFailures = MaxFailuresLimit }},
		{"jitterRatio", func(s *Settings) { s.JitterRatio = math.NaN() }},
		{"jitterRatio", func(s *Settings) { s.JitterRatio = math.Inf(1) }},
		{"connectTimeout", func(s *Settings) { s.ConnectTimeout = ConnectTimeoutLimit + time.Nanosecond }},
		{"connectTimeout", func(s *Settings) { s.ConnectTimeout = time.Duration(math.MaxInt64) }},
		{"", func(s *Settings) { s.ConnectTimeout = ConnectTimeoutLimit }},
		{"", func(s *Settings) {
			s.ConnectTimeout, s.SlowConnectThreshold = ConnectTimeoutLimit, ConnectTimeoutLimit-1
		}},
		{"window", func(s *Settings) { s.Window = WindowLimit + time.Nanosecond }},
		{"window", func(s *Settings) { s.Window = time.Duration(math.MaxInt64) }},
		{"", func(s *Settings) { s.Window = WindowLimit }},
		{"outlierMinHosts", func(s *Settings) { s.OutlierMinHosts = maxWindowCalls + 1 }},
		{"outlierStdevFactor", func(s *Settings) { s.OutlierStdevFactor = math.NaN() }},
	}
	for _, tc := range tests {
		s := Defaults()
		tc.mut(&s)
		err := s.Validate()
		var fe *FieldError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("unexpected error %v", err)
		case tc.field != "" && (!errors.As(err, &fe) || fe.Field != tc.field):
			t.Errorf("want error on %s, got %v", tc.field, err)
		case tc.field != "" && !strings.Contains(err.Error(), tc.field+": "):
			t.Errorf("error %q does not name the field", err)
		}
	}
}
