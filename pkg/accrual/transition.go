// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"fmt"
	"time"
)

// State is an endpoint's accrual state.
type State uint8

const (
	Ready     State = iota // in the table, taking new flows
	Ejected                // out of the table until its penalty ends
	Probation              // back in the table for exactly one probe flow

	numStates
)

var stateNames = [numStates]string{"ready", "ejected", "probation"}

func (s State) String() string {
	if s < numStates {
		return stateNames[s]
	}
	return fmt.Sprintf("state(%d)", uint8(s))
}

// MarshalText makes states readable in JSON (admin API, persisted records).
func (s State) MarshalText() ([]byte, error) {
	if s >= numStates {
		return nil, fmt.Errorf("invalid state %d", uint8(s))
	}
	return []byte(stateNames[s]), nil
}

// UnmarshalText parses the spelling MarshalText produces.
func (s *State) UnmarshalText(b []byte) error {
	for i, name := range stateNames {
		if string(b) == name {
			*s = State(i)
			return nil
		}
	}
	return fmt.Errorf("unknown state %q (want ready, ejected or probation)", b)
}

// Outcome is the classified L4 outcome of one flow to an endpoint.
type Outcome struct {
	Endpoint uint32
	Success  bool      // SYN-ACK seen; Kind is then ignored
	Kind     Kind      // failure kind when !Success
	Probe    bool      // the flow was the probe admitted to an endpoint in probation
	At       time.Time // when the datapath saw it; zero means "now"
	// Inconclusive: the connection ended without an answer to judge (the
	// client reset it before the backend accepted or refused). It counts
	// as nothing; a probe's makes its endpoint get a new probe.
	Inconclusive bool
	// Started is when the connection began (its first SYN); zero: unknown.
	// Outcomes arrive in the order they are decided, not in the order the
	// connections began: a timeout is known only a connect timeout later.
	Started time.Time
	// Handshake is a success's time from SYN to SYN-ACK as the datapath
	// saw them; zero: unknown (never slow).
	Handshake time.Duration
}

// Reason says why a transition happened. The set is closed: the constants
// below are all the values the engine produces, so consumers may switch on
// them and use them as metric label values.
type Reason string

const (
	// ready → ejected: MaxFailures consecutive counted failures.
	// Failures and Kind give the streak length and the last failure's kind.
	ReasonConsecutiveFailures Reason = "consecutive-failures"
	// ready → ejected: the window's failure rate exceeded
	// FailureRateThreshold (Window and Threshold say by how much).
	ReasonFailureRate Reason = "failure-rate"
	// ready → ejected: the window's share of slow connects exceeded
	// SlowConnectRateThreshold.
	ReasonSlowConnects Reason = "slow-connects"
	// ready → ejected: the window's success rate was below its peers' mean
	// by more than OutlierStdevFactor standard deviations (Threshold is the
	// success rate it fell below).
	ReasonOutlier Reason = "success-rate-outlier"
	// ready → ejected: the fleet's evidence (every node's window summed,
	// pkg/fleet) exceeded FailureRateThreshold where this node's own
	// volume was too small to judge. Window is the fleet's sum.
	ReasonFleet Reason = "fleet"
	// probation → ejected: the probe failed with a counted kind.
	ReasonProbeFailed Reason = "probe-failed"
	// ejected → probation: the penalty ended (Advance).
	ReasonPenaltyOver Reason = "penalty-over"
	// probation → ready: the probe succeeded.
	ReasonProbeSucceeded Reason = "probe-succeeded"
	// ejected|probation → ready: a success while the service failed open.
	ReasonFailOpenSuccess Reason = "fail-open-success"
	// ejected|probation → ready: the service's mode was set to none.
	ReasonAccrualDisabled Reason = "accrual-disabled"
	// any → any: state adopted from a Record by Restore.
	ReasonRestored Reason = "restored"
	// ready → ready: an ejection was due but MaxEjectionPercent was full.
	// Not a state change; emitted once per failure streak.
	ReasonEjectionSuppressed Reason = "ejection-suppressed"
	// probation → probation: the probe failed with a kind that does not
	// count; the agent should grant the endpoint a fresh probe.
	ReasonProbeInconclusive Reason = "probe-inconclusive"
	// Service-level: no endpoint is ready, the table holds all endpoints.
	// From and To are meaningless (zero).
	ReasonFailOpenStart Reason = "fail-open-start"
	// Service-level: an endpoint is ready again (or none is left).
	ReasonFailOpenEnd Reason = "fail-open-end"
)

// NoEndpoint is Transition.Endpoint for a service-level transition that no
// single endpoint's state change caused (a change of the endpoint set).
const NoEndpoint = ^uint32(0)

// Transition reports a state change of one endpoint or, for
// ReasonFailOpenStart/End, of a service's fail-open status.
type Transition struct {
	Service  uint32
	Endpoint uint32 // for fail-open events: the endpoint that caused it, or NoEndpoint
	From, To State
	Reason   Reason
	Kind     Kind   // failure kind behind an ejection, suppression or inconclusive probe
	Failures uint32 // the endpoint's consecutive counted failures at the decision
	// Penalty and ProbationAt describe the penalty drawn on entering
	// ejected (also set for restored ejected/probation endpoints).
	Penalty     time.Duration
	ProbationAt time.Time
	At          time.Time // engine clock time of the decision
	// FailureAt is the failure that caused an ejection or suppression (the
	// N-th failure's or the failed probe's own timestamp), so At-FailureAt
	// is the reaction time.
	FailureAt time.Time
	// Window is what the endpoint's window held when a rule ejected it (or
	// its ejection was suppressed), Threshold the limit it passed (0 for the
	// consecutive rule), and Cause, for a suppression, the rule that was due.
	Window    WindowSnapshot
	Threshold float64
	Cause     Reason
}

// The reasons that eject, indexed for per-reason counters.
var ejectReasons = [...]Reason{ReasonConsecutiveFailures, ReasonProbeFailed, ReasonFailureRate, ReasonSlowConnects, ReasonOutlier, ReasonFleet}

const numEjectReasons = len(ejectReasons)

// EjectReasons lists the reasons an endpoint can be ejected for.
func EjectReasons() []Reason { return ejectReasons[:] }

func ejectReasonIndex(r Reason) int {
	for i, x := range ejectReasons {
		if x == r {
			return i
		}
	}
	return 0
}

// ServiceLevel reports whether t is a fail-open start or end rather than an
// endpoint's state change.
func (t Transition) ServiceLevel() bool {
	return t.Reason == ReasonFailOpenStart || t.Reason == ReasonFailOpenEnd
}

// String renders t for logs, e.g. "svc 3 ep 7: ready → ejected (7
// consecutive failures (refused), penalty 1.2s)". It allocates; the engine
// never calls it.
func (t Transition) String() string {
	switch t.Reason {
	case ReasonFailOpenStart:
		return fmt.Sprintf("svc %d: fail-open started (no endpoint ready)", t.Service)
	case ReasonFailOpenEnd:
		return fmt.Sprintf("svc %d: fail-open ended", t.Service)
	}
	var why string
	switch t.Reason {
	case ReasonConsecutiveFailures:
		why = fmt.Sprintf("%d consecutive failures (%v)", t.Failures, t.Kind)
	case ReasonFailureRate:
		why = fmt.Sprintf("failure rate %.3f > %g (%d of %d)", t.Window.FailureRate, t.Threshold, t.Window.Failures, t.Window.Calls)
	case ReasonSlowConnects:
		why = fmt.Sprintf("slow connects %.3f > %g (%d of %d)", t.Window.SlowRate, t.Threshold, t.Window.Slow, t.Window.Calls)
	case ReasonOutlier:
		why = fmt.Sprintf("success rate %.3f < %.3f among peers (%d of %d failed)", 1-t.Window.FailureRate, t.Threshold, t.Window.Failures, t.Window.Calls)
	case ReasonFleet:
		why = fmt.Sprintf("fleet evidence: failure rate %.3f > %g (%d of %d on all nodes)", t.Window.FailureRate, t.Threshold, t.Window.Failures, t.Window.Calls)
	case ReasonProbeFailed:
		why = fmt.Sprintf("probe failed (%v)", t.Kind)
	case ReasonEjectionSuppressed:
		if t.Cause != "" && t.Cause != ReasonConsecutiveFailures {
			why = fmt.Sprintf("ejection suppressed: max-ejection-percent (%s)", t.Cause)
		} else {
			why = fmt.Sprintf("ejection suppressed: max-ejection-percent (%d consecutive failures (%v))", t.Failures, t.Kind)
		}
	case ReasonProbeInconclusive:
		why = fmt.Sprintf("probe inconclusive (%v does not count)", t.Kind)
	default:
		why = string(t.Reason)
	}
	if t.To == Ejected {
		why += fmt.Sprintf(", penalty %v", t.Penalty)
	}
	return fmt.Sprintf("svc %d ep %d: %v → %v (%s)", t.Service, t.Endpoint, t.From, t.To, why)
}
