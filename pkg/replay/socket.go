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
// namespace do. The source address stays the client's; the hop the
// forward would have taken off the TTL is taken here.
type Socket struct {
	fd4, fd6 int
}

// OpenSocket opens the raw IPv4 and IPv6 sockets (IPPROTO_RAW: the
// packet's own header is sent). ErrNoRawSocket when the process may not.
func OpenSocket() (*Socket, error) {
	fd4, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return nil, rawSocketErr("IPv4", err)
	}
	fd6, err := unix.Socket(unix.AF_INET6, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		unix.Close(fd4)
		return nil, rawSocketErr("IPv6", err)
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
	return errors.Join(unix.Close(s.fd4), unix.Close(s.fd6))
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
		return s.send(frame, true)
	case xdpTX, xdpRedirect:
		return s.send(frame, false)
	}
	return nil
}

// send sends frame's IP packet to its destination. hop: take one off its
// TTL (hop limit) first, as a forward would; at 1 or less it is not sent
// (the forward would have dropped it).
func (s *Socket) send(frame []byte, hop bool) error {
	if len(frame) < 14 {
		return fmt.Errorf("replay: output frame of %d bytes", len(frame))
	}
	pkt := frame[14:]
	switch binary.BigEndian.Uint16(frame[12:14]) {
	case unix.ETH_P_IP:
		if len(pkt) < 20 || pkt[0]>>4 != 4 {
			return fmt.Errorf("replay: output frame: no IPv4 header")
		}
		if hop {
			if pkt[8] <= 1 {
				return nil
			}
			// The kernel computes the header checksum again for a
			// packet sent with its own header (IPPROTO_RAW).
			pkt[8]--
		}
		sa := &unix.SockaddrInet4{}
		copy(sa.Addr[:], pkt[16:20])
		return sendErr(unix.Sendto(s.fd4, pkt, 0, sa))
	case unix.ETH_P_IPV6:
		if len(pkt) < 40 || pkt[0]>>4 != 6 {
			return fmt.Errorf("replay: output frame: no IPv6 header")
		}
		if hop {
			if pkt[7] <= 1 {
				return nil
			}
			pkt[7]--
		}
		sa := &unix.SockaddrInet6{}
		copy(sa.Addr[:], pkt[24:40])
		return sendErr(unix.Sendto(s.fd6, pkt, 0, sa))
	}
	return fmt.Errorf("replay: output frame of ethertype %#04x", binary.BigEndian.Uint16(frame[12:14]))
}

func sendErr(err error) error {
	if err != nil {
		return fmt.Errorf("replay: send through the raw socket: %w", err)
	}
	return nil
}
