// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// affinityFixture is the service over be1 and be2, slots alternating, so
// that a client's ports spread over both when nothing pins them.
func affinityFixture(t *testing.T) *fixture {
	f := newFixture(t)
	f.noRetransMinAge()
	t.Cleanup(func() { f.must(f.Maps.SetConfig(maps.Config{})) })
	f.must(f.Maps.ForgetAffinity(svcID))
	t.Cleanup(func() { f.must(f.Maps.ForgetAffinity(svcID)) })
	f.alternate(id1, id2)
	return f
}

// syn opens a flow from c and returns the backend it went to.
func (f *fixture) syn(c netip.AddrPort) netip.AddrPort {
	f.t.Helper()
	ret, p, _ := f.run(bpftest.TCP(c, vip, bpftest.SYN, nil))
	if ret != bpftest.XDPPass && ret != bpftest.XDPTX {
		f.t.Fatalf("SYN from %v: verdict %d", c, ret)
	}
	f.events()
	return p.Dst
}

// sessionAffinity ClientIP: every new flow of a client goes to the
// backend of its last one while the timeout has not run out since; the
// table's spread resumes when it has, or when affinity is off. Accrual
// wins: a pinned backend that is ejected gets no new flow, and the client
// stays on the one it was moved to when the first comes back.
func TestSessionAffinity(t *testing.T) {
	f := affinityFixture(t)
	port := uint16(41000)
	next := func(a netip.Addr) netip.AddrPort { port++; return netip.AddrPortFrom(a, port) }
	c := client.Addr()
	c2 := netip.MustParseAddr("198.18.0.3")

	// Off: the client's ports land on both backends.
	natural := map[netip.AddrPort]netip.AddrPort{}
	seen := map[netip.AddrPort]int{}
	for range 40 {
		cp := next(c)
		natural[cp] = f.syn(cp)
		seen[natural[cp]]++
	}
	if seen[be1] == 0 || seen[be2] == 0 {
		t.Fatalf("without affinity, 40 flows went to %v: the table does not spread them", seen)
	}

	f.svc.AffinityTimeoutS = 60
	f.writeService()
	first := f.syn(next(c))
	for i := range 40 {
		if got := f.syn(next(c)); got != first {
			t.Fatalf("flow %d of a pinned client went to %v, want %v", i, got, first)
		}
	}
	// Another client has its own pin, by its own first flow.
	other := f.syn(next(c2))
	for range 10 {
		if got := f.syn(next(c2)); got != other {
			t.Fatalf("the second client's flow went to %v, want %v", got, other)
		}
	}

	// Accrual wins: the pinned backend ejected, the client moves, and
	// stays moved when the backend is readmitted.
	firstID, otherBE := uint32(id1), be2
	if first == be2 {
		firstID, otherBE = id2, be1
	}
	f.must(f.Maps.SetBackend(firstID, maps.NewBackend(first, svcID, maps.BackendEjected, 0)))
	for range 10 {
		if got := f.syn(next(c)); got != otherBE {
			t.Fatalf("with its backend ejected, a pinned client's flow went to %v, want %v", got, otherBE)
		}
	}
	f.must(f.Maps.SetBackend(firstID, maps.NewBackend(first, svcID, maps.BackendActive, 0)))
	for range 10 {
		if got := f.syn(next(c)); got != otherBE {
			t.Fatalf("the ejected backend back, the moved client's flow went to %v, want %v (where it was moved)", got, otherBE)
		}
	}

	// The timeout runs from the client's last new flow: stamped just
	// over 60s ago, the pin is gone, the table picks again and the
	// client is pinned anew, to that pick, from now.
	k := bpf.LbAffinityKey{SvcId: svcID, Family: maps.Family(c)}
	k.Client.Bytes = maps.Addr16(c)
	var v bpf.LbAffinityValue
	f.must(f.PbAffinity.Lookup(&k, &v))
	if v.LastNs == 0 || v.BackendId != map[netip.AddrPort]uint32{be1: id1, be2: id2}[otherBE] {
		t.Fatalf("pb_affinity holds %+v for the client, want backend %v", v, otherBE)
	}
	byID := map[uint32]netip.AddrPort{id1: be1, id2: be2}
	for cp, want := range natural {
		if want != first {
			continue
		}
		v.LastNs = monotonicNow(t) - uint64(61*time.Second)
		f.must(f.PbAffinity.Put(&k, &v))
		// cp's port again: the table's pick for it is first's backend.
		f.run(bpftest.TCP(cp, vip, bpftest.RST, nil))
		if got := f.syn(cp); got != first {
			t.Fatalf("the timeout run out, a flow went to %v, want the table's pick %v", got, first)
		}
		f.must(f.PbAffinity.Lookup(&k, &v))
		if byID[v.BackendId] != first || monotonicNow(t)-v.LastNs > uint64(10*time.Second) {
			t.Errorf("after the timeout, the client's pin is %+v, want backend %v stamped now", v, first)
		}
		break
	}

	// Off again: the pins are forgotten with it (the agent's part) and the
	// table's spread is back.
	f.svc.AffinityTimeoutS = 0
	f.writeService()
	f.must(f.Maps.ForgetAffinity(svcID))
	if n, _, err := f.Maps.AffinityFill(); err != nil || n != 0 {
		t.Errorf("pb_affinity after ForgetAffinity: %d entries, %v", n, err)
	}
	seen = map[netip.AddrPort]int{}
	for range 40 {
		seen[f.syn(next(c))]++
	}
	if seen[be1] == 0 || seen[be2] == 0 {
		t.Errorf("affinity off: 40 flows went to %v, want both backends", seen)
	}
}
