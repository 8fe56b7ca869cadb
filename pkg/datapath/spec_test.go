// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"encoding/binary"
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
		bpf.LbMapPbSvcKeys:     300,
		bpf.LbMapPbMaglev:      600, // two tables per service
		bpf.LbMapPbMaglevFb:    300,
		bpf.LbMapPbSvcStatsV2:  19, // 16 services' counters to an element
		bpf.LbMapPbSvcInflight: 300,
		bpf.LbMapPbBackends:    700,
		bpf.LbMapPbBeStatsV2:   44, // 16 backends' counters to an element
		bpf.LbMapPbBeInflight:  700,
		bpf.LbMapPbHealth:      700,
		bpf.LbMapPbSvcBackends: 700,
		bpf.LbMapPbCtV2:        5000,
		bpf.LbMapPbFlows:       2500,
		bpf.LbMapPbEvents:      1 << 17,
	}
	for name, n := range want {
		if got := spec.Maps[name].MaxEntries; got != n {
			t.Errorf("%s: %d entries, want %d", name, got, n)
		}
	}
}

// A pin of a map a layout change renamed (pb_syns, now pb_syns_v2;
// pb_be_stats, now pb_be_stats_v2) is removed when the datapath loads:
// nothing reads it any more.
func TestRetiredPinsAreRemoved(t *testing.T) {
	bpftest.RequireRoot(t)
	root := bpftest.TempBPFFS(t)
	pinOld(t, root, "pb_syns", &ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	for _, name := range []string{"pb_svc_stats", "pb_be_stats"} {
		pinOld(t, root, name, &ebpf.MapSpec{Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: 40, MaxEntries: 16})
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
	for _, name := range []string{"pb_svc_stats", "pb_be_stats"} {
		if _, err := os.Stat(filepath.Join(root, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still pinned after the load: %v", name, err)
		}
		if _, err := os.Stat(filepath.Join(root, name+"_v2")); err != nil {
			t.Errorf("%s_v2 not pinned: %v", name, err)
		}
	}
}

// An upgrade from a datapath whose conntrack was pb_ct (no sequence
// numbers) keeps its flows: they are copied into pb_ct_v2, marked
// midstream (they decide no outcome), and the old pin goes.
func TestConntrackIsCopiedToV2(t *testing.T) {
	bpftest.RequireRoot(t)
	root := bpftest.TempBPFFS(t)
	old := pinOld(t, root, "pb_ct", &ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: 40, ValueSize: 48, MaxEntries: 64})
	var k bpf.LbCtKey
	k.Src.Bytes = [16]byte{198, 18, 0, 2}
	k.Dst.Bytes = [16]byte{198, 18, 100, 1}
	k.Sport, k.Dport, k.Proto, k.Family = 0x409c, 0x5000, 6, 4
	v := make([]byte, 48)
	copy(v, []byte{198, 18, 1, 2})
	binary.NativeEndian.PutUint16(v[16:], 0x901f)    // nat_port
	binary.NativeEndian.PutUint32(v[20:], 0x0101)    // flags: established, client acked
	binary.NativeEndian.PutUint32(v[24:], 3)         // svc_id
	binary.NativeEndian.PutUint32(v[28:], 11)        // backend_id
	binary.NativeEndian.PutUint64(v[32:], 123456789) // created_ns
	if err := old.Put(k, v); err != nil {
		t.Fatal(err)
	}
	d, err := datapath.Load(datapath.Options{Root: root, MaxServices: 16, MaxBackends: 16, ConntrackSize: 64, EventsBytes: 1 << 16})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := os.Stat(filepath.Join(root, "pb_ct")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pb_ct still pinned after the load: %v", err)
	}
	var got bpf.LbCtValue
	if err := d.PbCtV2.Lookup(k, &got); err != nil {
		t.Fatalf("the flow is not in pb_ct_v2: %v", err)
	}
	if got.NatAddr.Bytes != [16]byte{198, 18, 1, 2} || got.NatPort != 0x901f || got.SvcId != 3 ||
		got.BackendId != 11 || got.CreatedNs != 123456789 || got.Flags != 0x0101|0x0080 {
		t.Errorf("copied entry %+v", got)
	}
}
