// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// How dialing inside a namespace works
//
// A socket's network namespace is fixed when socket(2) runs, by the calling
// thread's namespace; everything after that (bind, connect, I/O, close) may
// happen on any thread. So only socket(2) needs a thread inside the
// namespace. Each NS keeps, per (family, type), a small pool of pre-created,
// unconnected, non-blocking sockets filled by one goroutine that is locked
// to a thread parked inside the namespace. DialContext takes a socket from
// the pool (a channel receive, no thread switch in the common case), then
// connects it on the caller's goroutine with Go's poller (os.NewFile +
// RawConn, EINPROGRESS → wait for writability → SO_ERROR), and finally
// turns it into a regular *net.TCPConn / *net.UDPConn with net.FileConn.
// Thousands of concurrent dials therefore cost no extra threads, and a dial
// blocked on a black-holed SYN holds nothing but its own socket.

type sockKey struct{ domain, typ int }

// sockPoolSize bounds the number of idle pre-created sockets per key.
const sockPoolSize = 32

type sockItem struct {
	fd  int
	err error
}

type sockPool struct {
	ch   chan sockItem
	stop chan struct{}
	done chan struct{}
}

func (n *NS) pool(k sockKey) (*sockPool, error) {
	n.poolMu.Lock()
	defer n.poolMu.Unlock()
	if n.pools == nil {
		return nil, errClosed
	}
	if p := n.pools[k]; p != nil {
		return p, nil
	}
	p := &sockPool{
		ch:   make(chan sockItem, sockPoolSize),
		stop: make(chan struct{}),
		done: make(chan struct{}),
	}
	ready := make(chan error, 1)
	go p.fill(n, k, ready)
	if err := <-ready; err != nil {
		return nil, err
	}
	n.pools[k] = p
	return p, nil
}

// fill runs on a thread that joins the namespace and never leaves it: the
// goroutine never unlocks, so the runtime destroys the thread when it exits.
func (p *sockPool) fill(n *NS, k sockKey, ready chan<- error) {
	defer close(p.done)
	runtime.LockOSThread()
	if err := n.enter(); err != nil {
		ready <- err
		return
	}
	ready <- nil
	for {
		fd, err := unix.Socket(k.domain, k.typ|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		select {
		case p.ch <- sockItem{fd, err}:
		case <-p.stop:
			if err == nil {
				unix.Close(fd)
			}
			return
		}
		if err != nil { // e.g. EMFILE: don't spin
			select {
			case <-time.After(10 * time.Millisecond):
			case <-p.stop:
				return
			}
		}
	}
}

func (p *sockPool) close() {
	close(p.stop)
	<-p.done
	for {
		select {
		case it := <-p.ch:
			if it.err == nil {
				unix.Close(it.fd)
			}
		default:
			return
		}
	}
}

func (p *sockPool) get(ctx context.Context) (int, error) {
	select {
	case it := <-p.ch:
		return it.fd, it.err
	default:
	}
	select {
	case it := <-p.ch:
		return it.fd, it.err
	case <-p.done:
		return -1, errClosed
	case <-ctx.Done():
		return -1, ctx.Err()
	}
}

// socket returns a new non-blocking, close-on-exec socket in the namespace.
func (n *NS) socket(ctx context.Context, domain, typ int) (int, error) {
	p, err := n.pool(sockKey{domain, typ})
	if err != nil {
		return -1, err
	}
	return p.get(ctx)
}

// Dialer dials from inside a namespace. The zero value of every field is
// usable; a Dialer is safe for concurrent use.
type Dialer struct {
	NS *NS
	// Timeout bounds the connect phase (in addition to the context).
	// Zero means no timeout beyond the context's.
	Timeout time.Duration
	// LocalAddr, if set, is bound before connecting (port 0 = any).
	LocalAddr netip.AddrPort
	// Control, if set, is called with the raw socket before bind/connect
	// (e.g. to set SO_LINGER or SO_RCVBUF).
	Control func(fd int) error
}

// Dialer returns a Dialer for the namespace with the given connect timeout.
func (n *NS) Dialer(timeout time.Duration) *Dialer { return &Dialer{NS: n, Timeout: timeout} }

// DialContext connects from inside the namespace; see Dialer.DialContext.
func (n *NS) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	return (&Dialer{NS: n}).DialContext(ctx, network, address)
}

// DialContext connects to address over network "tcp", "tcp4", "tcp6",
// "udp", "udp4" or "udp6" from inside the namespace. address is a literal
// IP and a port: "198.18.1.2:80", or for IPv6, in brackets,
// "[2001:2:0:1::2]:80" (a zone, "[fe80::1%eth0]:80", names an interface
// of the namespace). An IPv4-mapped IPv6 address ("[::ffff:198.18.1.2]:80")
// is dialed as IPv4, as the standard dialer does; "tcp4"/"udp4" with an
// IPv6 address and "tcp6"/"udp6" with an IPv4 one fail. It returns a
// *net.TCPConn or *net.UDPConn. Errors are *net.OpError{Op: "dial"} like
// the standard dialer's: errors.Is works for syscall.ECONNREFUSED, and a
// connect that ran out of time satisfies errors.Is(err,
// os.ErrDeadlineExceeded) and net.Error.Timeout().
func (d *Dialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return nil, &net.OpError{Op: "dial", Net: network, Err: fmt.Errorf("testnet: need a literal ip:port or [ipv6]:port: %w", err)}
	}
	if a := ap.Addr(); a.Is4In6() {
		ap = netip.AddrPortFrom(a.Unmap(), ap.Port())
	}
	var typ int
	var raddr net.Addr
	switch network {
	case "tcp", "tcp4", "tcp6":
		typ = unix.SOCK_STREAM
		raddr = net.TCPAddrFromAddrPort(ap)
	case "udp", "udp4", "udp6":
		typ = unix.SOCK_DGRAM
		raddr = net.UDPAddrFromAddrPort(ap)
	default:
		return nil, &net.OpError{Op: "dial", Net: network, Err: net.UnknownNetworkError(network)}
	}
	opErr := func(err error) error {
		return &net.OpError{Op: "dial", Net: network, Addr: raddr, Err: err}
	}
	is6 := ap.Addr().Is6()
	if suffix := network[len(network)-1]; (suffix == '4' && is6) || (suffix == '6' && !is6) {
		return nil, opErr(&net.AddrError{Err: "address of the wrong family for " + network, Addr: ap.Addr().String()})
	}
	var domain int
	var sa unix.Sockaddr
	if is6 {
		zone, err := d.NS.zoneIndex(ap.Addr().Zone())
		if err != nil {
			return nil, opErr(err)
		}
		domain = unix.AF_INET6
		sa = &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16(), ZoneId: zone}
	} else {
		domain = unix.AF_INET
		sa = &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	if d.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d.Timeout)
		defer cancel()
	}
	if err := ctx.Err(); err != nil {
		return nil, opErr(mapCtxErr(err))
	}

	fd, err := d.NS.socket(ctx, domain, typ)
	if err != nil {
		if ctx.Err() != nil {
			err = mapCtxErr(ctx.Err())
		}
		return nil, opErr(err)
	}
	if d.Control != nil {
		if err := d.Control(fd); err != nil {
			unix.Close(fd)
			return nil, opErr(err)
		}
	}
	if d.LocalAddr.IsValid() {
		lsa, err := d.localSockaddr(is6)
		if err != nil {
			unix.Close(fd)
			return nil, opErr(err)
		}
		if err := unix.Bind(fd, lsa); err != nil {
			unix.Close(fd)
			return nil, opErr(os.NewSyscallError("bind", err))
		}
	}

	// os.NewFile registers the non-blocking fd with the runtime poller; from
	// here on f owns fd.
	f := os.NewFile(uintptr(fd), "testnet-socket")
	defer f.Close() // net.FileConn dups the descriptor
	if err := connect(ctx, f, sa); err != nil {
		return nil, opErr(err)
	}
	c, err := net.FileConn(f)
	if err != nil {
		return nil, opErr(err)
	}
	return c, nil
}

// localSockaddr is d.LocalAddr for a socket of the given family. An
// unspecified address (0.0.0.0 or ::) binds only the port, in either
// family; any other address must be of the socket's family.
func (d *Dialer) localSockaddr(is6 bool) (unix.Sockaddr, error) {
	la, port := d.LocalAddr.Addr().Unmap(), int(d.LocalAddr.Port())
	if la.IsUnspecified() {
		if is6 {
			return &unix.SockaddrInet6{Port: port}, nil
		}
		return &unix.SockaddrInet4{Port: port}, nil
	}
	if la.Is6() != is6 {
		return nil, &net.AddrError{Err: "local address of the other family than the remote one", Addr: la.String()}
	}
	if !is6 {
		return &unix.SockaddrInet4{Port: port, Addr: la.As4()}, nil
	}
	zone, err := d.NS.zoneIndex(la.Zone())
	if err != nil {
		return nil, err
	}
	return &unix.SockaddrInet6{Port: port, Addr: la.As16(), ZoneId: zone}, nil
}

// zoneIndex resolves an IPv6 zone, an interface name or index, in the
// namespace ("" is 0: no zone).
func (n *NS) zoneIndex(zone string) (uint32, error) {
	if zone == "" {
		return 0, nil
	}
	if i, err := strconv.ParseUint(zone, 10, 32); err == nil {
		return uint32(i), nil
	}
	var idx int
	err := n.Do(func() error {
		// The route netlink socket behind InterfaceByName belongs to this
		// thread's namespace.
		ifi, err := net.InterfaceByName(zone)
		if err == nil {
			idx = ifi.Index
		}
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("testnet: zone %q in %s: %w", zone, n.Name, err)
	}
	return uint32(idx), nil
}

func mapCtxErr(err error) error {
	if errors.Is(err, context.DeadlineExceeded) {
		return os.ErrDeadlineExceeded
	}
	return err
}

var aLongTimeAgo = time.Unix(1, 0)

// connect performs a non-blocking connect(2), waiting on the runtime poller.
//
// An ICMP error (e.g. "network unreachable" from the node for a VIP with
// no load balancer) that arrives while a system call holds the socket —
// connect(2) itself, through which the whole veth round trip can run
// synchronously, or getpeername(2) — is recorded by the kernel only as a
// soft error (TcpExtLockDroppedIcmps): it does not end the connect or wake
// the poller, and would surface only with the SYN retransmission a second
// later. In SYN_SENT the kernel makes every other ICMP error fatal, so
// before each wait connect reads SO_ERROR (which returns the soft error
// too) and fails with what it finds.
func connect(ctx context.Context, f *os.File, sa unix.Sockaddr) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	if dl, ok := ctx.Deadline(); ok {
		if err := f.SetWriteDeadline(dl); err != nil {
			return err
		}
	}
	stop := context.AfterFunc(ctx, func() { f.SetWriteDeadline(aLongTimeAgo) })
	defer stop()

	started := false
	var cerr error
	// wait reports whether to wait for writability: not if SO_ERROR holds
	// an error (then cerr is set).
	wait := func(fd uintptr) bool {
		v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		switch e := unix.Errno(v); {
		case err != nil:
			cerr = os.NewSyscallError("getsockopt", err)
		case e == 0, e == unix.EINPROGRESS, e == unix.EALREADY, e == unix.EINTR:
			return true
		default:
			cerr = os.NewSyscallError("connect", e)
		}
		return false
	}
	werr := rc.Write(func(fd uintptr) bool {
		if !started {
			started = true
			switch err := unix.Connect(int(fd), sa); err {
			case nil, unix.EISCONN:
				return true
			case unix.EINPROGRESS, unix.EALREADY, unix.EINTR:
				return !wait(fd)
			default:
				cerr = os.NewSyscallError("connect", err)
				return true
			}
		}
		v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			cerr = os.NewSyscallError("getsockopt", err)
			return true
		}
		switch e := unix.Errno(v); e {
		case 0, unix.EISCONN:
			// The poller can wake us spuriously (e.g. the readiness event of
			// registering the unconnected socket): only a peer name proves
			// the connection is established.
			if _, err := unix.Getpeername(int(fd)); err != nil {
				return !wait(fd)
			}
			return true
		case unix.EINPROGRESS, unix.EALREADY, unix.EINTR:
			return !wait(fd)
		default:
			cerr = os.NewSyscallError("connect", e)
			return true
		}
	})
	if werr != nil {
		if errors.Is(werr, os.ErrDeadlineExceeded) {
			if err := ctx.Err(); err != nil {
				return mapCtxErr(err)
			}
		}
		return werr
	}
	return cerr
}

// dialInThread is the naive alternative, kept for the benchmark: the whole
// standard dial runs on a thread locked inside the namespace.
func (n *NS) dialInThread(ctx context.Context, network, address string) (net.Conn, error) {
	var c net.Conn
	err := n.Do(func() (err error) {
		var d net.Dialer
		c, err = d.DialContext(ctx, network, address)
		return err
	})
	return c, err
}
