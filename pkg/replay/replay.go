// SPDX-License-Identifier: Apache-2.0

// Package replay sends a refused connection's SYN again, at once, so that
// the datapath moves it to another backend: the client's connect succeeds
// one round trip later instead of failing (or, with the client's own
// retransmission, a second later).
//
// When a backend answers a new flow's SYN with RST and the service has
// retryRefused, the datapath keeps the RST from the client (the flow is
// "rescued") and has a copy of the SYN in pb_syns_v2. Replay rebuilds that
// SYN exactly (the client's addresses, ports, sequence number, window and
// options, the Ethernet addresses it arrived with) and runs the XDP
// program on it with BPF_PROG_RUN in live-frame mode, as if it had just
// arrived on the client's interface again: the datapath treats it as the
// client's retransmission (a rescued flow's SYN goes to another backend,
// once) and the kernel then forwards it as it forwards any client packet.
// The client never knows: it sees the new backend's SYN-ACK for its SYN.
// A kernel that refuses the live-frame mode gets the same replay through
// a raw socket (Socket): the program runs in the ordinary mode and the
// agent sends the packet it returns.
package replay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/csum"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// ErrNoCopy: pb_syns holds no copy of this flow's SYN (another flow's SYN
// took the slot). The client's own retransmission still gets the replay.
var ErrNoCopy = errors.New("replay: no copy of the SYN")

// ErrStale: the flow is no longer the refused one waiting for its second
// try (the client's own retransmission moved it already, or it ended).
// A replay now would be a second SYN on whatever the flow has become.
var ErrStale = errors.New("replay: the flow has moved on")

// ErrDropped: the datapath did not move the flow (no other backend to
// move it to, or the circuit breaker turned it away): the replay went
// nowhere, and the client's own retransmission is what it waits for (or,
// turned away, the breaker's RST).
var ErrDropped = errors.New("replay: the datapath did not move the flow")

// Replayer replays refused SYNs through the datapath program.
type Replayer struct {
	prog func() (*ebpf.Program, error)
	m    *maps.Maps
	ipID atomic.Uint32
	// sock, if set, sends the replays (SendThrough); nil: the live-frame
	// mode.
	sock *Socket
}

// New replays through the program prog returns (the datapath's XDP
// program, which may still be loading when the replayer is made),
// reading SYN copies (pb_syns) and flow state (pb_ct) from m.
func New(prog func() (*ebpf.Program, error), m *maps.Maps) *Replayer {
	return &Replayer{prog: prog, m: m}
}

// SendThrough makes r send its replays through s, for a kernel that
// refuses the live-frame mode (Probe); r is returned. The caller closes s.
func (r *Replayer) SendThrough(s *Socket) *Replayer {
	r.sock = s
	return r
}

// Replay sends again the SYN that client sent to vip, which backend
// refused: only while the flow is that refusal, kept from the client and
// not yet retried.
func (r *Replayer) Replay(client, vip, backend netip.AddrPort) error {
	flags, err := r.flowFlags(client, backend)
	if err != nil {
		return err
	}
	if flags&(maps.CTClosed|maps.CTRescued|maps.CTRetry) != maps.CTClosed|maps.CTRescued {
		return ErrStale
	}
	if err := r.send(client, vip, Meta(0)); err != nil {
		return r.notSent(client, vip, err)
	}
	// A live frame's run returns no verdict (and a Socket's sends what the
	// program returned as a live frame would), so the flow says whether the
	// datapath sent the SYN on: its forward entry is then a retry's, or
	// (the entry lost and made again) another backend's. Still the
	// refusal's, the SYN went nowhere: no backend to take it, or the
	// circuit breaker turned it away. Gone, the tuple was handed over to
	// kube-proxy.
	fwd, err := r.m.CTEntry(maps.RequestKey(client, vip))
	if err == nil && fwd.Flags&maps.CTRetry == 0 &&
		fwd.NatAddr.Bytes == maps.Addr16(backend.Addr()) && fwd.NatPort == maps.Port(backend.Port()) {
		return ErrDropped
	}
	return nil
}

// notSent is err, or, for a replay the datapath carried out whose packet
// could not be sent (ErrNotSent), a NotSentError naming the backend the
// flow moved to, read from its forward entry (a retry's now).
func (r *Replayer) notSent(client, vip netip.AddrPort, err error) error {
	if !errors.Is(err, ErrNotSent) {
		return err
	}
	ns := &NotSentError{Err: err}
	if fwd, ferr := r.m.CTEntry(maps.RequestKey(client, vip)); ferr == nil && fwd.Flags&maps.CTRetry != 0 {
		ns.Backend = fwd.BackendId
	}
	return ns
}

// flowFlags are the flags of client's flow with backend (its reverse
// conntrack entry); ErrStale when the entry is gone.
func (r *Replayer) flowFlags(client, backend netip.AddrPort) (uint32, error) {
	ct, err := r.m.CTEntry(maps.ReplyKey(backend, client))
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return 0, ErrStale
	}
	if err != nil {
		return 0, fmt.Errorf("replay: pb_ct: %w", err)
	}
	return ct.Flags, nil
}

// ReplayUnanswered sends again the SYN that client sent to vip, which
// backend (id backendID) has not answered, marked for the datapath to move
// the flow off that backend: only while the flow still waits for it (no
// SYN-ACK, not closed, not moved before).
func (r *Replayer) ReplayUnanswered(client, vip, backend netip.AddrPort, backendID uint32) error {
	flags, err := r.flowFlags(client, backend)
	if err != nil {
		return err
	}
	if flags&(maps.CTEstablished|maps.CTClosed|maps.CTRetry|maps.CTMoved) != 0 {
		return ErrStale
	}
	if err := r.send(client, vip, Meta(backendID)); err != nil {
		return r.notSent(client, vip, err)
	}
	// Moved, the flow leaves this backend's entry marked (PB_CT_MOVED), for
	// its late answer; a replay the datapath kept on it leaves it unmarked.
	// Gone, the client's own retransmission moved the flow first, and the
	// replay found it moved.
	flags, err = r.flowFlags(client, backend)
	if err != nil {
		return err
	}
	if flags&maps.CTMoved == 0 {
		return ErrDropped
	}
	return nil
}

// Meta is the XDP metadata (struct replay_meta) of a replayed SYN: it
// tells the datapath the SYN is the agent's, not a client's (the SYN guard
// does not judge it again), and which backend to move the flow off (0:
// none, the table picks).
func Meta(moveOff uint32) []byte {
	meta := make([]byte, 8)
	binary.NativeEndian.PutUint32(meta[0:], replayMagic)
	binary.NativeEndian.PutUint32(meta[4:], moveOff)
	return meta
}

// replayMagic is PB_REPLAY_MAGIC ("pbrp").
const replayMagic = 0x70627270

// send rebuilds the SYN client sent to vip from its pb_syns copy and runs
// the datapath on it, as arriving on the client's interface, with meta as
// the frame's XDP metadata.
func (r *Replayer) send(client, vip netip.AddrPort, meta []byte) error {
	var c bpf.LbSynCopy
	slot := maps.SynSlot(client.Addr(), client.Port())
	if err := r.m.Raw().PbSynsV2.Lookup(slot, &c); err != nil {
		return fmt.Errorf("replay: pb_syns_v2[%d]: %w", slot, err)
	}
	if c.Family != maps.Family(client.Addr()) ||
		maps.AddrFromFamily(c.Family, c.Client.Bytes) != client.Addr() || maps.Port(c.ClientPort) != client.Port() ||
		maps.AddrFromFamily(c.Family, c.Vip.Bytes) != vip.Addr() || maps.Port(c.VipPort) != vip.Port() {
		return ErrNoCopy
	}
	frame, err := Frame(&c, uint16(r.ipID.Add(1)))
	if err != nil {
		return err
	}
	// The kernel takes the first ctx.Data bytes of the data as metadata.
	data := append(append(make([]byte, 0, len(meta)+len(frame)), meta...), frame...)
	ctx := xdpMD{Data: uint32(len(meta)), DataEnd: uint32(len(data)), IngressIfindex: c.Ifindex}
	prog, err := r.prog()
	if err != nil {
		return fmt.Errorf("replay: %w", err)
	}
	if r.sock != nil {
		return r.sock.run(prog, data, ctx)
	}
	_, err = prog.Run(&ebpf.RunOptions{Data: data, Context: ctx, Repeat: 1, Flags: unix.BPF_F_TEST_XDP_LIVE_FRAMES})
	if err != nil {
		return fmt.Errorf("replay: run the datapath on the SYN (ifindex %d): %w", c.Ifindex, err)
	}
	return nil
}

// xdpMD is struct xdp_md, the context BPF_PROG_RUN takes for XDP: the
// kernel wants data_end to be the frame's length and the rest but the
// ingress interface zero.
type xdpMD struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

// Frame builds the SYN that c describes: Ethernet, IPv4 (no options, DF)
// or IPv6 (no extension headers, flow label 0), and TCP with c's options,
// checksums complete. ipID is IPv4's identification.
func Frame(c *bpf.LbSynCopy, ipID uint16) ([]byte, error) {
	n := int(c.OptLen)
	if n > len(c.Opts) || n%4 != 0 {
		return nil, fmt.Errorf("replay: SYN copy with %d bytes of options", n)
	}
	tcpLen := 20 + n
	l3 := 20
	switch c.Family {
	case maps.FamilyIPv4:
	case maps.FamilyIPv6:
		l3 = 40
	default:
		return nil, fmt.Errorf("replay: SYN copy of family %d", c.Family)
	}
	f := make([]byte, 14+l3+tcpLen)
	copy(f[0:12], c.Eth[:])
	if l3 == 40 {
		binary.BigEndian.PutUint16(f[12:], unix.ETH_P_IPV6)
		ip := f[14:54]
		ip[0] = 0x60
		binary.BigEndian.PutUint16(ip[4:], uint16(tcpLen))
		ip[6] = unix.IPPROTO_TCP
		ip[7] = c.Ttl
		copy(ip[8:24], c.Client.Bytes[:])
		copy(ip[24:40], c.Vip.Bytes[:])
	} else {
		binary.BigEndian.PutUint16(f[12:], unix.ETH_P_IP)
		ip := f[14:34]
		ip[0] = 0x45
		binary.BigEndian.PutUint16(ip[2:], uint16(20+tcpLen))
		binary.BigEndian.PutUint16(ip[4:], ipID)
		binary.BigEndian.PutUint16(ip[6:], 0x4000) // DF, as Linux sends a SYN
		ip[8] = c.Ttl
		ip[9] = unix.IPPROTO_TCP
		copy(ip[12:16], c.Client.Bytes[:4])
		copy(ip[16:20], c.Vip.Bytes[:4])
		binary.BigEndian.PutUint16(ip[10:], ^csum.Fold(csum.Sum(ip, 0)))
	}
	// The copy's ports and sequence number are in network order already.
	tcp := f[14+l3:]
	binary.NativeEndian.PutUint16(tcp[0:], c.ClientPort)
	binary.NativeEndian.PutUint16(tcp[2:], c.VipPort)
	binary.NativeEndian.PutUint32(tcp[4:], c.Seq)
	tcp[12] = byte(tcpLen/4) << 4
	tcp[13] = 0x02 // SYN
	binary.NativeEndian.PutUint16(tcp[14:], c.Window)
	copy(tcp[20:], c.Opts[:n])
	if l3 == 40 {
		csum.SetTCP6(f)
	} else {
		csum.SetTCP4(f)
	}
	return f, nil
}

// ErrLiveFramesRefused: the kernel refused to run an XDP program in
// BPF_PROG_RUN's live-frame mode (Probe), which replays use unless sent
// through a Socket.
var ErrLiveFramesRefused = errors.New("the kernel refuses BPF_PROG_RUN's live-frame mode")

// Probe says whether this kernel runs XDP programs in BPF_PROG_RUN's
// live-frame mode, which Replay uses unless it sends through a Socket: it
// runs a program that drops its frame in that mode. Some hardened or
// sandboxed kernels refuse the mode (EPERM, even for root):
// ErrLiveFramesRefused. The agent then sends its replays through a
// Socket, or, without CAP_NET_RAW, none: clients wait for their own
// retransmission. Another error (the probe program not loaded) says
// nothing of the mode.
func Probe() error {
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.XDP,
		License:      "Dual BSD/GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1 /* XDP_DROP */), asm.Return()},
	})
	if err != nil {
		return fmt.Errorf("replay: probe program: %w", err)
	}
	defer p.Close()
	frame := make([]byte, 64)
	ctx := xdpMD{DataEnd: uint32(len(frame))}
	if _, err := p.Run(&ebpf.RunOptions{Data: frame, Context: ctx, Repeat: 1, Flags: unix.BPF_F_TEST_XDP_LIVE_FRAMES}); err != nil {
		return fmt.Errorf("replay: %w: %w", ErrLiveFramesRefused, err)
	}
	return nil
}
