// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
)

// What ExpireCT did with one key of a CTExpire (enum
// pb_ct_expire_result).
const (
	// ExpireUnasked: the key has family 0, or the flow's reverse entry
	// stayed, so its forward one was not asked about.
	ExpireUnasked = uint8(bpf.LbPbCtExpireResultPB_CT_EXPIRE_UNASKED)
	// ExpireDeleted: the entry was the flow's, and is gone.
	ExpireDeleted = uint8(bpf.LbPbCtExpireResultPB_CT_EXPIRE_DELETED)
	// ExpireAbsent: no entry under the key.
	ExpireAbsent = uint8(bpf.LbPbCtExpireResultPB_CT_EXPIRE_ABSENT)
	// ExpireOther: the entry is another flow's (its tuple reused): kept.
	ExpireOther = uint8(bpf.LbPbCtExpireResultPB_CT_EXPIRE_OTHER)
)

// CTExpire is one flow to expire (struct ct_expire): its reverse and
// forward keys (family 0: none) and its start, which each entry must
// still have to be deleted. ExpireCT writes RevResult and FwdResult.
type CTExpire = bpf.LbCtExpire

// CTExpireBatch is pb_ct_expire's size (PB_CT_EXPIRE_BATCH): the flows
// one run of the sweep's program takes.
const CTExpireBatch = 1024

// ctExpirer runs pb_ct_expire_run over pb_ct_expire, memory-mapped.
// Maps.expMu guards the pointer to it: a sweep still running when the
// agent closes its maps must not write the unmapped memory.
type ctExpirer struct {
	prog *ebpf.Program
	mem  []byte
	ents *[CTExpireBatch]CTExpire // mem, as pb_ct_expire's elements lie in it
}

// UseCTExpire makes ExpireCT run p, pb_ct_expire_run, in the kernel: one
// system call for a batch of flows instead of a lookup and a delete for
// each of their entries.
func (m *Maps) UseCTExpire(p *ebpf.Program) error {
	if p == nil || m.m.PbCtExpire == nil {
		return errors.New("maps: no conntrack sweep program")
	}
	if n := m.m.PbCtExpire.MaxEntries(); n != CTExpireBatch {
		return fmt.Errorf("maps: pb_ct_expire holds %d entries, want %d", n, CTExpireBatch)
	}
	if sz := m.m.PbCtExpire.ValueSize(); sz != uint32(unsafe.Sizeof(CTExpire{})) || sz%8 != 0 {
		return fmt.Errorf("maps: pb_ct_expire's value is %d bytes, want %d", sz, unsafe.Sizeof(CTExpire{}))
	}
	mem, err := mmapArray(m.m.PbCtExpire)
	if err != nil {
		return fmt.Errorf("maps: pb_ct_expire: %w", err)
	}
	m.expMu.Lock()
	defer m.expMu.Unlock()
	m.closeCTExpireLocked()
	m.exp = &ctExpirer{prog: p, mem: mem, ents: (*[CTExpireBatch]CTExpire)(unsafe.Pointer(&mem[0]))}
	return nil
}

// CTExpireProgram reports whether ExpireCT runs pb_ct_expire_run (false
// without UseCTExpire, and once a run failed).
func (m *Maps) CTExpireProgram() bool {
	m.expMu.Lock()
	defer m.expMu.Unlock()
	return m.exp != nil
}

func (m *Maps) closeCTExpire() {
	m.expMu.Lock()
	defer m.expMu.Unlock()
	m.closeCTExpireLocked()
}

func (m *Maps) closeCTExpireLocked() {
	if m.exp != nil {
		unix.Munmap(m.exp.mem)
		m.exp = nil
	}
}

// ExpireCT deletes each flow's entries that are still the flow's (same
// created_ns), the reverse entry first and the forward one only once the
// reverse one went, and writes what it did into RevResult and FwdResult.
// It returns how many entries it deleted. Every flow is handled, whatever
// happens: without UseCTExpire it does the same with a lookup and a
// delete per entry, and if the program fails it does so from then on, and
// returns the program's error that once.
//
// Calls are serialised (pb_ct_expire is one buffer); the reaper's sweeps
// do not overlap anyway.
func (m *Maps) ExpireCT(flows []CTExpire) (int, error) {
	m.expMu.Lock()
	defer m.expMu.Unlock()
	deleted := 0
	for m.exp != nil && len(flows) > 0 {
		n := min(len(flows), CTExpireBatch)
		copy(m.exp.ents[:n], flows[:n])
		args := bpf.LbCtExpireArgs{N: uint32(n)}
		if _, err := m.exp.prog.Run(&ebpf.RunOptions{Context: &args, ContextOut: &args}); err != nil {
			m.closeCTExpireLocked()
			return deleted + m.expireCTSyscalls(flows), fmt.Errorf("pb_ct_expire_run: %w", err)
		}
		for i := range n {
			flows[i].RevResult, flows[i].FwdResult = m.exp.ents[i].RevResult, m.exp.ents[i].FwdResult
		}
		deleted += int(args.Deleted)
		flows = flows[n:]
	}
	return deleted + m.expireCTSyscalls(flows), nil
}

// expireCTSyscalls is ExpireCT with a lookup and a delete per entry. An
// entry it cannot read is taken for gone, and one it cannot delete for
// deleted, as the sweep took them before it had the program.
func (m *Maps) expireCTSyscalls(flows []CTExpire) int {
	deleted := 0
	one := func(k *bpf.LbCtKey, created uint64) uint8 {
		v, err := m.CTEntry(*k)
		if err != nil {
			return ExpireAbsent
		}
		if v.CreatedNs != created {
			return ExpireOther
		}
		if err := m.m.PbCtV2.Delete(k); err == nil {
			deleted++
		}
		return ExpireDeleted
	}
	for i := range flows {
		f := &flows[i]
		f.RevResult, f.FwdResult = ExpireUnasked, ExpireUnasked
		if f.Rev.Family != 0 {
			if f.RevResult = one(&f.Rev, f.CreatedNs); f.RevResult != ExpireDeleted {
				continue
			}
		}
		if f.Fwd.Family != 0 {
			f.FwdResult = one(&f.Fwd, f.CreatedNs)
		}
	}
	return deleted
}
