// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"fmt"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
)

// SYNGuard is what pb_syn_guard holds, in Go terms.
type SYNGuard struct {
	// Lease is how long the guard stays on unless written again (0: on
	// only where a CPU arms it). A lease, not a switch: an agent that dies
	// with the guard on leaves it on for at most this long.
	Lease time.Duration
	// Rate is how many SYNs from untrusted sources each CPU admits a
	// second while the guard is on; Burst how many at once. Rate 0: no
	// guard at all.
	Rate, Burst uint32
	// Trust is how long a source stays trusted after its last proof.
	Trust time.Duration
	// ArmRate is the rate of SYNs to services, per CPU and second over
	// one window, at which a CPU turns the guard on by itself (0: never).
	ArmRate uint32
}

// synWindow is PB_SYN_WINDOW_NS, the window of ArmRate.
const synWindow = 100 * time.Millisecond

// minBurst is the least burst_ns: the coarse clock's tick, with a margin.
const minBurst = uint64(10 * time.Millisecond)

// coarseNow reads the clock of the guard's times (bpf_ktime_get_coarse_ns).
func coarseNow() uint64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC_COARSE, &ts)
	return uint64(ts.Nano())
}

// SetSYNGuard writes pb_syn_guard[0]. The lease starts now, on the
// kernel's clock.
func (m *Maps) SetSYNGuard(g SYNGuard) error {
	var v bpf.LbSynGuard
	if g.Rate > 0 {
		interval := max(uint64(time.Second)/uint64(g.Rate), 1)
		v = bpf.LbSynGuard{
			IntervalNs: interval,
			// A burst of n admits n SYNs at once: the n-th is n-1 intervals
			// ahead of now. At least a tick of the coarse clock (4 ms at
			// HZ=250), which advances the budget in steps of one.
			BurstNs: max(interval*uint64(max(g.Burst, 1)-1), minBurst),
			TrustNs: uint64(g.Trust),
		}
		if g.Lease > 0 {
			v.UntilNs = coarseNow() + uint64(g.Lease)
		}
		if g.ArmRate > 0 {
			v.ArmSyns = max(uint64(g.ArmRate)*uint64(synWindow)/uint64(time.Second), 1)
		}
	}
	if err := m.m.PbSynGuard.Put(uint32(0), v); err != nil {
		return fmt.Errorf("pb_syn_guard: %w", err)
	}
	return nil
}

// SYNGuardStats sums pb_syn_guard_cpu[0]'s counters over CPUs (the
// window and budget fields are per CPU and left 0).
func (m *Maps) SYNGuardStats() (bpf.LbSynGuardCpu, error) {
	var per []bpf.LbSynGuardCpu
	var s bpf.LbSynGuardCpu
	if err := m.m.PbSynGuardCpu.Lookup(uint32(0), &per); err != nil {
		return s, fmt.Errorf("pb_syn_guard_cpu: %w", err)
	}
	for _, c := range per {
		s.Trusted += c.Trusted
		s.Admitted += c.Admitted
		s.Dropped += c.Dropped
		s.Armed += c.Armed
	}
	return s, nil
}

// TrustSource marks a as proven now, as the datapath does when a backend
// sends payload to it (tests, and operators seeding the table).
func (m *Maps) TrustSource(a netip.Addr) error {
	if err := m.m.PbSrcTrust.Put(srcKey(a), coarseNow()); err != nil {
		return fmt.Errorf("pb_src_trust: %w", err)
	}
	return nil
}

// TrustedSince reads when a last proved itself, on the kernel's coarse
// clock, or false when pb_src_trust does not hold it.
func (m *Maps) TrustedSince(a netip.Addr) (uint64, bool) {
	var ns uint64
	if err := m.m.PbSrcTrust.Lookup(srcKey(a), &ns); err != nil {
		return 0, false
	}
	return ns, true
}

func srcKey(a netip.Addr) bpf.LbSrcKey {
	var k bpf.LbSrcKey
	k.Addr.Bytes = Addr16(a)
	k.Family = Family(a)
	return k
}
