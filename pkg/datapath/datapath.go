// SPDX-License-Identifier: Apache-2.0

// Package datapath loads the XDP program and its maps, pins them under a
// bpffs directory and attaches the program to interfaces through pinned
// bpf_links. Pins outlive the agent: a restarted agent adopts the maps it
// finds (conntrack and all) and swaps its program into the existing links
// without a gap, so established flows keep flowing.
package datapath

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
)

// DefaultRoot is where maps and links are pinned unless told otherwise.
const DefaultRoot = "/sys/fs/bpf/penaltybox"

// Options size the maps. Zero values take the defaults below. Changing a
// size of a pinned map recreates that map, with what refers to it
// (pinGroups, pinFollowers): the agent logs it when it happens. Conntrack's
// flows are carried into the resized table (resize.go).
type Options struct {
	Root          string
	MaxServices   uint32
	MaxBackends   uint32
	ConntrackSize uint32 // entries; each flow takes two
	EventsBytes   uint32 // ring buffer size, a power of two multiple of the page size
	// AffinityClients: (service, client) pairs pb_affinity remembers for
	// sessionAffinity.
	AffinityClients uint32
	XDPMode         string // XDPAuto (the default), XDPNative or XDPGeneric
	Logger          *slog.Logger
	// UnseededConntrack, for tests: pb_ct_v2 hashes its keys without a
	// random seed (BPF_F_ZERO_SEED; CAP_SYS_ADMIN), so a test can put
	// entries in the buckets it wants, in the order it wants.
	UnseededConntrack bool
}

// XDP attach modes (--xdp-mode).
const (
	// XDPAuto attaches generic XDP to veths and native XDP elsewhere
	// (generic where the driver has no native XDP, as VXLAN devices).
	// Native XDP on a veth hands every packet the peer sends to a
	// 256-entry ring that the veth's NAPI drains in a second softirq
	// pass; when the CPU it runs on is busy (a SYN flood) the ring
	// overflows and packets are dropped before any program sees them.
	// Generic XDP runs in the receive path the packet takes anyway, in
	// the sender's softirq, behind the per-CPU backlog (where tc
	// programs run): the sender pays for what it sends.
	XDPAuto = "auto"
	// XDPNative attaches native XDP wherever the driver has it, veths
	// included (generic where not).
	XDPNative = "native"
	// XDPGeneric attaches generic XDP everywhere.
	XDPGeneric = "generic"
)

// CheckXDPMode says whether mode is one of the XDP attach modes.
func CheckXDPMode(mode string) error {
	switch mode {
	case XDPAuto, XDPNative, XDPGeneric:
		return nil
	}
	return fmt.Errorf("%q: want %s, %s or %s", mode, XDPAuto, XDPNative, XDPGeneric)
}

// xdpAttempts are the attach modes to try, in order, for an interface of
// netlink link type kind ("veth", "vxlan", "device", ...) under mode.
func xdpAttempts(mode, kind string) []link.XDPAttachFlags {
	switch {
	case mode == XDPGeneric, mode == XDPAuto && kind == "veth":
		return []link.XDPAttachFlags{link.XDPGenericMode}
	}
	return []link.XDPAttachFlags{link.XDPDriverMode, link.XDPGenericMode}
}

func xdpModeName(f link.XDPAttachFlags) string {
	if f == link.XDPGenericMode {
		return "generic"
	}
	return "driver"
}

// attachedMode names the mode of the XDP program netlink reports on an
// interface as xdpModeName does; "" when none is attached (or offloaded).
func attachedMode(x *netlink.LinkXdp) string {
	switch {
	case x == nil || !x.Attached:
		return ""
	case x.AttachMode == nl.XDP_ATTACHED_DRV:
		return xdpModeName(link.XDPDriverMode)
	case x.AttachMode == nl.XDP_ATTACHED_SKB:
		return xdpModeName(link.XDPGenericMode)
	}
	return ""
}

const (
	DefaultMaxServices   = 65536
	DefaultMaxBackends   = 262144
	DefaultConntrackSize = 262144
	DefaultEventsBytes   = 1 << 22
	// About 6 MB of kernel memory (an LRU hash is allocated whole).
	DefaultAffinityClients = 65536
)

func (o *Options) setDefaults() {
	if o.Root == "" {
		o.Root = DefaultRoot
	}
	if o.MaxServices == 0 {
		o.MaxServices = DefaultMaxServices
	}
	if o.MaxBackends == 0 {
		o.MaxBackends = DefaultMaxBackends
	}
	if o.ConntrackSize == 0 {
		o.ConntrackSize = DefaultConntrackSize
	}
	if o.EventsBytes == 0 {
		o.EventsBytes = DefaultEventsBytes
	}
	if o.AffinityClients == 0 {
		o.AffinityClients = DefaultAffinityClients
	}
	if o.XDPMode == "" {
		o.XDPMode = XDPAuto
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
}

// Datapath is the loaded program and its pinned maps.
type Datapath struct {
	// LbObjects: the maps (and variables), the counters' reset program
	// (PbStatsResetRun) and the sweep's programs (PbCtExpireRun and
	// PbCtSweepRun, each nil if the kernel refused it) once loaded; the XDP
	// program (PbXdp) once LoadProgram returned, or Program says it did.
	bpf.LbObjects
	Opts Options
	// InnerSpec is the Maglev inner map template, for creating tables.
	InnerSpec *ebpf.MapSpec

	// spec is what LoadProgram loads the program from; maps, by name,
	// every map LoadMaps made, which the program is loaded over (the data
	// sections' too: it must read the variables the agent writes, not
	// copies). Both nil once loaded.
	spec     *ebpf.CollectionSpec
	maps     map[string]*ebpf.Map
	sections *ebpf.Collection // the data sections' maps: LbObjects holds no handle on them
	// loading, once StartProgramLoad ran: closed when the load ended,
	// with loadErr its error.
	loading chan struct{}
	loadErr error

	// fresh: the pin directory was empty when LoadMaps ran (see Fresh).
	fresh bool
	// ctOld: the previous pb_ct_v2 of a resize, until a link runs the new
	// program (resize.go); nil otherwise.
	ctOld *ebpf.Map

	log   *slog.Logger
	mu    sync.Mutex
	links map[string]link.Link
}

// Fresh reports whether the maps were all created by this LoadMaps over
// an empty pin directory: no previous agent's state to adopt, no flow
// kept, every counter still zero. A pin of any kind, even one recreated
// for a changed layout, makes it false: a conntrack table kept beside
// recreated counters still refers to their ids.
func (d *Datapath) Fresh() bool { return d.fresh }

// statsBlocks is how many elements of pb_svc_stats_v2 or pb_be_stats_v2
// hold n ids' counters (PB_STATS_BLOCK to an element).
func statsBlocks(n uint32) uint32 {
	block := uint32(len(bpf.LbSvcStatsBlock{}.S))
	return max((n+block-1)/block, 1)
}

// Spec returns the program's collection spec sized by opts.
func Spec(opts Options) (*ebpf.CollectionSpec, error) {
	opts.setDefaults()
	spec, err := bpf.LoadLb()
	if err != nil {
		return nil, err
	}
	sizes := map[string]uint32{
		bpf.LbMapPbServices:     opts.MaxServices,
		bpf.LbMapPbSvcKeys:      opts.MaxServices,
		bpf.LbMapPbMaglev:       2 * opts.MaxServices, // two tables per service
		bpf.LbMapPbMaglevFb:     opts.MaxServices,
		bpf.LbMapPbSvcStatsV2:   statsBlocks(opts.MaxServices),
		bpf.LbMapPbSvcInflight:  opts.MaxServices,
		bpf.LbMapPbSvcTrip:      opts.MaxServices,
		bpf.LbMapPbBackends:     opts.MaxBackends,
		bpf.LbMapPbBeStatsV2:    statsBlocks(opts.MaxBackends),
		bpf.LbMapPbBeInflight:   opts.MaxBackends,
		bpf.LbMapPbHealth:       opts.MaxBackends,
		bpf.LbMapPbBeTrip:       opts.MaxBackends,
		bpf.LbMapPbSvcBackends:  opts.MaxBackends,
		bpf.LbMapPbCtV2:         opts.ConntrackSize,
		bpf.LbMapPbFlows:        max(opts.ConntrackSize/2, 1), // a flow takes two conntrack entries
		bpf.LbMapPbCtSweepApart: opts.ConntrackSize,
		bpf.LbMapPbCtSweepLone:  opts.ConntrackSize,
		bpf.LbMapPbCtInuseVips:  opts.MaxServices,
		bpf.LbMapPbEvents:       opts.EventsBytes,
		bpf.LbMapPbAffinity:     opts.AffinityClients,
	}
	for name, n := range sizes {
		ms, ok := spec.Maps[name]
		if !ok {
			return nil, fmt.Errorf("datapath: map %s missing from object", name)
		}
		ms.MaxEntries = n
	}
	if opts.UnseededConntrack {
		spec.Maps[bpf.LbMapPbCtV2].Flags |= unix.BPF_F_ZERO_SEED
	}
	if HaveNFKfuncs() {
		if err := spec.Variables[bpf.LbVarPbNfKfuncs].Set(uint32(1)); err != nil {
			return nil, fmt.Errorf("datapath: %s: %w", bpf.LbVarPbNfKfuncs, err)
		}
	}
	return spec, nil
}

// Load loads the program, creating or adopting the pinned maps under
// opts.Root (mounting a bpffs when needed).
func Load(opts Options) (*Datapath, error) {
	d, err := LoadMaps(opts)
	if err != nil {
		return nil, err
	}
	if err := d.LoadProgram(); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// LoadMaps creates or adopts the pinned maps under opts.Root (mounting a
// bpffs when needed), and leaves the program to LoadProgram or
// StartProgramLoad: the verifier takes most of a second over it, which
// the agent spends writing its first state into the maps meanwhile.
func LoadMaps(opts Options) (*Datapath, error) {
	opts.setDefaults()
	if err := CheckXDPMode(opts.XDPMode); err != nil {
		return nil, fmt.Errorf("datapath: XDP mode %w", err)
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("datapath: memlock: %w", err)
	}
	pins, err := ensureBPFFS(opts.Root)
	if err != nil {
		return nil, err
	}
	if opts.Logger != nil {
		how := "an existing bpffs"
		if pins.Mounted {
			how = "a bpffs the agent mounted"
		}
		opts.Logger.Info("pins outlive the agent: the datapath keeps forwarding while it is down",
			"bpffs_root", pins.Root, "bpffs_mount", pins.Mount, "on", how)
	}
	spec, err := Spec(opts)
	if err != nil {
		return nil, err
	}
	d := &Datapath{Opts: opts, log: opts.Logger, links: map[string]link.Link{},
		InnerSpec: spec.Maps[bpf.LbMapPbMaglev].InnerMap.Copy(), spec: spec}
	if entries, err := os.ReadDir(opts.Root); err == nil && len(entries) == 0 {
		d.fresh = true
	}
	// A failed load lets the previous table of a resize go, its pin left
	// aside for the next start.
	loaded := false
	defer func() {
		if !loaded && d.ctOld != nil {
			d.ctOld.Close()
			d.ctOld = nil
		}
	}()
	if err := d.dropIncompatiblePins(spec); err != nil {
		return nil, err
	}

	// The maps alone (the loader copies what it changes; the programs'
	// instructions need no copy to be left out).
	mapsOnly := &ebpf.CollectionSpec{Maps: spec.Maps, Variables: spec.Variables, Types: spec.Types, ByteOrder: spec.ByteOrder}
	coll, err := ebpf.NewCollectionWithOptions(mapsOnly, ebpf.CollectionOptions{
		Maps: ebpf.MapOptions{PinPath: opts.Root},
	})
	if err != nil {
		return nil, fmt.Errorf("datapath: load maps: %w", err)
	}
	d.maps = maps.Clone(coll.Maps)
	if err := coll.Assign(&d.LbMaps); err != nil {
		coll.Close()
		return nil, fmt.Errorf("datapath: load maps: %w", err)
	}
	if err := coll.Assign(&d.LbVariables); err != nil {
		coll.Close()
		d.LbMaps.Close()
		return nil, fmt.Errorf("datapath: load maps: %w", err)
	}
	d.sections = coll
	d.copyCT()
	d.loadExpire(spec)
	d.loadSweep(spec)
	if err := d.loadStatsReset(spec); err != nil {
		d.Close()
		return nil, err
	}
	loaded = true
	return d, nil
}

// loadStatsReset loads pb_stats_reset_run, which zeroes a reused id's
// counters (maps.Maps.UseStatsReset), over the maps LoadMaps made. It
// needs bpf_map_lookup_percpu_elem (KernelFeatures).
func (d *Datapath) loadStatsReset(spec *ebpf.CollectionSpec) error {
	var p struct {
		Run *ebpf.Program `ebpf:"pb_stats_reset_run"`
	}
	if err := spec.LoadAndAssign(&p, &ebpf.CollectionOptions{MapReplacements: d.maps}); err != nil {
		return fmt.Errorf("datapath: load pb_stats_reset_run: %w", err)
	}
	d.PbStatsResetRun = p.Run
	return nil
}

// loadExpire loads pb_ct_expire_run, the conntrack sweep's deletes in the
// kernel, over the maps LoadMaps made. It is a few dozen instructions,
// and the agent sweeps before the XDP program is loaded, so it comes with
// the maps. A kernel that refuses it leaves the sweep to
// its system calls (maps.Maps.ExpireCT), which do the same, slower.
func (d *Datapath) loadExpire(spec *ebpf.CollectionSpec) {
	var p struct {
		Run *ebpf.Program `ebpf:"pb_ct_expire_run"`
	}
	if err := spec.LoadAndAssign(&p, &ebpf.CollectionOptions{MapReplacements: d.maps}); err != nil {
		d.log.Warn("conntrack sweep program not loaded: the sweep deletes with a system call per entry", "err", err)
		return
	}
	d.PbCtExpireRun = p.Run
}

// loadSweep loads pb_ct_sweep_run, the whole conntrack sweep in the
// kernel (maps.Maps.UseCTSweep), over the maps LoadMaps made. A kernel
// that refuses it leaves the sweep to the agent's copy of the table.
func (d *Datapath) loadSweep(spec *ebpf.CollectionSpec) {
	var p struct {
		Run *ebpf.Program `ebpf:"pb_ct_sweep_run"`
	}
	if err := spec.LoadAndAssign(&p, &ebpf.CollectionOptions{MapReplacements: d.maps}); err != nil {
		d.log.Warn("kernel conntrack sweep not loaded: the agent sweeps a copy of the table", "err", err)
		return
	}
	d.PbCtSweepRun = p.Run
}

// LoadProgram loads the XDP program over the maps LoadMaps made, once.
func (d *Datapath) LoadProgram() error {
	if d.PbXdp != nil {
		return nil
	}
	start := time.Now()
	var progs struct {
		Xdp *ebpf.Program `ebpf:"pb_xdp"`
	}
	err := d.spec.LoadAndAssign(&progs, &ebpf.CollectionOptions{MapReplacements: d.maps})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return fmt.Errorf("datapath: verifier: %+v", ve)
		}
		return fmt.Errorf("datapath: load: %w", err)
	}
	d.PbXdp = progs.Xdp
	// The spec (instructions, BTF) is megabytes the agent no longer needs.
	d.spec, d.maps = nil, nil
	d.log.Info("datapath program loaded", "took", time.Since(start).Round(time.Millisecond).String())
	// Only now: with a program the kernel refuses, an older agent rolled
	// back to still finds its flows where it left them.
	d.migrateConntrack()
	return nil
}

// StartProgramLoad runs LoadProgram in the background, on a thread of
// the lowest priority (nice 19); Program waits for it. Until the program
// is attached, the interfaces run the previous agent's (a restart) or
// none: writing the maps meanwhile is what the agent does before it
// attaches anyway. In a container, the priority weighs only against the
// container's other threads (its cgroup has its own share); outside one,
// against the whole host's, where a busy host makes the load wait.
func (d *Datapath) StartProgramLoad() {
	if d.loading != nil || d.PbXdp != nil {
		return // begun or done already
	}
	d.loading = make(chan struct{})
	go func() {
		defer close(d.loading)
		// The verifier runs on this thread, in the kernel: at the lowest
		// priority, it takes the CPU the agent's other threads leave idle.
		// The thread, locked and never unlocked, ends with the goroutine.
		runtime.LockOSThread()
		if err := unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 19); err != nil {
			d.log.Debug("verifier thread priority", "err", err)
		}
		d.loadErr = d.LoadProgram()
	}()
}

// Program is the loaded XDP program, once the load StartProgramLoad
// began has ended (at once after LoadProgram).
func (d *Datapath) Program() (*ebpf.Program, error) {
	if d.loading != nil {
		<-d.loading
		if d.loadErr != nil {
			return nil, d.loadErr
		}
	}
	if d.PbXdp == nil {
		return nil, errors.New("datapath: program not loaded")
	}
	return d.PbXdp, nil
}

// dropIncompatiblePins removes pinned maps whose type, sizes or flags no
// longer match the spec, so they are created afresh instead of failing the
// load, and with them the maps whose contents refer to theirs (pinGroups,
// pinFollowers). Layout changes get a new map name (see README), so this
// only fires when an operator changed a size flag. A map of a group, or a
// follower, that cannot be removed fails the load: kept beside the new
// maps, it would be wrong for good. A pin gone already is no failure.
func (d *Datapath) dropIncompatiblePins(spec *ebpf.CollectionSpec) error {
	// Maps a layout change renamed: an older agent's pins, which nothing
	// reads any more.
	for _, name := range retiredPins {
		path := filepath.Join(d.Opts.Root, name)
		if err := os.Remove(path); err == nil {
			d.log.Info("removed the pin of a map this version replaced", "map", name)
		} else if !errors.Is(err, os.ErrNotExist) {
			d.log.Warn("remove a retired pin", "map", name, "err", err)
		}
	}
	drop := map[string]string{} // pin name → why it goes
	pinned := map[string]bool{}
	dropCT := d.prepareCTResize(spec.Maps[bpf.LbMapPbCtV2])
	for name, ms := range spec.Maps {
		if ms.Pinning != ebpf.PinByName {
			continue
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(d.Opts.Root, name), nil)
		if err != nil {
			continue
		}
		pinned[name] = true
		cerr := ms.Compatible(m)
		m.Close()
		if cerr != nil {
			drop[name] = cerr.Error()
		}
		if name == bpf.LbMapPbCtV2 && dropCT != "" {
			drop[name] = dropCT
		}
	}
	for _, group := range pinGroups {
		cause, n := "", 0
		for _, name := range group {
			if pinned[name] {
				n++
			}
			if _, ok := drop[name]; ok && cause == "" {
				cause = "recreated with " + name
			}
		}
		if cause == "" && n > 0 && n < len(group) {
			cause = "a map of its group is not pinned" // created empty beside it
		}
		for _, name := range group {
			if _, ok := drop[name]; !ok && pinned[name] && cause != "" {
				drop[name] = cause
			}
		}
	}
	for lead, followers := range pinFollowers {
		if _, ok := drop[lead]; ok || !pinned[lead] {
			for _, name := range followers {
				if _, ok := drop[name]; !ok && pinned[name] {
					drop[name] = "recreated with " + lead
				}
			}
		}
	}
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(drop)) {
		lost := lostOnRecreate(name)
		if name == bpf.LbMapPbCtV2 && d.ctOld != nil {
			lost = "nothing, if they fit: the flows are copied from the table moved aside (logged below)"
		}
		d.log.Warn("pinned map does not match, recreating it", "map", name, "reason", drop[name], "lost", lost)
		err := os.Remove(filepath.Join(d.Opts.Root, name))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			d.log.Error("remove pinned map", "map", name, "err", err)
			if recreatedWithOthers(name) {
				errs = append(errs, fmt.Errorf("datapath: remove the pin of %s: %w", name, err))
			}
		}
	}
	return errors.Join(errs...)
}

// pinGroups are maps whose contents count each other's: recreating one
// alone would leave the others wrong for good. pb_svc_inflight and
// pb_be_inflight count the flows pb_flows holds, and only a delete from
// pb_flows gives a slot back; so a pb_flows recreated empty (its size
// follows --conntrack-size) beside kept counters would hold their slots
// forever, and counters recreated at zero (--max-services,
// --max-backends) beside kept flows would go negative as those end.
// Recreated together, the breakers start from zero: flows open at the
// restart go uncounted until they end.
var pinGroups = [][]string{{bpf.LbMapPbFlows, bpf.LbMapPbSvcInflight, bpf.LbMapPbBeInflight}}

// pinFollowers are maps recreated whenever the map they follow is, but
// not the other way round. pb_svc_backends is keyed by service id: beside
// a recreated pb_services (--max-services) its lists are of ids nothing
// holds any more, and nothing would ever delete them.
var pinFollowers = map[string][]string{bpf.LbMapPbServices: {bpf.LbMapPbSvcBackends}}

// recreatedWithOthers reports whether name is in a pin group or follows
// another map: kept beside the others recreated, it would be wrong.
func recreatedWithOthers(name string) bool {
	for _, g := range pinGroups {
		if slices.Contains(g, name) {
			return true
		}
	}
	for _, fs := range pinFollowers {
		if slices.Contains(fs, name) {
			return true
		}
	}
	return false
}

// retiredPins are maps a layout change gave a new name: pb_syns became
// pb_syns_v2 (16-byte addresses), pb_config pb_config_v2 (the hash seed,
// the reverse-path check), pb_partial_ifaces pb_ifaces (masters),
// pb_stats pb_stats_v2 (the evidence counters), pb_svc_stats and
// pb_be_stats pb_svc_stats_v2 and pb_be_stats_v2 (PB_STATS_BLOCK ids to an
// element: their counters restart from 0). pb_ct, now pb_ct_v2 (the
// flows' sequence numbers), is copied over first (migrateConntrack).
var retiredPins = []string{"pb_syns", "pb_config", "pb_partial_ifaces", "pb_stats", "pb_svc_stats", "pb_be_stats"}

// ctValueV1 is pb_ct's value before pb_ct_v2.
type ctValueV1 struct {
	NatAddr    [16]byte
	NatPort    uint16
	Pad        uint16
	Flags      uint32
	SvcID      uint32
	BackendID  uint32
	CreatedNs  uint64
	LastSeenNs uint64
}

// ctMidstream is PB_CT_MIDSTREAM.
const ctMidstream = 0x0080

// migrateConntrack copies the flows of a previous version's pb_ct into
// pb_ct_v2 and removes its pin, so an upgrade keeps every flow on its
// backend. Their sequence numbers were never kept: the copies are marked
// midstream, as flows picked up without their handshake, and decide no
// outcome. Flows the old program creates between the copy and the switch
// of the links to this one are picked up midstream by it.
func (d *Datapath) migrateConntrack() {
	path := filepath.Join(d.Opts.Root, "pb_ct")
	old, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		return
	}
	defer old.Close()
	n, failed := 0, 0
	if old.ValueSize() == uint32(binary.Size(ctValueV1{})) {
		var k bpf.LbCtKey
		var v ctValueV1
		it := old.Iterate()
		for it.Next(&k, &v) {
			nv := bpf.LbCtValue{NatPort: v.NatPort, Flags: v.Flags | ctMidstream, SvcId: v.SvcID,
				BackendId: v.BackendID, CreatedNs: v.CreatedNs, LastSeenNs: v.LastSeenNs}
			nv.NatAddr.Bytes = v.NatAddr
			if err := d.PbCtV2.Update(k, nv, ebpf.UpdateNoExist); err != nil && !errors.Is(err, ebpf.ErrKeyExist) {
				failed++
				continue
			}
			n++
		}
	}
	if err := os.Remove(path); err != nil {
		d.log.Warn("remove a retired pin", "map", "pb_ct", "err", err)
	}
	d.log.Info("copied the flows of the previous version's conntrack", "from", "pb_ct", "to", bpf.LbMapPbCtV2,
		"flows", n, "failed", failed)
}

func lostOnRecreate(name string) string {
	switch name {
	case bpf.LbMapPbCtV2:
		return "established flows (they will be re-balanced, most break)"
	case bpf.LbMapPbEvents:
		return "undelivered outcome events"
	case bpf.LbMapPbStatsV2, bpf.LbMapPbSvcStatsV2, bpf.LbMapPbBeStatsV2, bpf.LbMapPbSynGuardCpu:
		return "kernel counters (they restart from 0, which Prometheus reads as a reset)"
	case bpf.LbMapPbFlows, bpf.LbMapPbSvcInflight, bpf.LbMapPbBeInflight:
		return "the circuit breakers' counts (they restart from 0: flows open now go uncounted until they end)"
	case bpf.LbMapPbHealth:
		return "the endpoints' ejections and penalties (an ejected endpoint is readmitted)"
	case bpf.LbMapPbSrcTrust:
		return "the SYN guard's trusted sources (each proves itself again with its next connection)"
	default:
		return "nothing: the agent rewrites it from the desired state"
	}
}

func (d *Datapath) linkDir() string { return filepath.Join(d.Opts.Root, "links") }

// linkPin is where the link of interface ifname is pinned. bpffs refuses
// names with a dot (reserved), and interface names may have one
// (flannel.1, vxlan.calico): dots become "%2e", and "%" itself "%25", so
// the mapping can be undone (pinnedIface).
func (d *Datapath) linkPin(ifname string) string {
	return filepath.Join(d.linkDir(), strings.NewReplacer("%", "%25", ".", "%2e").Replace(ifname))
}

// pinnedIface is the interface name a link pin stands for.
func pinnedIface(pin string) string {
	return strings.NewReplacer("%2e", ".", "%25", "%").Replace(pin)
}

// Attach runs the program on ifname's XDP hook through a pinned bpf_link.
// An existing pinned link for the same interface is adopted and atomically
// switched to this program.
func (d *Datapath) Attach(ifname string) error {
	prog, err := d.Program()
	if err != nil {
		return fmt.Errorf("attach %s: %w", ifname, err)
	}
	iface, err := net.InterfaceByName(ifname)
	if err != nil {
		return fmt.Errorf("attach %s: %w", ifname, err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	// Until a link runs this program, a resized table is brought up to
	// date with the previous one before each switch (resize.go).
	d.syncCT()
	d.unpinAside()
	if err := d.attachLocked(ifname, iface, prog); err != nil {
		d.repinAside() // no link switched
		return err
	}
	d.releaseCT()
	return nil
}

// attachLocked is Attach with d.mu held.
func (d *Datapath) attachLocked(ifname string, iface *net.Interface, prog *ebpf.Program) error {
	if l, ok := d.links[ifname]; ok {
		// -1: the link's info could not be read; it is kept, not
		// replaced on a guess.
		if idx := linkIfindex(l); idx == iface.Index || idx == -1 {
			return nil
		}
		// The interface was deleted (and maybe created again) under the
		// same name: the link died with the old one and must not stand
		// for the new. Its pin is found defunct below, as after a restart.
		l.Close()
		delete(d.links, ifname)
	}
	if err := os.MkdirAll(d.linkDir(), 0o700); err != nil {
		return fmt.Errorf("attach %s: %w", ifname, err)
	}
	pin := d.linkPin(ifname)
	kind, attached := "", ""
	if nlink, err := netlink.LinkByIndex(iface.Index); err == nil {
		kind, attached = nlink.Type(), attachedMode(nlink.Attrs().Xdp)
	}
	attempts := xdpAttempts(d.Opts.XDPMode, kind)

	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		if linkIfindex(l) == iface.Index {
			if err := l.Update(prog); err != nil {
				l.Close()
				return fmt.Errorf("attach %s: update pinned link: %w", ifname, err)
			}
			d.links[ifname] = l
			d.log.Info("adopted XDP link", "interface", ifname, "ifindex", iface.Index, "mode", attached)
			// Native and generic XDP cannot be attached at once: changing
			// the mode would leave the interface without a program for a
			// moment, so an adopted link keeps the mode it has.
			if want := xdpModeName(attempts[0]); attached != "" && attached != want {
				d.log.Warn("XDP link kept in the mode it was attached in; detach it (remove the interface from the agent's interfaces) or recreate the interface to change it",
					"interface", ifname, "mode", attached, "xdpMode", d.Opts.XDPMode, "wouldAttach", want)
			}
			return nil
		}
		// The interface was recreated under the same name: the old link is defunct.
		d.log.Info("XDP link lost with its interface; attaching again", "interface", ifname, "ifindex", iface.Index)
		l.Unpin()
		l.Close()
	}

	var l link.Link
	var err error
	var errs []string
	for _, f := range attempts {
		if l, err = link.AttachXDP(link.XDPOptions{Program: prog, Interface: iface.Index, Flags: f}); err == nil {
			break
		}
		errs = append(errs, fmt.Sprintf("%s mode: %v", xdpModeName(f), err))
	}
	if l == nil {
		return fmt.Errorf("attach %s (--xdp-mode %s): %s", ifname, d.Opts.XDPMode, strings.Join(errs, "; "))
	}
	mode := xdpModeName(attempts[len(errs)])
	if err := l.Pin(pin); err != nil {
		l.Close()
		return fmt.Errorf("attach %s: pin link: %w", ifname, err)
	}
	d.links[ifname] = l
	d.log.Info("attached XDP", "interface", ifname, "ifindex", iface.Index, "kind", kind, "mode", mode, "xdpMode", d.Opts.XDPMode)
	return nil
}

func linkIfindex(l link.Link) int {
	info, err := l.Info()
	if err != nil {
		return -1
	}
	if x := info.XDP(); x != nil {
		return int(x.Ifindex)
	}
	return -1
}

// Detach removes the program from ifname.
func (d *Datapath) Detach(ifname string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	l, ok := d.links[ifname]
	if !ok {
		var err error
		l, err = link.LoadPinnedLink(d.linkPin(ifname), nil)
		if err != nil {
			return nil
		}
	}
	delete(d.links, ifname)
	if err := l.Unpin(); err != nil {
		l.Close()
		return fmt.Errorf("detach %s: %w", ifname, err)
	}
	d.log.Info("detached XDP", "interface", ifname)
	return l.Close()
}

// Attached lists the interfaces that have a pinned link, whether this
// process attached them or a previous agent did.
func (d *Datapath) Attached() []string {
	ents, _ := os.ReadDir(d.linkDir())
	var out []string
	for _, e := range ents {
		out = append(out, pinnedIface(e.Name()))
	}
	sort.Strings(out)
	return out
}

// Close releases this process's handles. Pinned links and maps stay: the
// datapath keeps forwarding without the agent.
func (d *Datapath) Close() error {
	d.mu.Lock()
	for name, l := range d.links {
		l.Close()
		delete(d.links, name)
	}
	d.mu.Unlock()
	if d.loading != nil {
		<-d.loading // the program is closed with the rest, not leaked
	}
	if d.sections != nil {
		d.sections.Close()
	}
	d.mu.Lock()
	if d.ctOld != nil { // no link switched: the table aside (pinned) is the next start's
		d.ctOld.Close()
		d.ctOld = nil
	}
	d.mu.Unlock()
	return d.LbObjects.Close()
}

// Teardown detaches every pinned link under root and removes every pin.
func Teardown(root string, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	var errs []error
	linkDir := filepath.Join(root, "links")
	ents, _ := os.ReadDir(linkDir)
	for _, e := range ents {
		path := filepath.Join(linkDir, e.Name())
		l, err := link.LoadPinnedLink(path, nil)
		if err != nil {
			errs = append(errs, os.Remove(path))
			continue
		}
		if err := l.Unpin(); err != nil {
			errs = append(errs, err)
		}
		l.Close()
		log.Info("detached XDP", "interface", pinnedIface(e.Name()))
	}
	os.Remove(linkDir)
	ents, _ = os.ReadDir(root)
	for _, e := range ents {
		// Only the datapath's own pins: a root that is a bpffs mount point
		// also holds the kernel's maps.debug and progs.debug.
		if !strings.HasPrefix(e.Name(), "pb_") {
			continue
		}
		if err := os.Remove(filepath.Join(root, e.Name())); err != nil {
			errs = append(errs, err)
		}
	}
	// A root that is a mount point stays: it is the operator's.
	if mountPoint(root) != root {
		if err := os.Remove(root); err != nil && !os.IsNotExist(err) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
