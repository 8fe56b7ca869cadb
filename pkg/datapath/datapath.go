// Package datapath loads the XDP program and its maps, pins them under a
// bpffs directory and attaches the program to interfaces through pinned
// bpf_links. Pins outlive the agent: a restarted agent adopts the maps it
// finds (conntrack and all) and swaps its program into the existing links
// without a gap, so established flows keep flowing.
package datapath

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"

	"github.com/penaltybox/penaltybox/bpf"
)

// DefaultRoot is where maps and links are pinned unless told otherwise.
const DefaultRoot = "/sys/fs/bpf/penaltybox"

// Options size the maps. Zero values take the defaults below. Changing a
// size of a pinned map recreates that map (and, for conntrack, drops the
// flows it held): the agent logs it when it happens.
type Options struct {
	Root          string
	MaxServices   uint32
	MaxBackends   uint32
	ConntrackSize uint32 // entries; each flow takes two
	EventsBytes   uint32 // ring buffer size, a power of two multiple of the page size
	Logger        *slog.Logger
}

const (
	DefaultMaxServices   = 65536
	DefaultMaxBackends   = 262144
	DefaultConntrackSize = 262144
	DefaultEventsBytes   = 1 << 22
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
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
}

// Datapath is the loaded program and its pinned maps.
type Datapath struct {
	bpf.LbObjects
	Opts Options
	// InnerSpec is the Maglev inner map template, for creating tables.
	InnerSpec *ebpf.MapSpec

	log   *slog.Logger
	mu    sync.Mutex
	links map[string]link.Link
}

// Spec returns the program's collection spec sized by opts.
func Spec(opts Options) (*ebpf.CollectionSpec, error) {
	opts.setDefaults()
	spec, err := bpf.LoadLb()
	if err != nil {
		return nil, err
	}
	sizes := map[string]uint32{
		bpf.LbMapPbServices:    opts.MaxServices,
		bpf.LbMapPbMaglev:      2 * opts.MaxServices, // two tables per service
		bpf.LbMapPbMaglevFb:    opts.MaxServices,
		bpf.LbMapPbSvcStats:    opts.MaxServices,
		bpf.LbMapPbSvcInflight: opts.MaxServices,
		bpf.LbMapPbSvcTrip:     opts.MaxServices,
		bpf.LbMapPbBackends:    opts.MaxBackends,
		bpf.LbMapPbBeStats:     opts.MaxBackends,
		bpf.LbMapPbBeInflight:  opts.MaxBackends,
		bpf.LbMapPbHealth:      opts.MaxBackends,
		bpf.LbMapPbBeTrip:      opts.MaxBackends,
		bpf.LbMapPbSvcBackends: opts.MaxBackends,
		bpf.LbMapPbCt:          opts.ConntrackSize,
		bpf.LbMapPbFlows:       max(opts.ConntrackSize/2, 1), // a flow takes two conntrack entries
		bpf.LbMapPbEvents:      opts.EventsBytes,
	}
	for name, n := range sizes {
		ms, ok := spec.Maps[name]
		if !ok {
			return nil, fmt.Errorf("datapath: map %s missing from object", name)
		}
		ms.MaxEntries = n
	}
	return spec, nil
}

// Load loads the program, creating or adopting the pinned maps under
// opts.Root (mounting a bpffs when needed).
func Load(opts Options) (*Datapath, error) {
	opts.setDefaults()
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
		InnerSpec: spec.Maps[bpf.LbMapPbMaglev].InnerMap.Copy()}
	d.dropIncompatiblePins(spec)

	err = spec.LoadAndAssign(&d.LbObjects, &ebpf.CollectionOptions{
		Maps: ebpf.MapOptions{PinPath: opts.Root},
	})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("datapath: verifier: %+v", ve)
		}
		return nil, fmt.Errorf("datapath: load: %w", err)
	}
	return d, nil
}

// dropIncompatiblePins removes pinned maps whose type, sizes or flags no
// longer match the spec, so they are created afresh instead of failing the
// load. Layout changes get a new map name (see README), so this only fires
// when an operator changed a size flag.
func (d *Datapath) dropIncompatiblePins(spec *ebpf.CollectionSpec) {
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
	for name, ms := range spec.Maps {
		if ms.Pinning != ebpf.PinByName {
			continue
		}
		path := filepath.Join(d.Opts.Root, name)
		m, err := ebpf.LoadPinnedMap(path, nil)
		if err != nil {
			continue
		}
		cerr := ms.Compatible(m)
		m.Close()
		if cerr == nil {
			continue
		}
		d.log.Warn("pinned map does not match, recreating it", "map", name, "reason", cerr.Error(),
			"lost", lostOnRecreate(name))
		if err := os.Remove(path); err != nil {
			d.log.Error("remove pinned map", "map", name, "err", err)
		}
	}
}

// retiredPins are maps a layout change gave a new name: pb_syns became
// pb_syns_v2 (16-byte addresses).
var retiredPins = []string{"pb_syns"}

func lostOnRecreate(name string) string {
	switch name {
	case bpf.LbMapPbCt:
		return "established flows (they will be re-balanced, most break)"
	case bpf.LbMapPbEvents:
		return "undelivered outcome events"
	case bpf.LbMapPbStats, bpf.LbMapPbSvcStats, bpf.LbMapPbBeStats, bpf.LbMapPbSynGuardCpu:
		return "kernel counters (they restart from 0, which Prometheus reads as a reset)"
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
	iface, err := net.InterfaceByName(ifname)
	if err != nil {
		return fmt.Errorf("attach %s: %w", ifname, err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.links[ifname]; ok {
		return nil
	}
	if err := os.MkdirAll(d.linkDir(), 0o700); err != nil {
		return fmt.Errorf("attach %s: %w", ifname, err)
	}
	pin := d.linkPin(ifname)

	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		if linkIfindex(l) == iface.Index {
			if err := l.Update(d.PbXdp); err != nil {
				l.Close()
				return fmt.Errorf("attach %s: update pinned link: %w", ifname, err)
			}
			d.links[ifname] = l
			d.log.Info("adopted XDP link", "interface", ifname, "ifindex", iface.Index)
			return nil
		}
		// The interface was recreated under the same name: the old link is defunct.
		l.Unpin()
		l.Close()
	}

	mode := "driver"
	l, err := link.AttachXDP(link.XDPOptions{Program: d.PbXdp, Interface: iface.Index, Flags: link.XDPDriverMode})
	if err != nil {
		mode = "generic"
		var gerr error
		l, gerr = link.AttachXDP(link.XDPOptions{Program: d.PbXdp, Interface: iface.Index, Flags: link.XDPGenericMode})
		if gerr != nil {
			return fmt.Errorf("attach %s: driver mode: %v; generic mode: %w", ifname, err, gerr)
		}
	}
	if err := l.Pin(pin); err != nil {
		l.Close()
		return fmt.Errorf("attach %s: pin link: %w", ifname, err)
	}
	d.links[ifname] = l
	d.log.Info("attached XDP", "interface", ifname, "ifindex", iface.Index, "mode", mode)
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
