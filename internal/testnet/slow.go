package testnet

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/internal/testnet/synackdelay"
	"github.com/penaltybox/penaltybox/pkg/csum"
)

// resendMark is delay.c's resend_mark: the copies sent again carry it, so
// the program lets them pass.
const resendMark = 0x5ac4

// handshakeDelayer holds a backend's SYN-ACKs (synackdelay's tc egress
// program copies each to a ring buffer and drops it) and sends each again
// after a delay through a packet socket on the same interface.
type handshakeDelayer struct {
	objs synackdelay.DelayObjects
	tcx  link.Link
	// tc: the clsact qdisc holding the program where tcx is missing
	// (before 6.6), deleted in the backend's namespace on close.
	tc func()
	rd *ringbuf.Reader
	fd int
	wg sync.WaitGroup
}

// DelayHandshakes makes the backend's handshakes take d longer: every
// SYN-ACK it sends, IPv4 or IPv6, is held d before it leaves its eth0 (the
// kernel here has no sch_netem, so a tc program and the test process do
// what netem's delay would, for SYN-ACKs only; data is not delayed). d = 0
// stops it.
func (b *Backend) DelayHandshakes(d time.Duration) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errClosed
	}
	if b.delay != nil {
		b.delay.close()
		b.delay = nil
	}
	if d <= 0 {
		return nil
	}
	hd, err := b.startDelay(d)
	if err != nil {
		return fmt.Errorf("testnet: %s: delay handshakes: %w", b.Name, err)
	}
	b.delay = hd
	return nil
}

func (b *Backend) startDelay(d time.Duration) (*handshakeDelayer, error) {
	hd := &handshakeDelayer{fd: -1}
	if err := synackdelay.LoadDelayObjects(&hd.objs, nil); err != nil {
		return nil, err
	}
	ifindex := b.Link.PeerIndex
	err := b.Do(func() error {
		var err error
		// Both the attachment's ifindex and the socket belong to the
		// backend's namespace.
		hd.tcx, err = link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: hd.objs.HoldSynack, Attach: ebpf.AttachTCXEgress})
		if errors.Is(err, ebpf.ErrNotSupported) {
			var q netlink.Qdisc
			if q, err = attachClsact(ifindex, hd.objs.HoldSynack); err == nil {
				hd.tc = func() { b.Do(func() error { return netlink.QdiscDel(q) }) }
			}
		}
		if err != nil {
			return err
		}
		if hd.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		return unix.SetsockoptInt(hd.fd, unix.SOL_SOCKET, unix.SO_MARK, resendMark)
	})
	if err == nil {
		hd.rd, err = ringbuf.NewReader(hd.objs.Held)
	}
	if err != nil {
		hd.close()
		return nil, err
	}
	hd.wg.Add(1)
	go func() {
		defer hd.wg.Done()
		for {
			rec, err := hd.rd.Read()
			if errors.Is(err, ringbuf.ErrClosed) {
				return
			}
			if err != nil {
				// The program keeps dropping SYN-ACKs: keep sending them.
				continue
			}
			frame, proto, ok := heldFrame(rec.RawSample)
			if !ok {
				continue
			}
			hd.wg.Add(1)
			time.AfterFunc(d, func() {
				defer hd.wg.Done()
				// A sockaddr of its own: Sendto writes into it.
				to := &unix.SockaddrLinklayer{Ifindex: ifindex, Protocol: htons(proto)}
				unix.Sendto(hd.fd, frame, 0, to) // a lost SYN-ACK is retransmitted by the backend
			})
		}
	}()
	return hd, nil
}

func (hd *handshakeDelayer) close() {
	if hd.rd != nil {
		hd.rd.Close()
	}
	if hd.tcx != nil {
		hd.tcx.Close()
	}
	if hd.tc != nil {
		hd.tc()
	}
	hd.wg.Wait() // the held frames go out first
	if hd.fd >= 0 {
		unix.Close(hd.fd)
	}
	hd.objs.Close()
}

// attachClsact attaches prog to ifindex's egress the way tc does before
// tcx (6.6): a clsact qdisc, deleted to detach it, and a direct-action bpf
// filter. It runs in the caller's namespace.
func attachClsact(ifindex int, prog *ebpf.Program) (netlink.Qdisc, error) {
	q := &netlink.GenericQdisc{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
		QdiscType:  "clsact",
	}
	if err := netlink.QdiscAdd(q); err != nil {
		return nil, fmt.Errorf("clsact qdisc: %w", err)
	}
	f := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: ifindex, Parent: netlink.HANDLE_MIN_EGRESS, Handle: 1,
			Protocol: unix.ETH_P_ALL, Priority: 1},
		Fd: prog.FD(), Name: "hold_synack", DirectAction: true,
	}
	if err := netlink.FilterAdd(f); err != nil {
		netlink.QdiscDel(q)
		return nil, fmt.Errorf("tc filter: %w", err)
	}
	return q, nil
}

// heldFrame decodes one ring record (struct frame: len, then the bytes),
// an IPv4 or IPv6 SYN-ACK, and completes the TCP checksum: the stack may
// leave it to the device (CHECKSUM_PARTIAL), and a frame sent on a packet
// socket is final. proto is the frame's EtherType.
func heldFrame(rec []byte) (frame []byte, proto uint16, ok bool) {
	if len(rec) < 4 {
		return nil, 0, false
	}
	n := int(binary.LittleEndian.Uint32(rec))
	const eth, ip, ip6, tcp = 14, 20, 40, 20
	if n < eth+ip+tcp || n > len(rec)-4 {
		return nil, 0, false
	}
	f := append([]byte(nil), rec[4:4+n]...)
	switch proto = binary.BigEndian.Uint16(f[12:]); proto {
	case unix.ETH_P_IP:
		if tot := int(binary.BigEndian.Uint16(f[eth+2:])); tot < ip+tcp || eth+tot > n {
			return nil, 0, false
		}
		csum.SetTCP4(f)
	case unix.ETH_P_IPV6:
		if n < eth+ip6+tcp {
			return nil, 0, false
		}
		if pl := int(binary.BigEndian.Uint16(f[eth+4:])); pl < tcp || eth+ip6+pl > n || f[eth+6] != unix.IPPROTO_TCP {
			return nil, 0, false
		}
		setTCP6(f)
	default:
		return nil, 0, false
	}
	return f, proto, true
}

// setTCP6 is csum.SetTCP4 for an Ethernet frame carrying IPv6 (no extension
// headers) and TCP: the checksum over the segment the payload length gives
// and the IPv6 pseudo header (RFC 8200 8.1). The caller checks that the
// frame holds both headers and the segment.
func setTCP6(frame []byte) {
	ip := frame[14:]
	seg := ip[40 : 40+int(binary.BigEndian.Uint16(ip[4:]))]
	seg[16], seg[17] = 0, 0
	ps := csum.Sum(ip[8:40], 0) + uint32(len(seg)) + unix.IPPROTO_TCP
	binary.BigEndian.PutUint16(seg[16:], ^csum.Fold(csum.Sum(seg, ps)))
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }
