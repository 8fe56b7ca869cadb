// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// An interface deleted and created again under the same name gets the
// program again when it is attached by name: the link that died with the
// old interface does not stand for the new one (a config file's
// interfaces are attached by name, at every reload).
func TestAttachFollowsARecreatedInterface(t *testing.T) {
	bpftest.RequireRoot(t)
	h := testnet.OwnNetns(t, false)
	addVeth := func() int {
		t.Helper()
		v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pbt-a0"}, PeerName: "pbt-a1"}
		if err := h.LinkAdd(v); err != nil {
			t.Fatal(err)
		}
		l, err := h.LinkByName("pbt-a0")
		if err != nil {
			t.Fatal(err)
		}
		return l.Attrs().Index
	}
	progOn := func(name string) uint32 {
		t.Helper()
		l, err := h.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		if x := l.Attrs().Xdp; x != nil && x.Attached {
			return x.ProgId
		}
		return 0
	}

	first := addVeth()
	d, err := datapath.LoadMaps(smallOptions(bpftest.TempBPFFS(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	d.StartProgramLoad()
	if err := d.Attach("pbt-a0"); err != nil {
		t.Fatal(err)
	}
	prog := progOn("pbt-a0")
	if prog == 0 {
		t.Fatal("no program on the interface after Attach")
	}

	l, err := h.LinkByName("pbt-a0")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkDel(l); err != nil {
		t.Fatal(err)
	}
	second := addVeth()
	if second == first {
		t.Fatalf("the new interface has the old one's index %d", first)
	}
	if err := d.Attach("pbt-a0"); err != nil {
		t.Fatal(err)
	}
	if got := progOn("pbt-a0"); got != prog {
		t.Fatalf("program %d on the recreated interface (index %d), want %d", got, second, prog)
	}
	if got := d.Attached(); len(got) != 1 || got[0] != "pbt-a0" {
		t.Errorf("attached %v, want [pbt-a0]", got)
	}
	// Attached again: nothing changes.
	if err := d.Attach("pbt-a0"); err != nil || progOn("pbt-a0") != prog {
		t.Errorf("a second Attach: %v, program %d", err, progOn("pbt-a0"))
	}
}

// A resize across agents: the previous program keeps running on the table
// moved aside until a link switches to the new one. A start that ends
// before the switch leaves it aside, and the next start copies from it
// (a pinned link still runs), not from the stale copy pinned under
// pb_ct_v2. The switch brings the new table up to date and removes the pin
// aside. A pin aside is taken over a partial pinned copy even with no link
// running (frozen: copied once, its pin gone).
func TestConntrackResizeAcrossASwitch(t *testing.T) {
	bpftest.RequireRoot(t)
	h := testnet.OwnNetns(t, false)
	v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pbt-r0"}, PeerName: "pbt-r1"}
	if err := h.LinkAdd(v); err != nil {
		t.Fatal(err)
	}
	root := bpftest.TempBPFFS(t)
	aside := filepath.Join(root, datapath.CTAside)
	load := func(size uint32) *datapath.Datapath {
		t.Helper()
		d := loadSized(t, root, size)
		d.StartProgramLoad()
		return d
	}
	// runs reports whether the program on pbt-r0 uses m.
	runs := func(m *ebpf.Map) bool {
		t.Helper()
		l, err := h.LinkByName("pbt-r0")
		if err != nil {
			t.Fatal(err)
		}
		x := l.Attrs().Xdp
		if x == nil || !x.Attached {
			t.Fatal("no program on pbt-r0")
		}
		p, err := ebpf.NewProgramFromID(ebpf.ProgramID(x.ProgId))
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		pi, err := p.Info()
		if err != nil {
			t.Fatal(err)
		}
		mi, err := m.Info()
		if err != nil {
			t.Fatal(err)
		}
		id, _ := mi.ID()
		ids, _ := pi.MapIDs()
		return slices.Contains(ids, id)
	}

	// Tables of a thousand entries and more: a small LRU map evicts long
	// before it is full (each CPU takes free elements in batches), and
	// the test's writes to the table aside would lose flows on a 2-CPU
	// kernel (they did, at 64 entries, on 6.1).
	want := map[int]bpf.LbCtValue{}
	d := load(1024)
	if err := d.Attach("pbt-r0"); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		k, v := resizeFlow(i)
		if err := d.PbCtV2.Put(k, v); err != nil {
			t.Fatal(err)
		}
		want[i] = v
	}
	d.Close() // the link and its program stay

	// A start that ends before it attaches: the table is aside, and the
	// first program still runs on it.
	d = load(2048)
	ctHolds(t, d.PbCtV2, want, "copied at load")
	d.Close()
	old, err := ebpf.LoadPinnedMap(aside, nil)
	if err != nil {
		t.Fatalf("the previous table is not aside after a start that did not attach: %v", err)
	}
	defer old.Close()
	if !runs(old) {
		t.Fatal("the program on pbt-r0 does not use the table aside")
	}
	k10, v10 := resizeFlow(10)
	if err := old.Put(k10, v10); err != nil { // the first program's new flow
		t.Fatal(err)
	}
	want[10] = v10

	// A start whose switch fails pins the table aside again for the next:
	// pbt-r2's link cannot be pinned (a map holds its pin's name).
	if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pbt-r2"}, PeerName: "pbt-r3"}); err != nil {
		t.Fatal(err)
	}
	block, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer block.Close()
	if err := block.Pin(filepath.Join(root, "links", "pbt-r2")); err != nil {
		t.Fatal(err)
	}
	dn := load(2048)
	if err := dn.Attach("pbt-r2"); err == nil {
		t.Fatal("pbt-r2 attached over its pin's name taken")
	}
	if _, err := os.Stat(aside); err != nil {
		t.Errorf("no pin aside after a failed switch: %v", err)
	}
	dn.Close()
	block.Unpin()

	d = load(2048)
	defer d.Close()
	ctHolds(t, d.PbCtV2, want, "copied from the table aside, at the next start")
	// Before the switch, the first program closes flow 0, begins flow 11,
	// and flow 1's entry goes: the switch brings all three over.
	k0, v0 := resizeFlow(0)
	v0.Flags = maps.CTClosed
	k1, _ := resizeFlow(1)
	k11, v11 := resizeFlow(11)
	for _, err := range []error{old.Put(k0, v0), old.Delete(k1), old.Put(k11, v11)} {
		if err != nil {
			t.Fatal(err)
		}
	}
	want[0], want[11] = v0, v11
	delete(want, 1)
	if err := d.Attach("pbt-r0"); err != nil {
		t.Fatal(err)
	}
	ctHolds(t, d.PbCtV2, want, "after the switch")
	if !runs(d.PbCtV2) {
		t.Error("the program on pbt-r0 does not use the new table after the switch")
	}
	if _, err := os.Stat(aside); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the pin aside is left after the switch (%v)", err)
	}

	// A start killed after the move and before its copy left the pinned
	// table partial: a pin aside found is the previous table, taken over
	// the pinned one. With the link detached it is frozen, copied once,
	// and its pin goes.
	if err := d.Detach("pbt-r0"); err != nil {
		t.Fatal(err)
	}
	prev, err := ebpf.NewMap(&ebpf.MapSpec{Type: d.PbCtV2.Type(), KeySize: d.PbCtV2.KeySize(),
		ValueSize: d.PbCtV2.ValueSize(), MaxEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer prev.Close()
	for i, v := range want {
		k, _ := resizeFlow(i)
		if err := prev.Put(k, v); err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			if err := d.PbCtV2.Delete(k); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := prev.Pin(aside); err != nil {
		t.Fatal(err)
	}
	d.Close()
	d = load(2048)
	ctHolds(t, d.PbCtV2, want, "taken from the pin aside over a partial copy")
	if _, err := os.Stat(aside); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the pin aside of a frozen table is kept (%v)", err)
	}
}
