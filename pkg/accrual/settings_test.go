package accrual

import (
	"errors"
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
