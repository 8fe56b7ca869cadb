package nodelinks

import (
	"strings"
	"testing"
)

// The pre-flight's verdicts: nothing selected is an error naming what the
// node has; veths when no pod interface matches is a warning naming them;
// anything else passes.
func TestJudge(t *testing.T) {
	eth := Present{"eth0", "device"}
	for _, c := range []struct {
		name      string
		present   []Present
		selected  []Link
		err, warn string
	}{
		{"nothing matches", []Present{{"lo", "device"}, eth, {"cni0", "bridge"}}, nil, "no interface matches (this node has cni0, eth0)", ""},
		{"an empty node", []Present{{"lo", "device"}}, nil, "this node has none but lo", ""},
		{"uplink only, no pods yet", []Present{eth}, []Link{{Name: "eth0"}}, "", ""},
		{"pods found", []Present{eth, {"veth1", "veth"}, {"odd7", "veth"}}, []Link{{Name: "eth0"}, {Name: "veth1", Pod: true}}, "", ""},
		{"the CNI's names missed", []Present{eth, {"p9", "veth"}, {"p1", "veth"}, {"p2", "veth"}, {"p3", "veth"}, {"p4", "veth"}, {"p5", "veth"}, {"p6", "veth"}},
			[]Link{{Name: "eth0"}}, "", "the node has 7 veths (p1, p2, p3, p4, p5, p6 and 1 more)"},
		{"the uplink a veth (a test's namespace)", []Present{{"eth0", "veth"}}, []Link{{Name: "eth0"}}, "", ""},
	} {
		warn, err := judge(c.present, c.selected)
		switch {
		case c.err == "" && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("%s: error %v, want %q", c.name, err, c.err)
		case c.warn == "" && warn != "":
			t.Errorf("%s: warning %q", c.name, warn)
		case c.warn != "" && !strings.Contains(warn, c.warn):
			t.Errorf("%s: warning %q, want %q", c.name, warn, c.warn)
		}
	}
}
