package datapath_test

import (
	"testing"

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
