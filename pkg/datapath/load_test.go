// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"strings"
	"testing"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/datapath"
)

func smallOptions(root string) datapath.Options {
	return datapath.Options{Root: root, MaxServices: 16, MaxBackends: 16, ConntrackSize: 64, EventsBytes: 1 << 16}
}

// The program loaded after the maps (StartProgramLoad, while the agent
// writes its first state) runs over the maps LoadMaps made, the data
// sections' too: a copy made for the program would be a map the agent
// never writes. The kernel lists a program's maps by id.
func TestProgramLoadsOverTheLoadedMaps(t *testing.T) {
	bpftest.RequireRoot(t)
	d, err := datapath.LoadMaps(smallOptions(bpftest.TempBPFFS(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.Program(); err == nil || !strings.Contains(err.Error(), "not loaded") {
		t.Fatalf("Program before any load: err %v, want not loaded", err)
	}
	d.StartProgramLoad()
	prog, err := d.Program()
	if err != nil {
		t.Fatal(err)
	}
	if prog != d.PbXdp {
		t.Error("Program and PbXdp differ")
	}
	info, err := prog.Info()
	if err != nil {
		t.Fatal(err)
	}
	used, ok := info.MapIDs()
	if !ok || len(used) == 0 {
		t.Fatalf("the kernel lists no maps of the program (%v)", ok)
	}
	loaded, err := d.LoadedMapIDs()
	if err != nil {
		t.Fatal(err)
	}
	sections := 0
	for _, id := range used {
		name, ok := loaded[id]
		if !ok {
			t.Errorf("the program uses map id %d, which LoadMaps did not make", id)
		}
		if strings.HasPrefix(name, ".") {
			sections++
		}
	}
	if sections == 0 {
		t.Errorf("the program uses no data section of LoadMaps' (maps %v)", loaded)
	}
}

// A program the kernel refuses is the load's error, for Program and
// Attach alike, and nothing is attached; Close after it is clean.
func TestProgramLoadRefused(t *testing.T) {
	bpftest.RequireRoot(t)
	d, err := datapath.LoadMaps(smallOptions(bpftest.TempBPFFS(t)))
	if err != nil {
		t.Fatal(err)
	}
	d.BreakProgram()
	d.StartProgramLoad()
	if _, err := d.Program(); err == nil || !strings.Contains(err.Error(), "verifier") {
		t.Errorf("Program: err %v, want the verifier's", err)
	}
	// No such interface: the program's error must come first, before
	// anything of the node is looked at.
	if err := d.Attach("pb-none0"); err == nil || !strings.Contains(err.Error(), "verifier") {
		t.Errorf("Attach: err %v, want the verifier's", err)
	}
	if got := d.Attached(); len(got) != 0 {
		t.Errorf("attached %v", got)
	}
	if err := d.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
}
