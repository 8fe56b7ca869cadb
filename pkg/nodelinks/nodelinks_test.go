// SPDX-License-Identifier: Apache-2.0

package nodelinks

import (
	"reflect"
	"testing"
)

func TestSelect(t *testing.T) {
	links := map[int]Seen{1: {Name: "lo"}, 2: {Name: "eth0"}, 3: {Name: "eth1"}, 4: {Name: "cali1a2b3c"}, 5: {Name: "lxc9f8e"},
		6: {Name: "docker0"}, 7: {Name: "veth12ab", Master: 6}, 8: {Name: "bond0"},
		9: {Name: "flannel.1"}, 10: {Name: "vxlan.calico"}, 11: {Name: "tunl0"}, 12: {Name: "flannel-v6.1"}}
	pods, _ := ParsePatterns(DefaultPodPatterns)
	tunnels, _ := ParsePatterns(DefaultTunnelPatterns)
	ipip, _ := ParsePatterns(DefaultIPIPPatterns)
	tests := []struct {
		name   string
		routes map[int]bool
		o      Options
		want   []Link
	}{
		{"auto: the default route's interface and the pods", map[int]bool{2: true},
			Options{AutoExternal: true, Pods: pods},
			[]Link{{"cali1a2b3c", 4, true, false, false, 0}, {"eth0", 2, false, false, false, 0}, {"lxc9f8e", 5, true, false, false, 0}, {"veth12ab", 7, true, false, false, 6}}},
		{"IPIP's tunl0 by the default pattern, apart from VXLAN's", map[int]bool{2: true},
			Options{AutoExternal: true, Tunnels: tunnels, IPIP: ipip},
			[]Link{{"eth0", 2, false, false, false, 0}, {"flannel-v6.1", 12, false, true, false, 0}, {"flannel.1", 9, false, true, false, 0},
				{"tunl0", 11, false, false, true, 0}, {"vxlan.calico", 10, false, true, false, 0}}},
		{"overlay tunnels by the default patterns: VXLAN's, not IPIP's tunl0", map[int]bool{2: true},
			Options{AutoExternal: true, Pods: []string{"veth*"}, Tunnels: tunnels},
			[]Link{{"eth0", 2, false, false, false, 0}, {"flannel-v6.1", 12, false, true, false, 0}, {"flannel.1", 9, false, true, false, 0}, {"veth12ab", 7, true, false, false, 6},
				{"vxlan.calico", 10, false, true, false, 0}}},
		{"auto with ECMP over two interfaces", map[int]bool{2: true, 3: true},
			Options{AutoExternal: true},
			[]Link{{"eth0", 2, false, false, false, 0}, {"eth1", 3, false, false, false, 0}}},
		{"auto without a default route: pods only", nil,
			Options{AutoExternal: true, Pods: []string{"cali*"}},
			[]Link{{"cali1a2b3c", 4, true, false, false, 0}}},
		{"explicit names and globs; the default route does not matter", map[int]bool{2: true},
			Options{External: []string{"bond*", "eth1"}, Pods: []string{"lxc*"}},
			[]Link{{"bond0", 8, false, false, false, 0}, {"eth1", 3, false, false, false, 0}, {"lxc9f8e", 5, true, false, false, 0}}},
		{"none external", map[int]bool{2: true}, Options{Pods: []string{"veth*"}},
			[]Link{{"veth12ab", 7, true, false, false, 6}}},
		{"loopback never, even when a pattern matches it", map[int]bool{1: true},
			Options{AutoExternal: true, External: []string{"*"}},
			[]Link{{"bond0", 8, false, false, false, 0}, {"cali1a2b3c", 4, false, false, false, 0}, {"docker0", 6, false, false, false, 0}, {"eth0", 2, false, false, false, 0},
				{"eth1", 3, false, false, false, 0}, {"flannel-v6.1", 12, false, false, false, 0}, {"flannel.1", 9, false, false, false, 0}, {"lxc9f8e", 5, false, false, false, 0}, {"tunl0", 11, false, false, false, 0},
				{"veth12ab", 7, false, false, false, 6}, {"vxlan.calico", 10, false, false, false, 0}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Select(links, tt.routes, tt.o); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %v\nwant %v", got, tt.want)
			}
		})
	}
}

func TestParse(t *testing.T) {
	if p, auto, err := ParseExternal("auto"); err != nil || !auto || p != nil {
		t.Errorf("auto: %v %v %v", p, auto, err)
	}
	if p, auto, err := ParseExternal(""); err != nil || auto || len(p) != 0 {
		t.Errorf("empty: %v %v %v", p, auto, err)
	}
	if p, _, err := ParseExternal(" eth0, bond* ,"); err != nil || !reflect.DeepEqual(p, []string{"eth0", "bond*"}) {
		t.Errorf("list: %v %v", p, err)
	}
	if _, err := ParsePatterns("cali*,[x"); err == nil {
		t.Error("a malformed glob was accepted")
	}
}
