// SPDX-License-Identifier: Apache-2.0

package datapath

import "testing"

// Interface names with dots (bpffs refuses them in pin names) and with the
// escape character itself map to pin names and back.
func TestLinkPinNames(t *testing.T) {
	d := &Datapath{Opts: Options{Root: "/r"}}
	for name, pin := range map[string]string{
		"eth0":         "/r/links/eth0",
		"flannel.1":    "/r/links/flannel%2e1",
		"vxlan.calico": "/r/links/vxlan%2ecalico",
		"odd%2e.x":     "/r/links/odd%252e%2ex",
	} {
		got := d.linkPin(name)
		if got != pin {
			t.Errorf("linkPin(%q) = %q, want %q", name, got, pin)
		}
		if back := pinnedIface(got[len("/r/links/"):]); back != name {
			t.Errorf("pinnedIface(%q) = %q, want %q", got, back, name)
		}
	}
}
