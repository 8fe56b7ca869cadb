// SPDX-License-Identifier: Apache-2.0

package nodelinks

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
)

// Preflight checks once, at start, that o selects interfaces on this node.
// None at all is an error: the agent would see no Service traffic. Veths
// the pod patterns miss come back as a warning, not an error: their pods'
// connections pass to kube-proxy as if penaltybox were not installed, which
// is safe, and a node may briefly have a veth that is not a pod's.
func Preflight(o Options) (warning string, err error) {
	all, err := netlink.LinkList()
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		return "", fmt.Errorf("list links: %w", err)
	}
	links := map[int]Seen{}
	var present []Present
	for _, l := range all {
		links[l.Attrs().Index] = seen(l.Attrs())
		present = append(present, Present{Name: l.Attrs().Name, Type: l.Type()})
	}
	return judge(present, Select(links, defaultRoutes(o), o))
}

// Present is one of the node's interfaces as rtnetlink lists it.
type Present struct {
	Name string
	// Type is the link kind: "veth", "device", "bridge", ...
	Type string
}

// shown caps the interface names a message lists.
const shown = 6

func judge(present []Present, selected []Link) (warning string, err error) {
	if len(selected) == 0 {
		var names []string
		for _, p := range present {
			if p.Name != "lo" {
				names = append(names, p.Name)
			}
		}
		return "", fmt.Errorf("no interface matches (this node has %s)", list(names))
	}
	var missed []string
	for _, p := range present {
		if p.Type == "veth" && !slices.ContainsFunc(selected, func(l Link) bool { return l.Name == p.Name }) {
			missed = append(missed, p.Name)
		}
	}
	if len(missed) > 0 && !slices.ContainsFunc(selected, func(l Link) bool { return l.Pod }) {
		return fmt.Sprintf("no pod interface matches, and the node has %d veths (%s): their pods' connections go to kube-proxy",
			len(missed), list(missed)), nil
	}
	return "", nil
}

func list(names []string) string {
	if len(names) == 0 {
		return "none but lo"
	}
	slices.Sort(names)
	if len(names) > shown {
		return strings.Join(names[:shown], ", ") + fmt.Sprintf(" and %d more", len(names)-shown)
	}
	return strings.Join(names, ", ")
}
