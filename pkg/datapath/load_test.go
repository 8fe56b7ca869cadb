// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/datapath"
)

func smallOptions(root string) datapath.Options {
	return datapath.Options{Root: root, MaxServices: 16, MaxBackends: 16, ConntrackSize: 64, EventsBytes: 1 << 16}
}

// pinOld pins a map of spec as name under root, where a previous
// version's datapath would have left it, and returns it (closed with the
// test).
func pinOld(t *testing.T, root, name string, spec *ebpf.MapSpec) *ebpf.Map {
	t.Helper()
	if err := os.MkdirAll(root, 0o700); err != nil {
		t.Fatal(err)
	}
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if err := m.Pin(filepath.Join(root, name)); err != nil {
		t.Fatal(err)
	}
	return m
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
	loaded, err := d.LoadedMapIDs()
	if err != nil {
		t.Fatal(err)
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
	// Loaded once: asking again changes nothing.
	d.StartProgramLoad()
	if err := d.LoadProgram(); err != nil {
		t.Errorf("LoadProgram after the load: %v", err)
	}
	if again, err := d.Program(); err != nil || again != prog {
		t.Errorf("Program after asking again: %v, %v; want the same program", again, err)
	}
}

// A program the kernel refuses is the load's error, for Program and
// Attach alike, and nothing is attached; Close after it is clean. A
// previous version's conntrack (pb_ct) stays where it was: the agent
// rolled back to finds its flows.
func TestProgramLoadRefused(t *testing.T) {
	bpftest.RequireRoot(t)
	root := bpftest.TempBPFFS(t)
	pinOld(t, root, "pb_ct", &ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: 40, ValueSize: 48, MaxEntries: 64})
	d, err := datapath.LoadMaps(smallOptions(root))
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
	if _, err := os.Stat(filepath.Join(root, "pb_ct")); err != nil {
		t.Errorf("pb_ct after the refused load: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
}

// The background load lowers the priority of its own thread only, which
// ends with it: no thread the Go runtime hands to other goroutines keeps
// nice 19 (the agent's loop on one would yield to every other thread).
func TestProgramLoadLeavesNoThreadNiced(t *testing.T) {
	bpftest.RequireRoot(t)
	d, err := datapath.LoadMaps(smallOptions(bpftest.TempBPFFS(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	runtime.LockOSThread()
	want, err := unix.Getpriority(unix.PRIO_PROCESS, 0)
	runtime.UnlockOSThread()
	if err != nil {
		t.Fatal(err)
	}
	d.StartProgramLoad()
	if _, err := d.Program(); err != nil {
		t.Fatal(err)
	}
	// Many goroutines at once, each on a thread of its own: the pool's
	// threads, the one the load ran on among them if it was returned.
	const n = 64
	got := make(chan int, n)
	var ready, done sync.WaitGroup
	ready.Add(n)
	done.Add(1)
	for range n {
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			p, _ := unix.Getpriority(unix.PRIO_PROCESS, 0)
			got <- p
			ready.Done()
			done.Wait() // hold the thread until all have looked
		}()
	}
	ready.Wait()
	done.Done()
	for range n {
		if p := <-got; p != want {
			t.Fatalf("a thread has priority %d after the load, want %d", p, want)
		}
	}
}

// The maps are fresh only over an empty pin directory: a restart's maps
// are not, and neither are maps loaded beside a previous version's pin,
// even one LoadMaps replaces (a kept conntrack table may refer to ids in
// counters recreated beside it).
func TestFreshPins(t *testing.T) {
	bpftest.RequireRoot(t)
	root := bpftest.TempBPFFS(t)
	load := func() bool {
		t.Helper()
		d, err := datapath.LoadMaps(smallOptions(root))
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		return d.Fresh()
	}
	if !load() {
		t.Error("maps over an empty pin directory are not fresh")
	}
	if load() {
		t.Error("the maps a previous agent pinned are fresh")
	}

	old := bpftest.TempBPFFS(t)
	pinOld(t, old, "pb_be_stats_v2", &ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	d, err := datapath.LoadMaps(smallOptions(old))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Fresh() {
		t.Error("maps loaded beside a pin of an older layout are fresh")
	}
}

// The breakers' counters and pb_flows, the flows they count, are
// recreated together: a resized conntrack table (pb_flows follows
// --conntrack-size) beside kept counters would hold the slots of flows
// nothing can release any more, and recreated counters beside kept flows
// would go negative as those end. A group with a member's pin missing is
// recreated whole too. pb_svc_backends, keyed by service id, goes with a
// recreated (or unpinned) pb_services. Other maps are kept.
func TestBreakerPinsRecreatedTogether(t *testing.T) {
	bpftest.RequireRoot(t)
	fk := bpf.LbCtKey{Sport: 1234, Dport: 80, Proto: 6}
	fk.Src.Bytes[15], fk.Dst.Bytes[15] = 1, 2
	sk := bpf.LbSvcKey{Port: 80, Proto: 6, Family: 1}
	lk := bpf.LbSvcBackendKey{SvcId: 3, Idx: 0}
	// seed pins a flow of service 3 and backend 4, counted; the service,
	// its backend list, and a health entry.
	seed := func(root string) {
		t.Helper()
		d, err := datapath.LoadMaps(smallOptions(root))
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		for _, err := range []error{
			d.PbFlows.Put(fk, bpf.LbFlowValue{SvcId: 3, BackendId: 4}),
			d.PbSvcInflight.Put(uint32(3), bpf.LbInflight{Count: 1}),
			d.PbBeInflight.Put(uint32(4), bpf.LbInflight{Count: 1}),
			d.PbHealth.Put(uint32(4), bpf.LbEndpointHealth{SvcId: 3, EjectedAtNs: 42}),
			d.PbServices.Put(sk, bpf.LbSvcValue{Id: 3}),
			d.PbSvcBackends.Put(lk, uint32(4)),
		} {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	type state struct {
		flow     bool
		svc, be  int64
		health   bool
		service  bool
		backends bool
	}
	kept := func(d *datapath.Datapath) state {
		t.Helper()
		var st state
		var fv bpf.LbFlowValue
		st.flow = d.PbFlows.Lookup(fk, &fv) == nil
		var c bpf.LbInflight
		if err := d.PbSvcInflight.Lookup(uint32(3), &c); err != nil {
			t.Fatal(err)
		}
		st.svc = c.Count
		if err := d.PbBeInflight.Lookup(uint32(4), &c); err != nil {
			t.Fatal(err)
		}
		st.be = c.Count
		var h bpf.LbEndpointHealth
		st.health = d.PbHealth.Lookup(uint32(4), &h) == nil && h.EjectedAtNs == 42
		var sv bpf.LbSvcValue
		st.service = d.PbServices.Lookup(sk, &sv) == nil
		var id uint32
		st.backends = d.PbSvcBackends.Lookup(lk, &id) == nil
		return st
	}
	all := state{flow: true, svc: 1, be: 1, health: true, service: true, backends: true}
	for _, tc := range []struct {
		name   string
		change func(root string, o *datapath.Options)
		want   state
	}{
		{"same sizes", func(string, *datapath.Options) {}, all},
		{"conntrack resized", func(_ string, o *datapath.Options) { o.ConntrackSize *= 2 },
			state{health: true, service: true, backends: true}},
		// pb_health and pb_svc_backends follow --max-backends too.
		{"more backends", func(_ string, o *datapath.Options) { o.MaxBackends *= 2 },
			state{service: true}},
		{"more services", func(_ string, o *datapath.Options) { o.MaxServices *= 2 },
			state{health: true}},
		{"a counter's pin removed", func(root string, _ *datapath.Options) {
			if err := os.Remove(filepath.Join(root, "pb_be_inflight")); err != nil {
				t.Fatal(err)
			}
		}, state{health: true, service: true, backends: true}},
		{"pb_services' pin removed", func(root string, _ *datapath.Options) {
			if err := os.Remove(filepath.Join(root, "pb_services")); err != nil {
				t.Fatal(err)
			}
		}, state{flow: true, svc: 1, be: 1, health: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := bpftest.TempBPFFS(t)
			seed(root)
			opts := smallOptions(root)
			tc.change(root, &opts)
			d, err := datapath.LoadMaps(opts)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			if got := kept(d); got != tc.want {
				t.Errorf("after the change the maps hold %+v, want %+v", got, tc.want)
			}
		})
	}
}

// resizeFlow is the i-th test flow's forward key and a value to tell it by.
func resizeFlow(i int) (bpf.LbCtKey, bpf.LbCtValue) {
	k := bpf.LbCtKey{Sport: uint16(40000 + i), Dport: 80, Proto: 6, Family: 1}
	k.Src.Bytes[15], k.Dst.Bytes[15] = 1, 2
	return k, bpf.LbCtValue{SvcId: 3, BackendId: uint32(i), CreatedNs: uint64(i) + 1}
}

// ctHolds checks that m holds exactly the flows of want, each with its
// value.
func ctHolds(t *testing.T, m *ebpf.Map, want map[int]bpf.LbCtValue, when string) {
	t.Helper()
	got := map[int]bpf.LbCtValue{}
	var k bpf.LbCtKey
	var v bpf.LbCtValue
	for it := m.Iterate(); it.Next(&k, &v); {
		got[int(k.Sport)-40000] = v
	}
	for i, w := range want {
		if g, ok := got[i]; !ok || g != w {
			t.Errorf("%s: flow %d: %+v (held %v), want %+v", when, i, g, ok, w)
		}
	}
	if len(got) != len(want) {
		t.Errorf("%s: the table holds %d flows, want %d", when, len(got), len(want))
	}
}

// A new --conntrack-size keeps the flows: the previous table's are copied
// into the resized one at load. With no link running a program on it (the
// previous table is frozen), that copy is all, and its pin aside goes at
// once. A smaller table takes the flows only if they fill at most three
// quarters of it. (TestConntrackResizeAcrossASwitch: a table a program
// still writes.)
func TestConntrackResizeKeepsFlows(t *testing.T) {
	bpftest.RequireRoot(t)
	root := bpftest.TempBPFFS(t)
	aside := filepath.Join(root, datapath.CTAside)
	load := func(size uint32) *datapath.Datapath {
		t.Helper()
		d := loadSized(t, root, size)
		if got := d.PbCtV2.MaxEntries(); got != size {
			t.Fatalf("pb_ct_v2 has %d entries, want %d", got, size)
		}
		if _, err := os.Stat(aside); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("a pin aside is left with no program on it (%v)", err)
		}
		return d
	}
	// Tables of a thousand entries and more, but for the one too small:
	// a small LRU map evicts long before it is full (each CPU takes free
	// elements in batches).
	want := map[int]bpf.LbCtValue{}
	d := load(1024)
	for i := range 20 {
		k, v := resizeFlow(i)
		if err := d.PbCtV2.Put(k, v); err != nil {
			t.Fatal(err)
		}
		want[i] = v
	}
	d.Close()

	d = load(2048)
	ctHolds(t, d.PbCtV2, want, "grown")
	d.Close()
	d = load(512)
	ctHolds(t, d.PbCtV2, want, "shrunk to 512")
	d.Close()
	d = load(16) // 20 flows do not fit in three quarters of 16
	ctHolds(t, d.PbCtV2, nil, "shrunk to 16")
	d.Close()
}

// loadSized loads the maps under root with a conntrack table of size
// entries.
func loadSized(t *testing.T, root string, size uint32) *datapath.Datapath {
	t.Helper()
	o := smallOptions(root)
	o.ConntrackSize = size
	d, err := datapath.LoadMaps(o)
	if err != nil {
		t.Fatal(err)
	}
	return d
}
