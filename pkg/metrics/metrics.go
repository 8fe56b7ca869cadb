// SPDX-License-Identifier: Apache-2.0

// Package metrics exposes the agent on Prometheus: kernel counters and
// failure-accrual state are read at scrape time (so they cost nothing
// between scrapes), agent events are counted as they happen. Every name is
// prefixed penaltybox_ and uses base units.
//
// Labels survive the Prometheus Operator: none of the project's series has
// a label the Operator (or Prometheus' Kubernetes discovery) puts on every
// target (namespace, pod, service, job, instance, container, endpoint),
// which a scrape without honor_labels would rename exported_<label>. A
// service is three labels, svc_namespace, svc_name and svc_port (a
// Kubernetes Service port "shop/web:http" is shop, web, http; a
// dual-stack Service's second family keeps its "/ipv6" or "/ipv4" on
// svc_port; a standalone service has only svc_name, the config's name);
// an endpoint is backend ("10.244.1.7:8080").
//
// Per backend, --backend-metrics sets the detail (BackendDetail): basic
// (the default) exports 5 series per backend on each node, detailed 20
// more (23 with window rules), none 0 (docs/reference/metrics.md has the budget).
package metrics

import (
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/penaltybox/penaltybox/internal/version"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

const ns = "penaltybox"

// The labels a service is split into.
var svcLabels = []string{"svc_namespace", "svc_name", "svc_port"}

// SplitService splits a desired-state service name into its labels:
// "shop/web:http" (a Kubernetes Service port; "shop/web:http/ipv6" for a
// dual-stack Service's second family) is shop, web, http (http/ipv6);
// "shop/web" (a Kubernetes Service) is shop, web and no port; a standalone
// service's name is its name alone.
func SplitService(name string) (namespace, svc, port string) {
	ns, rest, ok := strings.Cut(name, "/")
	if !ok {
		return "", name, ""
	}
	svc, port, _ = strings.Cut(rest, ":")
	return ns, svc, port
}

// ServiceCounterVec is a counter vector whose first label value is a
// service's name, exported as svc_namespace, svc_name and svc_port.
type ServiceCounterVec struct{ *prometheus.CounterVec }

// NewServiceCounterVec is a counter vector of the service's labels and labels.
func NewServiceCounterVec(opts prometheus.CounterOpts, labels ...string) *ServiceCounterVec {
	return &ServiceCounterVec{prometheus.NewCounterVec(opts, append(slices.Clone(svcLabels), labels...))}
}

// WithLabelValues takes the service's name first, then the other labels'
// values.
func (v *ServiceCounterVec) WithLabelValues(service string, lvs ...string) prometheus.Counter {
	ns, name, port := SplitService(service)
	return v.CounterVec.WithLabelValues(append([]string{ns, name, port}, lvs...)...)
}

// DeleteService drops every series of service (a deleted Service's).
func (v *ServiceCounterVec) DeleteService(service string) int {
	ns, name, port := SplitService(service)
	l := prometheus.Labels{"svc_namespace": ns, "svc_name": name}
	if port != "" {
		l["svc_port"] = port
	}
	return v.DeletePartialMatch(l)
}

// BackendDetail is how many series each backend (a service's endpoint)
// gets on each node (--backend-metrics).
type BackendDetail int

const (
	// BackendBasic: endpoint_ejected, endpoint_ejections_total,
	// endpoint_restores_total, endpoint_connects_total and
	// endpoint_failures_total: 5 series per backend.
	BackendBasic BackendDetail = iota
	// BackendDetailed adds failures by kind, probes by result, ejections
	// by reason and suppressed, slow connects, the window rules' gauges
	// and the datapath's traffic counters per backend.
	BackendDetailed
	// BackendNone: no per-backend series; the per-service ones remain.
	BackendNone
)

// ParseBackendDetail reads --backend-metrics.
func ParseBackendDetail(s string) (BackendDetail, error) {
	switch s {
	case "basic":
		return BackendBasic, nil
	case "detailed":
		return BackendDetailed, nil
	case "none":
		return BackendNone, nil
	}
	return 0, fmt.Errorf("want basic, detailed or none, got %q", s)
}

func (d BackendDetail) String() string {
	return [...]string{"basic", "detailed", "none"}[d]
}

// ServiceView names a programmed service and its backends for labels.
type ServiceView struct {
	ID       uint32
	Name     string
	Backends []BackendView
	// MaxInflight is the circuit breaker's limit (0: none); Inflight the
	// live counted flows (counted only while some limit is set).
	MaxInflight uint32
	Inflight    int64
	// Served says why the service is served (desired.Service.Served; ""
	// from a config file).
	Served string
}

// BackendView is one backend of a service.
type BackendView struct {
	ID       uint32
	Endpoint string // "198.18.1.2:8080"
	Removed  bool
}

// Source is what the scrape-time collector reads of the agent's state.
// The agent implements it, taking its own lock where it needs one; the
// datapath's counters are read from the maps (maps.Counters) directly.
type Source interface {
	Services() []ServiceView
	Accrual() []accrual.ServiceSnapshot
}

// Metrics holds the agent's event-driven metrics and its registry.
type Metrics struct {
	Registry *prometheus.Registry

	Events             *prometheus.CounterVec
	EventsUndecodable  prometheus.Counter
	ConfigReloads      *prometheus.CounterVec
	ConfigLastSuccess  prometheus.Gauge
	ConfigLastOK       prometheus.Gauge
	ProgramErrors      prometheus.Counter
	Reaction           prometheus.Histogram
	Transitions        *ServiceCounterVec
	PendingConnects    prometheus.Gauge
	PendingOverflow    prometheus.Counter
	TrackedFlows       prometheus.Gauge
	TrackedFlowsLimit  prometheus.Gauge
	UntrackedFlows     *ServiceCounterVec
	Withheld           *prometheus.CounterVec
	FloodMode          prometheus.Gauge
	SYNGuard           prometheus.Gauge
	ProbeRegrants      *ServiceCounterVec
	InvalidSettings    *ServiceCounterVec
	ConntrackEntries   prometheus.Gauge
	ConntrackSize      prometheus.Gauge
	ConntrackExpired   prometheus.Counter
	ConntrackSweeps    *prometheus.CounterVec
	MaxInflightDefault prometheus.Gauge
	// KernelTrips and FlowsToEjected: every service's series from the
	// start, at 0 (ServiceCounters: Add when it is programmed).
	KernelTrips        *ServiceCounters
	FlowsToEjected     *ServiceCounters
	UnansweredUDP      *ServiceCounterVec
	Replays            *prometheus.CounterVec
	PolicyStatusLeader prometheus.Gauge
	PolicyStatusWrites *prometheus.CounterVec
	// Fleet evidence (Kubernetes mode): reports and verdicts written, by
	// result; 1 while this agent aggregates the fleet's reports.
	FleetReportWrites  *prometheus.CounterVec
	FleetVerdictWrites *prometheus.CounterVec
	FleetAggregator    prometheus.Gauge
	FleetCondemned     prometheus.Gauge
	// BuildInfo is 1, labelled with the build's version, git revision and
	// Go version (internal/version): which agents run which build.
	BuildInfo *prometheus.GaugeVec

	detail *atomic.Int32 // a BackendDetail, read by the collector
}

// SetBackendDetail sets how many series each backend gets from the next
// scrape on (--backend-metrics).
func (m *Metrics) SetBackendDetail(d BackendDetail) { m.detail.Store(int32(d)) }

// New registers every metric. src may be nil in tests that only need the
// event-driven ones.
func New(src Source, counters maps.Counters, log *slog.Logger) *Metrics {
	r := prometheus.NewRegistry()
	m := &Metrics{
		Registry: r,
		detail:   new(atomic.Int32),
		Events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "events_total",
			Help: "Outcome events read from the datapath's ring buffer, by type.",
		}, []string{"type"}),
		EventsUndecodable: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "events_undecodable_total",
			Help: "Ring buffer records that did not decode (agent and datapath disagree on the layout).",
		}),
		ConfigReloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "config_reloads_total",
			Help: "Configuration loads by result (success, error). On error the last good configuration stays in force.",
		}, []string{"result"}),
		ConfigLastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "config_last_reload_success_timestamp_seconds",
			Help: "When the configuration was last loaded successfully.",
		}),
		ConfigLastOK: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "config_last_reload_successful",
			Help: "1 if the last configuration load succeeded, 0 if it failed.",
		}),
		ProgramErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "map_programming_errors_total",
			Help: "Failed writes of services, backends or tables to the datapath maps.",
		}),
		Reaction: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: ns, Name: "ejection_reaction_seconds",
			Help:    "Time from the kernel seeing the failure that ejects an endpoint to the endpoint being out of its service's Maglev table.",
			Buckets: []float64{50e-6, 100e-6, 200e-6, 350e-6, 500e-6, 750e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.25, 1},
		}),
		Transitions: NewServiceCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "accrual_transitions_total",
			Help: "Failure-accrual decisions by reason (consecutive-failures, probe-failed, penalty-over, probe-succeeded, fail-open-start, ...).",
		}, "reason"),
		PendingConnects: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "pending_connects",
			Help: "New TCP flows waiting for the backend's first answer (SYN-ACK or RST), each under its connect deadline. Flood mode counts each service's up to a quarter of its threshold, so one service's half-open connections cannot hold it.",
		}),
		PendingOverflow: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "pending_connects_overflow_total",
			Help: "New flows not tracked because the node's tracker memory ceiling (--tracker-memory) was reached: untracked_flows_total{reason=\"memory_limit\"} summed over services.",
		}),
		TrackedFlows: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "tracked_flows",
			Help: "Flows the agent tracks: connects waiting for an answer, established connections settling, and decided ones remembered so a late event is no second verdict.",
		}),
		TrackedFlowsLimit: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "tracked_flows_limit",
			Help: "The node's ceiling on tracked flows: --tracker-memory over the bytes a tracked flow costs at most. Beyond it new flows are not tracked.",
		}),
		UntrackedFlows: NewServiceCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "untracked_flows_total",
			Help: "New flows the agent did not track, by service and reason: service_cap (the service already had its share of the node's tracked flows waiting for a verdict: one tenant's idle or half-open connections cannot take the node's) or memory_limit (the node's ceiling, --tracker-memory). The kernel's signals (a RST, a retransmitted SYN) still judge them; a SYN-ACK is their success, with no settling.",
		}, "reason"),
		Withheld: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "connect_timeouts_withheld_total",
			Help: "Connect timeouts not counted against their endpoint, by reason: events_lost (events were lost while the connection waited: its SYN-ACK may have been among them), service_wide (most of the service's endpoints were timing out at once: the service, or the node, is degraded, not the endpoint), before_start (the connect started before this agent did: its events may have been lost unseen), flood (seen in flood mode).",
		}, []string{"reason"}),
		FloodMode: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "flood_mode",
			Help: "1 while events are lost or read late, or too many connects are pending (a SYN flood, or the agent starved of CPU): connect deadlines then judge only connections whose events all arrived.",
		}),
		SYNGuard: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "syn_guard_active",
			Help: "1 while flood mode holds the SYN guard on (its lease; --syn-guard-rate above 0): SYNs to services from sources without a recent proof of a real connection get a per-CPU budget, and the rest are dropped in XDP. A CPU that armed the guard itself is counted in datapath_syn_guard_armed_total, not here.",
		}),
		ProbeRegrants: NewServiceCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "probe_regrants_total",
			Help: "Fresh probes the probation watchdog granted, by reason: no_verdict (the kernel admitted a probe and no verdict came: its events were lost, or the datapath saw no answer), state_drift (the kernel's entry was not in probation).",
		}, "reason"),
		InvalidSettings: NewServiceCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "invalid_settings_total",
			Help: "Invalid per-service settings rejected (config fields, annotations by key, BackendPolicies as \"BackendPolicy namespace/name\"); the last good setting stays in force.",
		}, "key"),
		ConntrackEntries: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "conntrack_entries",
			Help: "Conntrack entries at the last sweep (two per flow). Near --conntrack-size, the LRU starts evicting live flows.",
		}),
		ConntrackSize: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "conntrack_size",
			Help: "Entries the conntrack table holds (--conntrack-size; two per flow), as of the last sweep. Full, its LRU evicts flows, live ones included: their outcomes are lost.",
		}),
		ConntrackExpired: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "conntrack_expired_flows_total",
			Help: "Idle flows the conntrack sweep expired (their circuit-breaker slots released).",
		}),
		ConntrackSweeps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "conntrack_sweeps_total",
			Help: "Conntrack sweeps (every 10 s), by how they ran: kernel (pb_ct_sweep_run), copy (the agent copied the table: --kernel-sweep=false, or a kernel that refused the program or where it failed once), fallback (the kernel's sweep could not fill its in-use sets and the agent copied the table after it).",
		}, []string{"way"}),
		KernelTrips: NewServiceCounters(prometheus.CounterOpts{
			Namespace: ns, Name: "kernel_trips_total",
			Help: "Endpoints the datapath ejected on its own at their maxFailures-th consecutive failure (kernel trips), by what the agent did: adopted (its ejection, with penalty and probation) or undone (accrual kept the endpoint in: max-ejection cap, fail-open).",
		}, "result", "adopted", "undone"),
		FlowsToEjected: NewServiceCounters(prometheus.CounterOpts{
			Namespace: ns, Name: "new_flows_to_ejected_total",
			Help: "New flows the datapath gave an endpoint the agent holds ejected (probes aside): flows admitted after the failure that decided the ejection, before the maps took it in. Kernel trips keep it at 0 for refusals and resets; a connect timeout (the agent's own deadline) or --kernel-trips=false leaves the agent's reaction time, during which new flows still reach the endpoint. Also counted: the odd flow another CPU admitted before a kernel trip whose event came first, and flows the fail-open table admitted as the service left fail-open.",
		}, ""),
		UnansweredUDP: NewServiceCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "udp_unanswered_flows_total",
			Help: "UDP flows their endpoint had not answered by connectTimeout. Not failures (many UDP protocols never answer): a rise against the service's flows is a silent endpoint, which only a port unreachable or an answer lets accrual judge.",
		}),
		Replays: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "syn_replays_total",
			Help: "Client SYNs the agent sent again for the datapath to move to another backend (retryRefused), by reason (refused: the backend refused it; unanswered: the backend left it unanswered past the service's replay deadline) and result: sent; no_copy (another flow's SYN had taken its pb_syns slot: the client's own retransmission is moved instead); stale (read too late, the flow had moved on, or its service or backend had gone); dropped (the datapath did not move the flow: no other backend to take it, or the circuit breaker turned it away); flood (not replayed in flood mode); not_sent (on a kernel that refuses the live-frame mode, the datapath moved the flow but the raw socket could not send its SYN: the flow decides nothing about the backend it moved to, and the client's own retransmission goes there); error.",
		}, []string{"reason", "result"}),
		MaxInflightDefault: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "max_inflight_default",
			Help: "The circuit-breaker limit of services that set none (--max-inflight-default, or the config file's defaults.maxInflight); 0 is no limit.",
		}),
		PolicyStatusLeader: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "policy_status_leader",
			Help: "1 while this agent holds the Lease and writes the BackendPolicies' status (one agent in the cluster), else 0.",
		}),
		PolicyStatusWrites: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "policy_status_writes_total",
			Help: "BackendPolicy status updates sent by this agent while it leads, by result (ok, error); a status that would not change is not written.",
		}, []string{"result"}),
		FleetReportWrites: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "fleet_report_writes_total",
			Help: "Writes of this node's EndpointReport (fleet evidence), by result (ok, error, deleted); a report that would not change is not rewritten before it needs refreshing.",
		}, []string{"result"}),
		FleetVerdictWrites: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "fleet_verdict_writes_total",
			Help: "EndpointVerdict writes by this agent while it aggregates the fleet's reports, by result (ok, error, deleted).",
		}, []string{"result"}),
		FleetAggregator: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "fleet_aggregator",
			Help: "1 while this agent holds the fleet Lease and judges every node's EndpointReports (one agent in the cluster), else 0.",
		}),
		FleetCondemned: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "fleet_condemned_endpoints",
			Help: "Endpoints the fleet's evidence condemns in the unexpired EndpointVerdicts this agent sees.",
		}),
		BuildInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "build_info",
			Help: "1, labelled with the agent's version, git revision and Go version.",
		}, []string{"version", "revision", "goversion"}),
	}
	r.MustRegister(m.Events, m.EventsUndecodable, m.ConfigReloads, m.ConfigLastSuccess, m.ConfigLastOK,
		m.ProgramErrors, m.Reaction, m.Transitions, m.PendingConnects, m.PendingOverflow, m.TrackedFlows, m.TrackedFlowsLimit, m.UntrackedFlows,
		m.Withheld, m.FloodMode, m.SYNGuard, m.ProbeRegrants,
		m.InvalidSettings, m.ConntrackEntries, m.ConntrackSize, m.ConntrackExpired, m.ConntrackSweeps,
		m.MaxInflightDefault, m.PolicyStatusLeader, m.PolicyStatusWrites, m.FleetReportWrites, m.FleetVerdictWrites, m.FleetAggregator, m.FleetCondemned, m.KernelTrips, m.FlowsToEjected, m.UnansweredUDP, m.Replays, m.BuildInfo,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if src != nil {
		r.MustRegister(&collector{src: src, counters: counters, log: log, detail: m.detail})
	}
	m.BuildInfo.WithLabelValues(version.Version(), version.Revision(), version.GoVersion()).Set(1)
	// Every replay series exists from the start, so that the first replay
	// of each kind shows in increase().
	for _, reason := range []string{"refused", "unanswered"} {
		for _, result := range []string{"sent", "no_copy", "stale", "dropped", "flood", "error"} {
			m.Replays.WithLabelValues(reason, result)
		}
	}
	// So that the first fallback shows in increase() too.
	for _, way := range []string{SweepKernel, SweepCopy, SweepFallback} {
		m.ConntrackSweeps.WithLabelValues(way)
	}
	return m
}

// How a conntrack sweep ran: conntrack_sweeps_total's way.
const (
	SweepKernel   = "kernel"
	SweepCopy     = "copy"
	SweepFallback = "fallback"
)

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(ns+"_"+name, help, labels, nil)
}

// svcDesc is desc with the service's three labels first.
func svcDesc(name, help string, labels ...string) *prometheus.Desc {
	return desc(name, help, append(slices.Clone(svcLabels), labels...)...)
}

// beDesc is svcDesc with the backend's label after the service's.
func beDesc(name, help string, labels ...string) *prometheus.Desc {
	return svcDesc(name, help, append([]string{"backend"}, labels...)...)
}

var (
	dSvcPackets   = svcDesc("service_packets_total", "Client packets to the service's VIP forwarded to a backend.")
	dSvcBytes     = svcDesc("service_bytes_total", "Bytes of those packets (IP total length).")
	dSvcFlows     = svcDesc("service_flows_total", "New flows admitted to the service.")
	dSvcNoBackend = svcDesc("service_no_backend_flows_total", "New flows dropped because the service had no usable backend.")
	dCBRejected   = svcDesc("circuit_breaker_rejected_total", "New flows the service's circuit breaker refused (TCP: RST from the VIP; UDP: dropped). Never a backend's failure.")

	dEventsLost  = desc("datapath_events_lost_total", "Outcome events the datapath could not deliver because the ring buffer was full.")
	dForwarded   = desc("datapath_forwarded_packets_total", "Rewritten packets by how they left XDP: redirect (bpf_redirect_map) or pass (kernel stack).", "method")
	dNoBackend   = desc("datapath_no_backend_flows_total", "New flows to a service that had no usable backend; dropped.")
	dProbes      = desc("datapath_probe_flows_total", "New flows admitted to an endpoint in probation (its probe).")
	dSteered     = desc("datapath_steered_flows_total", "New flows moved off a backend that was not active, by result (steered to an active one, or failed: none found).", "result")
	dRescued     = desc("datapath_probes_rescued_total", "Refused probes whose RST the datapath kept from the client: its SYN retransmission goes to another backend, so the client sees a delay, not a failure.")
	dRetried     = desc("datapath_refused_retried_total", "Refused new flows of services with retryRefused: the RST kept from the client (result=rescued), and their retransmitted SYNs re-picked avoiding the refusing backend (result=retried).", "result")
	dRepicked    = desc("datapath_repicked_flows_total", "Unanswered flows moved to another backend on the client's SYN retransmission because theirs was ejected.")
	dCTFail      = desc("datapath_conntrack_insert_failures_total", "Conntrack inserts that failed.")
	dICMP        = desc("datapath_icmp_translated_total", "ICMP errors about a NATed flow (fragmentation needed, port unreachable, time exceeded) translated so that their receiver matches them: quoting the VIP to the client, the backend to the backend.")
	dSYNGuard    = desc("datapath_syn_guard_syns_total", "SYNs to services while the SYN guard was on (pure SYNs from clients, whatever conntrack holds for their tuple; not the agent's replays), by verdict: trusted (the source proved itself lately: a backend sent it payload), admitted (untrusted, within the per-CPU budget), dropped (untrusted, over the budget: dropped in XDP).", "verdict")
	dSYNArmed    = desc("datapath_syn_guard_armed_total", "Times a CPU turned the SYN guard on by itself: in 100 ms more SYNs to services than --syn-guard-arm-rate allows, and a quarter as many again from untrusted sources (a flood, seen before the agent can tell); it stays on there for 1 s past the last such window.")
	dAffinity    = desc("datapath_affinity_clients", "Clients pb_affinity remembers for services with sessionAffinity ClientIP (one per service and client address, for the service's timeout after its last new connection).")
	dAffinityMax = desc("datapath_affinity_clients_limit", "Clients pb_affinity can remember (--affinity-clients); past it the least recently seen are forgotten, and their next connection may go to another endpoint.")
	dMalformed   = desc("datapath_malformed_packets_total", "Packets to a service port too short or inconsistent to parse; passed unchanged.")
	dNFForgotten = desc("datapath_conntrack_forgotten_total", "Entries of the kernel's conntrack the datapath expired where kube-proxy's path and its own meet, so that a client port used on one path works on the other: taken_over (kube-proxy's finished flow on a new flow's tuple, services within --takeover-grace), handed_over (a finished flow of the datapath's on the tuple of a new flow left to kube-proxy).", "why")
	dKubeProxy   = desc("datapath_kube_proxy_flows_total", "Packets the datapath left to kube-proxy, by why: handed_over (a new flow while the agent is away longer than --dead-man-timeout, or uninstalling), taken_over (a mid-stream packet of a flow kube-proxy began before the service was taken over, within --takeover-grace).", "why")
	dUnproven    = desc("datapath_unproven_packets_total", "Packets the datapath did not take as evidence of a backend's health, because a client (or a pod spoofing a backend) could have sent them, by reason: syn_doomed (a SYN no backend can accept: bad checksum, SYN|FIN, TTL <= 1, TCP-MD5/AO; passed unchanged, no flow), syn_duplicate (a pending flow's SYN again too soon or with another ISN: no timeout), reply_wrong_side (a reply from where the node does not route its backend: passed unchanged), reply_bad_checksum (a RST, SYN-ACK or ICMP error with a bad checksum), reply_unacked (a RST or SYN-ACK not acknowledging what the client sent, or a reset after a wrong handshake ACK), client_rst_ignored (a client's RST out of the backend's sequence: the flow keeps its breaker slot).", "reason")

	dEndpoints   = svcDesc("endpoints", "Endpoints of the service by failure-accrual state (ready, ejected, probation).", "state")
	dCBMax       = svcDesc("circuit_breaker_max_inflight", "Live flows the service may hold (0: no limit).")
	dServed      = svcDesc("service_served", "1 for each service the agent serves, by why: scope-all, service-label, namespace-label, backend-policy (Kubernetes mode), config (a config file). A Service not listed is kube-proxy's.", "reason")
	dInflight    = svcDesc("inflight_connections", "Live flows of the service counted by its circuit breaker (0 while it has no limit).")
	dFailOpen    = svcDesc("service_fail_open", "1 while the service fails open (no endpoint ready: new flows go to all endpoints).")
	dFailOpenEps = svcDesc("service_fail_open_episodes_total", "Times the service started failing open.")

	// Per backend, basic (--backend-metrics=basic, the default): 5 series.
	dEpEjected   = beDesc("endpoint_ejected", "1 while the backend is out of its service's rotation (ejected, or in probation waiting for its probe), else 0.")
	dEpEjections = beDesc("endpoint_ejections_total", "Times the backend was ejected (a probe's failure ejects it again, and counts).")
	dEpRestores  = beDesc("endpoint_restores_total", "Times the backend came back into rotation: its probe connection succeeded (probation to ready).")
	dEpSuccesses = beDesc("endpoint_connects_total", "Successful connects (SYN-ACK) to the backend.")
	dEpFailures  = beDesc("endpoint_failures_total", "L4 failures of connections to the backend, of every kind (refused, timeout, reset, reset-after-data), counted against it or not.")

	// Per backend, detailed (--backend-metrics=detailed) adds these.
	dEpFailKinds  = beDesc("endpoint_failures_by_kind_total", "L4 failures per backend by kind (counted or not).", "kind")
	dEpProbes     = beDesc("endpoint_probes_total", "Probation probes by result (success, failure, inconclusive).", "result")
	dEpSuppressed = beDesc("endpoint_ejections_suppressed_total", "Ejections the max-ejection-percent cap prevented.")
	dEpByReason   = beDesc("endpoint_ejections_by_reason_total", "Times the backend was ejected since the agent started, by the rule that ejected it (consecutive-failures, probe-failed, failure-rate, slow-connects, success-rate-outlier, fleet).", "reason")
	dEpSlow       = beDesc("endpoint_slow_connects_total", "Successful connects whose handshake took at least the service's slowConnectThreshold.")
	dEpWinCalls   = beDesc("endpoint_window_connections", "Connections in the backend's accrual window (services with window rules only).")
	dEpWinRate    = beDesc("endpoint_window_failure_rate", "Share of counted failures in the backend's accrual window, as the failure-rate rule judges it.")
	dEpWinSlow    = beDesc("endpoint_window_slow_rate", "Share of slow connects in the backend's accrual window.")
	dBePackets    = beDesc("backend_packets_total", "Client packets sent to the backend.")
	dBeBytes      = beDesc("backend_bytes_total", "Bytes of those packets.")
	dBeFlows      = beDesc("backend_flows_total", "New flows sent to the backend.")
	dBeRPackets   = beDesc("backend_reply_packets_total", "Backend replies reverse-NATed back to the VIP.")
	dBeRBytes     = beDesc("backend_reply_bytes_total", "Bytes of those replies.")
)

type collector struct {
	src      Source
	counters maps.Counters
	log      *slog.Logger
	detail   *atomic.Int32
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{dSvcPackets, dSvcBytes, dSvcFlows, dSvcNoBackend, dCBRejected, dBePackets, dBeBytes,
		dBeFlows, dBeRPackets, dBeRBytes, dEventsLost, dForwarded, dNoBackend, dProbes, dSteered, dRepicked, dRescued, dRetried,
		dCTFail, dMalformed, dUnproven, dKubeProxy, dNFForgotten, dICMP, dSYNGuard, dSYNArmed, dAffinity, dAffinityMax, dEndpoints,
		dEpEjected, dEpEjections, dEpRestores, dEpSuccesses, dEpFailures,
		dEpFailKinds, dEpProbes, dEpSuppressed, dEpByReason, dEpSlow, dEpWinCalls, dEpWinRate, dEpWinSlow,
		dFailOpen, dFailOpenEps, dCBMax, dServed, dInflight} {
		ch <- d
	}
}

func counter(ch chan<- prometheus.Metric, d *prometheus.Desc, v uint64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
}

func gauge(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	// One read of each element of the per-service and per-backend
	// counters for the whole scrape (maps.Snapshot).
	counters := maps.Snapshot(c.counters)
	if gs, err := counters.GlobalStats(); err == nil {
		counter(ch, dEventsLost, gs.EventsLost)
		counter(ch, dForwarded, gs.Redirected, "redirect")
		counter(ch, dForwarded, gs.PassedAfterNat, "pass")
		counter(ch, dNoBackend, gs.NoBackend)
		counter(ch, dProbes, gs.ProbeAdmitted)
		counter(ch, dSteered, gs.Steered, "steered")
		counter(ch, dSteered, gs.SteerFailed, "failed")
		counter(ch, dRepicked, gs.Repicked)
		counter(ch, dRescued, gs.ProbeRescued)
		counter(ch, dRetried, gs.RefusedRescued, "rescued")
		counter(ch, dRetried, gs.Retried, "retried")
		counter(ch, dCTFail, gs.CtCreateFailed)
		counter(ch, dMalformed, gs.Malformed)
		counter(ch, dICMP, gs.IcmpTranslated)
		counter(ch, dKubeProxy, gs.HandedOver, "handed_over")
		counter(ch, dKubeProxy, gs.KubeProxyMidstream, "taken_over")
		if nf, err := counters.NFForgotten(); err == nil {
			counter(ch, dNFForgotten, nf.TakenOver, "taken_over")
			counter(ch, dNFForgotten, nf.HandedOver, "handed_over")
		}
		counter(ch, dUnproven, gs.SynDoomed, "syn_doomed")
		counter(ch, dUnproven, gs.SynDuplicate, "syn_duplicate")
		counter(ch, dUnproven, gs.ReplyWrongSide, "reply_wrong_side")
		counter(ch, dUnproven, gs.ReplyBadChecksum, "reply_bad_checksum")
		counter(ch, dUnproven, gs.ReplyUnacked, "reply_unacked")
		counter(ch, dUnproven, gs.ClientRstIgnored, "client_rst_ignored")
	} else {
		c.log.Warn("metrics: read pb_stats_v2", "err", err)
	}
	if g, err := counters.SYNGuardStats(); err == nil {
		counter(ch, dSYNGuard, g.Trusted, "trusted")
		counter(ch, dSYNGuard, g.Admitted, "admitted")
		counter(ch, dSYNGuard, g.Dropped, "dropped")
		counter(ch, dSYNArmed, g.Armed)
	} else {
		c.log.Warn("metrics: read pb_syn_guard_cpu", "err", err)
	}
	if n, max, err := counters.AffinityFill(); err == nil {
		gauge(ch, dAffinity, float64(n))
		gauge(ch, dAffinityMax, float64(max))
	} else {
		c.log.Warn("metrics: read pb_affinity", "err", err)
	}

	detail := BackendBasic
	if c.detail != nil {
		detail = BackendDetail(c.detail.Load())
	}
	names := map[uint32][]string{} // service id: its three label values
	endpoints := map[uint32]string{}
	for _, s := range c.src.Services() {
		ns, name, port := SplitService(s.Name)
		sl := []string{ns, name, port}
		names[s.ID] = sl
		gauge(ch, dCBMax, float64(s.MaxInflight), sl...)
		reason, _, _ := strings.Cut(s.Served, ":")
		if reason == "" {
			reason = "config"
		}
		gauge(ch, dServed, 1, append(sl, reason)...)
		gauge(ch, dInflight, float64(s.Inflight), sl...)
		if st, err := counters.ServiceStats(s.ID); err == nil {
			counter(ch, dSvcPackets, st.Packets, sl...)
			counter(ch, dSvcBytes, st.Bytes, sl...)
			counter(ch, dSvcFlows, st.Flows, sl...)
			counter(ch, dSvcNoBackend, st.NoBackend, sl...)
			counter(ch, dCBRejected, st.OverLimit, sl...)
		}
		for _, b := range s.Backends {
			endpoints[b.ID] = b.Endpoint
			if b.Removed || detail != BackendDetailed {
				continue
			}
			if st, err := counters.BackendStats(b.ID); err == nil {
				bl := append(slices.Clone(sl), b.Endpoint)
				counter(ch, dBePackets, st.Packets, bl...)
				counter(ch, dBeBytes, st.Bytes, bl...)
				counter(ch, dBeFlows, st.Flows, bl...)
				counter(ch, dBeRPackets, st.ReplyPackets, bl...)
				counter(ch, dBeRBytes, st.ReplyBytes, bl...)
			}
		}
	}

	for _, s := range c.src.Accrual() {
		sl, ok := names[s.ID]
		if !ok {
			continue
		}
		with := func(l ...string) []string { return append(slices.Clone(sl), l...) }
		gauge(ch, dEndpoints, float64(s.Ready), with("ready")...)
		gauge(ch, dEndpoints, float64(s.Ejected), with("ejected")...)
		gauge(ch, dEndpoints, float64(s.Probation), with("probation")...)
		fo := 0.0
		if s.FailOpen {
			fo = 1
		}
		gauge(ch, dFailOpen, fo, sl...)
		counter(ch, dFailOpenEps, s.FailOpenEpisodes, sl...)
		if detail == BackendNone {
			continue
		}
		for _, e := range s.Endpoints {
			ep, ok := endpoints[e.ID]
			if !ok {
				ep = "id-" + strconv.FormatUint(uint64(e.ID), 10)
			}
			bl := with(ep)
			out := 0.0
			if e.State != accrual.Ready {
				out = 1
			}
			f := e.Counters.Failures
			gauge(ch, dEpEjected, out, bl...)
			counter(ch, dEpEjections, e.Counters.Ejections, bl...)
			counter(ch, dEpRestores, e.Counters.ProbeSuccesses, bl...)
			counter(ch, dEpSuccesses, e.Counters.Successes, bl...)
			counter(ch, dEpFailures, f.Refused+f.Timeout+f.Reset+f.ResetAfterData, bl...)
			if detail != BackendDetailed {
				continue
			}
			bk := func(l ...string) []string { return append(slices.Clone(bl), l...) }
			counter(ch, dEpFailKinds, f.Refused, bk("refused")...)
			counter(ch, dEpFailKinds, f.Timeout, bk("timeout")...)
			counter(ch, dEpFailKinds, f.Reset, bk("reset")...)
			counter(ch, dEpFailKinds, f.ResetAfterData, bk("reset-after-data")...)
			counter(ch, dEpProbes, e.Counters.ProbeSuccesses, bk("success")...)
			counter(ch, dEpProbes, e.Counters.ProbeFailures, bk("failure")...)
			counter(ch, dEpProbes, e.Counters.ProbeInconclusive, bk("inconclusive")...)
			counter(ch, dEpSuppressed, e.Counters.SuppressedEjections, bl...)
			for _, r := range accrual.EjectReasons() {
				counter(ch, dEpByReason, e.Counters.EjectionsBy.Of(r), bk(string(r))...)
			}
			counter(ch, dEpSlow, e.Counters.SlowConnects, bl...)
			if w := e.Window; w != nil {
				gauge(ch, dEpWinCalls, float64(w.Calls), bl...)
				gauge(ch, dEpWinRate, w.FailureRate, bl...)
				gauge(ch, dEpWinSlow, w.SlowRate, bl...)
			}
		}
	}
}
