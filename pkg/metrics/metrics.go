// Package metrics exposes the agent on Prometheus: kernel counters and
// failure-accrual state are read at scrape time (so they cost nothing
// between scrapes), agent events are counted as they happen. Every name is
// prefixed penaltybox_ and uses base units.
package metrics

import (
	"log/slog"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

const ns = "penaltybox"

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
	Transitions        *prometheus.CounterVec
	PendingConnects    prometheus.Gauge
	PendingOverflow    prometheus.Counter
	TrackedFlows       prometheus.Gauge
	TrackedFlowsLimit  prometheus.Gauge
	UntrackedFlows     *prometheus.CounterVec
	Withheld           *prometheus.CounterVec
	FloodMode          prometheus.Gauge
	SYNGuard           prometheus.Gauge
	ProbeRegrants      *prometheus.CounterVec
	InvalidSettings    *prometheus.CounterVec
	ConntrackEntries   prometheus.Gauge
	ConntrackExpired   prometheus.Counter
	MaxInflightDefault prometheus.Gauge
	KernelTrips        *prometheus.CounterVec
	FlowsToEjected     *prometheus.CounterVec
	UnansweredUDP      *prometheus.CounterVec
	Replays            *prometheus.CounterVec
	PolicyStatusLeader prometheus.Gauge
	PolicyStatusWrites *prometheus.CounterVec
	// Fleet evidence (Kubernetes mode): reports and verdicts written, by
	// result; 1 while this agent aggregates the fleet's reports.
	FleetReportWrites  *prometheus.CounterVec
	FleetVerdictWrites *prometheus.CounterVec
	FleetAggregator    prometheus.Gauge
	FleetCondemned     prometheus.Gauge
}

// New registers every metric. src may be nil in tests that only need the
// event-driven ones.
func New(src Source, counters maps.Counters, log *slog.Logger) *Metrics {
	r := prometheus.NewRegistry()
	m := &Metrics{
		Registry: r,
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
		Transitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "accrual_transitions_total",
			Help: "Failure-accrual decisions by reason (consecutive-failures, probe-failed, penalty-over, probe-succeeded, fail-open-start, ...).",
		}, []string{"service", "reason"}),
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
		UntrackedFlows: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "untracked_flows_total",
			Help: "New flows the agent did not track, by service and reason: service_cap (the service already had its share of the node's tracked flows waiting for a verdict: one tenant's idle or half-open connections cannot take the node's) or memory_limit (the node's ceiling, --tracker-memory). The kernel's signals (a RST, a retransmitted SYN) still judge them; a SYN-ACK is their success, with no settling.",
		}, []string{"service", "reason"}),
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
		ProbeRegrants: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "probe_regrants_total",
			Help: "Fresh probes the probation watchdog granted, by reason: no_verdict (the kernel admitted a probe and no verdict came: its events were lost, or the datapath saw no answer), state_drift (the kernel's entry was not in probation).",
		}, []string{"service", "reason"}),
		InvalidSettings: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "invalid_settings_total",
			Help: "Invalid per-service settings rejected (config fields, annotations by key, BackendPolicies as \"BackendPolicy namespace/name\"); the last good setting stays in force.",
		}, []string{"service", "key"}),
		ConntrackEntries: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "conntrack_entries",
			Help: "Conntrack entries at the last sweep (two per flow). Near --conntrack-size, the LRU starts evicting live flows.",
		}),
		ConntrackExpired: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "conntrack_expired_flows_total",
			Help: "Idle flows the agent expired (their circuit-breaker slots released).",
		}),
		KernelTrips: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "kernel_trips_total",
			Help: "Endpoints the datapath ejected on its own at their maxFailures-th consecutive failure (kernel trips), by what the agent did: adopted (its ejection, with penalty and probation) or undone (accrual kept the endpoint in: max-ejection cap, fail-open).",
		}, []string{"service", "result"}),
		FlowsToEjected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "new_flows_to_ejected_total",
			Help: "New flows the datapath gave an endpoint the agent holds ejected (probes aside): flows admitted after the failure that decided the ejection, before the maps took it in. Kernel trips keep it at 0 for refusals and resets; a connect timeout (the agent's own deadline) or --kernel-trips=false leaves the agent's reaction time, during which new flows still reach the endpoint. Also counted: the odd flow another CPU admitted before a kernel trip whose event came first, and flows the fail-open table admitted as the service left fail-open.",
		}, []string{"service"}),
		UnansweredUDP: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "udp_unanswered_flows_total",
			Help: "UDP flows their endpoint had not answered by connectTimeout. Not failures (many UDP protocols never answer): a rise against the service's flows is a silent endpoint, which only a port unreachable or an answer lets accrual judge.",
		}, []string{"service"}),
		Replays: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "syn_replays_total",
			Help: "Client SYNs the agent sent again for the datapath to move to another backend (retryRefused), by reason (refused: the backend refused it; unanswered: the backend left it unanswered past the service's replay deadline) and result: sent; no_copy (another flow's SYN had taken its pb_syns slot: the client's own retransmission is moved instead); stale (read too late, or the flow had moved on); flood (not replayed in flood mode); error.",
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
	}
	r.MustRegister(m.Events, m.EventsUndecodable, m.ConfigReloads, m.ConfigLastSuccess, m.ConfigLastOK,
		m.ProgramErrors, m.Reaction, m.Transitions, m.PendingConnects, m.PendingOverflow, m.TrackedFlows, m.TrackedFlowsLimit, m.UntrackedFlows,
		m.Withheld, m.FloodMode, m.SYNGuard, m.ProbeRegrants,
		m.InvalidSettings, m.ConntrackEntries, m.ConntrackExpired,
		m.MaxInflightDefault, m.PolicyStatusLeader, m.PolicyStatusWrites, m.FleetReportWrites, m.FleetVerdictWrites, m.FleetAggregator, m.FleetCondemned, m.KernelTrips, m.FlowsToEjected, m.UnansweredUDP, m.Replays,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if src != nil {
		r.MustRegister(&collector{src: src, counters: counters, log: log})
	}
	// Every replay series exists from the start, so that the first replay
	// of each kind shows in increase().
	for _, reason := range []string{"refused", "unanswered"} {
		for _, result := range []string{"sent", "no_copy", "stale", "flood", "error"} {
			m.Replays.WithLabelValues(reason, result)
		}
	}
	return m
}

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(ns+"_"+name, help, labels, nil)
}

var (
	dSvcPackets   = desc("service_packets_total", "Client packets to the service's VIP forwarded to a backend.", "service")
	dSvcBytes     = desc("service_bytes_total", "Bytes of those packets (IP total length).", "service")
	dSvcFlows     = desc("service_flows_total", "New flows admitted to the service.", "service")
	dSvcNoBackend = desc("service_no_backend_flows_total", "New flows dropped because the service had no usable backend.", "service")
	dCBRejected   = desc("circuit_breaker_rejected_total", "New flows the service's circuit breaker refused (TCP: RST from the VIP; UDP: dropped). Never a backend's failure.", "service")

	dBePackets  = desc("backend_packets_total", "Client packets sent to the backend.", "service", "endpoint")
	dBeBytes    = desc("backend_bytes_total", "Bytes of those packets.", "service", "endpoint")
	dBeFlows    = desc("backend_flows_total", "New flows sent to the backend.", "service", "endpoint")
	dBeRPackets = desc("backend_reply_packets_total", "Backend replies reverse-NATed back to the VIP.", "service", "endpoint")
	dBeRBytes   = desc("backend_reply_bytes_total", "Bytes of those replies.", "service", "endpoint")

	dEventsLost   = desc("datapath_events_lost_total", "Outcome events the datapath could not deliver because the ring buffer was full.")
	dForwarded    = desc("datapath_forwarded_packets_total", "Rewritten packets by how they left XDP: redirect (bpf_redirect_map) or pass (kernel stack).", "method")
	dNoBackend    = desc("datapath_no_backend_flows_total", "New flows to a service that had no usable backend; dropped.")
	dProbes       = desc("datapath_probe_flows_total", "New flows admitted to an endpoint in probation (its probe).")
	dSteered      = desc("datapath_steered_flows_total", "New flows moved off a backend that was not active, by result (steered to an active one, or failed: none found).", "result")
	dRescued      = desc("datapath_probes_rescued_total", "Refused probes whose RST the datapath kept from the client: its SYN retransmission goes to another backend, so the client sees a delay, not a failure.")
	dRetried      = desc("datapath_refused_retried_total", "Refused new flows of services with retryRefused: the RST kept from the client (result=rescued), and their retransmitted SYNs re-picked avoiding the refusing backend (result=retried).", "result")
	dRepicked     = desc("datapath_repicked_flows_total", "Unanswered flows moved to another backend on the client's SYN retransmission because theirs was ejected.")
	dCTFail       = desc("datapath_conntrack_insert_failures_total", "Conntrack inserts that failed.")
	dICMP         = desc("datapath_icmp_translated_total", "ICMP errors about a NATed flow (fragmentation needed, port unreachable, time exceeded) translated so that their receiver matches them: quoting the VIP to the client, the backend to the backend.")
	dSYNGuard     = desc("datapath_syn_guard_syns_total", "SYNs to services while the SYN guard was on (pure SYNs from clients, whatever conntrack holds for their tuple; not the agent's replays), by verdict: trusted (the source proved itself lately: a backend sent it payload), admitted (untrusted, within the per-CPU budget), dropped (untrusted, over the budget: dropped in XDP).", "verdict")
	dSYNArmed     = desc("datapath_syn_guard_armed_total", "Times a CPU turned the SYN guard on by itself: in 100 ms more SYNs to services than --syn-guard-arm-rate allows, and a quarter as many again from untrusted sources (a flood, seen before the agent can tell); it stays on there for 1 s past the last such window.")
	dAffinity     = desc("datapath_affinity_clients", "Clients pb_affinity remembers for services with sessionAffinity ClientIP (one per service and client address, for the service's timeout after its last new connection).")
	dAffinityMax  = desc("datapath_affinity_clients_limit", "Clients pb_affinity can remember (--affinity-clients); past it the least recently seen are forgotten, and their next connection may go to another endpoint.")
	dMalformed    = desc("datapath_malformed_packets_total", "Packets to a service port too short or inconsistent to parse; passed unchanged.")
	dNFForgotten  = desc("datapath_conntrack_forgotten_total", "Entries of the kernel's conntrack the datapath expired where kube-proxy's path and its own meet, so that a client port used on one path works on the other: taken_over (kube-proxy's finished flow on a new flow's tuple, services within --takeover-grace), handed_over (a finished flow of the datapath's on the tuple of a new flow left to kube-proxy).", "why")
	dKubeProxy    = desc("datapath_kube_proxy_flows_total", "Packets the datapath left to kube-proxy, by why: handed_over (a new flow while the agent is away longer than --dead-man-timeout, or uninstalling), taken_over (a mid-stream packet of a flow kube-proxy began before the service was taken over, within --takeover-grace).", "why")
	dUnproven     = desc("datapath_unproven_packets_total", "Packets the datapath did not take as evidence of a backend's health, because a client (or a pod spoofing a backend) could have sent them, by reason: syn_doomed (a SYN no backend can accept: bad checksum, SYN|FIN, TTL <= 1, TCP-MD5/AO; passed unchanged, no flow), syn_duplicate (a pending flow's SYN again too soon or with another ISN: no timeout), reply_wrong_side (a reply from where the node does not route its backend: passed unchanged), reply_bad_checksum (a RST, SYN-ACK or ICMP error with a bad checksum), reply_unacked (a RST or SYN-ACK not acknowledging what the client sent, or a reset after a wrong handshake ACK), client_rst_ignored (a client's RST out of the backend's sequence: the flow keeps its breaker slot).", "reason")
	dEndpoints    = desc("endpoints", "Endpoints by failure-accrual state.", "service", "state")
	dEpState      = desc("endpoint_state", "1 for the endpoint's current failure-accrual state.", "service", "endpoint", "state")
	dEpFailures   = desc("endpoint_failures_total", "L4 failures seen per endpoint, by kind (counted or not).", "service", "endpoint", "kind")
	dEpSuccesses  = desc("endpoint_connects_total", "Successful connects (SYN-ACK) per endpoint.", "service", "endpoint")
	dEpEjections  = desc("endpoint_ejections_total", "Times the endpoint was ejected.", "service", "endpoint")
	dEpProbes     = desc("endpoint_probes_total", "Probation probes by result (success, failure, inconclusive).", "service", "endpoint", "result")
	dEpSuppressed = desc("endpoint_ejections_suppressed_total", "Ejections the max-ejection-percent cap prevented.", "service", "endpoint")
	dEpByReason   = desc("endpoint_ejections_by_reason_total", "Times the endpoint was ejected since the agent started, by the rule that ejected it (consecutive-failures, probe-failed, failure-rate, slow-connects, success-rate-outlier, fleet).", "service", "endpoint", "reason")
	dEpSlow       = desc("endpoint_slow_connects_total", "Successful connects whose handshake took at least the service's slowConnectThreshold.", "service", "endpoint")
	dEpWinCalls   = desc("endpoint_window_connections", "Connections in the endpoint's accrual window (services with window rules only).", "service", "endpoint")
	dEpWinRate    = desc("endpoint_window_failure_rate", "Share of counted failures in the endpoint's accrual window, as the failure-rate rule judges it.", "service", "endpoint")
	dEpWinSlow    = desc("endpoint_window_slow_rate", "Share of slow connects in the endpoint's accrual window.", "service", "endpoint")
	dCBMax        = desc("circuit_breaker_max_inflight", "Live flows the service may hold (0: no limit).", "service")
	dServed       = desc("service_served", "1 for each service the agent serves, by why: scope-all, service-label, namespace-label, backend-policy (Kubernetes mode), config (a config file). A Service not listed is kube-proxy's.", "service", "reason")
	dInflight     = desc("inflight_connections", "Live flows of the service counted by its circuit breaker (0 while it has no limit).", "service")
	dFailOpen     = desc("service_fail_open", "1 while the service fails open (no endpoint ready: new flows go to all endpoints).", "service")
	dFailOpenEps  = desc("service_fail_open_episodes_total", "Times the service started failing open.", "service")
)

type collector struct {
	src      Source
	counters maps.Counters
	log      *slog.Logger
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{dSvcPackets, dSvcBytes, dSvcFlows, dSvcNoBackend, dCBRejected, dBePackets, dBeBytes,
		dBeFlows, dBeRPackets, dBeRBytes, dEventsLost, dForwarded, dNoBackend, dProbes, dSteered, dRepicked, dRescued, dRetried,
		dCTFail, dMalformed, dUnproven, dKubeProxy, dNFForgotten, dICMP, dSYNGuard, dSYNArmed, dAffinity, dAffinityMax, dEndpoints, dEpState, dEpFailures, dEpSuccesses, dEpEjections, dEpProbes,
		dEpSuppressed, dEpByReason, dEpSlow, dEpWinCalls, dEpWinRate, dEpWinSlow, dFailOpen, dFailOpenEps, dCBMax, dServed, dInflight} {
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
	if gs, err := c.counters.GlobalStats(); err == nil {
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
		if nf, err := c.counters.NFForgotten(); err == nil {
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
	if g, err := c.counters.SYNGuardStats(); err == nil {
		counter(ch, dSYNGuard, g.Trusted, "trusted")
		counter(ch, dSYNGuard, g.Admitted, "admitted")
		counter(ch, dSYNGuard, g.Dropped, "dropped")
		counter(ch, dSYNArmed, g.Armed)
	} else {
		c.log.Warn("metrics: read pb_syn_guard_cpu", "err", err)
	}
	if n, max, err := c.counters.AffinityFill(); err == nil {
		gauge(ch, dAffinity, float64(n))
		gauge(ch, dAffinityMax, float64(max))
	} else {
		c.log.Warn("metrics: read pb_affinity", "err", err)
	}

	names := map[uint32]string{}
	endpoints := map[uint32]string{}
	for _, s := range c.src.Services() {
		names[s.ID] = s.Name
		gauge(ch, dCBMax, float64(s.MaxInflight), s.Name)
		reason, _, _ := strings.Cut(s.Served, ":")
		if reason == "" {
			reason = "config"
		}
		gauge(ch, dServed, 1, s.Name, reason)
		gauge(ch, dInflight, float64(s.Inflight), s.Name)
		if st, err := c.counters.ServiceStats(s.ID); err == nil {
			counter(ch, dSvcPackets, st.Packets, s.Name)
			counter(ch, dSvcBytes, st.Bytes, s.Name)
			counter(ch, dSvcFlows, st.Flows, s.Name)
			counter(ch, dSvcNoBackend, st.NoBackend, s.Name)
			counter(ch, dCBRejected, st.OverLimit, s.Name)
		}
		for _, b := range s.Backends {
			endpoints[b.ID] = b.Endpoint
			if b.Removed {
				continue
			}
			if st, err := c.counters.BackendStats(b.ID); err == nil {
				counter(ch, dBePackets, st.Packets, s.Name, b.Endpoint)
				counter(ch, dBeBytes, st.Bytes, s.Name, b.Endpoint)
				counter(ch, dBeFlows, st.Flows, s.Name, b.Endpoint)
				counter(ch, dBeRPackets, st.ReplyPackets, s.Name, b.Endpoint)
				counter(ch, dBeRBytes, st.ReplyBytes, s.Name, b.Endpoint)
			}
		}
	}

	for _, s := range c.src.Accrual() {
		name, ok := names[s.ID]
		if !ok {
			continue
		}
		gauge(ch, dEndpoints, float64(s.Ready), name, "ready")
		gauge(ch, dEndpoints, float64(s.Ejected), name, "ejected")
		gauge(ch, dEndpoints, float64(s.Probation), name, "probation")
		fo := 0.0
		if s.FailOpen {
			fo = 1
		}
		gauge(ch, dFailOpen, fo, name)
		counter(ch, dFailOpenEps, s.FailOpenEpisodes, name)
		for _, e := range s.Endpoints {
			ep, ok := endpoints[e.ID]
			if !ok {
				ep = "id-" + strconv.FormatUint(uint64(e.ID), 10)
			}
			for _, st := range []accrual.State{accrual.Ready, accrual.Ejected, accrual.Probation} {
				v := 0.0
				if e.State == st {
					v = 1
				}
				gauge(ch, dEpState, v, name, ep, st.String())
			}
			f := e.Counters.Failures
			counter(ch, dEpFailures, f.Refused, name, ep, "refused")
			counter(ch, dEpFailures, f.Timeout, name, ep, "timeout")
			counter(ch, dEpFailures, f.Reset, name, ep, "reset")
			counter(ch, dEpFailures, f.ResetAfterData, name, ep, "reset-after-data")
			counter(ch, dEpSuccesses, e.Counters.Successes, name, ep)
			counter(ch, dEpEjections, e.Counters.Ejections, name, ep)
			counter(ch, dEpProbes, e.Counters.ProbeSuccesses, name, ep, "success")
			counter(ch, dEpProbes, e.Counters.ProbeFailures, name, ep, "failure")
			counter(ch, dEpProbes, e.Counters.ProbeInconclusive, name, ep, "inconclusive")
			counter(ch, dEpSuppressed, e.Counters.SuppressedEjections, name, ep)
			for _, r := range accrual.EjectReasons() {
				counter(ch, dEpByReason, e.Counters.EjectionsBy.Of(r), name, ep, string(r))
			}
			counter(ch, dEpSlow, e.Counters.SlowConnects, name, ep)
			if w := e.Window; w != nil {
				gauge(ch, dEpWinCalls, float64(w.Calls), name, ep)
				gauge(ch, dEpWinRate, w.FailureRate, name, ep)
				gauge(ch, dEpWinSlow, w.SlowRate, name, ep)
			}
		}
	}
}
