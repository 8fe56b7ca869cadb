// SPDX-License-Identifier: Apache-2.0

// Regression tests for problems a review of the datapath found: each
// reproduced the problem before its fix.
package datapath_test

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

func laterClocks(d time.Duration) conntrack.Clocks {
	real := conntrack.KernelClocks()
	return conntrack.Clocks{
		Coarse: func() int64 { return real.Coarse() + int64(d) },
		Mono:   func() int64 { return real.Mono() + int64(d) },
	}
}

// the reverse half of a counted flow is evicted by the LRU. Replies
// are no longer reverse-NATed, the client's FIN/RST release nothing, and
// the reaper never expires the forward-only entry, so the circuit-breaker
// slot is held forever.
func TestEvictedReverseEntryDoesNotLeakSlot(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.limit(1, 0, id1)
	in := f.inflight()
	c := clientPort(1)
	f.run(bpftest.TCP(c, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, c, bpftest.SYNACK, nil))
	ents, err := f.Maps.Conntrack(0)
	f.must(err)
	for _, e := range ents {
		if e.Key.Dir == maps.DirRev {
			f.must(f.Maps.DeleteCT(e.Key)) // what LRU eviction does
		}
	}
	_, p, _ := f.run(bpftest.TCP(be1, c, bpftest.ACK, []byte("data")))
	t.Logf("reply after rev eviction leaves as %v -> %v (want %v)", p.Src, p.Dst, vip)
	f.run(bpftest.TCP(c, vip, bpftest.FIN, nil))
	f.run(bpftest.TCP(c, vip, bpftest.RST, nil))
	r := &conntrack.Reaper{Maps: f.Maps, Inflight: in, Timeouts: conntrack.DefaultTimeouts(), Clocks: laterClocks(30 * 24 * time.Hour)}
	for range 3 {
		res, err := r.Sweep()
		f.must(err)
		t.Logf("sweep +30d: %+v", res)
	}
	ents, _ = f.Maps.Conntrack(0)
	t.Logf("conntrack entries left: %d, inflight svc=%d be=%d", len(ents), in.Service(svcID), in.Backend(id1))
	if in.Service(svcID) != 0 {
		t.Errorf("slot never released (inflight %d)", in.Service(svcID))
	}
	// The service is now full forever: a new client gets a RST.
	ret, out := bpftest.Run(t, f.PbXdp, bpftest.TCP(clientPort(2), vip, bpftest.SYN, nil))
	if ret == bpftest.XDPPass && len(out) == 54 {
		t.Errorf("new flow refused by the breaker with zero live flows")
	}
}

// a complete checksum that happens to equal the pseudo-header sum is
// taken for CHECKSUM_PARTIAL and the packet leaves with a bad checksum;
// the identical retransmission is corrupted identically.
func TestCompleteChecksumEqualToPseudoSumIsNotPartial(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	const csumOff = 14 + 20 + 16
	var pkt []byte
	for w := 0; w < 65536; w++ {
		cand := bpftest.TCP(client, vip, bpftest.ACK, []byte{byte(w >> 8), byte(w), 'x', 'y'})
		if binary.BigEndian.Uint16(cand[csumOff:]) == pseudoSum(cand) {
			pkt = cand
			t.Logf("payload word %#04x: full checksum %#04x == pseudo-header sum", w, pseudoSum(cand))
			break
		}
	}
	if pkt == nil {
		t.Fatal("no collision found")
	}
	if _, err := bpftest.Parse(pkt); err != nil {
		t.Fatalf("input is not a valid packet: %v", err)
	}
	for i := range 2 {
		_, out := bpftest.Run(t, f.PbXdp, append([]byte(nil), pkt...))
		if _, err := bpftest.Parse(out); err != nil {
			t.Errorf("BUG (run %d): valid client segment leaves with %v", i, err)
		}
	}
}

// a probation backend that still carries flows from before its
// ejection is at its per-endpoint limit: its grant is consumed, the flow
// goes elsewhere unflagged, and no probe ever reaches it.
func TestProbeGrantKeptWhenProbeBackendIsFull(t *testing.T) {
	f := newFixture(t)
	f.must(f.Maps.SetBackend(id1, maps.NewBackend(be1, svcID, maps.BackendProbation, 1)))
	f.table(id1)
	f.must(f.Maps.SetFallback(svcID, fill(id2)))
	f.limit(0, 1, id2, id1)
	f.must(f.Maps.Raw().PbBeInflight.Put(uint32(id1), bpf.LbInflight{Count: 1})) // an old established flow
	_, p, _ := f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	b, _ := f.Maps.Backend(id1)
	t.Logf("flow went to %v; grants left %d; events %+v", p.Dst, b.ProbeGrants, f.events())
	if b.ProbeGrants <= 0 && p.Dst != be1 {
		t.Errorf("grant consumed, no probe admitted")
	}
}

// a flow picked up mid-stream (conntrack lost) that the backend
// resets is reported as RESET, which the tracker counts as a failure of
// the backend (it never saw the connection).
func TestMidstreamResetIsNoFailure(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.ACK, []byte("x")))
	f.run(bpftest.TCP(be1, client, bpftest.RST, nil))
	evs := f.events()
	t.Logf("events: %+v", evs)
	tr := outcomes.NewTracker(func(uint32) outcomes.Policy {
		return outcomes.PolicyFor(accrual.Defaults(), true)
	})
	for _, e := range evs {
		o, ok := tr.Classify(outcomes.Event{Type: outcomes.Type(e.Type), Flags: e.Flags, Service: e.Svc, Backend: e.BE, Client: e.Client, At: time.Now()})
		if ok && !o.Success {
			t.Errorf("mid-stream flow's reset counted as a %v failure of backend %d", o.Kind, o.Endpoint)
		}
	}
}

// a connection the tracker already settled as a success (no data
// within connectTimeout) that the backend later resets gets a second
// verdict: a failure.
func TestSettledConnectionGetsOneVerdict(t *testing.T) {
	pol := outcomes.PolicyFor(accrual.Defaults(), true)
	tr := outcomes.NewTracker(func(uint32) outcomes.Policy { return pol })
	c := netip.MustParseAddrPort("198.18.0.2:1234")
	t0 := time.Now()
	tr.Classify(outcomes.Event{Type: outcomes.NewFlow, Backend: 1, Client: c, At: t0})
	tr.Classify(outcomes.Event{Type: outcomes.Established, Backend: 1, Client: c, At: t0})
	var verdicts []accrual.Outcome
	tr.Expire(t0.Add(pol.ConnectTimeout+time.Second), func(o accrual.Outcome) { verdicts = append(verdicts, o) })
	if o, ok := tr.Classify(outcomes.Event{Type: outcomes.Reset, Backend: 1, Client: c, At: t0.Add(time.Minute)}); ok {
		verdicts = append(verdicts, o)
	}
	t.Logf("verdicts: %+v", verdicts)
	if len(verdicts) > 1 {
		t.Errorf("%d verdicts for one connection", len(verdicts))
	}
}

// a late SYN-ACK after the backend's RST (reordering) emits
// ESTABLISHED on a closed flow.
func TestNoOutcomeAfterFlowEnd(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, client, bpftest.RST, nil))
	f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	evs := f.events()
	t.Logf("events: %+v", evs)
	if len(evs) > 3 {
		t.Errorf("outcome event after flow end: %+v", evs[3:])
	}
}

// SYN+FIN (SEG.LEN counts FIN) and SYN with IP options.
func TestSynFinIsNotRejected(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.limit(1, 0, id1)
	f.run(bpftest.TCP(clientPort(1), vip, bpftest.SYN, nil))
	f.events()
	// SYN|FIN opens no connection (Linux drops it): it is not the
	// breaker's to answer, nor a flow's to start. It passes as it came.
	pkt := bpftest.TCP(clientPort(2), vip, bpftest.TCPFlags{SYN: true, FIN: true}, nil)
	ret, out := bpftest.Run(t, f.PbXdp, pkt)
	if ret != bpftest.XDPPass || !bytes.Equal(out[:len(pkt)], pkt) {
		t.Fatalf("SYN+FIN over the limit: verdict %d, changed %v; want it passed unchanged", ret, !bytes.Equal(out[:len(pkt)], pkt))
	}
	f.wantEvents()
}

// a SYN whose client never completes the handshake (spoofed source,
// client crashed) is ESTABLISHED as soon as the backend's SYN-ACK passes,
// so the reaper gives it the 6h established timeout and its breaker slot
// is held for 6 hours.
func TestHalfOpenHandshakeExpiresEarly(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.limit(1, 0, id1)
	in := f.inflight()
	spoofed := netip.MustParseAddrPort("198.19.250.1:4444")
	f.run(bpftest.TCP(spoofed, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, spoofed, bpftest.SYNACK, nil)) // backend answers, client never ACKs
	r := &conntrack.Reaper{Maps: f.Maps, Inflight: in, Timeouts: conntrack.DefaultTimeouts(), Clocks: laterClocks(5 * time.Hour)}
	res, err := r.Sweep()
	f.must(err)
	t.Logf("+5h: %+v inflight %d", res, in.Service(svcID))
	ret, out := bpftest.Run(t, f.PbXdp, bpftest.TCP(clientPort(2), vip, bpftest.SYN, nil))
	if in.Service(svcID) == 1 && ret == bpftest.XDPPass && len(out) == 54 {
		t.Errorf("one unanswered handshake keeps the service full for 5h+ (legit SYN refused)")
	}
}

// with the conntrack LRU full, every new flow evicts an entry; a
// concurrent reaper sweep (MapIterator: get_next_key restarts at bucket 0
// when its cursor key vanished) aborts, so nothing expires and no slot is
// released exactly when the table is under pressure.
func TestReaperSurvivesConntrackChurn(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	in := f.inflight()
	n := 0
	mk := func() {
		c := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, byte(n >> 8), byte(n)}), uint16(1024+n%60000))
		n++
		bpftest.Run(t, f.PbXdp, bpftest.TCP(c, vip, bpftest.SYN, nil))
	}
	for range 3000 { // 6000 entries > 4096: the LRU is full
		mk()
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
				mk()
			}
		}
	}()
	r := &conntrack.Reaper{Maps: f.Maps, Inflight: in, Timeouts: conntrack.DefaultTimeouts(), Clocks: conntrack.KernelClocks()}
	fails := 0
	for range 10 {
		if _, err := r.Sweep(); err != nil {
			fails++
			t.Logf("sweep: %v", err)
		}
	}
	close(stop)
	<-done
	if fails > 0 {
		t.Errorf("%d of 10 sweeps aborted under LRU churn", fails)
	}
}
