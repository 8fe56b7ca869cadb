// SPDX-License-Identifier: Apache-2.0

package datapath

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
)

// OpenPinned opens the maps a datapath pinned under root, read-only (the
// unpinned ones stay nil), without loading the program or changing a pin: for tools that read the
// state of a node whether its agent runs or not (agent inspect). Every map
// of this build's layout must be there: a missing one means no datapath,
// or one of another version, is pinned there.
func OpenPinned(root string) (*bpf.LbMaps, error) {
	if _, err := os.Stat(filepath.Join(root, bpf.LbMapPbServices)); err != nil {
		return nil, fmt.Errorf("no penaltybox datapath pinned under %s (is that the agent's --bpffs-root?): %w", root, err)
	}
	spec, err := bpf.LoadLb()
	if err != nil {
		return nil, err
	}
	var m bpf.LbMaps
	v := reflect.ValueOf(&m).Elem()
	for i := range v.NumField() {
		name := v.Type().Field(i).Tag.Get("ebpf")
		// Maps that are not pinned (pb_scratch) hold nothing to read.
		if ms := spec.Maps[name]; name == "" || ms == nil || ms.Pinning != ebpf.PinByName {
			continue
		}
		pm, err := ebpf.LoadPinnedMap(filepath.Join(root, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			err = fmt.Errorf("pinned map %s: %w", name, err)
			if errors.Is(err, os.ErrNotExist) {
				err = fmt.Errorf("%w (a datapath of another version is pinned under %s?)", err, root)
			}
			return nil, errors.Join(err, m.Close())
		}
		v.Field(i).Set(reflect.ValueOf(pm))
	}
	return &m, nil
}
