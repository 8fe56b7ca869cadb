// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/datapath"
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
