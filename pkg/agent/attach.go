// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"errors"
	"fmt"
	"slices"

	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/nodelinks"
)

// XDP attachment: the interfaces a config file lists (applyInterfaces),
// or the node's links as they come and go (SyncLinks, Kubernetes mode).

// checkInterfaces resolves every interface a config file names.
func (a *Agent) checkInterfaces(n *desired.Node) error {
	var errs []error
	for _, f := range []struct {
		field string
		names []string
	}{{"interfaces", n.Interfaces}, {"redirectInterfaces", n.RedirectInterfaces}} {
		for i, n := range f.names {
			if _, err := a.link(n); err != nil {
				errs = append(errs, fmt.Errorf("%s[%d]: %q: %w", f.field, i, n, err))
			}
		}
	}
	return errors.Join(errs...)
}

// applyInterfaces attaches XDP where listed and detaches it elsewhere, and
// tells the datapath which interfaces are veths and which take redirects.
// An interface that cannot be attached or resolved fails it (a config's
// interfaces were checked to exist just before).
func (a *Agent) applyInterfaces(ifaces, redirect []string) error {
	a.hooksMu.Lock()
	defer a.hooksMu.Unlock()
	return a.applyInterfacesLocked(ifaces, redirect, nil)
}

// applyInterfacesLocked is applyInterfaces with hooksMu held. With skip
// set (following the node's links), an interface that is absent or cannot
// be attached is passed to skip and left out instead of failing the rest;
// what was last seen of an absent one is kept, so that its return under a
// new index is a change.
func (a *Agent) applyInterfacesLocked(ifaces, redirect []string, skip func(name string, err error)) error {
	want := map[string]bool{}
	var attached []string
	for _, n := range ifaces {
		want[n] = true
		if err := a.hooks.Attach(n); err != nil {
			if skip == nil {
				return err
			}
			skip(n, err)
			continue
		}
		attached = append(attached, n)
	}
	for _, n := range a.hooks.Attached() {
		if !want[n] {
			if err := a.hooks.Detach(n); err != nil {
				a.log.Error("detach", "interface", n, "err", err)
			}
		}
	}
	seen := map[string]LinkInfo{}
	a.mu.RLock()
	for n, l := range a.listed.seen {
		seen[n] = l // an absent interface's last sight (skip)
	}
	a.mu.RUnlock()
	var known []maps.Iface
	for _, n := range attached {
		if l, err := a.link(n); err == nil {
			known = append(known, l.iface(l.Veth))
			seen[n] = l
		}
	}
	var idx []uint32
	for _, n := range redirect {
		l, err := a.link(n)
		if err != nil {
			if skip == nil {
				return fmt.Errorf("redirectInterfaces: %q: %w", n, err)
			}
			skip(n, err)
			continue
		}
		idx = append(idx, uint32(l.Index))
		seen[n] = l
	}
	for n := range seen {
		if !want[n] && !slices.Contains(redirect, n) {
			delete(seen, n)
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.rec.SetInterfaces(known); err != nil {
		return err
	}
	if err := a.rec.SetRedirectInterfaces(idx); err != nil {
		return err
	}
	a.interfaces = ifaces
	a.listed = listed{ifaces: ifaces, redirect: redirect, seen: seen}
	return nil
}

// listed is what applyInterfaces last applied: the config's interfaces
// and each one's index and master as they were last seen.
type listed struct {
	ifaces, redirect []string
	seen             map[string]LinkInfo
}

// FollowInterfaces applies the config's interfaces again when one of
// them changed on the node (ls: the node's links, from a watch): created
// again under its name (a new index: the XDP link and pb_ifaces entry of
// the old one are dead), or given another master (a CNI bridges a veth
// after it creates it). An interface absent from ls is left out of the
// datapath's lists until it comes back; the others are still followed.
// Nothing is done before a config's interfaces are applied (Kubernetes
// mode follows links with SyncLinks).
func (a *Agent) FollowInterfaces(ls []nodelinks.Link) {
	// hooksMu first, for the whole check and apply: a reload (applyNode)
	// applies its interfaces under it too, and the list checked must be
	// the one applied, not one a reload has replaced meanwhile.
	a.hooksMu.Lock()
	defer a.hooksMu.Unlock()
	a.mu.RLock()
	l := a.listed
	a.mu.RUnlock()
	changed := ""
	for _, n := range ls {
		if was, ok := l.seen[n.Name]; ok && (was.Index != n.Index || was.Master != n.Master) {
			changed = n.Name
			break
		}
	}
	if changed == "" {
		return
	}
	skip := func(name string, err error) {
		a.log.Warn("configured interface left out until it can be attached", "interface", name, "err", err)
	}
	if err := a.applyInterfacesLocked(l.ifaces, l.redirect, skip); err != nil {
		a.log.Error("a configured interface changed; applying the interfaces again failed", "interface", changed, "err", err)
		return
	}
	// Logged once the datapath's entries are written, not before: the
	// interface is served from here on.
	a.log.Info("a configured interface changed; interfaces applied again", "interface", changed)
}

// SyncLinks keeps XDP on exactly the given links (Kubernetes mode: the
// node's external interfaces and every pod's veth, as they come and go).
// A link whose ifindex changed under the same name (a pod recreated with a
// deterministic veth name) is detached and attached afresh. The first call
// also releases hooks a previous agent pinned on interfaces that are no
// longer wanted. An interface that cannot be attached is logged and
// retried on the next call; the others are not held up. It returns how
// many links are attached.
func (a *Agent) SyncLinks(ls []nodelinks.Link, first bool) int {
	a.hooksMu.Lock()
	defer a.hooksMu.Unlock()
	want := map[string]int{}
	for _, l := range ls {
		want[l.Name] = l.Index
	}
	if first {
		for _, name := range a.hooks.Attached() {
			if _, ok := want[name]; !ok {
				a.detach(name)
			}
		}
	}
	for name, idx := range a.links {
		if want[name] != idx {
			a.detach(name)
			delete(a.links, name)
		}
	}
	for _, l := range ls {
		if _, ok := a.links[l.Name]; ok || !l.Attach() {
			continue
		}
		if err := a.hooks.Attach(l.Name); err != nil {
			a.log.Warn("attach XDP", "interface", l.Name, "pod", l.Pod, "err", err)
			continue
		}
		a.links[l.Name] = l.Index
	}
	names := make([]string, 0, len(a.links))
	var known []maps.Iface
	for _, l := range ls {
		if _, ok := a.links[l.Name]; ok {
			names = append(names, l.Name)
			// Pods' packets arrive with their L4 checksum left to the
			// device: the datapath must know which interfaces can hand it
			// such packets. Not tunnels: what they decapsulate came off a
			// NIC, its checksums whole. A bridged pod's veth has the
			// bridge for master, which the node routes the pod through:
			// as the watch last saw it (a CNI sets it after it creates
			// the veth, and the watch reports that as a change).
			i := LinkInfo{Index: l.Index, Master: l.Master}.iface(l.Pod)
			i.Decap = l.External()
			known = append(known, i)
		}
		if l.IPIP {
			known = append(known, maps.Iface{Index: uint32(l.Index), IPIP: true})
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.rec.SetInterfaces(known); err != nil {
		a.log.Error("pb_ifaces", "err", err)
	}
	a.interfaces = names
	return len(a.links)
}

// NoRedirect sends all traffic through the kernel stack after NAT
// (Kubernetes mode): a pod's veth can only take redirected frames if the
// CNI enabled GRO or XDP on the pod's end, which the agent cannot know.
func (a *Agent) NoRedirect() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.rec.SetRedirectInterfaces(nil)
}

func (a *Agent) detach(name string) {
	if err := a.hooks.Detach(name); err != nil {
		a.log.Warn("detach XDP", "interface", name, "err", err)
	}
}
