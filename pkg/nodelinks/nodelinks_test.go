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
	ipip, _ := ParsePatterns(DefaultIPIPPatterns)
	tests := []struct {
		name   string
		routes map[int]bool
		o      Options
		want   []Link
	}{
		{"auto: the default route's interface and the pods", map[int]bool{2: true},
			Options{AutoExternal: true, Pods: pods},
			[]Link{{"cali1a2b3c", 4, true, false, false}, {"eth0", 2, false, false, false}, {"lxc9f8e", 5, true, false, false}, {"veth12ab", 7, true, false, false}}},
		{"IPIP's tunl0 by the default pattern, apart from VXLAN's", map[int]bool{2: true},
			Options{AutoExternal: true, Tunnels: tunnels, IPIP: ipip},
			[]Link{{"eth0", 2, false, false, false}, {"flannel-v6.1", 12, false, true, false}, {"flannel.1", 9, false, true, false},
				{"tunl0", 11, false, false, true}, {"vxlan.calico", 10, false, true, false}}},
		{"overlay tunnels by the default patterns: VXLAN's, not IPIP's tunl0", map[int]bool{2: true},
			Options{AutoExternal: true, Pods: []string{"veth*"}, Tunnels: tunnels},
			[]Link{{"eth0", 2, false, false, false}, {"flannel-v6.1", 12, false, true, false}, {"flannel.1", 9, false, true, false}, {"veth12ab", 7, true, false, false},
				{"vxlan.calico", 10, false, true, false}}},
		{"auto with ECMP over two interfaces", map[int]bool{2: true, 3: true},
			Options{AutoExternal: true},
			[]Link{{"eth0", 2, false, false, false}, {"eth1", 3, false, false, false}}},
		{"auto without a default route: pods only", nil,
			Options{AutoExternal: true, Pods: []string{"cali*"}},
			[]Link{{"cali1a2b3c", 4, true, false, false}}},
		{"explicit names and globs; the default route does not matter", map[int]bool{2: true},
			Options{External: []string{"bond*", "eth1"}, Pods: []string{"lxc*"}},
			[]Link{{"bond0", 8, false, false, false}, {"eth1", 3, false, false, false}, {"lxc9f8e", 5, true, false, false}}},
		{"none external", map[int]bool{2: true}, Options{Pods: []string{"veth*"}},
			[]Link{{"veth12ab", 7, true, false, false}}},
		{"loopback never, even when a pattern matches it", map[int]bool{1: true},
			Options{AutoExternal: true, External: []string{"*"}},
			[]Link{{"bond0", 8, false, false, false}, {"cali1a2b3c", 4, false, false, false}, {"docker0", 6, false, false, false}, {"eth0", 2, false, false, false},
				{"eth1", 3, false, false, false}, {"flannel-v6.1", 12, false, false, false}, {"flannel.1", 9, false, false, false}, {"lxc9f8e", 5, false, false, false}, {"tunl0", 11, false, false, false},
				{"veth12ab", 7, false, false, false}, {"vxlan.calico", 10, false, false, false}}},
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
