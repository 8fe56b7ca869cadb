// SPDX-License-Identifier: Apache-2.0

package datapath

import (
	"slices"
	"testing"

	"github.com/cilium/ebpf/link"
)

// auto gives veths generic XDP and everything else native first; the
// explicit modes mean what they say; a mode that is none of them is
// refused by name.
func TestXDPAttempts(t *testing.T) {
	native := []link.XDPAttachFlags{link.XDPDriverMode, link.XDPGenericMode}
	generic := []link.XDPAttachFlags{link.XDPGenericMode}
	for _, tt := range []struct {
		mode, kind string
		want       []link.XDPAttachFlags
	}{
		{XDPAuto, "veth", generic},
		{XDPAuto, "device", native},
		{XDPAuto, "vxlan", native}, // no native XDP: the generic attempt takes it
		{XDPAuto, "", native},      // kind unknown (netlink failed)
		{XDPNative, "veth", native},
		{XDPNative, "device", native},
		{XDPGeneric, "veth", generic},
		{XDPGeneric, "device", generic},
	} {
		if got := xdpAttempts(tt.mode, tt.kind); !slices.Equal(got, tt.want) {
			t.Errorf("%s on %q: %v, want %v", tt.mode, tt.kind, got, tt.want)
		}
	}
	for _, m := range []string{XDPAuto, XDPNative, XDPGeneric} {
		if err := CheckXDPMode(m); err != nil {
			t.Errorf("%s: %v", m, err)
		}
	}
	if err := CheckXDPMode("skb"); err == nil || err.Error() != `"skb": want auto, native or generic` {
		t.Errorf("skb: %v", err)
	}
}
