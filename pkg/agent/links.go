// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"net"

	"github.com/vishvananda/netlink"

	"github.com/penaltybox/penaltybox/pkg/maps"
)

// LinkInfo is what the agent needs to know of an interface it attaches to.
type LinkInfo struct {
	Index int
	// Veth: a veth, whose local sender may leave the L4 checksum to the
	// device.
	Veth bool
	// Master is its master's index (a bridge port's bridge), 0: none.
	Master int
}

// iface is l as the datapath's pb_ifaces entry; partial says whether its
// packets may carry a partial checksum.
func (l LinkInfo) iface(partial bool) maps.Iface {
	return maps.Iface{Index: uint32(l.Index), Partial: partial, Master: uint32(l.Master)}
}

// netlinkLink resolves an interface by name.
func netlinkLink(name string) (LinkInfo, error) {
	ifc, err := net.InterfaceByName(name)
	if err != nil {
		return LinkInfo{}, err
	}
	l, err := netlink.LinkByIndex(ifc.Index)
	if err != nil {
		return LinkInfo{Index: ifc.Index}, nil
	}
	return LinkInfo{Index: ifc.Index, Veth: l.Type() == "veth", Master: l.Attrs().MasterIndex}, nil
}
