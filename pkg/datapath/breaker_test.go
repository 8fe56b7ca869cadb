// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// limit sets the service's circuit breaker and lists its backends.
func (f *fixture) limit(maxInflight, perBackend uint32, backends ...uint32) {
	f.t.Helper()
	f.must(f.Maps.SetServiceBackends(svcID, nil, backends))
	f.svc.MaxInflight, f.svc.MaxInflightPerBackend = maxInflight, perBackend
	f.svc.BackendCount = uint32(len(backends))
	f.writeService()
}

func (f *fixture) inflight() *maps.Inflight {
	f.t.Helper()
	in, err := f.Maps.OpenInflight()
	f.must(err)
	f.t.Cleanup(func() { in.Close() })
	return in
}

func clientPort(p uint16) netip.AddrPort { return netip.AddrPortFrom(client.Addr(), p) }

// wantRST checks out is the RST a client's stack accepts for the SYN it
// sent from c: from the VIP, seq 0, ack = SYN's seq + 1, valid checksums,
// no options, nothing else.
func wantRST(t *testing.T, out []byte, c netip.AddrPort) {
	t.Helper()
	if len(out) != 14+20+20 {
		t.Fatalf("RST frame is %d bytes, want 54", len(out))
	}
	p, err := bpftest.Parse(out)
	if err != nil {
		t.Fatalf("RST: %v", err)
	}
	if p.Src != vip || p.Dst != c {
		t.Fatalf("RST %v -> %v, want %v -> %v", p.Src, p.Dst, vip, c)
	}
	tcp := gopacket.NewPacket(out, layers.LayerTypeEthernet, gopacket.Default).Layer(layers.LayerTypeTCP).(*layers.TCP)
	if !tcp.RST || !tcp.ACK || tcp.SYN || tcp.FIN || tcp.Seq != 0 || tcp.Ack != 1000+1 || tcp.DataOffset != 5 {
		t.Fatalf("RST flags/numbers wrong: rst=%v ack=%v syn=%v seq=%d ack=%d doff=%d",
			tcp.RST, tcp.ACK, tcp.SYN, tcp.Seq, tcp.Ack, tcp.DataOffset)
	}
}

func TestBreakerAdmitsUpToTheLimitThenResets(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.limit(2, 0, id1)
	in := f.inflight()

	for p := uint16(1); p <= 2; p++ {
		_, got, _ := f.run(bpftest.TCP(clientPort(p), vip, bpftest.SYN, nil))
		if got.Dst != be1 {
			t.Fatalf("flow %d under the limit went to %v", p, got.Dst)
		}
	}
	if n := in.Service(svcID); n != 2 {
		t.Fatalf("inflight = %d, want 2", n)
	}
	ret, out := bpftest.Run(t, f.PbXdp, bpftest.TCP(clientPort(3), vip, bpftest.SYN, []byte("x")))
	if ret != bpftest.XDPPass {
		t.Fatalf("verdict %d: without XDP_TX on the ingress, the RST goes through the stack", ret)
	}
	// The SYN carried a byte: the RST acknowledges it too.
	p, err := bpftest.Parse(out)
	if err != nil {
		t.Fatal(err)
	}
	tcp := gopacket.NewPacket(out, layers.LayerTypeEthernet, gopacket.Default).Layer(layers.LayerTypeTCP).(*layers.TCP)
	if p.Src != vip || p.Dst != clientPort(3) || !tcp.RST || tcp.Ack != 1000+1+1 {
		t.Fatalf("RST %v -> %v rst=%v ack=%d", p.Src, p.Dst, tcp.RST, tcp.Ack)
	}
	// With the ingress interface able to take redirected frames, the RST
	// goes straight back out of it, MACs swapped.
	f.must(f.Maps.SetRedirect([]uint32{1}))
	ret, out = bpftest.Run(t, f.PbXdp, bpftest.TCP(clientPort(4), vip, bpftest.SYN, nil))
	if ret != bpftest.XDPRedirect {
		t.Fatalf("verdict %d, want XDP_REDIRECT back out of the ingress", ret)
	}
	wantRST(t, out, clientPort(4))
	par, _ := bpftest.Parse(out)
	if par.DstMAC.String() != bpftest.ClientMAC.String() || par.SrcMAC.String() != bpftest.NodeMAC.String() {
		t.Fatalf("MACs not swapped: %v -> %v", par.SrcMAC, par.DstMAC)
	}

	// Rejected flows are counted, never reported as a backend's failure,
	// and never counted as inflight.
	f.wantEvents(ev(evNewFlow, 0, id1, clientPort(1)), ev(evNewFlow, 0, id1, clientPort(2)))
	ss, err := f.Maps.ServiceStats(svcID)
	f.must(err)
	if ss.OverLimit != 2 || ss.Flows != 2 {
		t.Fatalf("service stats %+v, want 2 over limit, 2 flows", ss)
	}
	if n := in.Service(svcID); n != 2 {
		t.Fatalf("inflight = %d after rejections, want 2", n)
	}
}

func TestBreakerReleasesOnFlowEnd(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.limit(1, 0, id1)
	in := f.inflight()
	c := clientPort(1)
	admitted := func(port uint16) bool {
		ret, _ := bpftest.Run(t, f.PbXdp, bpftest.TCP(clientPort(port), vip, bpftest.SYN, nil))
		return ret == bpftest.XDPPass && in.Service(svcID) == 1
	}
	for _, end := range []struct {
		name string
		pkts [][]byte
	}{
		{"FIN both ways", [][]byte{bpftest.TCP(c, vip, bpftest.FIN, nil), bpftest.TCP(be1, c, bpftest.FIN, nil)}},
		{"FIN both ways, backend first", [][]byte{bpftest.TCP(be1, c, bpftest.FIN, nil), bpftest.TCP(c, vip, bpftest.FIN, nil)}},
		{"RST from the client", [][]byte{bpftest.TCP(c, vip, bpftest.RST, nil)}},
		{"RST from the backend", [][]byte{bpftest.TCP(be1, c, bpftest.RST, nil)}},
	} {
		f.run(bpftest.TCP(c, vip, bpftest.SYN, nil))
		f.run(bpftest.TCP(be1, c, bpftest.SYNACK, nil))
		if n := in.Service(svcID); n != 1 {
			t.Fatalf("%s: inflight %d with one flow", end.name, n)
		}
		if ret, out := bpftest.Run(t, f.PbXdp, bpftest.TCP(clientPort(9), vip, bpftest.SYN, nil)); ret != bpftest.XDPPass || len(out) != 54 {
			t.Fatalf("%s: a second flow was not refused at the limit", end.name)
		}
		for i, pkt := range end.pkts {
			bpftest.Run(t, f.PbXdp, pkt)
			if i < len(end.pkts)-1 && in.Service(svcID) != 1 {
				t.Fatalf("%s: released before the flow ended", end.name)
			}
		}
		if n, b := in.Service(svcID), in.Backend(id1); n != 0 || b != 0 {
			t.Fatalf("%s: inflight service %d backend %d after the flow ended, want 0", end.name, n, b)
		}
		// A retransmitted FIN or RST releases nothing more.
		for _, pkt := range end.pkts {
			bpftest.Run(t, f.PbXdp, pkt)
		}
		if n := in.Service(svcID); n != 0 {
			t.Fatalf("%s: inflight %d after duplicates", end.name, n)
		}
		if !admitted(10) {
			t.Fatalf("%s: a new flow was not admitted after the release", end.name)
		}
		bpftest.Run(t, f.PbXdp, bpftest.TCP(clientPort(10), vip, bpftest.RST, nil))
		f.events()
	}
}

func TestBreakerZeroDisablesCounting(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.limit(0, 0, id1)
	in := f.inflight()
	for p := uint16(1); p <= 50; p++ {
		if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.TCP(clientPort(p), vip, bpftest.SYN, nil)); ret != bpftest.XDPPass {
			t.Fatalf("flow %d: verdict %d", p, ret)
		}
	}
	flows, err := f.Maps.Flows()
	f.must(err)
	if n := in.Service(svcID); n != 0 || len(flows) != 0 {
		t.Fatalf("no limit, yet %d counted and %d tracked", n, len(flows))
	}
}

func TestBreakerPerEndpointLimitSkipsFullEndpoint(t *testing.T) {
	f := newFixture(t)
	f.table(id1) // every new flow hashes to backend 1...
	f.limit(0, 2, id1, id2)
	in := f.inflight()
	var got []netip.AddrPort
	for p := uint16(1); p <= 4; p++ {
		_, par, _ := f.run(bpftest.TCP(clientPort(p), vip, bpftest.SYN, nil))
		got = append(got, par.Dst)
	}
	// ...until it is full: then backend 2 takes them, then nobody.
	want := []netip.AddrPort{be1, be1, be2, be2}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("flows went to %v, want %v", got, want)
		}
	}
	if ret, out := bpftest.Run(t, f.PbXdp, bpftest.TCP(clientPort(5), vip, bpftest.SYN, nil)); ret != bpftest.XDPPass || len(out) != 54 {
		t.Fatalf("a flow was admitted with every endpoint at its limit")
	}
	if a, b := in.Backend(id1), in.Backend(id2); a != 2 || b != 2 {
		t.Fatalf("per-endpoint inflight %d and %d, want 2 and 2", a, b)
	}
}

// The reaper expires idle flows and releases their slots exactly once;
// live flows keep theirs.
func TestReaperExpiresIdleFlows(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.limit(10, 0, id1)
	in := f.inflight()
	// An established TCP flow, an unanswered one, and one to be kept.
	f.run(bpftest.TCP(clientPort(1), vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, clientPort(1), bpftest.SYNACK, nil))
	f.run(bpftest.TCP(clientPort(1), vip, bpftest.ACK, nil)) // the client completes the handshake
	f.run(bpftest.TCP(clientPort(2), vip, bpftest.SYN, nil))
	if n := in.Service(svcID); n != 2 {
		t.Fatalf("inflight %d, want 2", n)
	}

	real := conntrack.KernelClocks()
	r := &conntrack.Reaper{Maps: f.Maps, Inflight: in, Timeouts: conntrack.DefaultTimeouts(), Clocks: real}
	res, err := r.Sweep()
	f.must(err)
	if res.Expired != 0 || res.Released != 0 || res.Counted != 2 {
		t.Fatalf("fresh flows: %+v", res)
	}
	if !res.InUse.Backends[id1] || !res.InUse.Services[svcID] {
		t.Fatalf("ids of live flows not reported in use: %+v", res.InUse)
	}

	// Two minutes later the unanswered flow (60s) is gone, the established
	// one (6h) stays.
	later := func(d time.Duration) conntrack.Clocks {
		return conntrack.Clocks{
			Coarse: func() int64 { return real.Coarse() + int64(d) },
			Mono:   func() int64 { return real.Mono() + int64(d) },
		}
	}
	r.Clocks = later(2 * time.Minute)
	res, err = r.Sweep()
	f.must(err)
	if res.Expired != 1 || res.Released != 1 || in.Service(svcID) != 1 {
		t.Fatalf("after 2m: %+v, inflight %d; want the opening flow expired", res, in.Service(svcID))
	}
	r.Clocks = later(7 * time.Hour)
	res, err = r.Sweep()
	f.must(err)
	if res.Expired != 1 || res.Released != 1 || in.Service(svcID) != 0 || in.Backend(id1) != 0 {
		t.Fatalf("after 7h: %+v, inflight %d", res, in.Service(svcID))
	}
	// Nothing left to release twice.
	res, err = r.Sweep()
	f.must(err)
	if res.Released != 0 || in.Service(svcID) != 0 {
		t.Fatalf("second sweep released again: %+v", res)
	}

	// A counted flow whose conntrack entries the LRU evicted is released
	// once it is older than the orphan grace.
	f.run(bpftest.TCP(clientPort(3), vip, bpftest.SYN, nil))
	ents, err := f.Maps.Conntrack(0)
	f.must(err)
	for _, e := range ents {
		f.must(f.Maps.DeleteCT(e.Key))
	}
	r.Clocks = real
	if res, _ = r.Sweep(); res.Released != 0 {
		t.Fatalf("a just-created flow was taken for an orphan: %+v", res)
	}
	r.Clocks = later(time.Minute)
	if res, _ = r.Sweep(); res.Released != 1 || in.Service(svcID) != 0 {
		t.Fatalf("orphan not released: %+v, inflight %d", res, in.Service(svcID))
	}
}
