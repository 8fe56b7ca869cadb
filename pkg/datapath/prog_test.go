// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/netip"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf/ringbuf"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/csum"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

var (
	vip     = netip.MustParseAddrPort("198.18.100.1:80")
	client  = netip.MustParseAddrPort("198.18.0.2:40000")
	client2 = netip.MustParseAddrPort("198.18.0.2:40001")
	be1     = netip.MustParseAddrPort("198.18.1.2:8080")
	be2     = netip.MustParseAddrPort("198.18.2.2:8080")
)

const (
	svcID = 3
	id1   = 11
	id2   = 12
	size  = 7
)

// Event types and flags of pb_consts.h.
const (
	evNewFlow     = 1
	evEstablished = 2
	evRefused     = 3
	evReset       = 4
	evSynRetrans  = 5
	evFlowEnd     = 6
	evFirstData   = 8

	evfProbe       = 0x01
	evfBackendData = 0x02
	evfRepick      = 0x04
	evfClient      = uint8(bpf.LbPbEventFlagPB_EVF_CLIENT)
	evfRescued     = uint8(bpf.LbPbEventFlagPB_EVF_RESCUED)
)

type fixture struct {
	*bpftest.Loaded
	t  testing.TB
	rb *ringbuf.Reader
	// svc is the service's pb_services value as last written; proto its
	// protocol.
	svc   bpf.LbSvcValue
	proto uint8
}

func newFixture(t testing.TB) *fixture {
	l := bpftest.Shared(t)
	rb, err := ringbuf.NewReader(l.PbEvents)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rb.Close() })
	f := &fixture{Loaded: l, t: t, rb: rb}
	f.must(f.Maps.SetBackend(id1, maps.NewBackend(be1, svcID, maps.BackendActive, 0)))
	f.must(f.Maps.SetBackend(id2, maps.NewBackend(be2, svcID, maps.BackendActive, 0)))
	f.must(f.Maps.SetPorts(nil, map[uint16]uint8{80: maps.PortVIP, 8080: maps.PortBackend}))
	f.must(f.Maps.SetVIPSlots(nil, map[uint32]bool{maps.VIPSlot(vip.Addr()): true}))
	f.must(f.Maps.InstallTables([]maps.TableInstall{{SvcID: svcID, N: 0, Size: size}, {SvcID: svcID, N: 1, Size: size}}))
	f.service(6, 0)
	return f
}

func (f *fixture) must(err error) {
	f.t.Helper()
	if err != nil {
		f.t.Fatal(err)
	}
}

// service programs the VIP for proto with every slot on backend id (0: no table).
func (f *fixture) service(proto uint8, id uint32) {
	f.t.Helper()
	f.proto = proto
	f.svc = bpf.LbSvcValue{Id: svcID}
	f.writeService()
	if id != 0 {
		f.table(id)
	}
}

func (f *fixture) writeService() {
	f.t.Helper()
	f.must(f.Maps.UpsertService(maps.ServiceKey(vip.Addr(), vip.Port(), f.proto), f.svc))
}

// table fills the service's spare table with every slot on backend id and
// flips the service to it, as the agent does.
func (f *fixture) table(id uint32) {
	f.t.Helper()
	next := uint32(0)
	if f.svc.TableSize != 0 {
		next = 1 - f.svc.Table
	}
	f.must(f.Maps.FillTable(svcID, next, fill(id)))
	f.svc.Table, f.svc.TableSize = next, size
	f.writeService()
}

// alternate fills table 0 with its slots cycling through ids and flips
// the service to it: a client's ports spread over them.
func (f *fixture) alternate(ids ...uint32) {
	f.t.Helper()
	slots := make([]uint32, size)
	for i := range slots {
		slots[i] = ids[i%len(ids)]
	}
	f.must(f.Maps.FillTable(svcID, 0, slots))
	f.svc.Table, f.svc.TableSize = 0, size
	f.writeService()
}

func fill(id uint32) []uint32 {
	t := make([]uint32, size)
	for i := range t {
		t[i] = id
	}
	return t
}

func (f *fixture) run(pkt []byte) (uint32, bpftest.Parsed, []byte) {
	f.t.Helper()
	ret, out := bpftest.Run(f.t, f.PbXdp, pkt)
	p, err := bpftest.Parse(out)
	if err != nil {
		f.t.Fatalf("output packet: %v", err)
	}
	return ret, p, out
}

type event struct {
	Type, Flags uint8
	Svc, BE     uint32
	Client      netip.AddrPort
}

// events drains the ring buffer.
func (f *fixture) events() []event {
	f.t.Helper()
	var out []event
	for range 1000 {
		f.rb.SetDeadline(time.Now())
		rec, err := f.rb.Read()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return out
		}
		if err != nil {
			f.t.Fatal(err)
		}
		var e bpf.LbEvent
		if err := binary.Read(bytes.NewReader(rec.RawSample), binary.NativeEndian, &e); err != nil {
			f.t.Fatal(err)
		}
		if e.TsNs == 0 {
			f.t.Errorf("event without timestamp: %+v", e)
		}
		a := maps.AddrFrom16(e.Client.Bytes)
		if e.Family == 6 {
			a = netip.AddrFrom16(e.Client.Bytes)
		}
		out = append(out, event{e.Type, e.Flags, e.SvcId, e.BackendId, netip.AddrPortFrom(a, maps.Port(e.ClientPort))})
	}
	f.t.Fatal("ring buffer does not drain")
	return nil
}

func (f *fixture) wantEvents(want ...event) {
	f.t.Helper()
	got := f.events()
	if len(got) != len(want) {
		f.t.Fatalf("events = %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			f.t.Errorf("event %d = %+v, want %+v", i, got[i], want[i])
		}
	}
}

// handshake runs a connection's opening through the datapath: the
// client's SYN, the backend's SYN-ACK and the client's ACK of it (a reset
// counts only after a right one).
func (f *fixture) handshake(c, be netip.AddrPort) {
	f.t.Helper()
	f.run(bpftest.TCP(c, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be, c, bpftest.SYNACK, nil))
	f.run(bpftest.TCP(c, vip, bpftest.ACK, nil))
}

// noRetransMinAge makes a SYN seen again a retransmission however soon it
// comes (the datapath's 200 ms minimum has a test of its own).
func (f *fixture) noRetransMinAge() {
	f.t.Helper()
	f.must(f.Maps.SetConfig(maps.Config{SYNRetransMinAge: time.Nanosecond}))
}

func ev(typ, flags uint8, be uint32, c netip.AddrPort) event {
	return event{Type: typ, Flags: flags, Svc: svcID, BE: be, Client: c}
}

func TestDNATAndReverseNAT(t *testing.T) {
	f := newFixture(t)
	f.table(id1)

	ret, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	if ret != bpftest.XDPPass {
		t.Fatalf("verdict %d, want XDP_PASS", ret)
	}
	if p.Src != client || p.Dst != be1 {
		t.Fatalf("DNAT: %v -> %v, want %v -> %v", p.Src, p.Dst, client, be1)
	}
	if p.TTL != 64 {
		t.Errorf("TTL changed on the XDP_PASS path: %d", p.TTL)
	}
	f.wantEvents(ev(evNewFlow, 0, id1, client))

	// The reply comes back from the VIP, with valid checksums, and the
	// SYN-ACK is reported once however often it is retransmitted.
	for range 2 {
		ret, p, _ = f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))
		if ret != bpftest.XDPPass || p.Src != vip || p.Dst != client {
			t.Fatalf("reverse NAT: verdict %d, %v -> %v", ret, p.Src, p.Dst)
		}
	}
	f.wantEvents(ev(evEstablished, 0, id1, client))

	// Data both ways keeps the mapping and emits nothing.
	_, p, _ = f.run(bpftest.TCP(client, vip, bpftest.ACK, []byte("GET / HTTP/1.1\r\n\r\n")))
	if p.Dst != be1 {
		t.Fatalf("established flow went to %v", p.Dst)
	}
	for range 2 {
		_, p, _ = f.run(bpftest.TCP(be1, client, bpftest.ACK, []byte("HTTP/1.1 200 OK\r\n\r\n")))
		if p.Src != vip {
			t.Fatalf("reply source %v", p.Src)
		}
	}
	f.wantEvents(ev(evFirstData, 0, id1, client))

	ss, err := f.Maps.ServiceStats(svcID)
	f.must(err)
	if ss.Flows != 1 || ss.Packets != 2 {
		t.Errorf("service stats = %+v, want 1 flow, 2 packets", ss)
	}
	bs, err := f.Maps.BackendStats(id1)
	f.must(err)
	if bs.Flows != 1 || bs.Packets != 2 || bs.ReplyPackets != 4 {
		t.Errorf("backend stats = %+v, want 1 flow, 2 packets, 4 replies", bs)
	}
	// id2 shares id1's element of pb_be_stats_v2 (16 ids to one), and
	// saw no traffic.
	if bs, err := f.Maps.BackendStats(id2); err != nil || bs != (bpf.LbBeStats{}) {
		t.Errorf("backend %d's stats = %+v (%v), want none: only its neighbour %d had traffic", id2, bs, err, id1)
	}
}

func TestUDPChecksums(t *testing.T) {
	f := newFixture(t)
	f.service(17, id1)
	ret, p, _ := f.run(bpftest.UDP(client, vip, []byte("ping")))
	if ret != bpftest.XDPPass || p.Dst != be1 {
		t.Fatalf("UDP DNAT: verdict %d, dst %v", ret, p.Dst)
	}
	f.wantEvents(ev(evNewFlow, 0, id1, client))
	_, p, _ = f.run(bpftest.UDP(be1, client, []byte("pong")))
	if p.Src != vip {
		t.Fatalf("UDP reverse NAT: src %v", p.Src)
	}

	// A zero UDP checksum means none: it must stay zero.
	pkt := bpftest.UDP(client2, vip, []byte("x"))
	binary.BigEndian.PutUint16(pkt[14+20+6:], 0)
	_, out := bpftest.Run(t, f.PbXdp, pkt)
	if c := binary.BigEndian.Uint16(out[14+20+6:]); c != 0 {
		t.Fatalf("zero UDP checksum became %#x", c)
	}
	if _, err := bpftest.Parse(out); err != nil {
		t.Fatal(err)
	}
}

func TestExistingFlowKeepsBackend(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))

	f.table(id2) // the backend set changes
	_, p, _ := f.run(bpftest.TCP(client, vip, bpftest.ACK, []byte("more")))
	if p.Dst != be1 {
		t.Fatalf("existing flow moved to %v after the table changed", p.Dst)
	}
	_, p, _ = f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil))
	if p.Dst != be2 {
		t.Fatalf("new flow went to %v, want the new table's %v", p.Dst, be2)
	}
}

// A reused backend id's counters are zeroed in place (pb_stats_reset_run)
// and those of the backend sharing its element of pb_be_stats_v2 are not,
// nor does the datapath stop counting into either.
func TestCounterResetKeepsItsNeighbours(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.table(id2)
	f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil))
	f.must(f.Maps.ResetBackendStats([]uint32{id1}))
	if bs, err := f.Maps.BackendStats(id1); err != nil || bs != (bpf.LbBeStats{}) {
		t.Errorf("backend %d after its reset: %+v (%v), want nothing counted", id1, bs, err)
	}
	if bs, err := f.Maps.BackendStats(id2); err != nil || bs.Flows != 1 || bs.Packets != 1 {
		t.Errorf("backend %d after its neighbour's reset: %+v (%v), want its flow and packet kept", id2, bs, err)
	}
	f.run(bpftest.TCP(client, vip, bpftest.ACK, []byte("again")))
	f.run(bpftest.TCP(client2, vip, bpftest.ACK, []byte("again")))
	if bs, err := f.Maps.BackendStats(id1); err != nil || bs.Packets != 1 {
		t.Errorf("backend %d's packets after the reset and one more: %+v (%v), want 1", id1, bs, err)
	}
	if bs, err := f.Maps.BackendStats(id2); err != nil || bs.Packets != 2 {
		t.Errorf("backend %d's packets: %+v (%v), want 2", id2, bs, err)
	}
}

func TestOutcomeEvents(t *testing.T) {
	f := newFixture(t)
	f.table(id1)

	// Refused: RST answering the SYN; the flow ends with it, and the
	// refusal is the whole story (no FLOW_END after a backend's RST).
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, client, bpftest.RST, nil))
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evRefused, 0, id1, client))

	// The client reuses the tuple: a new flow. Reset after the handshake,
	// before any payload from the backend.
	f.handshake(client, be1)
	f.run(bpftest.TCP(be1, client, bpftest.RST, nil))
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evEstablished, 0, id1, client),
		ev(evReset, 0, id1, client))

	// Reset after the backend sent data carries the flag.
	f.handshake(client2, be1)
	f.run(bpftest.TCP(be1, client2, bpftest.ACK, []byte("hello")))
	f.run(bpftest.TCP(be1, client2, bpftest.RST, nil))
	f.run(bpftest.TCP(be1, client2, bpftest.RST, nil)) // a second RST reports nothing
	f.wantEvents(ev(evNewFlow, 0, id1, client2), ev(evEstablished, 0, id1, client2),
		ev(evFirstData, 0, id1, client2), ev(evReset, evfBackendData, id1, client2))
}

// The quiet flags spare the agent the events its verdict does not wait
// for. A healthy flow ends with FIN both ways; what it reports depends on
// the service's flags when it began.
func TestQuietFlags(t *testing.T) {
	healthy := func(f *fixture, c netip.AddrPort) {
		f.run(bpftest.TCP(c, vip, bpftest.SYN, nil))
		f.run(bpftest.TCP(be1, c, bpftest.SYNACK, nil))
		f.run(bpftest.TCP(be1, c, bpftest.ACK, []byte("hello")))
		f.run(bpftest.TCP(c, vip, bpftest.FIN, nil))
		f.run(bpftest.TCP(be1, c, bpftest.FIN, nil))
	}
	for _, tc := range []struct {
		name  string
		flags uint32
		want  []uint8
	}{
		{"none: everything", 0, []uint8{evNewFlow, evEstablished, evFirstData, evFlowEnd}},
		{"verdict at first data", maps.ServiceQuietEnd, []uint8{evNewFlow, evEstablished, evFirstData}},
		{"verdict at the SYN-ACK", maps.ServiceQuietData | maps.ServiceQuietEnd, []uint8{evNewFlow, evEstablished}},
		{"verdict at the end", maps.ServiceQuietData, []uint8{evNewFlow, evEstablished, evFlowEnd}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.svc.Flags = tc.flags
			f.table(id1)
			healthy(f, client)
			var want []event
			for _, typ := range tc.want {
				want = append(want, ev(typ, 0, id1, client))
			}
			f.wantEvents(want...)
		})
	}
	// An undecided flow still reports its end, whatever the flags: the
	// client gave up before an answer (an inconclusive probe, for one),
	// or the backend closed before sending data.
	f := newFixture(t)
	f.svc.Flags = maps.ServiceQuietEnd
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(client, vip, bpftest.RST, nil))
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evFlowEnd, evfClient, id1, client))
	f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, client2, bpftest.SYNACK, nil))
	f.run(bpftest.TCP(be1, client2, bpftest.FIN, nil))
	f.run(bpftest.TCP(client2, vip, bpftest.FIN, nil))
	f.wantEvents(ev(evNewFlow, 0, id1, client2), ev(evEstablished, 0, id1, client2), ev(evFlowEnd, evfClient, id1, client2))
}

func TestSynRetransmitIsReportedOnce(t *testing.T) {
	f := newFixture(t)
	f.noRetransMinAge()
	f.table(id1)
	for range 3 {
		_, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
		if p.Dst != be1 {
			t.Fatalf("retransmitted SYN went to %v", p.Dst)
		}
	}
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evSynRetrans, 0, id1, client))

	// Once established, a stray SYN is not a timeout.
	f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.wantEvents(ev(evEstablished, 0, id1, client))
}

func TestRetransmittedSynLeavesEjectedBackend(t *testing.T) {
	f := newFixture(t)
	f.noRetransMinAge()
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))

	// The agent ejects backend 1 while the SYN is unanswered.
	f.must(f.Maps.SetBackend(id1, maps.NewBackend(be1, svcID, maps.BackendEjected, 0)))
	f.table(id2)

	_, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	if p.Dst != be2 {
		t.Fatalf("retransmitted SYN went to %v, want it moved to %v", p.Dst, be2)
	}
	_, p, _ = f.run(bpftest.TCP(be2, client, bpftest.SYNACK, nil))
	if p.Src != vip {
		t.Fatalf("reply from the new backend: src %v", p.Src)
	}
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evSynRetrans, 0, id1, client),
		ev(evNewFlow, evfRepick, id2, client), ev(evEstablished, 0, id2, client))

	// The old backend's late SYN-ACK no longer belongs to the flow.
	ret, out := bpftest.Run(t, f.PbXdp, bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	p2, _ := bpftest.Parse(out)
	if ret != bpftest.XDPPass || p2.Src != be1 {
		t.Fatalf("stale reply was rewritten: %v", p2.Src)
	}
	gs, err := f.Maps.GlobalStats()
	f.must(err)
	if gs.Repicked != 1 {
		t.Errorf("repicked = %d, want 1", gs.Repicked)
	}
}

func TestProbationAdmitsExactlyGrantedFlows(t *testing.T) {
	f := newFixture(t)
	// Every slot of the table holds backend 1, in probation with one grant;
	// the table without probation backends holds backend 2.
	f.must(f.Maps.SetBackend(id1, maps.NewBackend(be1, svcID, maps.BackendProbation, 1)))
	f.table(id1)
	f.must(f.Maps.SetFallback(svcID, fill(id2)))

	_, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	if p.Dst != be1 {
		t.Fatalf("first flow went to %v, want the probation backend", p.Dst)
	}
	_, p, _ = f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil))
	if p.Dst != be2 {
		t.Fatalf("second flow went to %v, want it steered to %v", p.Dst, be2)
	}
	// The probe's outcome is flagged.
	f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	f.wantEvents(ev(evNewFlow, evfProbe, id1, client), ev(evNewFlow, 0, id2, client2),
		ev(evEstablished, evfProbe, id1, client))

	b, err := f.Maps.Backend(id1)
	f.must(err)
	if b.ProbeGrants > 0 {
		t.Errorf("grants left: %d", b.ProbeGrants)
	}
	gs, err := f.Maps.GlobalStats()
	f.must(err)
	if gs.ProbeAdmitted != 1 || gs.Steered != 1 || gs.SteerFailed != 0 {
		t.Errorf("stats %+v: want 1 probe admitted, 1 steered", gs)
	}
}

func TestFlowEndOnFinBothWays(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	f.run(bpftest.TCP(client, vip, bpftest.FIN, nil))
	f.wantEvents(ev(evNewFlow, 0, id1, client), ev(evEstablished, 0, id1, client))
	f.run(bpftest.TCP(be1, client, bpftest.FIN, nil))
	f.run(bpftest.TCP(client, vip, bpftest.ACK, nil))
	f.wantEvents(ev(evFlowEnd, 0, id1, client))
}

// The reply path builds a flow's forward key (the client's tuple its
// events name) only for a packet that can decide something, into a
// per-CPU scratch that still holds the last flow's: each event here comes
// right after a reply of the other flow, and must name its own client.
func TestReplyEventsNameTheirOwnFlow(t *testing.T) {
	oneCPU(t) // the scratch is per CPU
	f := newFixture(t)
	f.table(id1)
	f.handshake(client2, be1)
	f.handshake(client, be1) // the scratch now has client's key
	f.run(bpftest.TCP(be1, client2, bpftest.ACK, []byte("hello")))
	f.wantEvents(ev(evNewFlow, 0, id1, client2), ev(evEstablished, 0, id1, client2),
		ev(evNewFlow, 0, id1, client), ev(evEstablished, 0, id1, client),
		ev(evFirstData, 0, id1, client2))
	f.run(bpftest.TCP(client2, vip, bpftest.FIN, nil))
	f.run(bpftest.TCP(be1, client, bpftest.ACK, []byte("hi")))
	f.run(bpftest.TCP(be1, client, bpftest.ACK, []byte("more"))) // builds no key
	f.run(bpftest.TCP(be1, client2, bpftest.FIN, nil))
	f.wantEvents(ev(evFirstData, 0, id1, client), ev(evFlowEnd, 0, id1, client2))
}

func TestMidstreamPacketGetsBackendWithoutEvent(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	_, p, _ := f.run(bpftest.TCP(client, vip, bpftest.ACK, []byte("x")))
	if p.Dst != be1 {
		t.Fatalf("mid-stream packet went to %v", p.Dst)
	}
	f.wantEvents()
}

func TestNoBackendDrops(t *testing.T) {
	f := newFixture(t)
	ret, _ := bpftest.Run(t, f.PbXdp, bpftest.TCP(client, vip, bpftest.SYN, nil))
	if ret != bpftest.XDPDrop {
		t.Fatalf("verdict %d, want XDP_DROP for a service without backends", ret)
	}
	ss, err := f.Maps.ServiceStats(svcID)
	f.must(err)
	if ss.NoBackend != 1 || ss.OverLimit != 0 {
		t.Errorf("no_backend = %d, over_limit = %d, want 1 and 0", ss.NoBackend, ss.OverLimit)
	}
}

func TestNotOursPassesUnchanged(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	other := netip.MustParseAddrPort("198.18.50.50:80")
	cases := map[string][]byte{
		"other address, VIP port":  bpftest.TCP(client, other, bpftest.SYN, nil),
		"VIP address, other port":  bpftest.TCP(client, netip.AddrPortFrom(vip.Addr(), 81), bpftest.SYN, nil),
		"UDP to a TCP-only VIP":    bpftest.UDP(client, vip, []byte("x")),
		"reply of an unknown flow": bpftest.TCP(be1, client2, bpftest.SYNACK, nil),
	}
	syn := bpftest.TCP(client, vip, bpftest.SYN, nil)
	// BPF_PROG_TEST_RUN refuses frames shorter than an Ethernet header.
	for _, n := range []int{14, 20, 33, 34, 35, 37, 47, 53} {
		cases["truncated to "+itoa(n)] = syn[:n]
	}
	mut := func(name string, f func(p []byte)) {
		p := append([]byte(nil), syn...)
		f(p)
		cases[name] = p
	}
	mut("IP header length 4", func(p []byte) { p[14] = 0x44 })
	mut("IP version 6 in an IPv4 frame", func(p []byte) { p[14] = 0x65 })
	mut("IP total length beyond the frame", func(p []byte) { binary.BigEndian.PutUint16(p[16:], 200) })
	mut("IP total length below the header", func(p []byte) { binary.BigEndian.PutUint16(p[16:], 10) })
	mut("TCP data offset 4", func(p []byte) { p[14+20+12] = 0x40 })
	mut("TCP data offset past the end", func(p []byte) { p[14+20+12] = 0xf0 })
	mut("fragment", func(p []byte) { binary.BigEndian.PutUint16(p[20:], 0x2000) })
	mut("ARP ethertype", func(p []byte) { binary.BigEndian.PutUint16(p[12:], 0x0806) })

	for name, pkt := range cases {
		t.Run(name, func(t *testing.T) {
			ret, out := bpftest.Run(t, f.PbXdp, pkt)
			if ret != bpftest.XDPPass {
				t.Fatalf("verdict %d, want XDP_PASS", ret)
			}
			if !bytes.Equal(out[:len(pkt)], pkt) {
				t.Fatalf("packet changed:\n got %x\nwant %x", out[:len(pkt)], pkt)
			}
		})
	}
	f.wantEvents()
	gs, err := f.Maps.GlobalStats()
	f.must(err)
	if gs.Malformed == 0 {
		t.Errorf("malformed VIP-bound packets were not counted")
	}
}

// pb_vip_slots gates every lookup of a VIP-port packet: with the VIP's
// slot clear, even a packet of an established flow passes unchanged (no
// conntrack or service lookup); marked again, the flow carries on.
func TestVIPSlotGatesLookups(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	if _, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil)); p.Dst != be1 {
		t.Fatalf("SYN went to %v, want %v", p.Dst, be1)
	}
	f.wantEvents(ev(evNewFlow, 0, id1, client))

	slot := map[uint32]bool{maps.VIPSlot(vip.Addr()): true}
	f.must(f.Maps.SetVIPSlots(slot, nil))
	for name, pkt := range map[string][]byte{
		"established flow": bpftest.TCP(client, vip, bpftest.ACK, []byte("GET /")),
		"new flow":         bpftest.TCP(client2, vip, bpftest.SYN, nil),
	} {
		ret, out := bpftest.Run(t, f.PbXdp, pkt)
		if ret != bpftest.XDPPass || !bytes.Equal(out[:len(pkt)], pkt) {
			t.Errorf("%s with the VIP's slot clear: verdict %d, changed %v; want XDP_PASS unchanged", name, ret, !bytes.Equal(out[:len(pkt)], pkt))
		}
	}
	f.wantEvents()
	if ss, err := f.Maps.ServiceStats(svcID); err != nil || ss.Flows != 1 {
		t.Errorf("flows = %d (%v), want only the first", ss.Flows, err)
	}

	f.must(f.Maps.SetVIPSlots(nil, slot))
	if _, p, _ := f.run(bpftest.TCP(client, vip, bpftest.ACK, []byte("GET /"))); p.Dst != be1 {
		t.Fatalf("with the slot marked again the flow went to %v, want %v", p.Dst, be1)
	}
}

func itoa(n int) string { return string(rune('0'+n/10)) + string(rune('0'+n%10)) }

// pseudoSum is the folded, uninverted pseudo-header sum a CHECKSUM_PARTIAL
// sender leaves in the L4 checksum field.
func pseudoSum(pkt []byte) uint16 {
	ip := pkt[14:]
	l4len := int(binary.BigEndian.Uint16(ip[2:])) - int(ip[0]&0xf)*4
	s := uint32(0)
	for i := 12; i < 20; i += 2 {
		s += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	s += uint32(ip[9]) + uint32(l4len)
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}

// finish does what the device does for CHECKSUM_PARTIAL: sum the L4
// segment with the field as it stands and store the inverted result.
func finish(pkt []byte, csumOff int) {
	ip := pkt[14:]
	ihl := int(ip[0]&0xf) * 4
	seg := ip[ihl:binary.BigEndian.Uint16(ip[2:])]
	binary.BigEndian.PutUint16(pkt[csumOff:], ^csum.Fold(csum.Sum(seg, 0)))
}

func TestPartialChecksumFromLocalSenders(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.must(f.Maps.SetIfaces([]maps.Iface{{Index: 1, Partial: true}})) // BPF_PROG_TEST_RUN's ingress (lo)
	const tcpCsum = 14 + 20 + 16
	for _, c := range []struct {
		name string
		pkt  []byte
		want netip.AddrPort
		dst  bool
	}{
		{"DNAT", bpftest.TCP(client, vip, bpftest.SYN, []byte("partial")), be1, true},
		{"reverse NAT", bpftest.TCP(be1, client, bpftest.SYNACK, []byte("partial")), vip, false},
	} {
		pkt := c.pkt
		binary.BigEndian.PutUint16(pkt[tcpCsum:], pseudoSum(pkt))
		ret, out := bpftest.Run(t, f.PbXdp, pkt)
		if ret != bpftest.XDPPass {
			t.Fatalf("%s: verdict %d", c.name, ret)
		}
		if got, want := binary.BigEndian.Uint16(out[tcpCsum:]), pseudoSum(out); got != want {
			t.Fatalf("%s: partial checksum field %#04x, want the new pseudo-header sum %#04x", c.name, got, want)
		}
		finish(out, tcpCsum)
		p, err := bpftest.Parse(out)
		if err != nil {
			t.Fatalf("%s: after the device finishes the checksum: %v", c.name, err)
		}
		if got := p.Dst; c.dst && got != c.want {
			t.Fatalf("%s: dst %v", c.name, got)
		}
		if got := p.Src; !c.dst && got != c.want {
			t.Fatalf("%s: src %v", c.name, got)
		}
	}
}

// A refused probe fails the endpoint, not the client: the RST is kept
// from it, and its retransmitted SYN goes to another backend.
func TestRefusedProbeIsRescued(t *testing.T) {
	f := newFixture(t)
	f.must(f.Maps.SetBackend(id1, maps.NewBackend(be1, svcID, maps.BackendProbation, 1)))
	f.table(id1)
	f.must(f.Maps.SetFallback(svcID, fill(id2)))

	_, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	if p.Dst != be1 {
		t.Fatalf("probe went to %v", p.Dst)
	}
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.TCP(be1, client, bpftest.RST, nil)); ret != bpftest.XDPDrop {
		t.Fatalf("the refused probe's RST was not kept from the client: verdict %d", ret)
	}
	// No copy of the SYN (no retryRefused): nothing for the agent to
	// replay; the client's retransmission is moved.
	f.wantEvents(ev(evNewFlow, evfProbe, id1, client), ev(evRefused, evfProbe, id1, client))

	// The agent ejects it again; the client retransmits its SYN.
	f.must(f.Maps.SetBackend(id1, maps.NewBackend(be1, svcID, maps.BackendEjected, 0)))
	f.table(id2)
	_, p, _ = f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	if p.Dst != be2 {
		t.Fatalf("retransmitted SYN went to %v, want %v", p.Dst, be2)
	}
	_, p, _ = f.run(bpftest.TCP(be2, client, bpftest.SYNACK, nil))
	if p.Src != vip {
		t.Fatalf("reply from the new backend: %v", p.Src)
	}
	gs, err := f.Maps.GlobalStats()
	f.must(err)
	if gs.ProbeRescued != 1 {
		t.Errorf("probe_rescued = %d, want 1", gs.ProbeRescued)
	}
	// A refused flow that is not a probe reaches its client as usual.
	f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil))
	if ret, out := bpftest.Run(t, f.PbXdp, bpftest.TCP(be2, client2, bpftest.RST, nil)); ret != bpftest.XDPPass || len(out) == 0 {
		t.Fatalf("an ordinary refusal was not passed on: verdict %d", ret)
	}
}

// More tables than the agent keeps mapped: every fill still lands in
// the right table.
func TestTableFillsBeyondTheMappingCache(t *testing.T) {
	f := newFixture(t)
	const n = 300
	var reqs []maps.TableInstall
	for id := uint32(10); id < 10+n/2; id++ {
		reqs = append(reqs, maps.TableInstall{SvcID: id, N: 0, Size: size}, maps.TableInstall{SvcID: id, N: 1, Size: size})
	}
	f.must(f.Maps.InstallTables(reqs))
	for round := range uint32(2) {
		for _, r := range reqs {
			f.must(f.Maps.FillTable(r.SvcID, r.N, fill(r.SvcID*10+r.N+round)))
		}
	}
	for _, r := range reqs {
		got, err := f.Maps.Table(r.SvcID, r.N)
		f.must(err)
		if want := fill(r.SvcID*10 + r.N + 1); !slices.Equal(got, want) {
			t.Fatalf("table %d of service %d holds %v, want %v", r.N, r.SvcID, got, want)
		}
	}
}

// With retryRefused, a refused new flow is not failed to its client: the
// RST is kept from it and its retransmitted SYN goes to another backend,
// once; a second refusal reaches the client.
func TestRetryRefusedSendsTheRetransmissionElsewhere(t *testing.T) {
	f := newFixture(t)
	// Every slot on backend 1: the other backend is found only through
	// the service's backend list, as when the refusing backend still
	// fills the table before its ejection.
	f.must(f.Maps.SetServiceBackends(svcID, nil, []uint32{id1, id2}))
	f.svc.BackendCount = 2
	f.svc.Flags = maps.ServiceRetryRefused
	f.table(id1)

	if _, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil)); p.Dst != be1 {
		t.Fatalf("SYN went to %v, want %v", p.Dst, be1)
	}
	f.events()
	for i := range 2 { // the refusal, and the backend's answer to an early retransmission
		if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.Refusal(be1, client, 1000)); ret != bpftest.XDPDrop {
			t.Fatalf("refusal %d reached the client: verdict %d", i+1, ret)
		}
	}
	_, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil)) // the client's retransmission
	if p.Dst != be2 {
		t.Fatalf("retransmitted SYN went to %v, want the other backend %v", p.Dst, be2)
	}
	f.wantEvents(ev(evRefused, evfRescued, id1, client), ev(evNewFlow, evfRepick, id2, client))
	// Refused again: once per connection, so this time the client hears it.
	if ret, out := bpftest.Run(t, f.PbXdp, bpftest.TCP(be2, client, bpftest.RST, nil)); ret != bpftest.XDPPass || len(out) == 0 {
		t.Fatalf("the second refusal was kept from the client too: verdict %d", ret)
	}
	gs, err := f.Maps.GlobalStats()
	f.must(err)
	if gs.RefusedRescued != 1 || gs.Retried != 1 || gs.Steered != 0 || gs.SteerFailed != 0 {
		t.Errorf("refused_rescued %d, retried %d, steered %d, steer_failed %d; want 1, 1, 0, 0",
			gs.RefusedRescued, gs.Retried, gs.Steered, gs.SteerFailed)
	}

	// A retry is never a probe: the client has been refused once already.
	pb := maps.NewBackend(be2, svcID, maps.BackendProbation, 1)
	f.must(f.Maps.SetBackend(id2, pb))
	c3 := clientPort(40100)
	f.run(bpftest.TCP(c3, vip, bpftest.SYN, nil))
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.TCP(be1, c3, bpftest.RST, nil)); ret != bpftest.XDPDrop {
		t.Fatalf("refusal reached the client: verdict %d", ret)
	}
	if _, p, _ := f.run(bpftest.TCP(c3, vip, bpftest.SYN, nil)); p.Dst != be1 {
		t.Fatalf("retry went to %v; with no other active backend, want %v", p.Dst, be1)
	}
	if b, err := f.Maps.Backend(id2); err != nil || b.ProbeGrants != 1 {
		t.Fatalf("probation backend's grants %d (%v), want 1: the retry became its probe", b.ProbeGrants, err)
	}

	// Without the service's flag, a refusal reaches the client at once.
	f.svc.Flags = 0
	f.writeService()
	f.run(bpftest.TCP(client2, vip, bpftest.SYN, nil))
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.TCP(be1, client2, bpftest.RST, nil)); ret != bpftest.XDPPass {
		t.Fatalf("a refusal without retryRefused was kept: verdict %d", ret)
	}
}

// A retry whose slot holds a backend that is not active (in probation
// with its grant spent) goes back to the backend it left when no other
// is active, not to the slot's; and a backend RST on a flow the client
// already closed marks nothing for the tuple's next SYN.
func TestRetryRefusedCornerCases(t *testing.T) {
	f := newFixture(t)
	f.must(f.Maps.SetServiceBackends(svcID, nil, []uint32{id1, id2}))
	f.svc.BackendCount = 2
	f.svc.Flags = maps.ServiceRetryRefused
	f.table(id2)
	f.must(f.Maps.SetBackend(id2, maps.NewBackend(be2, svcID, maps.BackendProbation, 0)))

	c := clientPort(40200)
	if _, p, _ := f.run(bpftest.TCP(c, vip, bpftest.SYN, nil)); p.Dst != be1 {
		t.Fatalf("SYN went to %v, want %v (the slot's backend has no grant)", p.Dst, be1)
	}
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.TCP(be1, c, bpftest.RST, nil)); ret != bpftest.XDPDrop {
		t.Fatalf("refusal reached the client: verdict %d", ret)
	}
	if _, p, _ := f.run(bpftest.TCP(c, vip, bpftest.SYN, nil)); p.Dst != be1 {
		t.Fatalf("retry went to %v; with no other active backend, want the one it left, %v", p.Dst, be1)
	}
	f.events()

	// The client gives up (RST) before the backend's RST arrives.
	c2 := clientPort(40201)
	f.run(bpftest.TCP(c2, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(c2, vip, bpftest.RST, nil))
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.TCP(be1, c2, bpftest.RST, nil)); ret != bpftest.XDPPass {
		t.Fatalf("a backend RST after the client's own was dropped: verdict %d", ret)
	}
	f.events()
	f.run(bpftest.TCP(c2, vip, bpftest.SYN, nil))
	f.wantEvents(ev(evNewFlow, 0, id1, c2))
}
