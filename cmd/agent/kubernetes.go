// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/penaltybox/penaltybox/pkg/agent"
	"github.com/penaltybox/penaltybox/pkg/config"
	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/k8s"
	"github.com/penaltybox/penaltybox/pkg/nodelinks"
)

// runKubernetes is the agent fed by the Kubernetes API (--node-name):
// Services and EndpointSlices are the desired state, XDP goes on the
// node's external interfaces and on every pod's veth as pods come and go,
// and accrual decisions become Events on the Services.
func runKubernetes(ctx context.Context, o options, log *slog.Logger) error {
	// client-go logs through klog: keep the agent's log one JSON stream.
	klog.SetSlogLogger(log)
	if err := preflightNode(ctx, o, log); err != nil {
		return err
	}
	clients, err := k8s.NewClients(o.kubeconfig, o.apiCompression)
	if err != nil {
		return err
	}
	// The agent stops when ctx ends (a signal) or when the controller
	// fails for good; the HTTP server started below stops with it.
	signalled := ctx
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The flow hash's seed, the cluster's: every node picks alike, and no
	// client can tell where its source port lands. Without it (RBAC, an
	// API server away), the node keeps the seed its datapath has.
	if o.dpConfig.HashSeed == 0 {
		if seed, err := k8s.HashSeed(ctx, clients.Core, o.leaseNamespace); err != nil {
			log.Warn("no cluster hash seed: this node keeps its own (picks differ across nodes)", "err", err)
		} else {
			o.dpConfig.HashSeed = seed
		}
	}
	// 1. The node: its interfaces and its own addresses, watched from now
	// on. The controller needs the addresses before its first snapshot.
	lopts := linkOptions(o, log)
	links := make(chan nodelinks.Update)
	go func() {
		if err := nodelinks.Watch(ctx, lopts, links); err != nil {
			log.Error("interface watch stopped", "err", err)
		}
	}()
	var firstLinks nodelinks.Update
	select {
	case firstLinks = <-links:
	case <-ctx.Done():
		return nil
	}

	// 2. Desired state: the lists begin now, and arrive while the maps
	// load (a third of a second at the default sizes, beside a list of
	// 10,000 Services that takes longer). The controller's first snapshot
	// is complete (all caches synced), so a restarted agent never drops a
	// service it had; applying it adopts the accrual state from before a
	// restart. BackendPolicies, when their CRD is installed; checked once,
	// at start.
	kopts := k8s.Options{
		NodeName:    o.nodeName,
		MaxInflight: o.maxInflightDefault,
		Scope:       k8s.Scope(o.scope),
		Logger:      log.With("component", "kubernetes"),
	}
	switch served, err := k8s.PoliciesServed(clients.Core.Discovery()); {
	case err != nil:
		return err
	case !served:
		log.Warn("BackendPolicy CRD not installed: Services are configured by annotations only; " +
			"apply deploy/backendpolicy-crd.yaml and restart the agents to use policies")
	default:
		kopts.Policies = clients.Dynamic
		kopts.Status = &k8s.StatusOptions{Client: clients.Core, Namespace: o.leaseNamespace, Identity: o.nodeName}
	}
	ctrl := k8s.New(clients.Core, kopts)
	ctrl.SetLocalAddrs(firstLinks.Addrs)
	ctrl.Start(ctx)

	n, err := start(ctx, o, log, config.DefaultMaglevTableSize)
	if err != nil {
		return err
	}
	defer n.Close()
	// The verifier (most of a second of one core) passes the program
	// meanwhile, at the lowest priority among the agent's threads (the
	// pod's cgroup is what it competes in): it takes what the lists and
	// the first state's writes leave idle. At the same priority it slowed
	// them as much as it saved on a 2-core node (bench/RESULTS-apiscale.md).
	n.Datapath.StartProgramLoad()
	m := n.Metrics()
	ctrl.SetMetrics(k8s.Metrics{InvalidSettings: m.InvalidSettings,
		PolicyStatusLeader: m.PolicyStatusLeader, PolicyStatusWrites: m.PolicyStatusWrites})
	n.SetNotify(func(t agent.Transition) { ctrl.Notify(k8s.Transition(t)) })
	states := make(chan desired.State)
	ctrlDone := make(chan error, 1)
	go func() { ctrlDone <- ctrl.Run(ctx, states) }()
	var first desired.State
	select {
	case first = <-states:
	case err := <-ctrlDone:
		if ctx.Err() != nil {
			return n.stop()
		}
		return fmt.Errorf("kubernetes: %w", err)
	case <-ctx.Done():
		return n.stop()
	}
	n.Apply(first)
	if err := n.PrefiltersWritten(); err != nil {
		return err
	}

	// 3. XDP hooks, once the maps hold the services and the verifier,
	// which ran meanwhile, passed the program; later changes as they come.
	// A program the kernel refuses stops the agent here, the previous
	// agent's program (if any) still attached and reading the first state
	// just written: the cluster's, in the maps' layouts it knows (a layout
	// change gets a new map name), as it would have written it itself.
	if _, err := n.Datapath.Program(); err != nil {
		return err
	}
	if err := n.NoRedirect(); err != nil {
		return err
	}
	attached := n.SyncLinks(firstLinks.Links, true)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	onLinks(ctx, &wg, links, func(u nodelinks.Update) {
		n.SyncLinks(u.Links, false)
		ctrl.SetLocalAddrs(u.Addrs)
	})

	// 4. Readiness, outcomes.
	if err := n.Begin(); err != nil {
		return err
	}
	log.Info("datapath ready", "mode", "kubernetes", "node", o.nodeName,
		"interfaces", attached, "services", len(first.Services))
	// Live: now the spare tables the first state's changes will fill
	// (events wait for them once, a tenth of a second at 10,000 services,
	// as they waited for the start before).
	n.PrepareTables()

	// Fleet evidence, once the agent judges: best effort, beside the loop.
	if o.fleet {
		switch served, err := k8s.FleetServed(clients.Core.Discovery()); {
		case err != nil:
			log.Warn("fleet evidence off: discovery failed", "err", err)
		case !served:
			log.Warn("fleet evidence off: CRDs not installed; apply deploy/fleet-crd.yaml and restart the agents to use it")
		default:
			m := n.Metrics()
			fo := k8s.FleetOptions{Dynamic: clients.Dynamic, Leases: clients.Core, Namespace: o.leaseNamespace,
				Node: o.nodeName, Interval: o.fleetInterval, Source: n.Agent, Logger: log.With("component", "fleet"),
				ReportWrites: m.FleetReportWrites, VerdictWrites: m.FleetVerdictWrites,
				Aggregator: m.FleetAggregator, Condemned: m.FleetCondemned}
			wg.Go(func() { k8s.RunFleet(ctx, fo) })
			log.Info("fleet evidence on", "report_interval", o.fleetInterval.String())
		}
	}

	// 5. The loop, fed by the controller.
	loopDone := make(chan struct{})
	go func() {
		// A controller that fails after its first snapshot ends the agent,
		// so that the kubelet restarts it rather than it serving stale state.
		select {
		case err := <-ctrlDone:
			if err != nil && ctx.Err() == nil {
				log.Error("kubernetes controller stopped", "err", err)
			}
			cancel()
		case <-loopDone:
		}
	}()
	n.Run(ctx, states)
	close(loopDone)

	// 6. Told to stop: a restart keeps the datapath (flows go on, the
	// next agent adopts it); the install being removed takes it away.
	if signalled.Err() != nil && o.podName != "" {
		qctx, qcancel := context.WithTimeout(context.Background(), 5*time.Second)
		removed, why := k8s.InstallRemoved(qctx, clients.Core, o.leaseNamespace, o.podName)
		qcancel()
		if removed {
			log.Info("the install is being removed: new flows go to kube-proxy, then the datapath goes",
				"why", why, "drain", o.uninstallWait.String())
			if err := n.Uninstall(o.uninstallWait); err != nil {
				log.Error("uninstall", "err", err)
			}
			return n.waitHTTP()
		}
		log.Info("stopping for a restart", "why", why)
	}
	return n.stop()
}

// preflightNode checks, before anything is loaded, what the agent needs of
// the node beyond the kernel (see run): interfaces its patterns select, and
// a kube-proxy to leave the rest to. What it cannot work without stops it
// with one line naming the flag to set; what only limits it is a warning.
func preflightNode(ctx context.Context, o options, log *slog.Logger) error {
	lopts := linkOptions(o, log)
	switch warn, err := nodelinks.Preflight(lopts); {
	case err != nil:
		return fmt.Errorf("--node-interfaces, --pod-interfaces: %w: the agent would see no Service traffic; "+
			"set them to this node's uplink and its CNI's host-side pod interfaces", err)
	case warn != "":
		log.Warn("--pod-interfaces "+warn+"; set it to the CNI's host-side pod interface names",
			"pod_interfaces", strings.Join(o.podIfaces, ","))
	}
	if !datapath.HaveNFKfuncs() {
		log.Warn("the kernel has no conntrack kfuncs (Linux 6.0 with BTF, nf_conntrack loaded): while a Service changes hands " +
			"between kube-proxy and penaltybox (opted in or out, the dead-man's switch, an uninstall), a connection from a client port " +
			"the other path used minutes before can fail")
	}
	if o.kubeProxyAddr == "" {
		return nil
	}
	mode, err := k8s.KubeProxyMode(ctx, o.kubeProxyAddr)
	if err != nil {
		log.Warn("no kube-proxy answers at --kube-proxy-metrics-addr: the Services this agent does not serve, "+
			"and new flows while its dead-man's switch has tripped, go to kube-proxy; make sure one (or a replacement) runs here",
			"addr", o.kubeProxyAddr, "err", err)
		return nil
	}
	log.Info("kube-proxy found", "mode", mode)
	return nil
}

// onLinks hands each update of the link watch to f, on a goroutine of wg,
// until ctx ends.
func onLinks(ctx context.Context, wg *sync.WaitGroup, links <-chan nodelinks.Update, f func(nodelinks.Update)) {
	wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case u := <-links:
				f(u)
			}
		}
	})
}

// linkOptions are the interfaces the flags select.
func linkOptions(o options, log *slog.Logger) nodelinks.Options {
	return nodelinks.Options{External: o.nodeIfaces, AutoExternal: o.nodeIfacesAuto, Pods: o.podIfaces,
		Tunnels: o.tunnelIfaces, IPIP: o.ipipIfaces, Logger: log.With("component", "interfaces")}
}
