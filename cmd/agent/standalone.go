// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"github.com/penaltybox/penaltybox/pkg/config"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/nodelinks"
)

// runStandalone is the agent fed by a config file: SIGHUP reloads it.
func runStandalone(ctx context.Context, o options, log *slog.Logger) error {
	// 1. Desired state: a bad config file stops the start, naming the field.
	load := func() (*config.Config, error) {
		cfg, err := config.Load(o.configPath)
		if err == nil && cfg.MaxInflight == nil && o.maxInflightDefault > 0 {
			cfg.MaxInflight = &o.maxInflightDefault
		}
		return cfg, err
	}
	cfg, err := load()
	if err != nil {
		return err
	}
	// 2. Datapath, agent, HTTP.
	n, err := start(ctx, o, log, cfg.MaglevTableSize)
	if err != nil {
		return err
	}
	defer n.Close()
	// 3. Maps first (with the accrual state from before a restart), then
	// the XDP hooks; then outcomes start flowing. The hooks need the
	// program: a program the kernel refuses stops the agent before the
	// config's services are written (the datapath's settings are written
	// already, with the maps).
	if err := n.Datapath.LoadProgram(); err != nil {
		return err
	}
	if err := n.Apply(desiredState(cfg)); err != nil {
		return err
	}
	if err := n.Begin(); err != nil {
		return err
	}
	log.Info("datapath ready", "interfaces", cfg.Interfaces, "services", len(cfg.Services))
	n.PrepareTables()

	// The config's interfaces are named: one deleted and created again
	// (a new index), or bridged after the agent read it (a new master),
	// is attached and written again, as Kubernetes mode follows its links.
	// Both goroutines end before the datapath is closed (n.Close, deferred
	// above): a late FollowInterfaces would attach to a closed program.
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	links := make(chan nodelinks.Update)
	wg.Go(func() {
		if err := nodelinks.Watch(ctx, nodelinks.Options{External: []string{"*"}, Logger: log.With("component", "interfaces")}, links); err != nil {
			log.Error("interface watch stopped", "err", err)
		}
	})
	onLinks(ctx, &wg, links, func(u nodelinks.Update) { n.FollowInterfaces(u.Links) })

	// 4. SIGHUP reloads the config file; a bad one leaves the last good one
	// in force.
	reloads := make(chan desired.State, 1)
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				cfg, err := load()
				if err != nil {
					n.ConfigRejected(err)
					continue
				}
				reloads <- desiredState(cfg)
			}
		}
	}()

	// 5. The loop.
	n.Run(ctx, reloads)
	return n.stop()
}

// desiredState is a config file as the agent takes it: the services the
// file lists, and the node's interfaces and settings. Nothing of the
// file's format goes past here.
func desiredState(cfg *config.Config) desired.State {
	st := cfg.Desired()
	st.Node = &desired.Node{Interfaces: cfg.Interfaces, RedirectInterfaces: cfg.RedirectInterfaces,
		TableSize: cfg.MaglevTableSize}
	// The file's defaults.maxInflight, else the flag's (load fills it in).
	if cfg.MaxInflight != nil {
		st.Node.MaxInflightDefault = *cfg.MaxInflight
	}
	return st
}
