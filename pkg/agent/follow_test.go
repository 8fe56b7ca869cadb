// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"maps"
	"slices"
	"testing"

	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/nodelinks"
)

// A config file's interfaces are applied again when one of them is
// created again under its name or gets another master, and only then.
func TestFollowInterfaces(t *testing.T) {
	e := newEnv(t)
	e.links = map[string]int{"cl0": 4, "b1": 5, "eth9": 6}
	e.veths = map[string]bool{"b1": true}
	e.masters = map[string]int{}
	node := &desired.Node{Interfaces: []string{"cl0", "b1"}, RedirectInterfaces: []string{"eth9"}, TableSize: 31}
	cfg := nodeConfig(node)

	// Before a config's interfaces are applied (and in Kubernetes mode)
	// there is nothing to follow.
	e.a.FollowInterfaces([]nodelinks.Link{{Name: "b1", Index: 9}})
	if len(e.hooks.attaches) != 0 {
		t.Fatalf("attached %v before any config", e.hooks.attaches)
	}
	if err := e.a.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	attaches := func() map[string]int { return maps.Clone(e.hooks.attaches) }
	before := attaches()

	// Nothing of theirs changed (another link came): nothing is done.
	e.links["veth77"] = 12
	e.a.FollowInterfaces(e.nodeLinks())
	if got := attaches(); !maps.Equal(got, before) {
		t.Fatalf("attaches %v after an unrelated link came, want %v", got, before)
	}

	// The bridge plugin makes cni0 b1's master after it created b1.
	e.masters["b1"] = 3
	e.a.FollowInterfaces(e.nodeLinks())
	if got := e.f.Masters[5]; got != 3 {
		t.Fatalf("b1's master in pb_ifaces %d, want 3", got)
	}
	before = attaches()

	// b1 deleted: left as it is until it comes back.
	delete(e.links, "b1")
	e.a.FollowInterfaces(e.nodeLinks())
	if got := attaches(); !maps.Equal(got, before) {
		t.Fatalf("attaches %v while b1 is gone, want %v", got, before)
	}
	// ...created again, under another index: attached again, and its
	// pb_ifaces entry is the new index's.
	e.links["b1"] = 13
	e.a.FollowInterfaces(e.nodeLinks())
	if got := e.hooks.attaches["b1"]; got != before["b1"]+1 {
		t.Fatalf("b1 attached %d times, want %d", got, before["b1"]+1)
	}
	if !slices.Equal(e.f.Partial, []uint32{13}) || e.f.Masters[13] != 3 {
		t.Fatalf("partial %v, masters %v; want b1 at 13, master 3", e.f.Partial, e.f.Masters)
	}

	// A redirect interface created again: pb_redirect follows.
	e.links["eth9"] = 14
	e.a.FollowInterfaces(e.nodeLinks())
	if !slices.Equal(e.f.PbRedirect, []uint32{14}) {
		t.Fatalf("pb_redirect %v, want [14]", e.f.PbRedirect)
	}
}

// An interface of the config that is gone does not hold up the others:
// one recreated meanwhile is followed, the gone one left out until it
// comes back. And an interface a reload dropped is followed no more.
func TestFollowInterfacesWithOneGone(t *testing.T) {
	e := newEnv(t)
	e.links = map[string]int{"cl0": 4, "b1": 5, "eth9": 6}
	e.veths = map[string]bool{"cl0": true, "b1": true}
	e.hooks.exists = func(n string) bool { _, ok := e.links[n]; return ok }
	node := &desired.Node{Interfaces: []string{"cl0", "b1"}, RedirectInterfaces: []string{"eth9"}, TableSize: 31}
	cfg := nodeConfig(node)
	if err := e.a.Apply(cfg); err != nil {
		t.Fatal(err)
	}

	// cl0 and eth9 gone for good (for now), b1 created again.
	delete(e.links, "cl0")
	delete(e.links, "eth9")
	e.links["b1"] = 15
	e.a.FollowInterfaces(e.nodeLinks())
	if e.hooks.attaches["b1"] != 2 || !slices.Equal(e.f.Partial, []uint32{15}) || len(e.f.PbRedirect) != 0 {
		t.Fatalf("b1 attached %d times, partial %v, redirect %v; want 2, [15], []",
			e.hooks.attaches["b1"], e.f.Partial, e.f.PbRedirect)
	}
	// Nothing changed since: nothing is done again.
	e.a.FollowInterfaces(e.nodeLinks())
	if e.hooks.attaches["b1"] != 2 {
		t.Fatalf("b1 attached %d times with nothing changed, want 2", e.hooks.attaches["b1"])
	}
	// cl0 and eth9 come back, under new indexes.
	e.links["cl0"] = 16
	e.links["eth9"] = 17
	e.a.FollowInterfaces(e.nodeLinks())
	if e.hooks.attaches["cl0"] != 2 || !slices.Equal(e.f.Partial, []uint32{16, 15}) || !slices.Equal(e.f.PbRedirect, []uint32{17}) {
		t.Fatalf("cl0 attached %d times, partial %v, redirect %v; want 2, [16 15], [17]",
			e.hooks.attaches["cl0"], e.f.Partial, e.f.PbRedirect)
	}

	// A reload drops b1; b1 created again afterwards is not the agent's.
	node.Interfaces = []string{"cl0"}
	if err := e.a.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	n := e.hooks.attaches["b1"]
	e.links["b1"] = 18
	e.a.FollowInterfaces(e.nodeLinks())
	if e.hooks.attaches["b1"] != n || slices.Contains(e.hooks.Attached(), "b1") {
		t.Fatalf("b1, dropped from the config, attached again (%d times, attached %v)", e.hooks.attaches["b1"], e.hooks.Attached())
	}
}

// nodeConfig is a config file's state: node's interfaces and one service.
func nodeConfig(node *desired.Node) desired.State {
	return desired.State{Node: node,
		Services: []desired.Service{{Name: "web", Key: desired.Key{VIP: vip, Port: 80, Protocol: desired.TCP}, Accrual: settings()}}}
}

// nodeLinks are the links that exist (e.links, with e.masters), as the
// link watch reports them.
func (e *env) nodeLinks() []nodelinks.Link {
	var ls []nodelinks.Link
	for _, n := range slices.Sorted(maps.Keys(e.links)) {
		ls = append(ls, nodelinks.Link{Name: n, Index: e.links[n], Master: e.masters[n]})
	}
	return ls
}
