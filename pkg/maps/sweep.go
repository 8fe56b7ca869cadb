// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"errors"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"net/netip"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
)

// CTSweepArgs are one kernel sweep's clocks and timeouts, in nanoseconds
// (struct ct_sweep_args; the outputs are read into CTSweep).
type CTSweepArgs = bpf.LbCtSweepArgs

// What made a kernel sweep's in-use sets not whole (ct_sweep_args.failed).
const (
	SweepFailApart = uint32(0x1)  // pb_ct_sweep_apart could not take a key
	SweepFailVIPs  = uint32(0x2)  // pb_ct_inuse_vips could not take a VIP
	SweepFailID    = uint32(0x4)  // an id past the bitmaps of pb_ct_inuse
	SweepFailInUse = uint32(0x8)  // pb_ct_inuse could not be read
	SweepFailLone  = uint32(0x10) // pb_ct_sweep_lone could not take a key
)

// CTSweep is what one sweep of pb_ct_sweep_run (a run per walk) did and
// found.
type CTSweep struct {
	Entries, Expired, Released, Counted int
	// The ids and VIPs live flows use.
	Services, Backends map[uint32]bool
	VIPs               map[netip.AddrPort]bool
}

// ErrSweepIncomplete: the kernel sweep could not fill a set (Failed says
// which). What it expired and released stands; an unpaired forward entry
// or a counted flow it could not judge for want of pb_ct_sweep_apart or
// pb_ct_sweep_lone it left alone.
type ErrSweepIncomplete struct{ Failed uint32 }

func (e ErrSweepIncomplete) Error() string {
	return fmt.Sprintf("pb_ct_sweep_run: in-use sets not whole (failed 0x%x)", e.Failed)
}

// UseCTSweep makes SweepCT run p, pb_ct_sweep_run.
func (m *Maps) UseCTSweep(p *ebpf.Program) error {
	if p == nil || m.m.PbCtInuse == nil || m.m.PbCtInuseVips == nil || m.m.PbCtSweepApart == nil ||
		m.m.PbCtSweepLone == nil {
		return errors.New("maps: no kernel conntrack sweep")
	}
	if sz := m.m.PbCtInuse.ValueSize(); sz != uint32(unsafe.Sizeof(bpf.LbCtInuse{})) {
		return fmt.Errorf("maps: pb_ct_inuse's value is %d bytes, want %d", sz, unsafe.Sizeof(bpf.LbCtInuse{}))
	}
	// Ids past the bitmaps would fail every kernel sweep into a copy.
	var u bpf.LbCtInuse
	if n, max := m.m.PbSvcInflight.MaxEntries(), uint32(64*len(u.Svc)); n > max {
		return fmt.Errorf("maps: %d services, past the kernel sweep's %d", n, max)
	}
	if n, max := m.m.PbBeInflight.MaxEntries(), uint32(64*len(u.Be)); n > max {
		return fmt.Errorf("maps: %d backends, past the kernel sweep's %d", n, max)
	}
	m.expMu.Lock()
	defer m.expMu.Unlock()
	m.sweep = p
	// Marks an agent before this one left are still in the table: the
	// first sweep clears them before it judges (walk 0). A random start makes
	// another agent sweeping the same maps at the same time unlikely to
	// use the same marks.
	m.sweepMark = uint16(rand.Uint32())
	m.sweepFresh = true
	return nil
}

// CTSweepMark is the last kernel sweep's mark (ct_sweep_args.mark, what
// its walk writes into the half of each flow it judged at the other);
// before the first sweep, the one the next sweep's counts up from.
func (m *Maps) CTSweepMark() uint16 {
	m.expMu.Lock()
	defer m.expMu.Unlock()
	return m.sweepMark
}

// CTSweepProgram reports whether SweepCT can run (false without
// UseCTSweep, and once a run failed).
func (m *Maps) CTSweepProgram() bool {
	m.expMu.Lock()
	defer m.expMu.Unlock()
	return m.sweep != nil
}

// SweepCT runs the whole conntrack sweep in the kernel: idle flows
// expired, orphaned pb_flows entries released (their breaker slots given
// back in pb_svc_inflight and pb_be_inflight), and the ids and VIPs live
// flows use read back. A failed run disables the program (CTSweepProgram
// is false from then on) and returns, with its error, what the walks
// before it did; a sweep whose sets are not whole returns
// ErrSweepIncomplete with what it did.
func (m *Maps) SweepCT(args CTSweepArgs) (CTSweep, error) {
	m.expMu.Lock()
	defer m.expMu.Unlock()
	if m.sweep == nil {
		return CTSweep{}, errors.New("maps: no kernel conntrack sweep")
	}
	args.Mark = m.nextSweepMark()
	// One run per walk: a kernel without full preemption keeps the CPU
	// for a run's whole length. Walk 0, an agent's first, clears the
	// marks the agent before it left, which may equal this one's.
	var s CTSweep
	first := uint8(1)
	if m.sweepFresh {
		first = 0
	}
	for walk := first; walk <= 3; walk++ {
		args.Walk = walk
		ret, err := m.sweep.Run(&ebpf.RunOptions{Context: &args, ContextOut: &args})
		if err == nil && ret != 0 {
			err = fmt.Errorf("walk %d returned %d", walk, ret)
		}
		if err != nil {
			// What the walks before it expired and released stands.
			m.sweep = nil
			return s, fmt.Errorf("pb_ct_sweep_run: %w", err)
		}
		if walk == 0 {
			m.sweepFresh = false // the earlier marks are cleared
			continue
		}
		s = CTSweep{Entries: int(args.Entries), Expired: int(args.Expired), Released: int(args.Released), Counted: int(args.Counted)}
	}
	if args.Failed != 0 {
		return s, ErrSweepIncomplete{args.Failed}
	}
	var u bpf.LbCtInuse
	if err := m.m.PbCtInuse.Lookup(uint32(0), &u); err != nil {
		return s, fmt.Errorf("pb_ct_inuse: %w", err)
	}
	s.Services, s.Backends = setBits(u.Svc[:]), setBits(u.Be[:])
	vips, err := entries[bpf.LbVipUseKey, uint8](m.m.PbCtInuseVips)
	if err != nil {
		return s, fmt.Errorf("pb_ct_inuse_vips: %w", err)
	}
	s.VIPs = make(map[netip.AddrPort]bool, len(vips))
	for k := range vips {
		if a := AddrFromFamily(k.Family, k.Addr.Bytes); a.IsValid() {
			s.VIPs[netip.AddrPortFrom(a, Port(k.Port))] = true
		}
	}
	return s, nil
}

// sweepMarkGone is PB_SWEEP_MARK_GONE: the mark of an entry a sweep
// deleted before its walk came to it.
const sweepMarkGone = 0xffff

// nextSweepMark is the next sweep's mark for the halves of the flows it
// judges at their other half, and never 0, a new entry's, nor
// sweepMarkGone. It comes round
// after 65,534 sweeps; each walk clears every other mark from the entries
// it judges, so none that old is left on them.
func (m *Maps) nextSweepMark() uint16 {
	m.sweepMark++
	if m.sweepMark == 0 || m.sweepMark == sweepMarkGone {
		m.sweepMark = 1
	}
	return m.sweepMark
}

// setBits lists a bitmap's set bits.
func setBits(words []uint64) map[uint32]bool {
	out := map[uint32]bool{}
	for i, w := range words {
		for w != 0 {
			b := uint32(bits.TrailingZeros64(w))
			out[uint32(i)*64+b] = true
			w &^= 1 << b
		}
	}
	return out
}
