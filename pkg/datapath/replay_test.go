// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"bytes"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/replay"
)

// A service with retryRefused keeps each client SYN as it arrived, and
// the replay rebuilds it byte for byte: same addresses, ports, sequence
// number, window, options, Ethernet addresses.
func TestSynCopyRebuildsTheClientSYN(t *testing.T) {
	f := newFixture(t)
	f.svc.Flags = maps.ServiceRetryRefused
	f.table(id1)
	syn := bpftest.LinuxSYN(client, vip, 0x12345678)
	f.run(syn)
	var c bpf.LbSynCopy
	f.must(f.LbMaps.PbSynsV2.Lookup(maps.SynSlot(client.Addr(), client.Port()), &c))
	if c.OptLen != 20 || c.Ifindex != 1 {
		t.Errorf("copy %+v: want 20 bytes of options, ifindex 1 (lo, the test run's)", c)
	}
	got, err := replay.Frame(&c, 1) // the crafted SYN's IP id
	f.must(err)
	if !bytes.Equal(got, syn) {
		t.Fatalf("rebuilt SYN\n%x\nwant\n%x", got, syn)
	}
	// The backend refuses it: the RST is kept from the client and the
	// event says the SYN may be replayed.
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.Refusal(be1, client, 0x12345678)); ret != bpftest.XDPDrop {
		t.Fatalf("refusal verdict %d, want it kept from the client", ret)
	}
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evRefused, evfRescued, id1, client))
	// The replayed SYN is the client's retransmission to the datapath: it
	// goes to the other backend.
	f.table(id2)
	_, p, _ := f.run(got)
	if p.Dst != be2 {
		t.Fatalf("replayed SYN went to %v, want %v", p.Dst, be2)
	}
}

// The same for an IPv6 client: the copy holds its 16-byte addresses and hop
// limit, and the replay rebuilds its SYN byte for byte, which the datapath
// sends to the other backend.
func TestSynCopyRebuildsTheClientSYNIPv6(t *testing.T) {
	f := fixture6(t, 6)
	f.svc6(6, 0, maps.ServiceRetryRefused)
	syn := bpftest.LinuxSYN(client6, vip6, 0x12345678)
	f.run(syn)
	var c bpf.LbSynCopy
	f.must(f.LbMaps.PbSynsV2.Lookup(maps.SynSlot(client6.Addr(), client6.Port()), &c))
	if c.Family != 6 || c.OptLen != 20 || c.Ttl != 64 {
		t.Errorf("copy %+v: want family 6, 20 bytes of options, hop limit 64", c)
	}
	got, err := replay.Frame(&c, 1)
	f.must(err)
	if !bytes.Equal(got, syn) {
		t.Fatalf("rebuilt SYN\n%x\nwant\n%x", got, syn)
	}
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.Refusal(be6a, client6, 0x12345678)); ret != bpftest.XDPDrop {
		t.Fatalf("refusal verdict %d, want it kept from the client", ret)
	}
	f.wantEvents(ev6(evNewFlow, 0, id6a, client6), ev6(evRefused, evfRescued, id6a, client6))
	// Every slot on the other backend now: the replay goes there.
	tbl := make([]uint32, size6)
	for i := range tbl {
		tbl[i] = id6b
	}
	f.must(f.Maps.FillTable(svc6, 0, tbl))
	_, p, _ := f.run(got)
	if p.Dst != be6b {
		t.Fatalf("replayed SYN went to %v, want %v", p.Dst, be6b)
	}
}

// A refusal of a SYN other than the one kept (the client tried again on
// the tuple with another ISN, and the slot now holds that one) is not
// replayable: the client's own retransmission is moved instead.
func TestRefusalOfAnotherSYNIsNotReplayable(t *testing.T) {
	f := newFixture(t)
	f.svc.Flags = maps.ServiceRetryRefused
	f.table(id1)
	f.run(bpftest.LinuxSYN(client, vip, 5000))
	f.run(bpftest.LinuxSYN(client, vip, 7000))
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.Refusal(be1, client, 5000)); ret != bpftest.XDPDrop {
		t.Fatalf("refusal verdict %d, want it kept from the client", ret)
	}
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evRefused, 0, id1, client))
}

// Without retryRefused nothing is copied: the new-flow path pays nothing.
func TestNoSynCopyWithoutRetryRefused(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.LinuxSYN(client, vip, 1))
	var c bpf.LbSynCopy
	f.must(f.LbMaps.PbSynsV2.Lookup(maps.SynSlot(client.Addr(), client.Port()), &c))
	if c.Family != 0 || c.OptLen != 0 {
		t.Errorf("copied a SYN for a service without retryRefused: %+v", c)
	}
}

// The agent's replay of an unanswered SYN carries metadata naming the
// backend to move off: the datapath moves the flow (once), without the
// backend being ejected.
func TestUnansweredReplayMovesTheFlow(t *testing.T) {
	f := newFixture(t)
	f.svc.Flags = maps.ServiceRetryRefused
	f.table(id1)
	syn := bpftest.LinuxSYN(client, vip, 42)
	f.run(syn)
	// A single listed backend: nowhere to move the flow, the replay is
	// dropped and the flow stays.
	f.svc.BackendCount = 1
	f.table(id2) // where a re-pick lands; backend 1 stays active
	meta := replay.Meta(id1)
	run := func(meta []byte) netip.AddrPort {
		t.Helper()
		_, p := f.runMeta(meta, syn)
		return p.Dst
	}
	// Without metadata it is the client's retransmission: it stays (the
	// backend is active).
	if dst := run(nil); dst != be1 {
		t.Fatalf("retransmitted SYN went to %v, want it kept on %v", dst, be1)
	}
	if dst := run(meta); dst != vip {
		t.Fatalf("replay with one backend listed went to %v, want it dropped (unchanged)", dst)
	}
	f.must(f.Maps.SetServiceBackends(svcID, nil, []uint32{id1, id2}))
	f.svc.BackendCount = 2
	f.writeService()
	if dst := run(meta); dst != be2 {
		t.Fatalf("replayed SYN went to %v, want it moved to %v", dst, be2)
	}
	evs := f.events()
	if n := len(evs); n < 2 || evs[n-1] != ev(evNewFlow, evfRepick, id2, client) {
		t.Fatalf("events %+v: want the move reported as a re-picked NEW_FLOW", evs)
	}
	// Short metadata is no replay: the client's retransmission, which
	// stays with the flow's new backend.
	if dst := run(append([]byte{}, meta[:4]...)); dst != be2 {
		t.Errorf("short metadata: %v", dst)
	}
	f.events()
	// The first backend answers late: its answer is reported (no timeout
	// for it) and kept from the client, which has its connection already.
	ret, _ := bpftest.Run(t, f.PbXdp, bpftest.TCPSeq(be1, client, bpftest.SYNACK, nil, bpftest.ISN, 43))
	if ret != bpftest.XDPDrop {
		t.Fatalf("late SYN-ACK verdict %d, want it dropped", ret)
	}
	f.wantEvents(ev(evEstablished, 0, id1, client))
	// The new backend's answer goes through.
	if _, p, _ := f.run(bpftest.TCPSeq(be2, client, bpftest.SYNACK, nil, bpftest.ISN, 43)); p.Src != vip {
		t.Fatalf("new backend's SYN-ACK: %v", p.Src)
	}
}

// A replay the datapath does not move (an unanswered SYN with no other
// backend listed to move it to; a refused one of a service left with no
// backend) went nowhere: the replayer says so (ErrDropped, its own metric
// result), not that it was sent. Run as the agent runs it, in live-frame
// mode; only the dropped cases, which send no frame out of the test.
func TestReplayTheDatapathDropsIsNotSent(t *testing.T) {
	bpftest.RequireLiveFrames(t)
	f := newFixture(t)
	f.svc.Flags = maps.ServiceRetryRefused
	f.table(id1)
	syn := bpftest.LinuxSYN(client, vip, 42)
	f.runMeta(nil, syn) // kept with the ingress interface 1 (lo), as live frames need one
	f.svc.BackendCount = 1
	f.writeService()
	r := replay.New(func() (*ebpf.Program, error) { return f.PbXdp, nil }, f.Maps)
	if err := r.ReplayUnanswered(client, vip, be1, id1); !errors.Is(err, replay.ErrDropped) {
		t.Fatalf("replay with nowhere to move the flow: %v, want ErrDropped", err)
	}
	// The flow is as it was: still with its backend, waiting.
	var v bpf.LbCtValue
	f.must(f.LbMaps.PbCtV2.Lookup(maps.ReplyKey(be1, client), &v))
	if v.BackendId != id1 || v.Flags&(maps.CTRetry|maps.CTClosed) != 0 {
		t.Errorf("flow after a dropped replay: backend %d flags %#x, want it unchanged on %d", v.BackendId, v.Flags, id1)
	}

	// A rescued refusal (another client port) of a service left with no
	// backend at all.
	client2 := netip.AddrPortFrom(client.Addr(), client.Port()+1)
	f.runMeta(nil, bpftest.LinuxSYN(client2, vip, 5000))
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.Refusal(be1, client2, 5000)); ret != bpftest.XDPDrop {
		t.Fatalf("refusal verdict %d, want it kept from the client", ret)
	}
	f.svc.TableSize = 0
	f.writeService()
	if err := r.Replay(client2, vip, be1); !errors.Is(err, replay.ErrDropped) {
		t.Fatalf("refused replay with no backend: %v, want ErrDropped", err)
	}
}

// runMeta runs the datapath on pkt with meta as its XDP metadata, as the
// agent's replays arrive (ingress ifindex 1).
func (f *fixture) runMeta(meta, pkt []byte) (uint32, bpftest.Parsed) {
	f.t.Helper()
	data := append(append([]byte{}, meta...), pkt...)
	out := make([]byte, len(data)+256)
	ret, err := f.PbXdp.Run(&ebpf.RunOptions{Data: data, DataOut: out, Repeat: 1,
		Context: [6]uint32{uint32(len(meta)), uint32(len(data)), 0, 1, 0, 0}})
	f.must(err)
	p, err := bpftest.Parse(out[len(meta):]) // the output starts at the metadata
	f.must(err)
	return ret, p
}

// A flow the agent's replay moved keeps the entry of the backend it left
// (PB_CT_MOVED, for that backend's late answer). That entry expires on the
// opening timeout while the moved flow lives on: its expiry must take
// only itself, not the live flow's forward entry (which a reverse entry's
// VIP names too), or the flow's next packet is picked up midstream and
// may land on the backend it was moved off.
func TestMovedOffEntryExpiresAlone(t *testing.T) {
	f := newFixture(t)
	f.svc.Flags = maps.ServiceRetryRefused
	f.svc.BackendCount = 2
	f.writeService()
	f.table(id1)
	f.must(f.Maps.SetServiceBackends(svcID, nil, []uint32{id1, id2}))
	syn := bpftest.LinuxSYN(client, vip, 42)
	f.run(syn)
	f.table(id2) // where the re-pick lands; backend 1 stays active
	f.runMeta(replay.Meta(id1), syn)
	// The moved flow completes with its new backend; the old one never
	// answers.
	f.run(bpftest.TCPSeq(be2, client, bpftest.SYNACK, nil, bpftest.ISN, 43))
	f.run(bpftest.TCPSeq(client, vip, bpftest.ACK, nil, 43, bpftest.ISN+1))
	f.events()
	// The table goes back to backend 1, as after a heal: a flow that lost
	// its forward entry would be picked up there.
	f.table(id1)

	// Past the opening timeout, well inside the established one.
	r := &conntrack.Reaper{Maps: f.Maps, Inflight: f.inflight(), Timeouts: conntrack.DefaultTimeouts(),
		Clocks: laterClocks(2 * time.Minute)}
	res, err := r.Sweep()
	f.must(err)
	if res.Expired != 1 {
		t.Errorf("sweep expired %d flows, want 1 (the moved-off backend's entry)", res.Expired)
	}
	if _, p, _ := f.run(bpftest.TCP(client, vip, bpftest.ACK, []byte("x"))); p.Dst != be2 {
		t.Fatalf("the moved flow's next packet went to %v, want %v", p.Dst, be2)
	}
	if _, p, _ := f.run(bpftest.TCP(be2, client, bpftest.ACK, nil)); p.Src != vip {
		t.Errorf("the moved flow's reply is not reverse-NATed: from %v", p.Src)
	}
}
