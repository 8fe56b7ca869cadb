// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"net/netip"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/replay"
)

var spoofed = netip.MustParseAddr("198.18.0.77")

// syns sends n SYNs opening new flows from src (ports from port up) and
// counts those the datapath forwarded.
func (f *fixture) syns(src netip.Addr, port uint16, n int) int {
	f.t.Helper()
	passed := 0
	for i := range n {
		ret, _, _ := f.run(bpftest.TCP(netip.AddrPortFrom(src, port+uint16(i)), vip, bpftest.SYN, nil))
		switch ret {
		case bpftest.XDPPass:
			passed++
		case bpftest.XDPDrop:
		default:
			f.t.Fatalf("verdict %d", ret)
		}
	}
	f.events()
	return passed
}

// While the SYN guard is on, a source without a proof of a real connection
// gets the per-CPU budget and no more; a trusted source is not limited;
// the guard off, or its lease run out, limits nothing.
func TestSYNGuardLimitsOnlyUntrustedSources(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	oneCPU(t) // the budget is per CPU

	if n := f.syns(spoofed, 1000, 20); n != 20 {
		t.Fatalf("guard off: %d of 20 SYNs forwarded", n)
	}

	// One SYN a second, three at once: the test takes far less than a
	// second, and each second it might take admits one more.
	start := time.Now()
	f.must(f.Maps.SetSYNGuard(maps.SYNGuard{Lease: time.Minute, Rate: 1, Burst: 3, Trust: time.Hour}))
	f.must(f.Maps.TrustSource(client.Addr()))
	admitted := f.syns(spoofed, 2000, 20)
	trusted := f.syns(client.Addr(), 2000, 20)
	slack := int(time.Since(start)/time.Second) + 1
	if admitted < 3 || admitted > 3+slack {
		t.Errorf("guard on: %d of 20 untrusted SYNs forwarded, want 3 (the burst)", admitted)
	}
	if trusted != 20 {
		t.Errorf("guard on: %d of 20 trusted SYNs forwarded, want all", trusted)
	}
	s, err := f.Maps.SYNGuardStats()
	f.must(err)
	if want := (bpf.LbSynGuardCpu{Trusted: 20, Admitted: uint64(admitted), Dropped: uint64(20 - admitted)}); s != want {
		t.Errorf("guard counters = %+v, want %+v", s, want)
	}

	// A SYN on a tuple conntrack knows is judged as a new one: again on a
	// half-open flow the guard admitted, or on one that ended (a flood's
	// walking ports wrap around), it finds the budget spent; a trusted
	// source's passes.
	if ret, _, _ := f.run(bpftest.TCP(netip.AddrPortFrom(spoofed, 2000), vip, bpftest.SYN, nil)); ret != bpftest.XDPDrop {
		t.Errorf("SYN again on an untrusted half-open flow: verdict %d, want XDP_DROP", ret)
	}
	f.run(bpftest.TCP(be1, netip.AddrPortFrom(spoofed, 2001), bpftest.SYNACK, nil))
	f.run(bpftest.TCP(netip.AddrPortFrom(spoofed, 2001), vip, bpftest.RST, nil))
	if ret, _, _ := f.run(bpftest.TCP(netip.AddrPortFrom(spoofed, 2001), vip, bpftest.SYN, nil)); ret != bpftest.XDPDrop {
		t.Errorf("SYN on an untrusted tuple whose flow ended: verdict %d, want XDP_DROP", ret)
	}
	if ret, _, _ := f.run(bpftest.TCP(netip.AddrPortFrom(client.Addr(), 2000), vip, bpftest.SYN, nil)); ret != bpftest.XDPPass {
		t.Errorf("SYN again on a trusted half-open flow: verdict %d, want XDP_PASS", ret)
	}
	// The guard judges a SYN before conntrack is read (a flood's SYN
	// costs no conntrack bucket), so a SYN on a flow its untrusted client
	// completed is judged too: such a SYN starts nothing a client needs.
	sp := netip.AddrPortFrom(spoofed, 2002)
	f.run(bpftest.TCP(be1, sp, bpftest.SYNACK, nil))
	f.run(bpftest.TCP(sp, vip, bpftest.ACK, nil))
	if ret, _, _ := f.run(bpftest.TCP(sp, vip, bpftest.SYN, nil)); ret != bpftest.XDPDrop {
		t.Errorf("SYN on an untrusted established flow: verdict %d, want XDP_DROP", ret)
	}
	// Its other packets are not the guard's.
	if ret, _, _ := f.run(bpftest.TCP(sp, vip, bpftest.ACK, nil)); ret != bpftest.XDPPass {
		t.Errorf("ACK on an untrusted established flow: verdict %d, want XDP_PASS", ret)
	}
	f.events()

	// Trust ends: the same source is limited once its proof is older
	// than the guard's trust (this one is from the kernel clock's zero).
	var k bpf.LbSrcKey
	k.Addr.Bytes, k.Family = maps.Addr16(client.Addr()), maps.Family(client.Addr())
	f.must(f.PbSrcTrust.Put(k, uint64(0)))
	f.must(f.Maps.SetSYNGuard(maps.SYNGuard{Lease: time.Minute, Rate: 1, Burst: 1, Trust: time.Millisecond}))
	if n := f.syns(client.Addr(), 3000, 20); n > 1+slack {
		t.Errorf("trust expired: %d of 20 SYNs forwarded", n)
	}

	// A lease the agent did not renew ends the guard by itself.
	f.must(f.PbSynGuard.Put(uint32(0), bpf.LbSynGuard{UntilNs: 1, IntervalNs: uint64(time.Second), TrustNs: 1}))
	if n := f.syns(spoofed, 4000, 20); n != 20 {
		t.Errorf("lease over: %d of 20 SYNs forwarded", n)
	}
	f.must(f.Maps.SetSYNGuard(maps.SYNGuard{}))
	if n := f.syns(spoofed, 5000, 20); n != 20 {
		t.Errorf("guard off again: %d of 20 SYNs forwarded", n)
	}
}

// guardedRetryFixture is a retryRefused service on one CPU with the SYN
// guard on and a budget of one SYN at once, one a second.
func guardedRetryFixture(t *testing.T) *fixture {
	f := newFixture(t)
	f.svc.Flags = maps.ServiceRetryRefused
	f.writeService()
	f.table(id1)
	oneCPU(t)
	f.must(f.Maps.SetSYNGuard(maps.SYNGuard{Lease: time.Minute, Rate: 1, Burst: 1, Trust: time.Hour}))
	return f
}

// spendBudget sends syn, the budget's one SYN, which must pass.
func (f *fixture) spendBudget(syn []byte) {
	f.t.Helper()
	if ret, _, _ := f.run(syn); ret != bpftest.XDPPass {
		f.t.Fatalf("the budget's one SYN: verdict %d", ret)
	}
}

// A SYN the guard drops takes no pb_syns_v2 slot: with retryRefused a
// flood reusing tuples would otherwise overwrite the copies legit flows'
// replays need.
func TestSYNGuardDropKeepsNoSYNCopy(t *testing.T) {
	f := guardedRetryFixture(t)
	c := netip.AddrPortFrom(spoofed, 3000)
	f.spendBudget(bpftest.LinuxSYN(c, vip, 100))
	// Again on the same (half-open) tuple, with another sequence number:
	// over the budget, dropped, and the copy is still the first SYN's.
	if ret, _, _ := f.run(bpftest.LinuxSYN(c, vip, 200)); ret != bpftest.XDPDrop {
		t.Fatalf("over the budget: verdict %d, want XDP_DROP", ret)
	}
	// And a new tuple's, dropped, takes no slot either.
	d := netip.AddrPortFrom(spoofed, 3001)
	f.run(bpftest.LinuxSYN(d, vip, 300))
	var cp bpf.LbSynCopy
	f.must(f.LbMaps.PbSynsV2.Lookup(maps.SynSlot(c.Addr(), c.Port()), &cp))
	if maps.Port(cp.ClientPort) != c.Port() || cp.Seq != htonl(100) {
		t.Errorf("the kept SYN is port %d seq %d, want the admitted one's (%d, 100)", maps.Port(cp.ClientPort), htonl(cp.Seq), c.Port())
	}
	f.must(f.LbMaps.PbSynsV2.Lookup(maps.SynSlot(d.Addr(), d.Port()), &cp))
	if maps.Port(cp.ClientPort) == d.Port() {
		t.Errorf("a dropped SYN took its slot: %+v", cp)
	}
	f.events()
}

// The agent's replay of a refused SYN is not judged by the guard: the
// client's SYN took the budget once, and its refusal was kept from it on
// the promise of that replay. The client's own retransmission is judged.
func TestSYNGuardLetsTheAgentsReplaysThrough(t *testing.T) {
	f := guardedRetryFixture(t)
	c := netip.AddrPortFrom(spoofed, 3100)
	syn := bpftest.LinuxSYN(c, vip, 100)
	f.spendBudget(syn)
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.Refusal(be1, c, 100)); ret != bpftest.XDPDrop {
		t.Fatalf("refusal verdict %d, want it kept from the client", ret)
	}
	before, err := f.Maps.SYNGuardStats()
	f.must(err)
	f.table(id2)
	if ret, p := f.runMeta(replay.Meta(0), syn); ret != bpftest.XDPPass || p.Dst != be2 {
		t.Fatalf("the agent's replay, budget spent: verdict %d to %v, want XDP_PASS to %v", ret, p.Dst, be2)
	}
	after, err := f.Maps.SYNGuardStats()
	f.must(err)
	if after != before {
		t.Errorf("the replay was counted by the guard: %+v, then %+v", before, after)
	}
	// Not the agent's (no metadata): the client's retransmission of that
	// SYN, over the budget.
	if ret, _, _ := f.run(syn); ret != bpftest.XDPDrop {
		t.Errorf("the client's retransmission, budget spent: verdict %d, want XDP_DROP", ret)
	}
	f.events()
}

func htonl(v uint32) uint32 { return v>>24 | v>>8&0xff00 | v<<8&0xff0000 | v<<24 }

// A CPU that sees more SYNs to services in one window than the guard's
// arm_syns, and then a quarter of that again from untrusted sources, turns
// the guard on by itself, without the agent's lease; a busy node's trusted
// clients do not arm it, and are never limited.
func TestSYNGuardArmsItself(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	oneCPU(t)
	// 100 SYNs a second over 100 ms: 10 a window, then 2 more untrusted
	// ones, and the 3rd arms.
	f.must(f.Maps.SetSYNGuard(maps.SYNGuard{Rate: 1, Burst: 3, Trust: time.Hour, ArmRate: 100}))
	f.must(f.Maps.TrustSource(client.Addr()))
	if n := f.syns(client.Addr(), 1000, 200); n != 200 {
		t.Errorf("busy with trusted clients: %d of 200 SYNs forwarded, want all", n)
	}
	if s, _ := f.Maps.SYNGuardStats(); s.Armed != 0 {
		t.Errorf("trusted clients armed the guard: %+v", s)
	}

	f.resetGuardCPU()
	start := time.Now()
	passed := f.syns(spoofed, 1000, 200)
	trusted := f.syns(client.Addr(), 2000, 50)
	// 12 before arming, then the burst of 3; a window that ran out before
	// (a test preempted for 100 ms) lets up to 12 more through, and each
	// second the test takes one more.
	slack := int(time.Since(start)/time.Second) + 1
	if passed < 15 || passed > 27+slack {
		t.Errorf("%d of 200 untrusted SYNs forwarded, want 15 (12 before arming, a burst of 3)", passed)
	}
	if trusted != 50 {
		t.Errorf("%d of 50 trusted SYNs forwarded once armed, want all", trusted)
	}
	s, err := f.Maps.SYNGuardStats()
	f.must(err)
	if s.Armed != 1 || s.Dropped != uint64(200-passed) {
		t.Errorf("guard counters = %+v, want armed once and %d dropped", s, 200-passed)
	}

	// Without arm_syns (--syn-guard-arm-rate 0) only the lease turns it on.
	f.must(f.Maps.SetSYNGuard(maps.SYNGuard{Rate: 1, Burst: 3, Trust: time.Hour}))
	f.resetGuardCPU()
	if n := f.syns(spoofed, 3000, 200); n != 200 {
		t.Errorf("never armed: %d of 200 SYNs forwarded", n)
	}
}

// resetGuardCPU clears the guard's per-CPU state: windows, arming, budget.
func (f *fixture) resetGuardCPU() {
	f.t.Helper()
	var per []bpf.LbSynGuardCpu
	f.must(f.PbSynGuardCpu.Lookup(uint32(0), &per))
	for i := range per {
		per[i] = bpf.LbSynGuardCpu{}
	}
	f.must(f.PbSynGuardCpu.Put(uint32(0), per))
}

// A source earns trust when a backend sends payload on one of its flows,
// not from a SYN-ACK (a spoofed source gets those too) nor from its own
// ACK (a blind one can be forged).
func TestBackendPayloadTrustsTheClient(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	c := netip.AddrPortFrom(spoofed, 41000)

	f.run(bpftest.TCP(c, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, c, bpftest.SYNACK, nil))
	f.run(bpftest.TCP(c, vip, bpftest.ACK, nil))
	f.run(bpftest.TCP(c, vip, bpftest.ACK, []byte("GET / HTTP/1.1\r\n\r\n")))
	if _, ok := f.Maps.TrustedSince(spoofed); ok {
		t.Fatal("trusted before any payload from the backend")
	}
	f.run(bpftest.TCP(be1, c, bpftest.ACK, []byte("HTTP/1.1 200 OK\r\n\r\n")))
	first, ok := f.Maps.TrustedSince(spoofed)
	if !ok {
		t.Fatal("not trusted after the backend's payload")
	}
	if now := coarseNow(); first > now || now-first > uint64(time.Second) {
		t.Errorf("trusted since %d, now is %d", first, now)
	}
	if _, ok := f.Maps.TrustedSince(client.Addr()); ok {
		t.Error("an address that sent nothing is trusted")
	}

	// The proof is renewed by the next flow's first payload, not by every
	// packet of a flow.
	var k bpf.LbSrcKey
	k.Addr.Bytes, k.Family = maps.Addr16(spoofed), maps.Family(spoofed)
	old := coarseNow() - uint64(2*time.Second)
	f.must(f.PbSrcTrust.Put(k, old))
	f.run(bpftest.TCP(be1, c, bpftest.ACK, []byte("more")))
	if again, _ := f.Maps.TrustedSince(spoofed); again != old {
		t.Errorf("trust renewed by a flow's second payload: %d, then %d", old, again)
	}
	c2 := netip.AddrPortFrom(spoofed, 41001)
	f.run(bpftest.TCP(c2, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, c2, bpftest.SYNACK, nil))
	f.run(bpftest.TCP(be1, c2, bpftest.ACK, []byte("HTTP/1.1 200 OK\r\n\r\n")))
	if again, _ := f.Maps.TrustedSince(spoofed); again <= old {
		t.Errorf("trust not renewed by a new flow's payload: %d, then %d", old, again)
	}
}

// coarseNow reads the guard's clock (bpf_ktime_get_coarse_ns).
func coarseNow() uint64 { return uint64(conntrack.KernelClocks().Coarse()) }

// oneCPU keeps the test, and the program runs it makes, on one CPU.
func oneCPU(t *testing.T) {
	runtime.LockOSThread()
	var was, one unix.CPUSet
	if err := unix.SchedGetaffinity(0, &was); err != nil {
		t.Fatal(err)
	}
	for cpu := range 1024 {
		if was.IsSet(cpu) {
			one.Set(cpu)
			break
		}
	}
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.SchedSetaffinity(0, &was)
		runtime.UnlockOSThread()
	})
}
