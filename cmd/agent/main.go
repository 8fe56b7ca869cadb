// SPDX-License-Identifier: Apache-2.0

// Command agent is penaltybox's node agent. It programs the XDP datapath
// from a desired state (a config file, or Kubernetes), watches the L4
// outcome of every new connection, and takes endpoints that keep failing
// out of their service for a penalty that backs off, until one real
// connection proves them healthy again.
//
//	agent --config FILE [--metrics-addr :9464]   standalone (/admin/* on 127.0.0.1:9465)
//	agent --node-name NODE [--kubeconfig FILE]   Kubernetes (a DaemonSet)
//	agent teardown [--bpffs-root DIR] [--then-wait]  detach and unpin everything
//	agent version                               version, git revision, Go version
//
// This package holds only flags, the wiring of the two modes and the
// process's lifecycle; the decisions are pkg/agent's. Read top-down:
// main.go (flags) → standalone.go or kubernetes.go (a mode: where desired
// state comes from) → node.go (the datapath, the agent over it, HTTP).
// The loop itself, desired state → maps → kernel → outcomes → accrual →
// maps, is pkg/agent's Run.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"os"
	"os/signal"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/penaltybox/penaltybox/pkg/agent"
	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/k8s"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/metrics"
	"github.com/penaltybox/penaltybox/pkg/nodelinks"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// defaultMemoryLimit is the agent's soft heap limit (GOMEMLIMIT overrides).
const defaultMemoryLimit = 96 << 20

type options struct {
	configPath string
	// Kubernetes mode (--node-name): the API server, and the interfaces
	// that get XDP.
	nodeName       string
	kubeconfig     string
	apiCompression bool
	nodeIfaces     []string
	nodeIfacesAuto bool
	podIfaces      []string
	tunnelIfaces   []string
	ipipIfaces     []string
	// leaseNamespace holds the Lease that picks the one agent writing the
	// BackendPolicies' status.
	leaseNamespace string
	// fleet: share failure-rate evidence with the other nodes through the
	// API (EndpointReports, EndpointVerdicts), reported every fleetInterval.
	fleet         bool
	fleetInterval time.Duration

	metricsAddr string
	adminAddr   string
	bpffsRoot   string
	logLevel    string
	dp          datapath.Options
	// maxInflightDefault is the circuit-breaker limit of services that set
	// none (a config file's defaults.maxInflight overrides it); 0: none.
	maxInflightDefault uint32
	// kernelTrips: the datapath ejects a backend at its deciding failure
	// (the agent adopts it); off, the agent's accrual alone does.
	kernelTrips bool
	// kernelSweep: the conntrack sweep runs in the kernel (pb_ct_sweep_run);
	// off, the agent sweeps a copy of the table.
	kernelSweep bool
	// synGuard: the SYN guard's budget and trust (Rate 0: no guard).
	synGuard maps.SYNGuard
	// dpConfig: the datapath's settings: what it takes as a backend's
	// answer, the flow hash's seed (0: Kubernetes mode, the cluster's
	// Secret; standalone, the pinned datapath's or a random one), the
	// dead-man's bound.
	dpConfig     maps.Config
	hashSeedFile string
	// Kubernetes mode: scope (scopeOptIn or scopeAll), how long a service
	// just taken from kube-proxy leaves its old flows to it, and how long
	// an uninstall waits for the flows here to end.
	scope         string
	takeoverGrace time.Duration
	uninstallWait time.Duration
	// kubeProxyAddr is kube-proxy's metrics server, asked its mode at
	// start ("": not asked).
	kubeProxyAddr string
	// podName is the agent's pod (asked on SIGTERM whether its DaemonSet
	// is being deleted).
	podName string
	// trackerMemory: the ceiling of the tracked flows' memory, in bytes.
	trackerMemory int64
	// backendMetrics: how many series each backend gets (--backend-metrics).
	backendMetrics metrics.BackendDetail
}

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "teardown":
			os.Exit(teardown(os.Args[2:]))
		case "inspect":
			os.Exit(inspectCmd(os.Args[2:], os.Stdout, os.Stderr))
		case "version":
			os.Exit(versionCmd(os.Args[2:], os.Stdout, os.Stderr))
		}
	}
	opts, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "agent:", err)
		os.Exit(2)
	}
	log := newLogger(opts.logLevel)
	// A soft heap limit keeps the agent's footprint steady on a node; an
	// operator's GOMEMLIMIT wins (the DaemonSet's is the container's
	// limit, which fitMemoryLimit narrows to the Go runtime's share once
	// the maps are loaded). The GC works harder near it, never fails.
	if os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(defaultMemoryLimit)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	stopProfile := cpuProfile(log)
	err = run(ctx, opts, log)
	stopProfile()
	if err != nil {
		log.Error("agent failed", "err", err)
		fmt.Fprintln(os.Stderr, "agent:", err)
		os.Exit(1)
	}
}

// cpuProfile writes a CPU profile (go tool pprof) of the whole run to the
// file $PENALTYBOX_CPU_PROFILE names, when it is set: how the control-plane
// bench finds where the agent's time goes; a heap profile is written beside
// it (.heap) at the end. It returns the function that ends the profile.
func cpuProfile(log *slog.Logger) func() {
	path := os.Getenv("PENALTYBOX_CPU_PROFILE")
	if path == "" {
		return func() {}
	}
	f, err := os.Create(path)
	if err == nil {
		err = pprof.StartCPUProfile(f)
	}
	if err != nil {
		log.Warn("no CPU profile", "path", path, "err", err)
		return func() {}
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
		// And what the heap holds at the end, beside it.
		if h, err := os.Create(path + ".heap"); err == nil {
			pprof.Lookup("heap").WriteTo(h, 0)
			h.Close()
		}
	}
}

// run starts the agent in the mode the flags select and runs its loop
// until ctx ends.
func run(ctx context.Context, o options, log *slog.Logger) error {
	// Pre-flight: a kernel without what the datapath uses is refused in
	// one line, before the verifier's dump would say it less clearly.
	if err := datapath.CheckKernel(datapath.KernelFeatures); err != nil {
		return err
	}
	if o.configPath != "" {
		return runStandalone(ctx, o, log)
	}
	return runKubernetes(ctx, o, log)
}

func parseFlags(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	fs.StringVar(&o.configPath, "config", "", "standalone mode: the YAML file with interfaces and services (SIGHUP reloads it)")
	fs.StringVar(&o.nodeName, "node-name", "", "Kubernetes mode: this node's name (from the downward API); Services and EndpointSlices come from the API server")
	fs.StringVar(&o.leaseNamespace, "lease-namespace", cmp.Or(os.Getenv("POD_NAMESPACE"), "penaltybox-system"),
		"Kubernetes mode: namespace of the Lease that picks the one agent writing BackendPolicy status (default $POD_NAMESPACE, else penaltybox-system)")
	fs.BoolVar(&o.fleet, "fleet-evidence", true, "Kubernetes mode: judge failure rates on every node's evidence too, for endpoints each node sees too little of (needs deploy/fleet-crd.yaml; a Service opts out with penaltybox.io/failure-accrual-fleet-evidence: \"false\")")
	fs.DurationVar(&o.fleetInterval, "fleet-report-interval", 5*time.Second, "Kubernetes mode: how often this node writes its EndpointReport at most (more rarely when it is big: 200 bytes/s per node)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "Kubernetes mode: kubeconfig file (default: the pod's service account)")
	fs.BoolVar(&o.apiCompression, "api-compression", false, "Kubernetes mode: ask the API server for gzipped responses: fewer bytes, more CPU on both sides (off, as kube-controller-manager has it; on only over a slow link to the API server; a kubeconfig's disable-compression still wins)")
	nodeIfaces := fs.String("node-interfaces", nodelinks.Auto, `Kubernetes mode: the node's external interfaces, comma-separated names or globs; "auto" is the interfaces of the default routes, "" none`)
	podIfaces := fs.String("pod-interfaces", nodelinks.DefaultPodPatterns, "Kubernetes mode: globs of the host-side pod interface names (veths), comma-separated")
	ipipIfaces := fs.String("ipip-interfaces", nodelinks.DefaultIPIPPatterns, `Kubernetes mode: globs of the pod network's IPIP tunnel devices (Calico's tunl0): replies from pods on other nodes arrive on the node's uplinks inside IPIP packets, rewritten there, and must come from the node the route through the tunnel names; "" none`)
	tunnelIfaces := fs.String("tunnel-interfaces", nodelinks.DefaultTunnelPatterns, `Kubernetes mode: globs of the overlay pod network's VXLAN devices (replies from pods on other nodes arrive there), comma-separated; "" none`)
	fs.StringVar(&o.metricsAddr, "metrics-addr", ":9464", "address for /metrics, /healthz and /readyz (every interface by default; the DaemonSet binds the pod's IP)")
	fs.StringVar(&o.adminAddr, "admin-addr", "127.0.0.1:9465", `address for the read-only, unauthenticated /admin/* JSON views: loopback by default (kubectl port-forward reaches it); "" serves none`)
	fs.StringVar(&o.bpffsRoot, "bpffs-root", datapath.DefaultRoot, "directory on a bpffs for the pinned maps and links; they must outlive the agent, so a bpffs is mounted only in the host's mount namespace, on /sys/fs/bpf or an empty directory, when none is there")
	fs.BoolVar(&o.kernelSweep, "kernel-sweep", true, "the conntrack sweep (every 10 s: idle flows expired, the breaker's slots of vanished flows released) runs in the kernel, without copying the table. Each of its walks is one system call that, on a kernel without full preemption (PREEMPT_NONE or PREEMPT_VOLUNTARY, the usual defaults), keeps its CPU until it returns: up to about 100 ms at a full default table on a 2.8 GHz guest, during which other tasks on that CPU (ksoftirqd too) wait. false: the agent copies the table in batches, at about twice the agent's CPU for the sweep")
	fs.BoolVar(&o.kernelTrips, "kernel-trips", true, "the datapath ejects an endpoint itself at the failure that decides it, before the agent reacts; false: the agent alone ejects (about a millisecond later, new flows still reach the endpoint meanwhile)")
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.Func("backend-metrics", `series per backend (a service's endpoint) on /metrics: "basic", 5 (ejected now, ejections, restores, connects, failures); "detailed", also failures by kind, probes, ejections by reason, slow connects, window rates and traffic (20 more, 23 with window rules); "none", only the per-service series (default basic)`,
		func(s string) (err error) { o.backendMetrics, err = metrics.ParseBackendDetail(s); return err })
	// uintFlag parses flag name as a uint32 from lo to hi into p.
	uintFlag := func(p *uint32, name, help string, lo, hi uint64) {
		fs.Func(name, help, func(s string) error {
			if v, err := strconv.ParseUint(s, 10, 32); err == nil && v >= lo && v <= hi {
				*p = uint32(v)
				return nil
			}
			switch {
			case hi < math.MaxUint32:
				return fmt.Errorf("want an integer from %d to %d, got %q", lo, hi, s)
			case lo > 0:
				return fmt.Errorf("want a positive integer, got %q", s)
			}
			return fmt.Errorf("want a non-negative integer, got %q", s)
		})
	}
	uintFlag(&o.synGuard.Rate, "syn-guard-rate", fmt.Sprintf("in flood mode, SYNs opening new flows from sources that have not proved themselves lately (no backend sent them payload within --syn-guard-trust) that each CPU admits a second (a node admits up to its CPUs times this); the rest are dropped in XDP. 0: no guard, every SYN is forwarded (default %d)", defaultSYNGuardRate), 0, maxSYNGuardRate)
	fs.DurationVar(&o.synGuard.Trust, "syn-guard-trust", time.Hour, "how long a source stays trusted by the SYN guard after a backend last sent it payload")
	uintFlag(&o.synGuard.ArmRate, "syn-guard-arm-rate", fmt.Sprintf("SYNs to services per second on one CPU (counted over 100 ms) beyond which that CPU turns the SYN guard on by itself, before the agent's flood mode can, once a quarter as many again come from untrusted sources; 0: only flood mode turns it on; no effect with --syn-guard-rate 0 (default %d)", defaultSYNGuardArmRate), 0, math.MaxUint32)
	o.synGuard.Rate, o.synGuard.ArmRate = defaultSYNGuardRate, defaultSYNGuardArmRate
	max := func(p *uint32, name string, def uint32, help string) {
		uintFlag(p, name, fmt.Sprintf("%s (default %d)", help, def), 1, math.MaxUint32)
	}
	uintFlag(&o.maxInflightDefault, "max-inflight-default", "live flows a service may hold unless it sets its own limit (config defaults.maxInflight, annotation penaltybox.io/max-inflight); 0: no limit (default 0)", 0, math.MaxUint32)
	max(&o.dp.MaxServices, "max-services", datapath.DefaultMaxServices, "size of the services maps")
	max(&o.dp.MaxBackends, "max-backends", datapath.DefaultMaxBackends, "size of the backends maps (one entry per service endpoint)")
	max(&o.dp.ConntrackSize, "conntrack-size", datapath.DefaultConntrackSize, "conntrack entries, two per flow: at least twice the open flows plus 20 s of TCP connections that end otherwise than by a FIN each way, the second acknowledging the first (resets, FINs that cross; those leave at their last ACK) and 70 s of UDP flows (full, its LRU evicts live flows)")
	max(&o.dp.EventsBytes, "events-bytes", datapath.DefaultEventsBytes, "ring buffer bytes for outcome events (power of two)")
	max(&o.dp.AffinityClients, "affinity-clients", datapath.DefaultAffinityClients, "clients remembered for sessionAffinity ClientIP, one per service and client address; past it the least recently seen are forgotten")
	fs.BoolVar(&o.dpConfig.ReversePath, "reverse-path-check", true, "a backend's reply counts as its answer (refused, reset, accepted) only if it arrived where the node routes that backend, as the kernel's strict rp_filter rule has it: no pod can answer for another; false only where replies come back another way (asymmetric routing)")
	fs.DurationVar(&o.dpConfig.SYNRetransMinAge, "syn-retransmit-min-age", 200*time.Millisecond, "a pending connection's SYN seen again sooner than this after the first is a duplicate, not the client's retransmission, and no timeout (Linux retransmits a SYN after 1s; 200ms is its smallest retransmission timeout)")
	fs.DurationVar(&o.dpConfig.DeadMan, "dead-man-timeout", 30*time.Second, "with no heartbeat from the agent for this long (it crashed, hangs or was removed without a clean-up), the datapath hands every new flow to kube-proxy and lets the flows it has finish; the agent takes new flows back once it runs again. Longer than any restart; 0: never")
	fs.StringVar(&o.scope, "scope", scopeOptIn, `Kubernetes mode: which Services the agent serves: "opt-in", those labelled penaltybox.io/enabled: "true", in a namespace so labelled, or targeted by a BackendPolicy (a Service labelled "false" never); "all", every eligible Service. The rest are left to kube-proxy`)
	fs.DurationVar(&o.takeoverGrace, "takeover-grace", 6*time.Hour, "Kubernetes mode: for this long after a Service is first served, a TCP packet of a flow the datapath has no entry for is left to kube-proxy (a connection kube-proxy began before); 0: taken at once (such connections break)")
	fs.StringVar(&o.kubeProxyAddr, "kube-proxy-metrics-addr", "127.0.0.1:10249", "Kubernetes mode: kube-proxy's --metrics-bind-address on this node, asked at start which mode it runs in: the Services the agent does not serve, and new flows while its dead-man's switch has tripped, are left to kube-proxy, so a node without one gets a warning; empty: not asked")
	fs.StringVar(&o.podName, "pod-name", os.Getenv("POD_NAME"), "Kubernetes mode: this agent's pod (default $POD_NAME, from the downward API): told to stop, the agent looks up its DaemonSet to tell a restart (the datapath stays) from the install's removal (it goes); none: every stop is a restart")
	fs.DurationVar(&o.uninstallWait, "uninstall-drain", 20*time.Second, "Kubernetes mode: when the agent's DaemonSet is deleted, how long the agent hands new flows to kube-proxy and waits for the flows here to end before it removes the datapath (keep it under the pod's terminationGracePeriodSeconds)")
	fs.StringVar(&o.hashSeedFile, "hash-seed-file", "", "a file whose bytes seed the flow hash, the same on every node (default: Kubernetes mode, the Secret penaltybox-hash-seed in the agent's namespace, created when missing; standalone, the seed the pinned datapath has, or a random one)")
	o.trackerMemory = agent.DefaultTrackerMemory
	fs.Func("tracker-memory", fmt.Sprintf("ceiling of the memory of the flows the agent tracks (connects waiting for an answer, connections settling), as a Kubernetes quantity (64Mi) or bytes: %d bytes a flow, a sixteenth of them for each service at most; beyond it new flows are judged only by the kernel's signals (default %s)",
		outcomes.EntryBytes, resource.NewQuantity(agent.DefaultTrackerMemory, resource.BinarySI)), func(s string) error {
		q, err := resource.ParseQuantity(s)
		if err != nil || q.Value() < minTrackerMemory || q.Value() > maxTrackerMemory {
			return fmt.Errorf("want a quantity from 1Mi to 16Gi, got %q", s)
		}
		o.trackerMemory = q.Value()
		return nil
	})
	fs.StringVar(&o.dp.XDPMode, "xdp-mode", datapath.XDPAuto, `how the program attaches: "auto" generic XDP on veths (no NAPI ring to overflow under a flood), native elsewhere; "native" native wherever the driver has it, veths included; "generic" generic everywhere. A pinned link the agent adopts keeps its mode`)
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	switch {
	case o.configPath == "" && o.nodeName == "":
		return o, errors.New("--config FILE (standalone) or --node-name NODE (Kubernetes) is required")
	case o.configPath != "" && o.nodeName != "":
		return o, errors.New("--config and --node-name are exclusive: standalone or Kubernetes mode, not both")
	}
	var err error
	if o.nodeIfaces, o.nodeIfacesAuto, err = nodelinks.ParseExternal(*nodeIfaces); err != nil {
		return o, fmt.Errorf("--node-interfaces: %w", err)
	}
	if o.podIfaces, err = nodelinks.ParsePatterns(*podIfaces); err != nil {
		return o, fmt.Errorf("--pod-interfaces: %w", err)
	}
	if o.fleetInterval < time.Second {
		return o, fmt.Errorf("--fleet-report-interval %v: must be at least 1s", o.fleetInterval)
	}
	if o.tunnelIfaces, err = nodelinks.ParsePatterns(*tunnelIfaces); err != nil {
		return o, fmt.Errorf("--tunnel-interfaces: %w", err)
	}
	if o.ipipIfaces, err = nodelinks.ParsePatterns(*ipipIfaces); err != nil {
		return o, fmt.Errorf("--ipip-interfaces: %w", err)
	}
	if _, err := parseLevel(o.logLevel); err != nil {
		return o, err
	}
	if err := datapath.CheckXDPMode(o.dp.XDPMode); err != nil {
		return o, fmt.Errorf("--xdp-mode: %w", err)
	}
	if o.scope != scopeOptIn && o.scope != scopeAll {
		return o, fmt.Errorf("--scope %q: want %s or %s", o.scope, scopeOptIn, scopeAll)
	}
	if o.dpConfig.DeadMan < 0 || (o.dpConfig.DeadMan > 0 && o.dpConfig.DeadMan < 5*time.Second) {
		return o, fmt.Errorf("--dead-man-timeout %v: want 0 (never) or at least 5s (the heartbeat is every second; a restart takes seconds)", o.dpConfig.DeadMan)
	}
	if o.takeoverGrace < 0 || o.uninstallWait < 0 {
		return o, errors.New("--takeover-grace and --uninstall-drain must not be negative")
	}
	if a := o.dpConfig.SYNRetransMinAge; a < 10*time.Millisecond || a > 3*time.Second {
		return o, fmt.Errorf("--syn-retransmit-min-age %v: want 10ms to 3s (a SYN is first retransmitted after 1s)", a)
	}
	if o.hashSeedFile != "" {
		b, err := os.ReadFile(o.hashSeedFile)
		if err != nil {
			return o, fmt.Errorf("--hash-seed-file: %w", err)
		}
		if len(b) < 4 {
			return o, fmt.Errorf("--hash-seed-file %s: %d bytes, want at least 4", o.hashSeedFile, len(b))
		}
		o.dpConfig.HashSeed = k8s.SeedOf(b)
	}
	if o.synGuard.Trust <= 0 {
		return o, fmt.Errorf("--syn-guard-trust %v: must be positive", o.synGuard.Trust)
	}
	// A tenth of a second's budget at once: a short burst of new clients
	// is not cut to the rate's spacing.
	o.synGuard.Burst = o.synGuard.Rate / 10
	if o.synGuard.Burst == 0 {
		o.synGuard.Burst = 1
	}
	o.dp.Root = o.bpffsRoot
	return o, nil
}

// --scope values.
const (
	scopeOptIn = "opt-in"
	scopeAll   = "all"
)

// defaultSYNGuardRate: a flood's untrusted SYNs that reach the backends
// per CPU a second while the guard is on; a few thousand cost a node
// little (the handshakes a small web server makes anyway) and leave new
// clients a way in.
const defaultSYNGuardRate = 2000

// defaultSYNGuardArmRate: new flows a second on one CPU that only a flood
// (or a node far busier than most) reaches; it limits only sources no
// backend has sent payload to lately.
const defaultSYNGuardArmRate = 20000

// maxSYNGuardRate: beyond a million a second per CPU the guard would
// admit all a CPU can receive anyway.
const maxSYNGuardRate = 1000000

// The --tracker-memory range: below 1Mi (1,638 flows) a busy service
// would go untracked; beyond 16Gi it bounds nothing a node has.
const (
	minTrackerMemory = 1 << 20
	maxTrackerMemory = 16 << 30
)

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return l, fmt.Errorf("--log-level: %q: want debug, info, warn or error", s)
	}
	return l, nil
}

func newLogger(level string) *slog.Logger {
	l, _ := parseLevel(level)
	return slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: l}))
}

func teardown(args []string) int {
	fs := flag.NewFlagSet("agent teardown", flag.ContinueOnError)
	root := fs.String("bpffs-root", datapath.DefaultRoot, "directory holding the pins")
	wait := fs.Bool("then-wait", false, "once done, wait for SIGTERM or SIGINT instead of exiting (a DaemonSet's pod must keep running: deploy/cleanup)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := newLogger("info")
	if err := datapath.Teardown(*root, log); err != nil {
		fmt.Fprintln(os.Stderr, "agent teardown:", err)
		return 1
	}
	log.Info("teardown complete", "root", *root)
	if *wait {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
		defer stop()
		<-ctx.Done()
	}
	return 0
}
