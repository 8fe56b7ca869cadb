// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// FloodSources are four more addresses of the client's /24 for a flood
// (AddAddrs): the backends' SYN-ACKs to them reach the client's kernel,
// which answers them with RST.
var FloodSources = []netip.Addr{
	netip.MustParseAddr("198.18.0.10"), netip.MustParseAddr("198.18.0.11"),
	netip.MustParseAddr("198.18.0.12"), netip.MustParseAddr("198.18.0.13"),
}

// FloodSpec is a SYN flood: SYNs from Sources to Target, Rate a second for
// Duration, every SYN a new flow (each source walks its source port).
type FloodSpec struct {
	Sources  []netip.Addr // IPv4 addresses of the namespace's eth0 (AddAddrs)
	Target   netip.AddrPort
	Rate     int
	Duration time.Duration
}

// FloodResult says what the sender managed.
type FloodResult struct {
	Sent    int
	Elapsed time.Duration
}

// Rate is the SYNs per second actually sent.
func (r FloodResult) Rate() float64 { return float64(r.Sent) / r.Elapsed.Seconds() }

// AddAddrs gives the namespace's eth0 more addresses of its /24 (IPv4) or
// /64 (IPv6, added with nodad, so usable at once), so a backend's SYN-ACKs
// to them come back to this namespace, whose kernel answers them with RST
// (no socket): a flood from real, reachable sources.
func (n *NS) AddAddrs(addrs ...netip.Addr) error {
	for _, a := range addrs {
		args := []string{"ip", "addr", "add", a.String() + "/24", "dev", "eth0"}
		if a.Is6() {
			args = []string{"ip", "-6", "addr", "add", a.String() + "/64", "dev", "eth0", "nodad"}
		}
		if _, err := n.Run(args...); err != nil {
			return err
		}
	}
	return nil
}

// SYNFlood sends spec's SYNs through a raw socket in the namespace, paced
// in 1 ms slices, until Duration passes or ctx ends, at most Rate·Duration
// packets. A sender the machine slows down sends fewer (FloodResult).
// It is IPv4 only: an IPv6 target or source is an error.
func (n *NS) SYNFlood(ctx context.Context, spec FloodSpec) (FloodResult, error) {
	if !spec.Target.Addr().Is4() {
		return FloodResult{}, fmt.Errorf("testnet: flood target %s: IPv4 only", spec.Target)
	}
	for _, s := range spec.Sources {
		if !s.Is4() {
			return FloodResult{}, fmt.Errorf("testnet: flood source %s: IPv4 only", s)
		}
	}
	var fd int
	if err := n.Do(func() (err error) {
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		return err
	}); err != nil {
		return FloodResult{}, fmt.Errorf("testnet: raw socket: %w", err)
	}
	defer unix.Close(fd)
	if len(spec.Sources) == 0 || spec.Rate <= 0 {
		return FloodResult{}, fmt.Errorf("testnet: flood needs sources and a rate")
	}
	dst := spec.Target.Addr().As4()
	sa := &unix.SockaddrInet4{Addr: dst}
	pkts := make([][]byte, len(spec.Sources))
	for i, s := range spec.Sources {
		pkts[i] = synTemplate(s.As4(), dst, spec.Target.Port())
	}
	ports := make([]uint16, len(spec.Sources))
	for i := range ports {
		ports[i] = uint16(1024 + rand.IntN(60000))
	}
	total := int(float64(spec.Rate) * spec.Duration.Seconds())
	start := time.Now()
	sent, i := 0, 0
	for sent < total && ctx.Err() == nil && time.Since(start) < spec.Duration {
		// Everything due by now, then a breath.
		due := min(total, int(float64(spec.Rate)*time.Since(start).Seconds())+1)
		for ; sent < due; sent++ {
			// A sender that fell behind stops at the duration all the
			// same, instead of catching up past it.
			if sent%256 == 0 && time.Since(start) >= spec.Duration {
				break
			}
			k := i % len(pkts)
			i++
			ports[k]++
			if ports[k] < 1024 {
				ports[k] = 1024
			}
			setSYN(pkts[k], ports[k], rand.Uint32())
			if err := unix.Sendto(fd, pkts[k], 0, sa); err != nil && err != unix.ENOBUFS {
				return FloodResult{Sent: sent, Elapsed: time.Since(start)}, fmt.Errorf("testnet: send SYN: %w", err)
			}
		}
		time.Sleep(time.Millisecond)
	}
	return FloodResult{Sent: sent, Elapsed: time.Since(start)}, nil
}

// synTemplate is an IPv4 + TCP SYN packet from src to dst:port. The
// kernel fills the IP checksum, length and id (IP_HDRINCL semantics);
// setSYN fills the source port, sequence number and TCP checksum.
func synTemplate(src, dst [4]byte, port uint16) []byte {
	b := make([]byte, 40)
	b[0] = 0x45
	b[8] = 64 // TTL
	b[9] = unix.IPPROTO_TCP
	copy(b[12:16], src[:])
	copy(b[16:20], dst[:])
	binary.BigEndian.PutUint16(b[22:], port)
	b[32] = 5 << 4 // data offset
	b[33] = 0x02   // SYN
	binary.BigEndian.PutUint16(b[34:], 64240)
	return b
}

func setSYN(b []byte, sport uint16, seq uint32) {
	t := b[20:]
	binary.BigEndian.PutUint16(t[0:], sport)
	binary.BigEndian.PutUint32(t[4:], seq)
	t[16], t[17] = 0, 0
	// Pseudo-header: source, destination, protocol, TCP length (20).
	sum := uint32(6 + 20)
	for i := 12; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(t[i:]))
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	binary.BigEndian.PutUint16(t[16:], ^uint16(sum))
}

// TxDrops is the interface's transmit drop count (0 if unreadable). On a
// veth whose peer runs XDP these are the frames its peer's queue had no
// room for.
func (n *NS) TxDrops(iface string) uint64 {
	var drops uint64
	n.Do(func() error {
		// netlink, not /sys: sysfs shows the host's interfaces here.
		if l, err := netlink.LinkByName(iface); err == nil && l.Attrs().Statistics != nil {
			drops = l.Attrs().Statistics.TxDropped
		}
		return nil
	})
	return drops
}
