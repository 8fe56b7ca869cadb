package datapath_test

import (
	"bytes"
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
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
	f.must(f.LbMaps.PbSyns.Lookup(maps.SynSlot(client.Addr(), client.Port()), &c))
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

// A refusal that does not acknowledge the kept SYN (the slot holds another
// connection's, or the RST answers something else) is not replayable: the
// client's own retransmission is moved instead.
func TestRefusalOfAnotherSYNIsNotReplayable(t *testing.T) {
	f := newFixture(t)
	f.svc.Flags = maps.ServiceRetryRefused
	f.table(id1)
	f.run(bpftest.LinuxSYN(client, vip, 5000))
	if ret, _ := bpftest.Run(t, f.PbXdp, bpftest.Refusal(be1, client, 7000)); ret != bpftest.XDPDrop {
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
	f.must(f.LbMaps.PbSyns.Lookup(maps.SynSlot(client.Addr(), client.Port()), &c))
	if c.Client != 0 || c.OptLen != 0 {
		t.Errorf("copied a SYN for a service without retryRefused: %+v", c)
	}
}
