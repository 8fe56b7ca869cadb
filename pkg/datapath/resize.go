// SPDX-License-Identifier: Apache-2.0

package datapath

import (
	"errors"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/penaltybox/penaltybox/bpf"
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
//  4. After the first switch, the pin aside is removed (releaseCT).
//
// When no pinned link runs the previous program (the agent detached
// them), the table is frozen: step 2 is the only copy, and the pin aside
// goes at once. A start that ends before 4 leaves the pin aside. The next
// one finds the previous table there, and tells which table is live by
// the maps of the programs the pinned links run (ctTablesInUse): if one
// runs on the table aside and none on the pinned pb_ct_v2, the pinned one
// is a stale copy and is dropped, and the copy starts again from the
// table aside; otherwise the pin aside is stale and goes.
const ctAside = bpf.LbMapPbCtV2 + "_resized" // bpffs takes no dots in names

// prepareCTResize is step 1, and the checks of a pin left aside. ms is
// pb_ct_v2's spec. It reports a reason to drop the pinned pb_ct_v2 when
// the table aside is the live one.
func (d *Datapath) prepareCTResize(ms *ebpf.MapSpec) (dropPinned string) {
	main := filepath.Join(d.Opts.Root, bpf.LbMapPbCtV2)
	aside := filepath.Join(d.Opts.Root, ctAside)
	if old, err := ebpf.LoadPinnedMap(aside, nil); err == nil {
		var pinnedUsed, asideUsed bool
		if cur, err := ebpf.LoadPinnedMap(main, nil); err == nil {
			pinnedUsed, asideUsed = d.ctTablesInUse(cur, old)
			cur.Close()
		} else {
			_, asideUsed = d.ctTablesInUse(nil, old)
		}
		if onlySizeDiffers(ms, old) && asideUsed && !pinnedUsed {
			d.ctOld, d.ctLive = old, true
			return "a copy of the table a resize moved aside, which the running program still writes"
		}
		old.Close()
		if err := os.Remove(aside); err != nil {
			d.log.Warn("remove a stale pin of a resized table", "pin", ctAside, "err", err)
		} else {
			d.log.Info("removed a stale pin of a resized table", "pin", ctAside)
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
	_, d.ctLive = d.ctTablesInUse(nil, old)
	return ""
}

// ctTablesInUse reports whether a program a pinned link runs uses each
// of the tables (nil: not asked). A link whose interface is gone (ifindex
// 0) runs nothing. Each program's maps are read once (ProgramInfo copies
// the program's code with them).
func (d *Datapath) ctTablesInUse(pinned, aside *ebpf.Map) (pinnedUsed, asideUsed bool) {
	id := func(m *ebpf.Map) ebpf.MapID {
		if m == nil {
			return 0
		}
		info, err := m.Info()
		if err != nil {
			return 0
		}
		id, _ := info.ID()
		return id
	}
	pid, aid := id(pinned), id(aside)
	seen := map[ebpf.ProgramID]bool{}
	ents, _ := os.ReadDir(d.linkDir())
	for _, e := range ents {
		l, err := link.LoadPinnedLink(filepath.Join(d.linkDir(), e.Name()), nil)
		if err != nil {
			continue
		}
		li, err := l.Info()
		l.Close()
		if err != nil {
			d.log.Warn("read a pinned link's program", "link", e.Name(), "err", err)
			continue
		}
		if x := li.XDP(); x == nil || x.Ifindex == 0 || seen[li.Program] {
			continue
		}
		seen[li.Program] = true
		p, err := ebpf.NewProgramFromID(li.Program)
		if err != nil {
			continue
		}
		pi, err := p.Info()
		p.Close()
		if err != nil {
			d.log.Warn("read a pinned link's program", "link", e.Name(), "err", err)
			continue
		}
		ids, _ := pi.MapIDs()
		pinnedUsed = pinnedUsed || (pid != 0 && slices.Contains(ids, pid))
		asideUsed = asideUsed || (aid != 0 && slices.Contains(ids, aid))
	}
	return pinnedUsed, asideUsed
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
		d.ctOld.Close()
		d.ctOld = nil
		os.Remove(filepath.Join(d.Opts.Root, ctAside))
	case err != nil:
		d.log.Error("copy the flows of the resized table", append(args, "copied", n, "err", err)...)
	default:
		d.log.Info("copied the flows of the resized table", append(args, "copied", n)...)
	}
	if d.ctOld != nil && !d.ctLive {
		d.releaseCT() // no program writes it: nothing to bring up to date
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
	const chunk = 4096
	keys, vals := make([]bpf.LbCtKey, chunk), make([]bpf.LbCtValue, chunk)
	var cursor ebpf.MapBatchCursor
	for {
		got, err := m.BatchLookup(&cursor, keys, vals, nil)
		if got > 0 {
			if ferr := f(keys[:got], vals[:got]); ferr != nil {
				return ferr
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
	}
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

// releaseCT is step 4. Called with d.mu held.
func (d *Datapath) releaseCT() {
	if d.ctOld == nil {
		return
	}
	d.ctOld.Close()
	d.ctOld = nil
	if err := os.Remove(filepath.Join(d.Opts.Root, ctAside)); err != nil && !errors.Is(err, os.ErrNotExist) {
		d.log.Warn("remove the resized table's previous pin", "pin", ctAside, "err", err)
	}
}
