// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// RawSender sends whole Ethernet frames out of a namespace's eth0 through
// a packet socket, every header field as given: a pod with CAP_NET_RAW
// (most container runtimes' default) forging what it likes, a bad
// checksum, a TTL of 1 or another pod's address included.
type RawSender struct {
	fd      int
	ifindex int
	link    *Link
}

// RawSender opens a packet socket on the eth0 of l's namespace (the client
// or a backend).
func (l *Link) RawSender() (*RawSender, error) {
	s := &RawSender{fd: -1, ifindex: l.PeerIndex, link: l}
	err := l.Peer.Do(func() (err error) {
		s.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("testnet: packet socket in %s: %w", l.Peer, err)
	}
	return s, nil
}

// Send sends frame, its Ethernet addresses set to eth0's and the node's
// (whatever frame says), so the node's interface takes it.
func (s *RawSender) Send(frame []byte) error {
	if len(frame) < 14 {
		return fmt.Errorf("testnet: %d-byte frame", len(frame))
	}
	f := append([]byte(nil), frame...)
	copy(f[0:6], s.link.MAC)
	copy(f[6:12], s.link.PeerMAC)
	proto := uint16(f[12])<<8 | uint16(f[13])
	to := &unix.SockaddrLinklayer{Ifindex: s.ifindex, Protocol: htons(proto)}
	if err := unix.Sendto(s.fd, f, 0, to); err != nil {
		return fmt.Errorf("testnet: send: %w", err)
	}
	return nil
}

// Close closes the socket.
func (s *RawSender) Close() error { return unix.Close(s.fd) }
