package accrual

import (
	"fmt"
	"strings"
	"time"
)

// Mode selects how failures accrue.
type Mode string

const (
	// ModeConsecutive ejects an endpoint after MaxFailures failures in a row.
	ModeConsecutive Mode = "consecutive"
	// ModeNone never ejects.
	ModeNone Mode = "none"
)

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
}

// Defaults follow Linkerd's consecutive failure accrual
// (balancer.linkerd.io/failure-accrual-consecutive-*): 7 failures, 1s
// minimum penalty, 1m maximum, jitter 0.5. The connect timeout, failure
// kinds and ejection cap are ours.
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
	}
}

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
	case ModeConsecutive, ModeNone:
	default:
		return &FieldError{"mode", s.Mode, "unknown mode (want consecutive or none)"}
	}
	if s.MaxFailures < 1 {
		return &FieldError{"maxFailures", s.MaxFailures, "must be at least 1"}
	}
	if s.MinPenalty <= 0 {
		return &FieldError{"minPenalty", s.MinPenalty, "must be positive"}
	}
	if s.MaxPenalty <= 0 {
		return &FieldError{"maxPenalty", s.MaxPenalty, "must be positive"}
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
	if s.FailureKinds == 0 && s.Mode == ModeConsecutive {
		return &FieldError{"failureKinds", "[]", "must name at least one kind"}
	}
	if s.MaxEjectionPercent < 0 || s.MaxEjectionPercent > 100 {
		return &FieldError{"maxEjectionPercent", s.MaxEjectionPercent, "must be within [0, 100]"}
	}
	return nil
}
