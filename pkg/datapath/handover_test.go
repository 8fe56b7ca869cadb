package datapath_test

import (
	"bytes"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

func monotonicNow(t *testing.T) uint64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return uint64(ts.Nano())
}

// passesUnchanged runs pkt and fails unless it leaves as it came.
func (f *fixture) passesUnchanged(what string, pkt []byte) {
	f.t.Helper()
	ret, out := bpftest.Run(f.t, f.PbXdp, pkt)
	if ret != bpftest.XDPPass || !bytes.Equal(out[:len(pkt)], pkt) {
		f.t.Errorf("%s: verdict %d, changed %v; want it passed to kube-proxy as it came", what, ret, !bytes.Equal(out[:len(pkt)], pkt))
	}
}

// The dead-man's switch: with the agent's heartbeat older than the bound,
// a new flow is kube-proxy's (the maps no longer follow the endpoints),
// while a flow already here keeps its backend. A fresh heartbeat takes
// new flows back.
func TestDeadMansSwitch(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.events()
	stale := maps.Config{DeadMan: 30 * time.Second, Heartbeat: monotonicNow(t) - uint64(time.Minute)}
	f.must(f.Maps.SetConfig(stale))
	f.passesUnchanged("a new flow with no heartbeat for a minute", bpftest.TCP(client2, vip, bpftest.SYN, nil))
	if _, p, _ := f.run(bpftest.TCP(client, vip, bpftest.ACK, nil)); p.Dst != be1 {
		t.Errorf("the established flow's packet went to %v, want its backend %v", p.Dst, be1)
	}
	// The tuple of a flow that ended is a new flow too.
	f.run(bpftest.TCP(client, vip, bpftest.RST, nil))
	f.passesUnchanged("a SYN on an ended flow's tuple", bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.wantEvents(ev(evFlowEnd, evfClient, id1, client))
	if got := f.stats().HandedOver; got != 2 {
		t.Errorf("handed_over %d, want 2", got)
	}

	fresh := stale
	fresh.Heartbeat = monotonicNow(t)
	f.must(f.Maps.SetConfig(fresh))
	if _, p, _ := f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil)); p.Dst != be1 {
		t.Errorf("with a fresh heartbeat the new flow went to %v", p.Dst)
	}
	// No bound: never handed over, however old the heartbeat.
	f.must(f.Maps.SetConfig(maps.Config{Heartbeat: 1}))
	if _, p, _ := f.run(bpftest.TCP(clientPort(7), vip, bpftest.SYN, nil)); p.Dst != be1 {
		t.Errorf("with no dead-man's bound the new flow went to %v", p.Dst)
	}
}

// Draining (the install going): new flows are kube-proxy's at once, the
// flows here finish.
func TestDrainHandsNewFlowsOver(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.handshake(client, be1)
	f.must(f.Maps.SetConfig(maps.Config{Drain: true}))
	f.passesUnchanged("a new flow while draining", bpftest.TCP(client2, vip, bpftest.SYN, nil))
	if _, p, _ := f.run(bpftest.TCP(client, vip, bpftest.ACK, []byte("more"))); p.Dst != be1 {
		t.Errorf("the flow here went to %v while draining, want %v", p.Dst, be1)
	}
	if _, p, _ := f.run(bpftest.TCP(be1, client, bpftest.ACK, []byte("reply"))); p.Src != vip {
		t.Errorf("its reply left as %v, want the VIP", p.Src)
	}
}

// A service just taken from kube-proxy leaves the flows kube-proxy began
// to it: a TCP packet with no flow here passes, instead of being picked up
// mid-stream and sent to a backend that never saw its handshake. SYNs are
// new flows, taken.
func TestTakenOverServiceLeavesKubeProxysFlows(t *testing.T) {
	f := newFixture(t)
	f.svc.Flags = maps.ServiceTakenOver
	f.table(id1)
	f.passesUnchanged("kube-proxy's flow's packet", bpftest.TCP(client, vip, bpftest.ACK, []byte("data")))
	if got := f.stats().KubeProxyMidstream; got != 1 {
		t.Errorf("kube_proxy_midstream %d, want 1", got)
	}
	if _, p, _ := f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil)); p.Dst != be1 {
		t.Errorf("a new flow of a service taken over went to %v", p.Dst)
	}
	// Once the grace is over, a mid-stream packet is picked up again.
	f.svc.Flags = 0
	f.writeService()
	if _, p, _ := f.run(bpftest.TCP(client, vip, bpftest.ACK, []byte("data"))); p.Dst != be1 {
		t.Errorf("after the grace, a mid-stream packet went to %v", p.Dst)
	}
}

// A service handed back to kube-proxy (no longer served): its new flows
// pass, a SYN on the tuple of one of its ended flows too, and a packet of
// a flow with no entry here (kube-proxy's); the flows admitted before
// finish on their backends, both ways.
func TestHandedBackServiceFinishesItsFlows(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.handshake(client, be1)
	f.run(bpftest.TCP(clientPort(40007), vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(clientPort(40007), vip, bpftest.RST, nil))
	f.events()
	f.svc.Flags, f.svc.TableSize = maps.ServiceHandedBack, 0
	f.writeService()
	f.passesUnchanged("a new flow", bpftest.TCP(client2, vip, bpftest.SYN, nil))
	f.passesUnchanged("a SYN on an ended flow's tuple", bpftest.TCP(clientPort(40007), vip, bpftest.SYN, nil))
	// That is kube-proxy's flow now: its replies are not the old flow's.
	f.passesUnchanged("kube-proxy's reply on the old flow's tuple", bpftest.TCP(be1, clientPort(40007), bpftest.SYNACK, nil))
	f.passesUnchanged("kube-proxy's flow's packet", bpftest.TCP(clientPort(40008), vip, bpftest.ACK, []byte("data")))
	if _, p, _ := f.run(bpftest.TCP(client, vip, bpftest.ACK, []byte("more"))); p.Dst != be1 {
		t.Errorf("the flow admitted before went to %v, want %v", p.Dst, be1)
	}
	if _, p, _ := f.run(bpftest.TCP(be1, client, bpftest.ACK, []byte("reply"))); p.Src != vip {
		t.Errorf("its reply left as %v, want the VIP", p.Src)
	}
	if got := f.stats().HandedOver; got != 3 {
		t.Errorf("handed_over %d, want 3 (two new flows, one mid-stream packet)", got)
	}
}
