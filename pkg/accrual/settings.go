// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// Mode selects how failures accrue.
type Mode string

const (
	// ModeConsecutive ejects an endpoint after MaxFailures failures in a row.
	ModeConsecutive Mode = "consecutive"
	// ModeFailureRate ejects an endpoint whose failure rate over a window
	// of recent connections exceeds FailureRateThreshold, once the window
	// holds MinCalls connections.
	ModeFailureRate Mode = "failure-rate"
	// ModeUnified ejects on either rule, whichever trips first: Linkerd's
	// "unified" breaker.
	ModeUnified Mode = "unified"
	// ModeNone never ejects.
	ModeNone Mode = "none"
)

// Consecutive reports whether m ejects on a streak of failures.
func (m Mode) Consecutive() bool { return m == ModeConsecutive || m == ModeUnified }

// RatesFailures reports whether m ejects on the window's failure rate.
func (m Mode) RatesFailures() bool { return m == ModeFailureRate || m == ModeUnified }

// WindowBuckets is how many buckets a window has: it forgets its oldest
// tenth at a time, as Linkerd's and Resilience4j's windows do.
const WindowBuckets = 10

// Kind is a kind of L4 failure.
type Kind uint8

const (
	KindRefused        Kind = iota + 1 // RST answering the SYN
	KindTimeout                        // no SYN-ACK within the connect timeout
	KindReset                          // RST after the handshake, before the backend sent data
	KindResetAfterData                 // RST after the backend sent data (off by default)
)

var kindNames = map[Kind]string{
	KindRefused:        "refused",
	KindTimeout:        "timeout",
	KindReset:          "reset",
	KindResetAfterData: "reset-after-data",
}

func (k Kind) String() string {
	if s, ok := kindNames[k]; ok {
		return s
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// ParseKind parses the config spelling of a kind.
func ParseKind(s string) (Kind, error) {
	for k, name := range kindNames {
		if name == s {
			return k, nil
		}
	}
	return 0, fmt.Errorf("unknown failure kind %q (want one of refused, timeout, reset, reset-after-data)", s)
}

// Kinds is a set of failure kinds.
type Kinds uint8

func KindsOf(ks ...Kind) Kinds {
	var s Kinds
	for _, k := range ks {
		s |= 1 << k
	}
	return s
}

func (s Kinds) Has(k Kind) bool { return s&(1<<k) != 0 }

// List returns the kinds in a fixed order.
func (s Kinds) List() []Kind {
	var out []Kind
	for k := KindRefused; k <= KindResetAfterData; k++ {
		if s.Has(k) {
			out = append(out, k)
		}
	}
	return out
}

func (s Kinds) String() string {
	var names []string
	for _, k := range s.List() {
		names = append(names, k.String())
	}
	return "[" + strings.Join(names, ", ") + "]"
}

// Settings configure failure accrual for one service.
type Settings struct {
	Mode               Mode
	MaxFailures        int           // consecutive failures that eject
	MinPenalty         time.Duration // first penalty
	MaxPenalty         time.Duration // cap of the doubling penalty
	JitterRatio        float64       // penalty varies uniformly by ± this ratio
	ConnectTimeout     time.Duration // no SYN-ACK within this is a timeout failure
	FailureKinds       Kinds         // which kinds count
	MaxEjectionPercent int           // at most this share of a service's endpoints ejected at once

	// The window of recent connections that the failure-rate rule, the
	// slow-connect rule and the outlier rule judge.
	Window      time.Duration // time-based window: the connections of the last Window
	WindowCalls int           // > 0: a count-based window of the last WindowCalls connections instead
	MinCalls    int           // connections the window must hold before any rate is judged
	// FailureRateThreshold: modes failure-rate and unified eject an endpoint
	// whose window's share of counted failures exceeds it.
	FailureRateThreshold float64
	// SlowConnectThreshold > 0 makes a handshake (SYN to SYN-ACK) at least
	// this long a slow connect; an endpoint whose window's share of slow
	// connects exceeds SlowConnectRateThreshold is ejected. A slow connect
	// is a success for every other rule.
	SlowConnectThreshold     time.Duration
	SlowConnectRateThreshold float64
	// Outliers ejects an endpoint whose window's success rate is below the
	// mean of its peers' by more than OutlierStdevFactor standard
	// deviations, judged every tenth of Window among the ready endpoints
	// whose windows hold OutlierMinCalls connections, when there are at
	// least OutlierMinHosts of them (Envoy's success-rate outlier rule).
	Outliers           bool
	OutlierStdevFactor float64
	OutlierMinHosts    int
	OutlierMinCalls    int
	// FleetEvidence shares the failure-rate rule's evidence with the other
	// nodes (Kubernetes mode, time-based windows only): an endpoint every
	// node sees too little of to judge alone is judged on the fleet's sum.
	FleetEvidence bool
}

// Fleet reports whether s judges failure rates on the fleet's evidence.
func (s *Settings) Fleet() bool {
	return s.FleetEvidence && s.Mode.RatesFailures() && s.WindowCalls == 0
}

// Windowed reports whether s needs a window of recent connections.
func (s *Settings) Windowed() bool {
	return s.Mode != ModeNone && (s.Mode.RatesFailures() || s.SlowConnectThreshold > 0 || s.Outliers)
}

// Defaults follow Linkerd's consecutive failure accrual
// (balancer.linkerd.io/failure-accrual-consecutive-*): 7 failures, 1s
// minimum penalty, 1m maximum, jitter 0.5. The connect timeout, failure
// kinds and ejection cap are ours. The window follows Linkerd's unified
// breaker (balancer.alpha.linkerd.io/failure-accrual-success-rate-*): 10s,
// 5 calls, success rate 0.8 (a failure rate of 0.2); the outlier rule
// follows Envoy's success-rate outlier detection (factor 1.9, 5 hosts, 100
// calls).
func Defaults() Settings {
	return Settings{
		Mode:               ModeConsecutive,
		MaxFailures:        7,
		MinPenalty:         time.Second,
		MaxPenalty:         time.Minute,
		JitterRatio:        0.5,
		ConnectTimeout:     time.Second,
		FailureKinds:       KindsOf(KindRefused, KindTimeout, KindReset),
		MaxEjectionPercent: 100,

		Window:                   10 * time.Second,
		MinCalls:                 5,
		FailureRateThreshold:     0.2,
		SlowConnectRateThreshold: 0.5,
		OutlierStdevFactor:       1.9,
		OutlierMinHosts:          5,
		OutlierMinCalls:          100,
		FleetEvidence:            true,
	}
}

// Upper bounds of the settings a tenant controls (a Service's annotations,
// a BackendPolicy). They keep every product of them far from overflow and
// keep one tenant from holding node-shared state for long; README's
// annotation table gives the same reasons.
const (
	// MaxPenaltyLimit: an ejection longer than a day is an outage to fix,
	// not a penalty to wait out. The longest penalty drawn is twice it
	// (jitter ≤ 1): 48h, nowhere near a Duration's 292 years, so doubling,
	// jitter and deadlines (now + penalty) cannot wrap.
	MaxPenaltyLimit = 24 * time.Hour
	// MaxFailuresLimit: the datapath counts a streak in 32 bits; a streak
	// of a million failures is never waited for in practice (and the CRD's
	// schema says the same).
	MaxFailuresLimit = 1_000_000
	// ConnectTimeoutLimit: a connection is tracked for up to a connect
	// timeout (its SYN-ACK, then its settling), remembered for ten more
	// after a timeout, and the datapath keeps a reset's judgement open as
	// long: the one setting that holds node memory per connection. Linux
	// gives up a connect after ~127s (6 SYN retries), Envoy's and Linkerd's
	// connect timeouts are seconds (5s, 1s); by 30s a client has sent its
	// SYN five times (at 0, 1, 3, 7 and 15s), so an endpoint that answered
	// none of them is not answering. 30s bounds what one idle connection
	// costs without judging a slow handshake that real clients would wait
	// for.
	ConnectTimeoutLimit = 30 * time.Second
	// WindowLimit: a failure rate over more than an hour says nothing of
	// an endpoint now, and the window also sets how long a relapse doubles
	// the penalty and how long the fleet's reports and verdicts hold (two
	// windows).
	WindowLimit = time.Hour
)

// maxWindowCalls bounds a count-based window (a bit per connection and
// rule: 25 kB at most per endpoint) and the call minimums, so a typo cannot
// make a window remember connections it will never judge, or wrap.
const maxWindowCalls = 100_000

// FieldError names the setting that is wrong and its value.
type FieldError struct {
	Field string
	Value any
	Msg   string
}

func (e *FieldError) Error() string {
	return fmt.Sprintf("%s: %v: %s", e.Field, e.Value, e.Msg)
}

// Validate checks s. Field names in errors are the config file's
// (maxFailures, minPenalty, ...); callers prefix their own path.
func (s Settings) Validate() error {
	switch s.Mode {
	case ModeConsecutive, ModeFailureRate, ModeUnified, ModeNone:
	default:
		return &FieldError{"mode", s.Mode, "unknown mode (want consecutive, failure-rate, unified or none)"}
	}
	if s.MaxFailures < 1 {
		return &FieldError{"maxFailures", s.MaxFailures, "must be at least 1"}
	}
	if s.MaxFailures > MaxFailuresLimit {
		return &FieldError{"maxFailures", s.MaxFailures, fmt.Sprintf("must be at most %d", MaxFailuresLimit)}
	}
	if s.MinPenalty <= 0 {
		return &FieldError{"minPenalty", s.MinPenalty, "must be positive"}
	}
	if s.MaxPenalty <= 0 {
		return &FieldError{"maxPenalty", s.MaxPenalty, "must be positive"}
	}
	if s.MaxPenalty > MaxPenaltyLimit {
		return &FieldError{"maxPenalty", s.MaxPenalty, fmt.Sprintf("must be at most %v", MaxPenaltyLimit)}
	}
	if s.MinPenalty > s.MaxPenalty {
		return &FieldError{"minPenalty", s.MinPenalty, fmt.Sprintf("must not exceed maxPenalty (%v)", s.MaxPenalty)}
	}
	if !(s.JitterRatio >= 0 && s.JitterRatio <= 1) {
		return &FieldError{"jitterRatio", s.JitterRatio, "must be within [0, 1]"}
	}
	if s.ConnectTimeout <= 0 {
		return &FieldError{"connectTimeout", s.ConnectTimeout, "must be positive"}
	}
	if s.ConnectTimeout > ConnectTimeoutLimit {
		return &FieldError{"connectTimeout", s.ConnectTimeout, fmt.Sprintf("must be at most %v", ConnectTimeoutLimit)}
	}
	if s.FailureKinds == 0 && s.Mode == ModeConsecutive {
		return &FieldError{"failureKinds", "[]", "must name at least one kind"}
	}
	if s.MaxEjectionPercent < 0 || s.MaxEjectionPercent > 100 {
		return &FieldError{"maxEjectionPercent", s.MaxEjectionPercent, "must be within [0, 100]"}
	}
	return s.validateWindow()
}

// partners names, for each field that Validate checks against another,
// that other field (config-file names). It mirrors Validate's cross-field
// rules, so that the config and annotation layers can put an error on the
// field that was actually set.
var partners = map[string]string{
	"minPenalty":           "maxPenalty",
	"maxPenalty":           "minPenalty",
	"failureKinds":         "mode",
	"minCalls":             "windowCalls",
	"slowConnectThreshold": "connectTimeout",
	// Not a field of Settings: config files and annotations may write
	// failureRateThreshold as its complement, successRateThreshold.
	"failureRateThreshold": "successRateThreshold",
}

// FailureRateFor turns a success-rate threshold (Linkerd's spelling of the
// failure-rate rule) into FailureRateThreshold, to twelve places: 1 − 0.8
// is 0.2, not 0.19999999999999996. ok is false unless both are within
// (0, 1).
func FailureRateFor(success float64) (rate float64, ok bool) {
	rate = math.Round((1-success)*1e12) / 1e12
	return rate, success > 0 && success < 1 && rate > 0 && rate < 1
}

// Partner returns the field Validate checks field against, if any: an
// error on field may be the doing of a setting of the partner.
func Partner(field string) (string, bool) {
	p, ok := partners[field]
	return p, ok
}

// validateWindow checks the window rules' settings. They are checked
// whatever the mode, so a setting written for later is already right.
func (s Settings) validateWindow() error {
	if s.Window < WindowBuckets*time.Millisecond {
		return &FieldError{"window", s.Window, "must be at least 10ms (ten buckets of at least 1ms)"}
	}
	if s.Window > WindowLimit {
		return &FieldError{"window", s.Window, fmt.Sprintf("must be at most %v", WindowLimit)}
	}
	if s.WindowCalls < 0 || s.WindowCalls > maxWindowCalls {
		return &FieldError{"windowCalls", s.WindowCalls, fmt.Sprintf("must be within [0, %d] (0: a time-based window)", maxWindowCalls)}
	}
	if s.MinCalls < 1 || s.MinCalls > maxWindowCalls {
		return &FieldError{"minCalls", s.MinCalls, fmt.Sprintf("must be within [1, %d]", maxWindowCalls)}
	}
	if s.WindowCalls > 0 && s.MinCalls > s.WindowCalls {
		return &FieldError{"minCalls", s.MinCalls, fmt.Sprintf("must not exceed windowCalls (%d): the window could never hold that many", s.WindowCalls)}
	}
	if !(s.FailureRateThreshold > 0 && s.FailureRateThreshold < 1) {
		return &FieldError{"failureRateThreshold", s.FailureRateThreshold, "must be within (0, 1), e.g. 0.2"}
	}
	if s.SlowConnectThreshold < 0 {
		return &FieldError{"slowConnectThreshold", s.SlowConnectThreshold, "must not be negative (0: off)"}
	}
	if s.SlowConnectThreshold >= s.ConnectTimeout {
		return &FieldError{"slowConnectThreshold", s.SlowConnectThreshold, fmt.Sprintf("must be below connectTimeout (%v): a slower handshake is a timeout", s.ConnectTimeout)}
	}
	if !(s.SlowConnectRateThreshold > 0 && s.SlowConnectRateThreshold < 1) {
		return &FieldError{"slowConnectRateThreshold", s.SlowConnectRateThreshold, "must be within (0, 1), e.g. 0.5"}
	}
	if !(s.OutlierStdevFactor > 0) || math.IsInf(s.OutlierStdevFactor, 0) {
		return &FieldError{"outlierStdevFactor", s.OutlierStdevFactor, "must be a positive number, e.g. 1.9"}
	}
	if s.OutlierMinHosts < 2 {
		return &FieldError{"outlierMinHosts", s.OutlierMinHosts, "must be at least 2 (an outlier needs peers)"}
	}
	if s.OutlierMinHosts > maxWindowCalls {
		return &FieldError{"outlierMinHosts", s.OutlierMinHosts, fmt.Sprintf("must be at most %d", maxWindowCalls)}
	}
	if s.OutlierMinCalls < 1 || s.OutlierMinCalls > maxWindowCalls {
		return &FieldError{"outlierMinCalls", s.OutlierMinCalls, fmt.Sprintf("must be within [1, %d]", maxWindowCalls)}
	}
	return nil
}
