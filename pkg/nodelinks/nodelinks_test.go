// SPDX-License-Identifier: Apache-2.0

package nodelinks

import (
	"reflect"
	"testing"
)

func TestSelect(t *testing.T) {
	links := map[int]string{1: "lo", 2: "eth0", 3: "eth1", 4: "cali1a2b3c", 5: "lxc9f8e", 6: "docker0", 7: "veth12ab", 8: "bond0",
		9: "flannel.1", 10: "vxlan.calico", 11: "tunl0", 12: "flannel-v6.1"}
	pods, _ := ParsePatterns(DefaultPodPatterns)
	tunnels, _ := ParsePatterns(DefaultTunnelPatterns)
	tests := []struct {
		name   string
		routes map[int]bool
		o      Options
		want   []Link
	}{
		{"auto: the default route's interface and the pods", map[int]bool{2: true},
			Options{AutoExternal: true, Pods: pods},
			[]Link{{"cali1a2b3c", 4, true, false}, {"eth0", 2, false, false}, {"lxc9f8e", 5, true, false}, {"veth12ab", 7, true, false}}},
		{"overlay tunnels by the default patterns: VXLAN's, not IPIP's tunl0", map[int]bool{2: true},
			Options{AutoExternal: true, Pods: []string{"veth*"}, Tunnels: tunnels},
			[]Link{{"eth0", 2, false, false}, {"flannel-v6.1", 12, false, true}, {"flannel.1", 9, false, true}, {"veth12ab", 7, true, false},
				{"vxlan.calico", 10, false, true}}},
		{"auto with ECMP over two interfaces", map[int]bool{2: true, 3: true},
			Options{AutoExternal: true},
			[]Link{{"eth0", 2, false, false}, {"eth1", 3, false, false}}},
		{"auto without a default route: pods only", nil,
			Options{AutoExternal: true, Pods: []string{"cali*"}},
			[]Link{{"cali1a2b3c", 4, true, false}}},
		{"explicit names and globs; the default route does not matter", map[int]bool{2: true},
			Options{External: []string{"bond*", "eth1"}, Pods: []string{"lxc*"}},
			[]Link{{"bond0", 8, false, false}, {"eth1", 3, false, false}, {"lxc9f8e", 5, true, false}}},
		{"none external", map[int]bool{2: true}, Options{Pods: []string{"veth*"}},
			[]Link{{"veth12ab", 7, true, false}}},
		{"loopback never, even when a pattern matches it", map[int]bool{1: true},
			Options{AutoExternal: true, External: []string{"*"}},
			[]Link{{"bond0", 8, false, false}, {"cali1a2b3c", 4, false, false}, {"docker0", 6, false, false}, {"eth0", 2, false, false},
				{"eth1", 3, false, false}, {"flannel-v6.1", 12, false, false}, {"flannel.1", 9, false, false}, {"lxc9f8e", 5, false, false}, {"tunl0", 11, false, false},
				{"veth12ab", 7, false, false}, {"vxlan.calico", 10, false, false}}},
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
