// SPDX-License-Identifier: Apache-2.0

package datapath

import (
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/penaltybox/penaltybox/bpf"
)

// LoadedMapIDs are the kernel ids of every map LoadMaps made or adopted,
// the data sections' included; asked before the program is loaded.
func (d *Datapath) LoadedMapIDs() (map[ebpf.MapID]string, error) {
	ids := map[ebpf.MapID]string{}
	for name, m := range d.maps {
		info, err := m.Info()
		if err != nil {
			return nil, err
		}
		id, _ := info.ID()
		ids[id] = name
	}
	return ids, nil
}

// BreakProgram makes the next program load fail in the verifier: pb_xdp
// becomes an exit that never set its return value.
func (d *Datapath) BreakProgram() {
	d.spec = d.spec.Copy()
	d.spec.Programs[bpf.LbProgPbXdp].Instructions = asm.Instructions{asm.Return()}
}

// CTAside is the pin a resized table is moved aside to.
const CTAside = ctAside
