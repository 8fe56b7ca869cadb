// SPDX-License-Identifier: Apache-2.0

package admin

import (
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// The JSON documents of the /admin/ views. Every key is camelCase; counters
// are the datapath's, renamed from the C fields (bpf/include/pb_structs.h).

// ServicesView is GET /admin/services: what the datapath holds.
type ServicesView struct {
	Interfaces []string          `json:"interfaces"`
	Services   []Service         `json:"services"`
	Datapath   *DatapathCounters `json:"datapath,omitempty"`
}

// Service is one programmed service.
type Service struct {
	Name string `json:"name"`
	// Served says why the service is served (Kubernetes mode: the scope,
	// a label, a BackendPolicy); a service not listed is kube-proxy's.
	Served   string `json:"served,omitempty"`
	ID       uint32 `json:"id"`
	VIP      string `json:"vip"`
	Port     uint16 `json:"port"`
	Protocol string `json:"protocol"`
	FailOpen bool   `json:"failOpen"`
	// RetryRefused: refused new connections get a second try (pb_services flags).
	RetryRefused bool             `json:"retryRefused"`
	Counters     *ServiceCounters `json:"counters,omitempty"`
	// KernelTrips is pb_svc_trip: the datapath's own ejections; absent
	// when the service has none (maxFailures 0).
	KernelTrips *KernelTrips `json:"kernelTrips,omitempty"`
	// ReplayAfter is the replay deadline of a SYN its backend leaves
	// unanswered (a Go duration), from the service's recent handshakes;
	// absent when the service replays nothing.
	ReplayAfter string    `json:"replayAfter,omitempty"`
	Backends    []Backend `json:"backends"`
}

// KernelTrips: when the datapath ejects a backend of the service itself,
// how many more it may (budget), how many it did and held back.
type KernelTrips struct {
	MaxFailures uint32 `json:"maxFailures"`
	// Kinds are the failures counted: refused, reset, reset-after-data.
	Kinds []string `json:"kinds"`
	// Settle: a reset counts only this soon after its flow's SYN (a Go
	// duration).
	Settle     string `json:"settle"`
	Budget     int64  `json:"budget"`
	Trips      uint64 `json:"trips"`
	Suppressed uint64 `json:"suppressed"`
}

// Backend is one endpoint's kernel entry.
type Backend struct {
	ID       uint32 `json:"id"`
	Endpoint string `json:"endpoint"`
	Name     string `json:"name,omitempty"`
	// DatapathState is the entry's state in pb_backends: active,
	// probation, ejected or removed.
	DatapathState string `json:"datapathState"`
	// KernelStreak is the datapath's count of the backend's consecutive
	// counted failures (pb_be_trip), which trips it at maxFailures.
	KernelStreak uint32           `json:"kernelStreak"`
	Counters     *BackendCounters `json:"counters,omitempty"`
}

// ServiceCounters are a service's counters (its slot of pb_svc_stats_v2),
// summed over CPUs.
type ServiceCounters struct {
	Packets   uint64 `json:"packets"`
	Bytes     uint64 `json:"bytes"`
	Flows     uint64 `json:"flows"`
	NoBackend uint64 `json:"noBackend"`
	OverLimit uint64 `json:"overLimit"`
}

// BackendCounters are a backend's counters (its slot of pb_be_stats_v2),
// summed over CPUs.
type BackendCounters struct {
	Packets      uint64 `json:"packets"`
	Bytes        uint64 `json:"bytes"`
	Flows        uint64 `json:"flows"`
	ReplyPackets uint64 `json:"replyPackets"`
	ReplyBytes   uint64 `json:"replyBytes"`
}

// DatapathCounters are pb_global_stats, summed over CPUs.
type DatapathCounters struct {
	EventsLost        uint64 `json:"eventsLost"`
	Redirected        uint64 `json:"redirected"`
	PassedAfterNAT    uint64 `json:"passedAfterNat"`
	NoBackend         uint64 `json:"noBackend"`
	ProbeAdmitted     uint64 `json:"probeAdmitted"`
	Steered           uint64 `json:"steered"`
	SteerFailed       uint64 `json:"steerFailed"`
	Repicked          uint64 `json:"repicked"`
	CTCreateFailed    uint64 `json:"ctCreateFailed"`
	Malformed         uint64 `json:"malformed"`
	InflightRejected  uint64 `json:"inflightRejected"`
	InflightUntracked uint64 `json:"inflightUntracked"`
	RejectRSTTx       uint64 `json:"rejectRstTx"`
	RejectRSTPass     uint64 `json:"rejectRstPass"`
	ProbeRescued      uint64 `json:"probeRescued"`
	RefusedRescued    uint64 `json:"refusedRescued"`
	Retried           uint64 `json:"retried"`
	ICMPTranslated    uint64 `json:"icmpTranslated"`
}

// NewKernelTrips renames a pb_svc_trip value; nil when the service has no
// kernel trips (max_failures 0).
func NewKernelTrips(t bpf.LbSvcTrip) *KernelTrips {
	if t.MaxFailures == 0 {
		return nil
	}
	return &KernelTrips{MaxFailures: t.MaxFailures, Kinds: maps.TripKindNames(t.Kinds),
		Settle: time.Duration(t.SettleNs).String(), Budget: t.Budget, Trips: t.Trips, Suppressed: t.Suppressed}
}

// NewServiceCounters renames a service's counters.
func NewServiceCounters(s bpf.LbSvcStats) *ServiceCounters {
	return &ServiceCounters{Packets: s.Packets, Bytes: s.Bytes, Flows: s.Flows, NoBackend: s.NoBackend, OverLimit: s.OverLimit}
}

// NewBackendCounters renames a backend's counters.
func NewBackendCounters(s bpf.LbBeStats) *BackendCounters {
	return &BackendCounters{Packets: s.Packets, Bytes: s.Bytes, Flows: s.Flows, ReplyPackets: s.ReplyPackets, ReplyBytes: s.ReplyBytes}
}

// NewDatapathCounters renames a pb_global_stats value.
func NewDatapathCounters(s bpf.LbGlobalStats) *DatapathCounters {
	return &DatapathCounters{
		EventsLost: s.EventsLost, Redirected: s.Redirected, PassedAfterNAT: s.PassedAfterNat,
		NoBackend: s.NoBackend, ProbeAdmitted: s.ProbeAdmitted, Steered: s.Steered,
		SteerFailed: s.SteerFailed, Repicked: s.Repicked, CTCreateFailed: s.CtCreateFailed,
		Malformed: s.Malformed, InflightRejected: s.InflightRejected, InflightUntracked: s.InflightUntracked,
		RejectRSTTx: s.RejectRstTx, RejectRSTPass: s.RejectRstPass, ProbeRescued: s.ProbeRescued,
		RefusedRescued: s.RefusedRescued, Retried: s.Retried, ICMPTranslated: s.IcmpTranslated,
	}
}

// EndpointsView is GET /admin/endpoints: failure accrual per endpoint.
type EndpointsView struct {
	Services []AccrualService `json:"services"`
}

// AccrualService is one service's failure accrual.
type AccrualService struct {
	Service string       `json:"service"`
	ID      uint32       `json:"id"`
	Mode    accrual.Mode `json:"mode"`
	// Thresholds are what the window rules judge each endpoint's window
	// against; absent when the service's settings judge no window.
	Thresholds    *Thresholds `json:"thresholds,omitempty"`
	Ready         int         `json:"ready"`
	Ejected       int         `json:"ejected"`
	Probation     int         `json:"probation"`
	FailOpen      bool        `json:"failOpen"`
	FailOpenSince *time.Time  `json:"failOpenSince,omitempty"`
	Endpoints     []Endpoint  `json:"endpoints"`
}

// Thresholds are a service's window rules, as in force.
type Thresholds struct {
	Window             string  `json:"window"` // a Go duration
	WindowCalls        int     `json:"windowCalls,omitempty"`
	MinCalls           int     `json:"minCalls"`
	FailureRate        float64 `json:"failureRate,omitempty"` // modes failure-rate and unified
	SlowConnect        string  `json:"slowConnect,omitempty"` // a Go duration
	SlowConnectRate    float64 `json:"slowConnectRate,omitempty"`
	OutlierStdevFactor float64 `json:"outlierStdevFactor,omitempty"`
	OutlierMinHosts    int     `json:"outlierMinHosts,omitempty"`
	OutlierMinCalls    int     `json:"outlierMinCalls,omitempty"`
}

// ThresholdsOf returns s's window rules, nil when it judges no window.
func ThresholdsOf(s accrual.Settings) *Thresholds {
	if !s.Windowed() {
		return nil
	}
	rate := s.Mode.RatesFailures()
	t := &Thresholds{Window: s.Window.String(), WindowCalls: s.WindowCalls, MinCalls: s.MinCalls}
	if rate {
		t.FailureRate = s.FailureRateThreshold
	}
	if s.SlowConnectThreshold > 0 {
		t.SlowConnect, t.SlowConnectRate = s.SlowConnectThreshold.String(), s.SlowConnectRateThreshold
	}
	if s.Outliers {
		t.OutlierStdevFactor, t.OutlierMinHosts, t.OutlierMinCalls = s.OutlierStdevFactor, s.OutlierMinHosts, s.OutlierMinCalls
	}
	return t
}

// Endpoint is one endpoint's accrual state.
type Endpoint struct {
	Endpoint            string `json:"endpoint"`
	Name                string `json:"name,omitempty"`
	ID                  uint32 `json:"id"`
	State               string `json:"state"` // ready, ejected or probation
	ConsecutiveFailures uint32 `json:"consecutiveFailures"`
	// Penalty is the current ejection's (a Go duration); empty when ready.
	Penalty         string     `json:"penalty,omitempty"`
	ProbationAt     *time.Time `json:"probationAt,omitempty"`
	LastFailureKind string     `json:"lastFailureKind,omitempty"`
	LastFailureAt   *time.Time `json:"lastFailureAt,omitempty"`
	// Window is the endpoint's window of recent connections, which the
	// service's window rules judge (see the service's thresholds); absent
	// when its settings judge none.
	Window   *accrual.WindowSnapshot `json:"window,omitempty"`
	Counters accrual.Counters        `json:"counters"`
}

// CircuitBreakersView is GET /admin/circuit_breakers: limits, live flows
// and rejections. A rejection here is the node refusing a flow over the
// limit; a backend's own refusal shows as a refused failure in
// /admin/endpoints instead.
//
// The backend* and rejectedBackend* fields repeat the per-service figures
// in the words and shapes of the gateway whose circuit breaker this one
// follows (a "backend" there is a Service port here), maps keyed by
// service name, so scripts written for its admin snapshot keep working.
type CircuitBreakersView struct {
	DefaultMaxInflight uint32 `json:"defaultMaxInflight"`
	// RejectedTotal counts every flow the node refused over a limit since
	// the datapath was loaded, services since removed included.
	RejectedTotal  uint64           `json:"rejectedTotal"`
	UntrackedTotal uint64           `json:"untrackedTotal"`
	Services       []CircuitBreaker `json:"services"`

	// BackendMaxInflightRequests: each service's limit in force (0: none).
	BackendMaxInflightRequests map[string]uint32 `json:"backendMaxInflightRequests"`
	// BackendInflightCurrent: each service's live counted flows.
	BackendInflightCurrent map[string]int64 `json:"backendInflightCurrent"`
	// RejectedBackendByName: each service's flows refused over its
	// limits (its own or its endpoints').
	RejectedBackendByName map[string]uint64 `json:"rejectedBackendByName"`
	// RejectedBackendTotal is the sum of RejectedBackendByName.
	RejectedBackendTotal uint64 `json:"rejectedBackendTotal"`
}

// CircuitBreaker is one service's limits and live flows.
type CircuitBreaker struct {
	Service                string          `json:"service"`
	ID                     uint32          `json:"id"`
	MaxInflight            uint32          `json:"maxInflight"`
	MaxInflightPerEndpoint uint32          `json:"maxInflightPerEndpoint"`
	Inflight               int64           `json:"inflight"`
	Rejected               uint64          `json:"rejected"`
	Endpoints              []EndpointFlows `json:"endpoints"`
}

// EndpointFlows is one endpoint's live flows.
type EndpointFlows struct {
	Endpoint string `json:"endpoint"`
	ID       uint32 `json:"id"`
	Inflight int64  `json:"inflight"`
}

// TimeOrNil is t, or nil (the key left out) when t is zero.
func TimeOrNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}
