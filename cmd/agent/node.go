// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/penaltybox/penaltybox/pkg/admin"
	"github.com/penaltybox/penaltybox/pkg/agent"
	"github.com/penaltybox/penaltybox/pkg/datapath"
)

// node is one agent process: the agent over the datapath, and the HTTP
// surface.
type node struct {
	*agent.Node
	log      *slog.Logger
	httpDone <-chan error
}

// start loads (or adopts) the datapath, builds the agent over it and
// serves HTTP.
func start(ctx context.Context, o options, log *slog.Logger, tableSize uint32) (*node, error) {
	// Standalone, there is no kube-proxy to leave a service's old flows to.
	var takeover time.Duration
	if o.nodeName != "" {
		takeover = o.takeoverGrace
	}
	an, err := agent.Open(agent.NodeOptions{Datapath: o.dp, Log: log,
		TableSize: tableSize, MaxInflightDefault: o.maxInflightDefault, NoKernelTrips: !o.kernelTrips, NoKernelSweep: !o.kernelSweep,
		SYNGuard: o.synGuard, TrackerMemory: o.trackerMemory, Config: o.dpConfig, TakeoverGrace: takeover})
	if re := (*datapath.RootError)(nil); errors.As(err, &re) {
		return nil, fmt.Errorf("--bpffs-root %w", err)
	}
	if err != nil {
		return nil, err
	}
	n := &node{Node: an, log: log}
	n.Metrics().SetBackendDetail(o.backendMetrics)
	// The maps are charged to the container's cgroup now: fit the Go
	// runtime's share of its limit.
	fitMemoryLimit("/sys/fs/cgroup", log)
	srv := admin.New(n.Metrics().Registry, n.Ready, log)
	srv.JSON("/admin/services", func() any { return n.ServicesView() })
	srv.JSON("/admin/endpoints", func() any { return n.EndpointsView() })
	srv.JSON("/admin/circuit_breakers", func() any { return n.CircuitBreakersView() })
	addrs, httpDone, err := srv.Serve(ctx, o.metricsAddr, o.adminAddr)
	if err != nil {
		n.Close()
		return nil, err
	}
	n.httpDone = httpDone
	args := []any{"metrics_addr", addrs.Metrics.String()}
	if addrs.Admin != nil {
		args = append(args, "admin_addr", addrs.Admin.String())
	}
	log.Info("serving metrics and probes, and the admin views", args...)
	return n, nil
}

// stop waits for the HTTP server after the loop returned.
func (n *node) stop() error {
	n.log.Info("agent stopping; pinned datapath keeps forwarding", "bpffs_root", n.Datapath.Opts.Root)
	return n.waitHTTP()
}

func (n *node) waitHTTP() error {
	if n.httpDone != nil {
		return <-n.httpDone
	}
	return nil
}
