// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"context"
	"encoding/binary"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
)

// redirectProg returns an XDP program that redirects IPv4 packets for dst
// out of ifindex after rewriting the Ethernet addresses, and passes
// everything else.
func redirectProg(dst netip.Addr, dstMAC, srcMAC net.HardwareAddr, ifindex int) (*ebpf.Program, error) {
	le32 := func(b []byte) int64 { return int64(int32(binary.LittleEndian.Uint32(b))) }
	le16 := func(b []byte) int64 { return int64(binary.LittleEndian.Uint16(b)) }
	d4 := dst.As4()
	insns := asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, 0, asm.Word), // data
		asm.LoadMem(asm.R3, asm.R1, 4, asm.Word), // data_end
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, 34), // eth + ipv4 header
		asm.JGT.Reg(asm.R4, asm.R3, "pass"),
		asm.LoadMem(asm.R5, asm.R2, 12, asm.Half),
		asm.JNE.Imm(asm.R5, 0x0008, "pass"), // htons(ETH_P_IP)
		asm.LoadMem(asm.R5, asm.R2, 30, asm.Word),
		asm.JNE.Imm32(asm.R5, int32(le32(d4[:])), "pass"),
		asm.StoreImm(asm.R2, 0, le32(dstMAC[0:4]), asm.Word),
		asm.StoreImm(asm.R2, 4, le16(dstMAC[4:6]), asm.Half),
		asm.StoreImm(asm.R2, 6, le32(srcMAC[0:4]), asm.Word),
		asm.StoreImm(asm.R2, 10, le16(srcMAC[4:6]), asm.Half),
		asm.Mov.Imm(asm.R1, int32(ifindex)),
		asm.Mov.Imm(asm.R2, 0),
		asm.FnRedirect.Call(),
		asm.Return(),
		asm.Mov.Imm(asm.R0, 2).WithSymbol("pass"), // XDP_PASS
		asm.Return(),
	}
	return ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, Instructions: insns, License: "GPL"})
}

// xdpRedirectWorks wires cl0 -> b1 and b1 -> cl0 with XDP_REDIRECT and
// reports whether an HTTP GET from the client to backend 1 succeeds.
func xdpRedirectWorks(t *testing.T, opts Options) (bool, error) {
	topo := New(t, opts)
	cl, b1 := topo.Links[0], topo.Links[1]
	fwd, err := redirectProg(b1.PeerAddr.Addr(), b1.PeerMAC, b1.MAC, b1.Index)
	if err != nil {
		t.Skipf("cannot load an XDP program here: %v", err)
	}
	defer fwd.Close()
	rev, err := redirectProg(cl.PeerAddr.Addr(), cl.PeerMAC, cl.MAC, cl.Index)
	if err != nil {
		t.Fatal(err)
	}
	defer rev.Close()
	var links []link.Link
	err = topo.Node.Do(func() error {
		for _, a := range []struct {
			p   *ebpf.Program
			if_ int
		}{{fwd, cl.Index}, {rev, b1.Index}} {
			l, err := link.AttachXDP(link.XDPOptions{Program: a.p, Interface: a.if_})
			if err != nil {
				return err
			}
			links = append(links, l)
		}
		return nil
	})
	defer func() {
		for _, l := range links {
			l.Close()
		}
	}()
	if err != nil {
		t.Skipf("cannot attach XDP here: %v", err)
	}
	b := topo.Backend(1)
	if err := b.ServeHTTP(80); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	body, err := topo.Client.HTTPGet(ctx, "http://198.18.1.2/", 500*time.Millisecond)
	out, _ := topo.Backend(1).Run("nstat", "-az", "TcpInCsumErrors")
	t.Logf("GET -> %q, %v (%s); backend: %s", body, err, Classify(err), strings.Join(strings.Fields(out), " "))
	return err == nil && body == "b1\n", err
}

// TestXDPRedirectNeedsGROAndFullChecksums documents (and guards) the two
// kernel facts behind Options.GRO and Options.TxChecksumOff with a minimal
// XDP_REDIRECT "router" on the node: cl0 -> b1 for 198.18.1.2 and b1 -> cl0
// for 198.18.0.2. Without GRO on the peers the redirected frames are
// dropped; with GRO but offloaded (partial) checksums the backend counts
// TcpInCsumErrors and drops the SYN; with both it works.
func TestXDPRedirectNeedsGROAndFullChecksums(t *testing.T) {
	cases := []struct {
		name string
		opts Options
		want bool
	}{
		{"plain", Options{Backends: 1, StaticNeighbors: true}, false},
		{"gro", Options{Backends: 1, GRO: true, StaticNeighbors: true}, false},
		{"gro+txcsumoff", XDPOptions(1), true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ok, err := xdpRedirectWorks(t, c.opts)
			if ok != c.want {
				t.Errorf("redirect delivery = %v (%v), want %v", ok, err, c.want)
			}
		})
	}
}
