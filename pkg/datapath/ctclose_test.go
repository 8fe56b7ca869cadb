// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Sequence numbers of the closes below: the client's and the backend's
// ISNs, the request's and the response's lengths.
const (
	cISN    = 5000
	bISN    = 90000
	reqLen  = 10
	respLen = 20
)

// closeFlow is one flow's conntrack as the datapath sees it: its client,
// VIP and backend, and the packets of a connection numbered right.
type closeFlow struct {
	f                *fixture
	c, vip, be       netip.AddrPort
	cNext, bNext     uint32 // the next sequence number each side sends
	cFinEnd, bFinEnd uint32
}

// open runs the handshake, a request and its response.
func (f *fixture) open(c, vip, be netip.AddrPort) *closeFlow {
	f.t.Helper()
	fl := &closeFlow{f: f, c: c, vip: vip, be: be}
	f.run(bpftest.TCPSeq(c, vip, bpftest.SYN, nil, cISN, 0))
	f.run(bpftest.TCPSeq(be, c, bpftest.SYNACK, nil, bISN, cISN+1))
	f.run(bpftest.TCPSeq(c, vip, bpftest.ACK, nil, cISN+1, bISN+1))
	f.run(bpftest.TCPSeq(c, vip, bpftest.ACK, make([]byte, reqLen), cISN+1, bISN+1))
	f.run(bpftest.TCPSeq(be, c, bpftest.ACK, make([]byte, respLen), bISN+1, cISN+1+reqLen))
	fl.cNext, fl.bNext = cISN+1+reqLen, bISN+1+respLen
	fl.cFinEnd, fl.bFinEnd = fl.cNext+1, fl.bNext+1
	f.events() // the opening's, which other tests check
	return fl
}

func (fl *closeFlow) clientFIN(ack uint32) {
	fl.f.t.Helper()
	fl.f.run(bpftest.TCPSeq(fl.c, fl.vip, bpftest.FIN, nil, fl.cNext, ack))
}

func (fl *closeFlow) backendFIN(ack uint32) {
	fl.f.t.Helper()
	fl.f.run(bpftest.TCPSeq(fl.be, fl.c, bpftest.FIN, nil, fl.bNext, ack))
}

// clientACK sends the client's ACK and checks it went to the backend.
func (fl *closeFlow) clientACK(ack uint32) {
	fl.f.t.Helper()
	_, p, _ := fl.f.run(bpftest.TCPSeq(fl.c, fl.vip, bpftest.ACK, nil, fl.cFinEnd, ack))
	if p.Dst != fl.be {
		fl.f.t.Fatalf("client's ACK went to %v, want %v", p.Dst, fl.be)
	}
}

// backendACK sends the backend's ACK and checks it reached the client
// from the VIP.
func (fl *closeFlow) backendACK(ack uint32) {
	fl.f.t.Helper()
	_, p, _ := fl.f.run(bpftest.TCPSeq(fl.be, fl.c, bpftest.ACK, nil, fl.bFinEnd, ack))
	if p.Src != fl.vip {
		fl.f.t.Fatalf("backend's ACK came from %v, want %v", p.Src, fl.vip)
	}
}

// bad sends pkt with its TCP checksum broken (corrupt): the datapath
// passes it on, and it decides nothing.
func (fl *closeFlow) bad(pkt []byte) {
	fl.f.t.Helper()
	if ret, _ := bpftest.Run(fl.f.t, fl.f.PbXdp, corrupt(pkt)); ret != bpftest.XDPPass {
		fl.f.t.Fatalf("a segment with a wrong checksum: verdict %d, want XDP_PASS", ret)
	}
}

// entries says which of the flow's two conntrack entries are there.
func (fl *closeFlow) entries() (fwd, rev bool) {
	fl.f.t.Helper()
	fwdKey, revKey := maps.RequestKey(fl.c, fl.vip), maps.ReplyKey(fl.be, fl.c)
	_, err := fl.f.Maps.CTEntry(fwdKey)
	fwd = lookedUp(fl.f.t, err)
	_, err = fl.f.Maps.CTEntry(revKey)
	rev = lookedUp(fl.f.t, err)
	return fwd, rev
}

func lookedUp(t testing.TB, err error) bool {
	t.Helper()
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Fatal(err)
	}
	return err == nil
}

func (fl *closeFlow) want(what string, fwd, rev bool) {
	fl.f.t.Helper()
	gotF, gotR := fl.entries()
	if gotF != fwd || gotR != rev {
		fl.f.t.Errorf("%s: forward entry %v, reverse %v; want %v, %v", what, gotF, gotR, fwd, rev)
	}
}

// A flow closed by a FIN each way, each acknowledged, leaves conntrack at
// the ACK of the second FIN, in whichever order the two ends closed and
// for either family: its two entries are not left for the sweep. The
// ACK still goes where it was going; the flow's end is reported once; a
// new SYN on the tuple is a new flow.
func TestCloseWithFINsLeavesConntrack(t *testing.T) {
	for _, fam := range []struct {
		name       string
		c, vip, be netip.AddrPort
		fixture    func(*testing.T) *fixture
		wantEvents func(f *fixture, typ uint8, flags uint8, c netip.AddrPort)
	}{
		{"IPv4", client, vip, be1, func(t *testing.T) *fixture { f := newFixture(t); f.table(id1); return f },
			func(f *fixture, typ, flags uint8, c netip.AddrPort) { f.wantEvents(ev(typ, flags, id1, c)) }},
		{"IPv6", client6, vip6, be6a, func(t *testing.T) *fixture { return fixture6(t, 6) },
			func(f *fixture, typ, flags uint8, c netip.AddrPort) { f.wantEvents(ev6(typ, flags, id6a, c)) }},
	} {
		t.Run(fam.name+"/the backend closes first", func(t *testing.T) {
			f := fam.fixture(t)
			fl := f.open(fam.c, fam.vip, fam.be)
			fl.backendFIN(fl.cNext)
			fl.clientACK(fl.bFinEnd)
			fl.clientFIN(fl.bFinEnd)
			fam.wantEvents(f, evFlowEnd, evfClient, fam.c)
			fl.want("closed, the last ACK to come", true, true)
			fl.backendACK(fl.cFinEnd)
			fl.want("after the backend's ACK of the client's FIN", false, false)
			f.run(bpftest.TCPSeq(fam.c, fam.vip, bpftest.SYN, nil, cISN+7777, 0))
			fam.wantEvents(f, evNewFlow, 0, fam.c)
		})
		t.Run(fam.name+"/the client closes first", func(t *testing.T) {
			f := fam.fixture(t)
			fl := f.open(fam.c, fam.vip, fam.be)
			fl.clientFIN(fl.bNext)
			fl.backendFIN(fl.cFinEnd)
			fam.wantEvents(f, evFlowEnd, 0, fam.c)
			fl.want("closed, the last ACK to come", true, true)
			fl.clientACK(fl.bFinEnd)
			fl.want("after the client's ACK of the backend's FIN", false, false)
		})
	}
}

// Nothing but the right ACK of a close whose second FIN acknowledged the
// first takes a flow's entries: a client that forges FINs or ACKs with
// sequence numbers it guessed wrong, a checksum that is wrong, an ACK
// before the close or after a reset, leave the flow to the sweep, as
// before; duplicated FINs of a right close do not keep it from leaving.
func TestCloseLeavesConntrackOnlyOnItsLastACK(t *testing.T) {
	for _, tc := range []struct {
		name string
		run  func(fl *closeFlow)
		gone bool
	}{
		{"the client's ACK one short of the backend's FIN", func(fl *closeFlow) {
			fl.clientFIN(fl.bNext)
			fl.backendFIN(fl.cFinEnd)
			fl.clientACK(fl.bFinEnd - 1)
		}, false},
		{"the client's ACK one past the backend's FIN", func(fl *closeFlow) {
			fl.clientFIN(fl.bNext)
			fl.backendFIN(fl.cFinEnd)
			fl.clientACK(fl.bFinEnd + 1)
		}, false},
		{"the backend's ACK one short of the client's FIN", func(fl *closeFlow) {
			fl.backendFIN(fl.cNext)
			fl.clientFIN(fl.bFinEnd)
			fl.backendACK(fl.cFinEnd - 1)
		}, false},
		{"a second FIN that does not acknowledge the first", func(fl *closeFlow) {
			fl.clientFIN(fl.bNext)
			fl.backendFIN(fl.cNext) // the client's FIN not yet received
			fl.clientACK(fl.bFinEnd)
		}, false},
		{"a client's forged FIN before its own", func(fl *closeFlow) {
			fl.f.run(bpftest.TCPSeq(fl.c, fl.vip, bpftest.FIN, nil, fl.cNext+4096, fl.bNext))
			fl.clientFIN(fl.bNext)
			fl.backendFIN(fl.cFinEnd)
			fl.clientACK(fl.bFinEnd)
		}, false},
		{"a client's forged ACK of a FIN not sent", func(fl *closeFlow) {
			fl.clientFIN(fl.bNext)
			fl.clientACK(fl.bFinEnd)
		}, false},
		{"the last ACK with a wrong checksum", func(fl *closeFlow) {
			fl.clientFIN(fl.bNext)
			fl.backendFIN(fl.cFinEnd)
			fl.bad(bpftest.TCPSeq(fl.c, fl.vip, bpftest.ACK, nil, fl.cFinEnd, fl.bFinEnd))
		}, false},
		{"a reset, then a FIN and the ACK", func(fl *closeFlow) {
			fl.clientFIN(fl.bNext)
			fl.f.run(bpftest.TCPSeq(fl.be, fl.c, bpftest.TCPFlags{RST: true, ACK: true}, nil, fl.bNext, fl.cFinEnd))
			fl.backendFIN(fl.cFinEnd)
			fl.clientACK(fl.bFinEnd)
		}, false},
		{"a second FIN with a wrong checksum", func(fl *closeFlow) {
			fl.clientFIN(fl.bNext)
			fl.bad(bpftest.TCPSeq(fl.be, fl.c, bpftest.FIN, nil, fl.bNext, fl.cFinEnd))
			fl.clientACK(fl.bFinEnd)
		}, false},
		{"the client's second FIN with a wrong checksum", func(fl *closeFlow) {
			fl.backendFIN(fl.cNext)
			fl.bad(bpftest.TCPSeq(fl.c, fl.vip, bpftest.FIN, nil, fl.cNext, fl.bFinEnd))
			fl.backendACK(fl.cFinEnd)
		}, false},
		{"the backend's last ACK with a wrong checksum", func(fl *closeFlow) {
			fl.backendFIN(fl.cNext)
			fl.clientFIN(fl.bFinEnd)
			fl.bad(bpftest.TCPSeq(fl.be, fl.c, bpftest.ACK, nil, fl.bFinEnd, fl.cFinEnd))
		}, false},
		{"the client's FIN again after the backend's", func(fl *closeFlow) {
			fl.clientFIN(fl.bNext)
			fl.backendFIN(fl.cFinEnd)
			fl.clientFIN(fl.bFinEnd)
			fl.clientACK(fl.bFinEnd)
		}, true},
		{"a FIN with data, the backend's data after the client's FIN", func(fl *closeFlow) {
			fl.f.run(bpftest.TCPSeq(fl.c, fl.vip, bpftest.FIN, make([]byte, 5), fl.cNext, fl.bNext))
			fl.cFinEnd = fl.cNext + 5 + 1
			fl.f.run(bpftest.TCPSeq(fl.be, fl.c, bpftest.ACK, make([]byte, 7), fl.bNext, fl.cFinEnd))
			fl.bNext += 7
			fl.bFinEnd = fl.bNext + 1
			fl.backendFIN(fl.cFinEnd)
			fl.clientACK(fl.bFinEnd - 1) // acknowledges the data, not the FIN
			fl.want("the data acknowledged, not the FIN", true, true)
			fl.clientACK(fl.bFinEnd)
		}, true},
		{"the backend's FIN twice", func(fl *closeFlow) {
			fl.backendFIN(fl.cNext)
			fl.backendFIN(fl.cNext)
			fl.clientFIN(fl.bFinEnd)
			fl.backendACK(fl.cFinEnd)
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.table(id1)
			fl := f.open(client, vip, be1)
			tc.run(fl)
			fl.want(tc.name, !tc.gone, !tc.gone)
			f.events()
		})
	}
}

// A close deletes the other half only if it is the same flow's (the same
// start): a Linux client may use one port towards two VIPs with a
// backend in common, whose reverse entries then share a key.
func TestCloseLeavesAnotherFlowsHalf(t *testing.T) {
	fwd, rev := maps.RequestKey(client, vip), maps.ReplyKey(be1, client)
	for _, tc := range []struct {
		name     string
		run      func(fl *closeFlow, other func(bpf.LbCtKey))
		fwd, rev bool // the entries left
	}{
		{"the reverse key another flow's at the client's last ACK", func(fl *closeFlow, other func(bpf.LbCtKey)) {
			fl.clientFIN(fl.bNext)
			fl.backendFIN(fl.cFinEnd)
			other(rev)
			fl.clientACK(fl.bFinEnd)
		}, false, true},
		{"the forward key another flow's at the backend's last ACK", func(fl *closeFlow, other func(bpf.LbCtKey)) {
			fl.backendFIN(fl.cNext)
			fl.clientFIN(fl.bFinEnd)
			other(fwd)
			fl.backendACK(fl.cFinEnd)
		}, true, true},
		{"the forward key another flow's at the second FIN", func(fl *closeFlow, other func(bpf.LbCtKey)) {
			fl.clientFIN(fl.bNext)
			other(fwd)
			fl.backendFIN(fl.cFinEnd)
			fl.clientACK(fl.bFinEnd)
		}, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.table(id1)
			fl := f.open(client, vip, be1)
			tc.run(fl, func(k bpf.LbCtKey) {
				var v bpf.LbCtValue
				f.must(f.LbMaps.PbCtV2.Lookup(k, &v))
				v.CreatedNs++ // another flow's start
				f.must(f.LbMaps.PbCtV2.Put(k, v))
			})
			fl.want(tc.name, tc.fwd, tc.rev)
		})
	}
}

// The client's FIN sent again after the backend's last ACK took the flow
// (lost on its way to the client) finds no entry: it is picked up as a
// closed flow, whose entries stay the closed timeout, not an opening's
// (60 s) or an established flow's (6 h).
func TestFINAfterTheCloseIsPickedUpClosed(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	fl := f.open(client, vip, be1)
	fl.backendFIN(fl.cNext)
	fl.clientFIN(fl.bFinEnd)
	fl.backendACK(fl.cFinEnd)
	fl.want("closed", false, false)
	f.events() // the close's end
	_, p, _ := f.run(bpftest.TCPSeq(client, vip, bpftest.FIN, nil, fl.cNext, fl.bFinEnd))
	if p.Dst != be1 {
		t.Fatalf("the FIN sent again went to %v, want %v", p.Dst, be1)
	}
	f.wantEvents() // picked up midstream: nothing to judge
	for _, k := range []bpf.LbCtKey{maps.RequestKey(client, vip), maps.ReplyKey(be1, client)} {
		v, err := f.Maps.CTEntry(k)
		if err != nil {
			t.Fatalf("entry %d: %v", k.Dir, err)
		}
		if want := maps.CTClosed | maps.CTFinFwd | maps.CTMidstream; v.Flags&want != want {
			t.Errorf("entry %d flags %#x, want %#x set", k.Dir, v.Flags, want)
		}
	}
}
