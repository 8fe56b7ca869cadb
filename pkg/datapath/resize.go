// SPDX-License-Identifier: Apache-2.0

package datapath

import (
	"errors"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// A new --conntrack-size makes a new pb_ct_v2. Its flows are carried over,
// so that an operator can resize the table (PenaltyboxConntrackFull)
// without re-balancing every established flow:
//
//  1. LoadMaps moves the previous table's pin aside (ctAside) and keeps a
//     handle on it; the previous program, still attached, goes on writing
//     it.
//  2. Once the new table exists, its entries are copied in (copyCT), so
//     that the agent's first sweep, which reads the new table, keeps the
//     ids of those flows out of reuse. A smaller table takes them only if
//     they fill at most three quarters of it: an LRU map evicts before it
//     is full (each CPU keeps free elements of its own), and an eviction
//     keeps one half of a flow and drops the other.
//  3. Each Attach, until one switches a link to the new program, first
//     makes the new table what the previous one is then (syncCT): what the
//     previous one no longer holds deleted, then every entry copied over
//     again. That also brings back what the agent's first sweep expired
//     in the new table: the next sweep, 10 s on, expires it again (as
//     late as any sweep can be). Between the sync and the switch of the
//     node's last link (an Attach each), the previous program's changes
//     are lost: a flow it begins is picked up midstream, and one it
//     closes stays open in the new table until its idle timeout (6 h for
//     an established flow).
//  4. Before the first switch, the pin aside is removed, and after the
//     first switch that succeeds the previous table is let go
//     (releaseCT); an Attach that fails brings the table up to date again
//     at the next one; a failed switch pins the previous table aside
//     again (repinAside), for a start after this one.
//
// So a pin aside that a later start finds means no link was switched
// since it was moved (or the switch failed, and Attach pinned it again):
// it is the previous table, at least as complete as the pinned pb_ct_v2,
// which is a copy of it that the start before may have left partial. The
// copy starts again from it, and the pinned one is dropped; it is live
// (brought up to date at the switch) while pinned links run on interfaces
// still there (a link whose interface is gone reads ifindex 0), and frozen
// otherwise. Which maps a running program uses could be read only by
// opening it by id (CAP_SYS_ADMIN, which the DaemonSet does not grant);
// the order above needs no capability beyond the DaemonSet's.
//
// An older agent knows nothing of the pin aside: rolled back to after a
// start that ended before the switch, it runs on the pinned copy, and a
// later start would take the pin aside, by then stale, for the previous
// table. Remove it before such a rollback (see the runbook).
const ctAside = bpf.LbMapPbCtV2 + "_resized" // bpffs takes no dots in names

// prepareCTResize is step 1, or takes a pin left aside as the previous
// table. ms is pb_ct_v2's spec. It reports a reason to drop the pinned
// pb_ct_v2 when a pin aside is taken (the pinned one is its copy).
func (d *Datapath) prepareCTResize(ms *ebpf.MapSpec) (dropPinned string) {
	main := filepath.Join(d.Opts.Root, bpf.LbMapPbCtV2)
	aside := filepath.Join(d.Opts.Root, ctAside)
	if old, err := ebpf.LoadPinnedMap(aside, nil); err == nil {
		if onlySizeDiffers(ms, old) {
			d.ctOld = old
			if _, err := os.Stat(main); errors.Is(err, os.ErrNotExist) {
				return ""
			}
			return "a copy of the table a resize moved aside, whose switch never came"
		}
		old.Close()
		if err := os.Remove(aside); err != nil {
			d.log.Warn("remove a pin aside of another layout", "pin", ctAside, "err", err)
		} else {
			d.log.Info("removed a pin aside of another layout", "pin", ctAside)
		}
	}
	old, err := ebpf.LoadPinnedMap(main, nil)
	if err != nil {
		return ""
	}
	if ms.Compatible(old) == nil || !onlySizeDiffers(ms, old) {
		old.Close()
		return ""
	}
	if err := os.Rename(main, aside); err != nil {
		// Dropped as any other map whose size changed: its flows are lost.
		d.log.Warn("move a resized table's pin aside; its flows are not copied", "map", bpf.LbMapPbCtV2, "err", err)
		old.Close()
		return ""
	}
	d.ctOld = old
	return ""
}

// linksRun reports whether a pinned link runs a program on an interface
// that is still there (a link whose interface is gone reads ifindex 0).
func (d *Datapath) linksRun() bool {
	ents, _ := os.ReadDir(d.linkDir())
	for _, e := range ents {
		l, err := link.LoadPinnedLink(filepath.Join(d.linkDir(), e.Name()), nil)
		if err != nil {
			continue
		}
		li, err := l.Info()
		l.Close()
		if err != nil {
			d.log.Warn("read a pinned link", "link", e.Name(), "err", err)
			continue
		}
		if x := li.XDP(); x != nil && x.Ifindex != 0 {
			return true
		}
	}
	return false
}

// onlySizeDiffers reports whether m is ms but for its number of entries.
func onlySizeDiffers(ms *ebpf.MapSpec, m *ebpf.Map) bool {
	c := ms.Copy()
	c.MaxEntries = m.MaxEntries()
	return c.Compatible(m) == nil
}

// errNoRoom: the new table is smaller than three quarters of what the
// previous one holds would need.
var errNoRoom = errors.New("no room for the previous table's flows")

// copyCT is step 2.
func (d *Datapath) copyCT() {
	if d.ctOld == nil {
		return
	}
	to := d.PbCtV2
	args := []any{"map", bpf.LbMapPbCtV2, "from_size", d.ctOld.MaxEntries(), "to_size", to.MaxEntries()}
	n, err := copyCTEntries(d.ctOld, to, true)
	switch {
	case errors.Is(err, errNoRoom):
		d.log.Warn("the resized table cannot hold the previous one's flows: none copied, they are lost", args...)
		d.releaseCT()
	case err != nil:
		d.log.Error("copy the flows of the resized table", append(args, "copied", n, "err", err)...)
	default:
		d.log.Info("copied the flows of the resized table", append(args, "copied", n)...)
		if !d.linksRun() {
			d.releaseCT() // no program writes it: nothing to bring up to date
		}
	}
}

// copyCTEntries writes every entry of from into to, over what to holds,
// in batches; with checkRoom, into a smaller map only if they fit
// (errNoRoom).
func copyCTEntries(from, to *ebpf.Map, checkRoom bool) (n int, err error) {
	if checkRoom && to.MaxEntries() < from.MaxEntries() {
		count := 0
		if err := eachCT(from, func(keys []bpf.LbCtKey, _ []bpf.LbCtValue) error {
			count += len(keys)
			return nil
		}); err != nil {
			return 0, err
		}
		if count > int(to.MaxEntries())/4*3 {
			return 0, errNoRoom
		}
	}
	err = eachCT(from, func(keys []bpf.LbCtKey, vals []bpf.LbCtValue) error {
		c, err := to.BatchUpdate(keys, vals, nil)
		n += c
		return err
	})
	return n, err
}

// eachCT hands f the entries of a conntrack table, a batch at a time.
func eachCT(m *ebpf.Map, f func([]bpf.LbCtKey, []bpf.LbCtValue) error) error {
	return maps.EachBatch(m, 4096, f)
}

// syncCT is step 3: the new table made what the previous one is now.
// Called with d.mu held.
func (d *Datapath) syncCT() {
	if d.ctOld == nil {
		return
	}
	// Deletes first: into a smaller table, the copy then needs no more
	// room than the previous table's flows.
	var gone []bpf.LbCtKey
	var v bpf.LbCtValue
	err := eachCT(d.PbCtV2, func(keys []bpf.LbCtKey, _ []bpf.LbCtValue) error {
		for _, k := range keys {
			if lerr := d.ctOld.Lookup(&k, &v); errors.Is(lerr, ebpf.ErrKeyNotExist) {
				gone = append(gone, k)
			}
		}
		return nil
	})
	deleted := 0
	for _, k := range gone {
		if d.PbCtV2.Delete(&k) == nil {
			deleted++
		}
	}
	// The room was judged at load (copyCT): a table that took the flows
	// then takes them now.
	copied := 0
	if err == nil {
		copied, err = copyCTEntries(d.ctOld, d.PbCtV2, false)
	}
	args := []any{"map", bpf.LbMapPbCtV2, "copied", copied, "deleted", deleted}
	if err != nil {
		d.log.Error("bring the resized table up to date at the switch", append(args, "err", err)...)
		return
	}
	d.log.Info("brought the resized table up to date at the switch to the new program", args...)
}

// unpinAside removes the pin aside before a link switches (step 4), so
// that a pin aside found later always means no link was switched.
// Called with d.mu held.
func (d *Datapath) unpinAside() {
	if d.ctOld == nil {
		return
	}
	if err := os.Remove(filepath.Join(d.Opts.Root, ctAside)); err != nil && !errors.Is(err, os.ErrNotExist) {
		d.log.Warn("remove the resized table's previous pin", "pin", ctAside, "err", err)
	}
}

// repinAside pins the previous table aside again after a failed switch,
// so that a start after this one copies from it. Called with d.mu held.
func (d *Datapath) repinAside() {
	if d.ctOld == nil {
		return
	}
	// Through a clone (a handle of its own, with no pinned path): ctOld
	// remembers the path it was loaded from, which ebpf.Map.Pin would
	// rename (it may be the new table's).
	m, err := d.ctOld.Clone()
	if err == nil {
		err = m.Pin(filepath.Join(d.Opts.Root, ctAside))
		m.Close()
	}
	if err != nil {
		d.log.Warn("pin the resized table's previous table aside again", "pin", ctAside, "err", err)
	}
}

// releaseCT lets the previous table go and removes its pin aside.
// Called with d.mu held, or before d is shared.
func (d *Datapath) releaseCT() {
	if d.ctOld == nil {
		return
	}
	d.unpinAside()
	d.ctOld.Close()
	d.ctOld = nil
}
