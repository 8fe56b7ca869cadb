package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"

	"k8s.io/klog/v2"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/config"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/k8s"
	"github.com/penaltybox/penaltybox/pkg/nodelinks"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
)

// runKubernetes is the agent fed by the Kubernetes API (--node-name):
// Services and EndpointSlices are the desired state, XDP goes on the
// node's external interfaces and on every pod's veth as pods come and go,
// and accrual decisions become Events on the Services.
func runKubernetes(ctx context.Context, o options, log *slog.Logger) error {
	// client-go logs through klog: keep the agent's log one JSON stream.
	klog.SetSlogLogger(log)
	client, err := k8s.NewClient(o.kubeconfig, o.nodeName)
	if err != nil {
		return err
	}
	// The agent stops when ctx ends or when the controller fails for good;
	// the HTTP server started below stops with it.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	a, err := start(ctx, o, log, config.DefaultMaglevTableSize)
	if err != nil {
		return err
	}
	defer a.close()

	// 1. The node: its interfaces and its own addresses, watched from now
	// on. The controller needs the addresses before its first snapshot.
	lopts := nodelinks.Options{External: o.nodeIfaces, AutoExternal: o.nodeIfacesAuto, Pods: o.podIfaces,
		Logger: log.With("component", "interfaces")}
	node := make(chan nodelinks.Update)
	go func() {
		if err := nodelinks.Watch(ctx, lopts, node); err != nil {
			log.Error("interface watch stopped", "err", err)
		}
	}()
	var firstNode nodelinks.Update
	select {
	case firstNode = <-node:
	case <-ctx.Done():
		return a.stop()
	}

	// 2. Desired state: the controller's first snapshot is complete (all
	// caches synced), so a restarted agent never drops a service it had.
	ctrl := k8s.New(client, k8s.Options{
		NodeName:        o.nodeName,
		MaxInflight:     o.maxInflightDefault,
		InvalidSettings: a.metrics.InvalidSettings,
		Logger:          log.With("component", "kubernetes"),
	})
	ctrl.SetLocalAddrs(firstNode.Addrs)
	a.notify = func(s *reconcile.Service, b *reconcile.Backend, t accrual.Transition) {
		if s == nil {
			return // the service is gone: no object to attach an Event to
		}
		n := k8s.Transition{Service: s.Spec.Name, Transition: t}
		if b != nil {
			n.Endpoint, n.Addr = b.Name, b.Addr
		}
		ctrl.Notify(n)
	}
	states := make(chan desired.State)
	ctrlDone := make(chan error, 1)
	go func() { ctrlDone <- ctrl.Run(ctx, states) }()
	var first desired.State
	select {
	case first = <-states:
	case err := <-ctrlDone:
		if ctx.Err() != nil {
			return a.stop()
		}
		return fmt.Errorf("kubernetes: %w", err)
	case <-ctx.Done():
		return a.stop()
	}
	a.applyDesired(first)
	if err := a.prefiltersWritten(); err != nil {
		return err
	}

	// 3. XDP hooks, once the maps hold the services; later changes as they
	// come. Traffic goes through the kernel stack after NAT (no
	// XDP_REDIRECT): a pod's veth can only take redirected frames if the
	// CNI enabled GRO or XDP on the pod's end, which the agent cannot know.
	if err := a.maps.SetRedirect(nil); err != nil {
		return err
	}
	if err := a.maps.SetConfig(0); err != nil {
		return err
	}
	att := &attacher{a: a, have: map[string]int{}}
	att.apply(firstNode.Links, true)
	attached := len(att.have) // att is the goroutine's from here on
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case u := <-node:
				att.apply(u.Links, false)
				ctrl.SetLocalAddrs(u.Addrs)
			}
		}
	})

	// 4. Accrual state from before a restart, readiness, outcomes.
	if err := a.begin(); err != nil {
		return err
	}
	log.Info("datapath ready", "mode", "kubernetes", "node", o.nodeName,
		"interfaces", attached, "services", len(first.Services))

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
	a.loop(ctx, nil, states)
	close(loopDone)
	return a.stop()
}

// attacher keeps XDP on exactly the selected links. Only its goroutine
// uses it after the first apply.
type attacher struct {
	a    *agent
	have map[string]int // attached: name → ifindex
}

// apply attaches XDP to new links and detaches it from links that went.
// A link whose ifindex changed under the same name (a pod recreated with a
// deterministic veth name) is detached and attached afresh. On the first
// call it also releases hooks a previous agent pinned on interfaces that
// are no longer wanted. An interface that cannot be attached is logged
// and retried on the next change; the others are not held up.
func (t *attacher) apply(ls []nodelinks.Link, first bool) {
	want := map[string]int{}
	for _, l := range ls {
		want[l.Name] = l.Index
	}
	if first {
		for _, name := range t.a.dp.Attached() {
			if _, ok := want[name]; !ok {
				t.detach(name)
			}
		}
	}
	for name, idx := range t.have {
		if want[name] != idx {
			t.detach(name)
			delete(t.have, name)
		}
	}
	for _, l := range ls {
		if _, ok := t.have[l.Name]; ok {
			continue
		}
		if err := t.a.dp.Attach(l.Name); err != nil {
			t.a.log.Warn("attach XDP", "interface", l.Name, "pod", l.Pod, "err", err)
			continue
		}
		t.have[l.Name] = l.Index
	}
	names := make([]string, 0, len(t.have))
	var pods []uint32
	for _, l := range ls {
		if _, ok := t.have[l.Name]; ok {
			names = append(names, l.Name)
			if l.Pod {
				pods = append(pods, uint32(l.Index))
			}
		}
	}
	// Pods' packets arrive with their L4 checksum left to the device: the
	// datapath must know which interfaces can hand it such packets.
	if err := t.a.maps.SetPartialIfaces(pods); err != nil {
		t.a.log.Error("pb_partial_ifaces", "err", err)
	}
	t.a.mu.Lock()
	t.a.interfaces = names
	t.a.mu.Unlock()
}

func (t *attacher) detach(name string) {
	if err := t.a.dp.Detach(name); err != nil {
		t.a.log.Warn("detach XDP", "interface", name, "err", err)
	}
}
