// SPDX-License-Identifier: Apache-2.0

package replay

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// ErrNoRawSocket: no raw IP socket could be opened (the agent lacks
// CAP_NET_RAW), which Socket needs.
var ErrNoRawSocket = errors.New("no raw IP socket (CAP_NET_RAW)")

// Socket sends replays where the kernel refuses BPF_PROG_RUN's live-frame
// mode. The datapath still decides each replay: the rebuilt SYN runs
// through the program in the mode every kernel allows, which moves the
// flow in the maps and returns the frame as the program left it (DNATed
// to the new backend). Socket then hands that packet to the kernel through
// a raw IP socket, which routes it to its destination.
//
// What differs from a live frame: the kernel sends the packet as the
// node's own (netfilter's OUTPUT and POSTROUTING chains, not FORWARD), so
// a firewall that filters forwarded traffic in FORWARD does not see
// replays, while rules at the backend's interface or in the backend's
// namespace do. Its route is looked up by destination and the client's
// source address, not by the interface the client's packets arrive on
// (see send). The source address stays the client's; the hop the forward
// would have taken off the TTL is taken here. A send that fails after the
// program moved the flow is a NotSentError.
type Socket struct {
	fd4, fd6 int // -1: none (a node without IPv6)
}

// ErrNotSent: the datapath moved the flow, but its packet could not be
// sent (see NotSentError).
var ErrNotSent = errors.New("the moved SYN could not be sent")

// NotSentError says that a replay moved its flow to Backend but the
// packet could not be sent there: the flow waits for the client's own
// retransmission, and what it does until then (the new backend's
// silence) is no evidence about that backend.
type NotSentError struct {
	Backend uint32 // the backend id the flow moved to (0: unknown)
	Err     error
}

func (e *NotSentError) Error() string {
	return fmt.Sprintf("replay: the flow moved to backend %d: %v", e.Backend, e.Err)
}

func (e *NotSentError) Unwrap() []error { return []error{ErrNotSent, e.Err} }

// OpenSocket opens the raw IPv4 and IPv6 sockets (IPPROTO_RAW: the
// packet's own header is sent). ErrNoRawSocket when the process may not;
// a kernel without IPv6 leaves IPv6 replays unsent (ErrNotSent).
func OpenSocket() (*Socket, error) {
	fd4, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return nil, rawSocketErr("IPv4", err)
	}
	fd6, err := unix.Socket(unix.AF_INET6, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if errors.Is(err, unix.EAFNOSUPPORT) {
		fd6 = -1
	} else if err != nil {
		unix.Close(fd4)
		return nil, rawSocketErr("IPv6", err)
	} else if err := unix.SetsockoptInt(fd6, unix.SOL_IPV6, unix.IPV6_FREEBIND, 1); err != nil {
		// The route lookup by the client's source (send) needs it.
		unix.Close(fd4)
		unix.Close(fd6)
		return nil, fmt.Errorf("replay: raw IPv6 socket: IPV6_FREEBIND: %w", err)
	}
	return &Socket{fd4: fd4, fd6: fd6}, nil
}

func rawSocketErr(family string, err error) error {
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
		return fmt.Errorf("replay: %w: %s: %w", ErrNoRawSocket, family, err)
	}
	return fmt.Errorf("replay: raw %s socket: %w", family, err)
}

// Close closes the sockets.
func (s *Socket) Close() error {
	err := unix.Close(s.fd4)
	if s.fd6 >= 0 {
		err = errors.Join(err, unix.Close(s.fd6))
	}
	return err
}

// The XDP verdicts a run of the program returns.
const (
	xdpAborted = iota
	xdpDrop
	xdpPass
	xdpTX
	xdpRedirect
)

// run runs prog on data (XDP metadata, then the frame) with ctx in the
// ordinary BPF_PROG_RUN mode and sends the packet it leaves, as the
// kernel would have: a passed frame goes on its route (one hop off its
// TTL, as forwarded), a redirected or transmitted one too (the program
// took the hop off and rewrote the Ethernet header for the interface it
// chose, which the route picks again). A dropped or aborted frame goes
// nowhere, as live.
func (s *Socket) run(prog *ebpf.Program, data []byte, ctx xdpMD) error {
	// Room for what the program may add in front (an encapsulation) as
	// well as the frame itself.
	opts := ebpf.RunOptions{Data: data, DataOut: make([]byte, len(data)+512), Context: ctx, ContextOut: &xdpMD{}, Repeat: 1}
	ret, err := prog.Run(&opts)
	if err != nil {
		return fmt.Errorf("replay: run the datapath on the SYN (ifindex %d): %w", ctx.IngressIfindex, err)
	}
	out := opts.ContextOut.(*xdpMD)
	if out.Data > out.DataEnd || int(out.DataEnd) > len(opts.DataOut) {
		return fmt.Errorf("replay: the datapath's output frame [%d, %d) of %d bytes", out.Data, out.DataEnd, len(opts.DataOut))
	}
	frame := opts.DataOut[out.Data:out.DataEnd]
	switch ret {
	case xdpPass:
		err = s.send(frame, true)
	case xdpTX, xdpRedirect:
		err = s.send(frame, false)
	}
	if err != nil {
		return fmt.Errorf("%w: %w", ErrNotSent, err)
	}
	return nil
}

// send sends frame's IP packet to its destination. hop: take one off its
// TTL (hop limit) first, as a forward would; at 1 or less it is not sent
// (the forward would have dropped it). The route is looked up with the
// packet's own source (IP_PKTINFO's spec_dst, IPV6_PKTINFO's address; a
// raw socket that writes its headers may name any), so that policy routing
// by source (CNIs that send each pod's traffic out its own interface) picks
// the route the client's packet would get; rules by input interface see
// the node's own output, not the client's interface.
func (s *Socket) send(frame []byte, hop bool) error {
	if len(frame) < 14 {
		return fmt.Errorf("replay: output frame of %d bytes", len(frame))
	}
	pkt := frame[14:]
	// Where the header's version, TTL (hop limit) and addresses are.
	var hdr, ttlAt, srcAt, dstAt, alen int
	var version byte
	switch binary.BigEndian.Uint16(frame[12:14]) {
	case unix.ETH_P_IP:
		hdr, version, ttlAt, srcAt, dstAt, alen = 20, 4, 8, 12, 16, 4
	case unix.ETH_P_IPV6:
		hdr, version, ttlAt, srcAt, dstAt, alen = 40, 6, 7, 8, 24, 16
	default:
		return fmt.Errorf("replay: output frame of ethertype %#04x", binary.BigEndian.Uint16(frame[12:14]))
	}
	if len(pkt) < hdr || pkt[0]>>4 != version {
		return fmt.Errorf("replay: output frame: no IPv%d header", version)
	}
	if hop {
		if pkt[ttlAt] <= 1 {
			return nil
		}
		// IPv4's header checksum the kernel computes again for a packet
		// sent with its own header (IPPROTO_RAW).
		pkt[ttlAt]--
	}
	src, dst := pkt[srcAt:srcAt+alen], pkt[dstAt:dstAt+alen]
	var err error
	if version == 4 {
		sa := &unix.SockaddrInet4{}
		copy(sa.Addr[:], dst)
		info := unix.Inet4Pktinfo{}
		copy(info.Spec_dst[:], src)
		_, err = unix.SendmsgN(s.fd4, pkt, unix.PktInfo4(&info), sa, unix.MSG_DONTWAIT)
	} else {
		if s.fd6 < 0 {
			return errors.New("replay: no raw IPv6 socket (the kernel has no IPv6)")
		}
		sa := &unix.SockaddrInet6{}
		copy(sa.Addr[:], dst)
		info := unix.Inet6Pktinfo{}
		copy(info.Addr[:], src)
		_, err = unix.SendmsgN(s.fd6, pkt, unix.PktInfo6(&info), sa, unix.MSG_DONTWAIT)
	}
	return sendErr(err)
}

// sendErr words a send's error. The send never waits (MSG_DONTWAIT): the
// agent replays under its lock, and a full socket buffer (packets held
// for their neighbour's address) must not stall its events.
func sendErr(err error) error {
	if err != nil {
		return fmt.Errorf("replay: send through the raw socket: %w", err)
	}
	return nil
}
