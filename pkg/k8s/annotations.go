// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// Annotation keys on a Service. The consecutive-* keys and the mode key
// have Linkerd spellings (balancer.linkerd.io/…) that are accepted too, so
// Services annotated for Linkerd carry their settings over; when both
// spellings of a key are set, ours is the one in force.
const (
	AnnotationMode               = "penaltybox.io/failure-accrual"
	AnnotationMaxFailures        = "penaltybox.io/failure-accrual-consecutive-max-failures"
	AnnotationMinPenalty         = "penaltybox.io/failure-accrual-consecutive-min-penalty"
	AnnotationMaxPenalty         = "penaltybox.io/failure-accrual-consecutive-max-penalty"
	AnnotationJitterRatio        = "penaltybox.io/failure-accrual-consecutive-jitter-ratio"
	AnnotationConnectTimeout     = "penaltybox.io/failure-accrual-connect-timeout"
	AnnotationFailureKinds       = "penaltybox.io/failure-accrual-failure-kinds"
	AnnotationMaxEjectionPercent = "penaltybox.io/failure-accrual-max-ejection-percent"

	// The window rules (modes failure-rate and unified, slow connects,
	// outliers). The success-rate keys have Linkerd's alpha spellings
	// (balancer.alpha.linkerd.io/failure-accrual-success-rate-*).
	AnnotationWindow                   = "penaltybox.io/failure-accrual-window"
	AnnotationWindowCalls              = "penaltybox.io/failure-accrual-window-calls"
	AnnotationMinCalls                 = "penaltybox.io/failure-accrual-min-calls"
	AnnotationFailureRateThreshold     = "penaltybox.io/failure-accrual-failure-rate-threshold"
	AnnotationSuccessRateThreshold     = "penaltybox.io/failure-accrual-success-rate-threshold"
	AnnotationSlowConnectThreshold     = "penaltybox.io/failure-accrual-slow-connect-threshold"
	AnnotationSlowConnectRateThreshold = "penaltybox.io/failure-accrual-slow-connect-rate-threshold"
	AnnotationOutliers                 = "penaltybox.io/failure-accrual-outliers"
	AnnotationOutlierStdevFactor       = "penaltybox.io/failure-accrual-outlier-stdev-factor"
	AnnotationOutlierMinHosts          = "penaltybox.io/failure-accrual-outlier-min-hosts"
	AnnotationOutlierMinCalls          = "penaltybox.io/failure-accrual-outlier-min-calls"

	// Fleet evidence (on by default where the CRDs are installed): "false"
	// judges the Service's endpoints on this node's evidence alone.
	AnnotationFleetEvidence = "penaltybox.io/failure-accrual-fleet-evidence"

	linkerdAlpha = "balancer.alpha.linkerd.io/failure-accrual-success-rate-"

	// Circuit breaking: live flows the Service (each of its ports) and each
	// endpoint may hold; 0 is no limit.
	AnnotationMaxInflight            = "penaltybox.io/max-inflight"
	AnnotationMaxInflightPerEndpoint = "penaltybox.io/max-inflight-per-endpoint"

	// A refused new connection gets one more try on another backend: its
	// client sees a delay of about a second, not the refusal.
	AnnotationRetryRefused = "penaltybox.io/retry-refused"

	ourPrefix     = "penaltybox.io/"
	linkerdPrefix = "balancer.linkerd.io/"
)

// Settings are what a Service's annotations configure.
type Settings struct {
	Accrual                accrual.Settings
	MaxInflight            uint32
	MaxInflightPerEndpoint uint32
	RetryRefused           bool
	// Ports holds the settings of the Service ports (by name) that a
	// BackendPolicy with sectionName targets; the others have these.
	Ports map[string]Settings
}

// ForPort returns the settings of the Service port named name.
func (s Settings) ForPort(name string) Settings {
	if p, ok := s.Ports[name]; ok {
		return p
	}
	s.Ports = nil
	return s
}

// DefaultSettings are the settings of a Service without annotations:
// accrual.Defaults(), the given circuit-breaker limit, and refused SYNs
// replayed to another endpoint (retryRefused).
func DefaultSettings(maxInflight uint32) Settings {
	return Settings{Accrual: accrual.Defaults(), MaxInflight: maxInflight, RetryRefused: true}
}

// annotation is one settable field: its key, the field it sets (by the
// config file's name, which is what accrual.Settings.Validate reports),
// and how to parse it.
type annotation struct {
	key     string
	field   string
	linkerd bool   // balancer.linkerd.io/ spelling accepted
	alias   string // another spelling accepted (Linkerd's alpha keys)
	set     func(s *Settings, v string) error
}

// boolSetter parses "true" or "false" into the field f returns.
func boolSetter(f func(*Settings) *bool) func(*Settings, string) error {
	return func(s *Settings, v string) error {
		switch v {
		case "true", "false":
			*f(s) = v == "true"
			return nil
		}
		return errors.New(`want "true" or "false"`)
	}
}

// acc adapts a parser of an accrual setting.
func acc(f func(s *accrual.Settings, v string) error) func(*Settings, string) error {
	return func(s *Settings, v string) error { return f(&s.Accrual, v) }
}

var annotations = []annotation{
	{AnnotationMode, "mode", true, "", acc(func(s *accrual.Settings, v string) error {
		switch m := accrual.Mode(v); m {
		case accrual.ModeConsecutive, accrual.ModeFailureRate, accrual.ModeUnified, accrual.ModeNone:
			s.Mode = m
			return nil
		}
		return errors.New("unknown mode (want consecutive, failure-rate, unified or none)")
	})},
	{AnnotationMaxFailures, "maxFailures", true, "", acc(func(s *accrual.Settings, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil {
			return errors.New("want a whole number of failures, e.g. 7")
		}
		s.MaxFailures = n
		return nil
	})},
	{AnnotationMinPenalty, "minPenalty", true, "", durationSetter(func(s *accrual.Settings) *time.Duration { return &s.MinPenalty })},
	{AnnotationMaxPenalty, "maxPenalty", true, "", durationSetter(func(s *accrual.Settings) *time.Duration { return &s.MaxPenalty })},
	{AnnotationJitterRatio, "jitterRatio", true, "", acc(func(s *accrual.Settings, v string) error {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return errors.New("want a number within [0, 1], e.g. 0.5")
		}
		s.JitterRatio = f
		return nil
	})},
	{AnnotationConnectTimeout, "connectTimeout", false, "", durationSetter(func(s *accrual.Settings) *time.Duration { return &s.ConnectTimeout })},
	{AnnotationFailureKinds, "failureKinds", false, "", acc(func(s *accrual.Settings, v string) error {
		var set accrual.Kinds
		for _, name := range strings.Split(v, ",") {
			k, err := accrual.ParseKind(strings.TrimSpace(name))
			if err != nil {
				return fmt.Errorf("unknown failure kind %q (want a comma-separated list of refused, timeout, reset, reset-after-data)", strings.TrimSpace(name))
			}
			if set.Has(k) {
				return fmt.Errorf("failure kind %q listed twice", k)
			}
			set |= accrual.KindsOf(k)
		}
		s.FailureKinds = set
		return nil
	})},
	{AnnotationMaxEjectionPercent, "maxEjectionPercent", false, "", acc(func(s *accrual.Settings, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil {
			return errors.New("want a whole percentage within [0, 100], e.g. 50")
		}
		s.MaxEjectionPercent = n
		return nil
	})},
	{AnnotationWindow, "window", false, linkerdAlpha + "window", durationSetter(func(s *accrual.Settings) *time.Duration { return &s.Window })},
	{AnnotationWindowCalls, "windowCalls", false, "", intSetter("want a whole number of connections, 0 for a time-based window", func(s *accrual.Settings) *int { return &s.WindowCalls })},
	{AnnotationMinCalls, "minCalls", false, linkerdAlpha + "min-requests", intSetter("want a whole number of connections, e.g. 5", func(s *accrual.Settings) *int { return &s.MinCalls })},
	{AnnotationFailureRateThreshold, "failureRateThreshold", false, "", ratioSetter(func(s *accrual.Settings) *float64 { return &s.FailureRateThreshold })},
	{AnnotationSuccessRateThreshold, "successRateThreshold", false, linkerdAlpha + "threshold", acc(func(s *accrual.Settings, v string) error {
		f, err := strconv.ParseFloat(v, 64)
		rate, ok := accrual.FailureRateFor(f)
		if err != nil || !ok {
			return errors.New("want a number within (0, 1), e.g. 0.8 (the failure-rate threshold is 1 minus it)")
		}
		s.FailureRateThreshold = rate
		return nil
	})},
	{AnnotationSlowConnectThreshold, "slowConnectThreshold", false, "", durationSetter(func(s *accrual.Settings) *time.Duration { return &s.SlowConnectThreshold })},
	{AnnotationSlowConnectRateThreshold, "slowConnectRateThreshold", false, "", ratioSetter(func(s *accrual.Settings) *float64 { return &s.SlowConnectRateThreshold })},
	{AnnotationOutliers, "outliers", false, "", boolSetter(func(s *Settings) *bool { return &s.Accrual.Outliers })},
	{AnnotationOutlierStdevFactor, "outlierStdevFactor", false, "", ratioSetter(func(s *accrual.Settings) *float64 { return &s.OutlierStdevFactor })},
	{AnnotationOutlierMinHosts, "outlierMinHosts", false, "", intSetter("want a whole number of endpoints, e.g. 5", func(s *accrual.Settings) *int { return &s.OutlierMinHosts })},
	{AnnotationOutlierMinCalls, "outlierMinCalls", false, "", intSetter("want a whole number of connections, e.g. 100", func(s *accrual.Settings) *int { return &s.OutlierMinCalls })},
	{AnnotationFleetEvidence, "fleetEvidence", false, "", boolSetter(func(s *Settings) *bool { return &s.Accrual.FleetEvidence })},
	{AnnotationMaxInflight, "maxInflight", false, "", limitSetter(func(s *Settings) *uint32 { return &s.MaxInflight })},
	{AnnotationMaxInflightPerEndpoint, "maxInflightPerEndpoint", false, "", limitSetter(func(s *Settings) *uint32 { return &s.MaxInflightPerEndpoint })},
	{AnnotationRetryRefused, "retryRefused", false, "", boolSetter(func(s *Settings) *bool { return &s.RetryRefused })},
}

// durationSetter parses Go durations ("500ms", "10s", "1m"), as the config
// file and Linkerd do. Sign and range are Validate's business.
func durationSetter(field func(*accrual.Settings) *time.Duration) func(*Settings, string) error {
	return acc(func(s *accrual.Settings, v string) error {
		d, err := time.ParseDuration(v)
		if err != nil {
			return errors.New(`invalid duration (want e.g. "500ms", "10s", "5m")`)
		}
		*field(s) = d
		return nil
	})
}

// intSetter parses a whole number; range is Validate's business.
func intSetter(want string, field func(*accrual.Settings) *int) func(*Settings, string) error {
	return acc(func(s *accrual.Settings, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil {
			return errors.New(want)
		}
		*field(s) = n
		return nil
	})
}

// ratioSetter parses a number; range is Validate's business.
func ratioSetter(field func(*accrual.Settings) *float64) func(*Settings, string) error {
	return acc(func(s *accrual.Settings, v string) error {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return errors.New("want a number, e.g. 0.2")
		}
		*field(s) = f
		return nil
	})
}

// limitSetter parses a flow limit: a whole number, 0 for none.
func limitSetter(field func(*Settings) *uint32) func(*Settings, string) error {
	return func(s *Settings, v string) error {
		n, err := strconv.ParseUint(v, 10, 32)
		if err != nil {
			return errors.New("want a whole number of flows, 0 for no limit")
		}
		*field(s) = uint32(n)
		return nil
	}
}

// AnnotationError is one invalid annotation: the key as written on the
// Service (ours or Linkerd's spelling), its value and what is wrong.
type AnnotationError struct {
	Key   string
	Value string
	Msg   string
}

func (e *AnnotationError) Error() string {
	return fmt.Sprintf("annotation %s=%q: %s", e.Key, e.Value, e.Msg)
}

// ParseAnnotations overlays the annotations found in ann onto base (whose
// accrual settings must be valid) and validates the result. On any error
// the returned settings are base unchanged: a Service's settings apply
// whole or not at all, never half of an edit. Every invalid key is
// reported, in the order of the table above.
func ParseAnnotations(ann map[string]string, base Settings) (Settings, []*AnnotationError) {
	s := base
	var errs []*AnnotationError
	keys := map[string]string{}   // field → the key that set it
	values := map[string]string{} // field → the value as written
	for _, a := range annotations {
		key, v, ok := lookup(ann, a)
		if !ok {
			continue
		}
		keys[a.field] = key
		values[a.field] = v
		if strings.TrimSpace(v) == "" {
			errs = append(errs, &AnnotationError{key, v, "empty value (remove the annotation to use the default)"})
			continue
		}
		if err := a.set(&s, strings.TrimSpace(v)); err != nil {
			errs = append(errs, &AnnotationError{key, v, err.Error()})
		}
	}
	if fk, ok := keys["failureRateThreshold"]; ok {
		if sk, ok := keys["successRateThreshold"]; ok {
			errs = append(errs, &AnnotationError{sk, values["successRateThreshold"], "set either " + fk + " or " + sk + " (1 minus the other), not both"})
		}
	}
	if len(errs) > 0 {
		return base, errs
	}
	if err := s.Accrual.Validate(); err != nil {
		var fe *accrual.FieldError
		if !errors.As(err, &fe) {
			return base, []*AnnotationError{{Msg: err.Error()}}
		}
		field := fe.Field
		if key, ok := keys[field]; ok {
			return base, []*AnnotationError{{key, values[field], fe.Msg}}
		}
		if p, ok := accrual.Partner(field); ok {
			if key, ok := keys[p]; ok {
				return base, []*AnnotationError{{key, values[p], "conflicts with the default of " + keyOf(field) + " (" + fe.Error() + ")"}}
			}
		}
		// Only a rule this package does not know of gets here.
		return base, []*AnnotationError{{Msg: "settings invalid: " + fe.Error()}}
	}
	return s, nil
}

// keyOf returns our annotation key for a settings field.
func keyOf(field string) string {
	for _, a := range annotations {
		if a.field == field {
			return a.key
		}
	}
	return field
}

// readKeys are the annotation keys ParseAnnotations reads besides ours
// (penaltybox.io/…, all of which it reads, to report the unknown ones):
// the Linkerd spellings. The informers' cache keeps these and drops the
// rest (stripForCache).
var readKeys = sync.OnceValue(func() map[string]bool {
	m := map[string]bool{}
	for _, a := range annotations {
		if a.linkerd {
			m[linkerdKey(a)] = true
		}
		if a.alias != "" {
			m[a.alias] = true
		}
	}
	return m
})

// annotationRead says whether ParseAnnotations reads key.
func annotationRead(key string) bool {
	return strings.HasPrefix(key, ourPrefix) || readKeys()[key]
}

// linkerdKey is Linkerd's spelling of a's key (a.linkerd).
func linkerdKey(a annotation) string { return linkerdPrefix + strings.TrimPrefix(a.key, ourPrefix) }

// lookup finds a's value, ours first, then Linkerd's spelling.
func lookup(ann map[string]string, a annotation) (key, value string, ok bool) {
	if v, ok := ann[a.key]; ok {
		return a.key, v, true
	}
	if a.linkerd {
		key := linkerdKey(a)
		if v, ok := ann[key]; ok {
			return key, v, true
		}
	}
	if a.alias != "" {
		if v, ok := ann[a.alias]; ok {
			return a.alias, v, true
		}
	}
	return "", "", false
}
