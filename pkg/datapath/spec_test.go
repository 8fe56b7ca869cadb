package datapath_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/internal/bpftest"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/datapath"
)

// Every sized map follows the options; a map left at its compiled-in
// default would silently cap services, backends or flows.
func TestMapSizesFollowOptions(t *testing.T) {
	o := datapath.Options{MaxServices: 300, MaxBackends: 700, ConntrackSize: 5000, EventsBytes: 1 << 17}
	spec, err := datapath.Spec(o)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]uint32{
		bpf.LbMapPbServices:    300,
		bpf.LbMapPbMaglev:      600, // two tables per service
		bpf.LbMapPbMaglevFb:    300,
		bpf.LbMapPbSvcStats:    300,
		bpf.LbMapPbSvcInflight: 300,
		bpf.LbMapPbBackends:    700,
		bpf.LbMapPbBeStats:     700,
		bpf.LbMapPbBeInflight:  700,
		bpf.LbMapPbHealth:      700,
		bpf.LbMapPbSvcBackends: 700,
		bpf.LbMapPbCt:          5000,
		bpf.LbMapPbFlows:       2500,
		bpf.LbMapPbEvents:      1 << 17,
	}
	for name, n := range want {
		if got := spec.Maps[name].MaxEntries; got != n {
			t.Errorf("%s: %d entries, want %d", name, got, n)
		}
	}
}

// A pin of a map a layout change renamed (pb_syns, now pb_syns_v2) is
// removed when the datapath loads: nothing reads it any more.
func TestRetiredPinsAreRemoved(t *testing.T) {
	bpftest.RequireRoot(t)
	root := bpftest.TempBPFFS(t)
	if err := os.MkdirAll(root, 0o700); err != nil {
		t.Fatal(err)
	}
	old, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	if err := old.Pin(filepath.Join(root, "pb_syns")); err != nil {
		t.Fatal(err)
	}
	d, err := datapath.Load(datapath.Options{Root: root, MaxServices: 16, MaxBackends: 16, ConntrackSize: 64, EventsBytes: 1 << 16})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := os.Stat(filepath.Join(root, "pb_syns")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pb_syns still pinned after the load: %v", err)
	}
	if _, err := os.Stat(filepath.Join(root, "pb_syns_v2")); err != nil {
		t.Errorf("pb_syns_v2 not pinned: %v", err)
	}
}
