// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/netip"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Mode is a backend's behaviour towards new connections. It can be changed
// at any time with SetMode; flapping is a sequence of SetMode calls. Every
// mode applies alike to IPv4 and IPv6 clients: the servers listen on both
// families and the nftables tables are of family inet.
type Mode int32

const (
	// Serve answers every HTTP request with the backend name ("b1\n") and
	// every UDP datagram with "b1\n" + the datagram.
	Serve Mode = iota
	// Refuse closes the listening sockets: the kernel answers a SYN with
	// RST (the client sees ECONNREFUSED) and a UDP datagram with ICMP (or
	// ICMPv6) port unreachable, which a connected UDP socket reports as
	// ECONNREFUSED. Connections already established are not touched.
	Refuse
	// Blackhole drops incoming SYNs (and UDP datagrams) to the served ports,
	// IPv4 and IPv6, with an nftables rule in the backend namespace (table
	// inet pbtest): the client's connect times out, retransmitting its SYN
	// meanwhile. Established connections keep working.
	Blackhole
	// ResetAfterHandshake accepts each connection and closes it at once
	// with SO_LINGER{1,0}, so a RST goes out before any data byte.
	// UDP is served as in Serve.
	ResetAfterHandshake
	// Hold accepts connections and holds them open without reading or
	// answering, until ReleaseHeld (then they are served), CloseHeld or
	// Close. Changing the mode does not release them. UDP datagrams are
	// read and dropped.
	Hold
)

func (m Mode) String() string {
	switch m {
	case Serve:
		return "serve"
	case Refuse:
		return "refuse"
	case Blackhole:
		return "blackhole"
	case ResetAfterHandshake:
		return "reset-after-handshake"
	case Hold:
		return "hold"
	}
	return fmt.Sprintf("Mode(%d)", int32(m))
}

// Backend is a backend namespace with real servers on real sockets.
// The embedded *NS gives it Do, Listen, DialContext, Run, etc.
type Backend struct {
	*NS
	Index  int        // i in "b<i>"
	Name   string     // "b<i>", also the HTTP response body (plus "\n")
	Addr   netip.Addr // 198.18.<i>.2
	AddrV6 netip.Addr // 2001:2:0:<i>::2 (see Link for how i is spelled)
	Link   *Link      // the veth pair to the node

	mode atomic.Int32

	mu      sync.Mutex // serialises mode changes, server start/stop, Close
	tcp     map[int]*tcpServer
	udp     map[int]*udpServer
	nftOn   bool
	share   bool              // the refuse-share table is installed
	delay   *handshakeDelayer // DelayHandshakes, when on
	closed  bool
	stopped chan struct{} // closed by Close

	heldMu     sync.Mutex // guards held, heldClosed (never held with mu waiting)
	held       []net.Conn
	heldClosed bool

	accepted   atomic.Int64
	requests   atomic.Int64
	resets     atomic.Int64
	udpPackets atomic.Int64
}

func newBackend(ns *NS, i int) *Backend {
	return &Backend{
		NS:      ns,
		Index:   i,
		Name:    ns.Role,
		tcp:     map[int]*tcpServer{},
		udp:     map[int]*udpServer{},
		stopped: make(chan struct{}),
	}
}

// BackendStats are cumulative counters of a backend (all ports).
type BackendStats struct {
	Accepted   int64 // TCP connections accepted, in any mode
	Requests   int64 // HTTP requests answered
	Resets     int64 // connections reset in ResetAfterHandshake
	Held       int   // connections currently held (Hold)
	UDPPackets int64 // UDP datagrams received, in any mode
}

// Stats returns the backend's counters.
func (b *Backend) Stats() BackendStats {
	b.heldMu.Lock()
	held := len(b.held)
	b.heldMu.Unlock()
	return BackendStats{
		Accepted:   b.accepted.Load(),
		Requests:   b.requests.Load(),
		Resets:     b.resets.Load(),
		Held:       held,
		UDPPackets: b.udpPackets.Load(),
	}
}

// Accepted is the number of TCP connections accepted so far.
func (b *Backend) Accepted() int64 { return b.accepted.Load() }

// Requests is the number of HTTP requests answered so far.
func (b *Backend) Requests() int64 { return b.requests.Load() }

// Mode returns the current mode.
func (b *Backend) Mode() Mode { return Mode(b.mode.Load()) }

// tcpServer is one HTTP port. The raw listener exists except in Refuse; an
// accept loop hands connections to the http.Server through feed.
type tcpServer struct {
	port     int
	ln       net.Listener // nil while refusing
	loopDone chan struct{}
	feed     *chanListener
	srv      *http.Server
}

type udpServer struct {
	port int
	pc   net.PacketConn // nil while refusing
	done chan struct{}
}

// ServeHTTP starts an HTTP/1.1 server on [::]:port (IPv4 and IPv6) in the
// backend namespace that answers every request with the backend name
// ("b1\n"). Keep-alive works. The server follows the backend's mode.
func (b *Backend) ServeHTTP(port int) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errClosed
	}
	if _, ok := b.tcp[port]; ok {
		return fmt.Errorf("testnet: %s already serves tcp port %d", b.Name, port)
	}
	s := &tcpServer{port: port, feed: newChanListener(netip.AddrPortFrom(b.Addr, uint16(port)))}
	s.srv = &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b.requests.Add(1)
			w.Header().Set("Content-Type", "text/plain")
			io.WriteString(w, b.Name+"\n")
		}),
		ReadHeaderTimeout: 30 * time.Second,
		ErrorLog:          nullLogger(),
	}
	if b.Mode() != Refuse {
		if err := b.listenTCP(s); err != nil {
			return err
		}
	}
	b.tcp[port] = s
	go s.srv.Serve(s.feed)
	if b.Mode() == Blackhole {
		return b.applyNft()
	}
	return nil
}

// ServeUDPEcho starts a UDP server on [::]:port (IPv4 and IPv6) in the
// backend namespace that answers each datagram with the backend name, a
// newline, and the datagram itself ("b1\n" + payload). It follows the
// backend's mode.
func (b *Backend) ServeUDPEcho(port int) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errClosed
	}
	if _, ok := b.udp[port]; ok {
		return fmt.Errorf("testnet: %s already serves udp port %d", b.Name, port)
	}
	s := &udpServer{port: port}
	if b.Mode() != Refuse {
		if err := b.listenUDP(s); err != nil {
			return err
		}
	}
	b.udp[port] = s
	if b.Mode() == Blackhole {
		return b.applyNft()
	}
	return nil
}

func (b *Backend) listenTCP(s *tcpServer) error {
	ln, err := b.Listen("tcp", fmt.Sprintf(":%d", s.port))
	if err != nil {
		return fmt.Errorf("testnet: %s listen tcp :%d: %w", b.Name, s.port, err)
	}
	s.ln = ln
	s.loopDone = make(chan struct{})
	go b.acceptLoop(s.ln, s.feed, s.loopDone)
	return nil
}

func (b *Backend) listenUDP(s *udpServer) error {
	pc, err := b.ListenPacket("udp", fmt.Sprintf(":%d", s.port))
	if err != nil {
		return fmt.Errorf("testnet: %s listen udp :%d: %w", b.Name, s.port, err)
	}
	s.pc = pc
	s.done = make(chan struct{})
	go b.udpLoop(pc, s.done)
	return nil
}

func (b *Backend) acceptLoop(ln net.Listener, feed *chanListener, done chan struct{}) {
	defer close(done)
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Transient (e.g. EMFILE): back off briefly, stop when closed.
			select {
			case <-time.After(5 * time.Millisecond):
				continue
			case <-b.stopped:
				return
			}
		}
		b.accepted.Add(1)
		switch b.Mode() {
		case ResetAfterHandshake:
			b.resets.Add(1) // before the RST goes out, so a client never sees it first
			if tc, ok := c.(*net.TCPConn); ok {
				tc.SetLinger(0)
			}
			c.Close()
		case Hold:
			b.heldMu.Lock()
			if b.heldClosed {
				c.Close()
			} else {
				b.held = append(b.held, c)
			}
			b.heldMu.Unlock()
		default:
			feed.push(c)
		}
	}
}

func (b *Backend) udpLoop(pc net.PacketConn, done chan struct{}) {
	defer close(done)
	buf := make([]byte, 64<<10)
	prefix := []byte(b.Name + "\n")
	out := make([]byte, 0, len(prefix)+len(buf))
	for {
		n, addr, err := pc.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue // e.g. ECONNREFUSED from an earlier ICMP error
		}
		b.udpPackets.Add(1)
		if b.Mode() == Hold {
			continue
		}
		out = append(append(out[:0], prefix...), buf[:n]...)
		pc.WriteTo(out, addr)
	}
}

// SetMode switches the backend's behaviour for new connections (see Mode).
func (b *Backend) SetMode(m Mode) error {
	if m < Serve || m > Hold {
		return fmt.Errorf("testnet: unknown mode %d", m)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errClosed
	}
	old := b.Mode()
	if old == m {
		return nil
	}
	var errs []error
	if m == Blackhole {
		// Drop SYNs before anything else changes.
		b.mode.Store(int32(m))
		errs = append(errs, b.applyNft())
	}
	if m == Refuse {
		b.mode.Store(int32(m))
		b.stopListeners()
	} else if old == Refuse {
		for _, p := range sortedKeys(b.tcp) {
			if s := b.tcp[p]; s.ln == nil {
				errs = append(errs, b.listenTCP(s))
			}
		}
		for _, p := range sortedKeys(b.udp) {
			if s := b.udp[p]; s.pc == nil {
				errs = append(errs, b.listenUDP(s))
			}
		}
	}
	b.mode.Store(int32(m))
	if old == Blackhole {
		errs = append(errs, b.removeNft())
	}
	return errors.Join(errs...)
}

// stopListeners closes the listening sockets (mu held). Connections in the
// accept queue are reset by the kernel.
func (b *Backend) stopListeners() {
	for _, s := range b.tcp {
		if s.ln != nil {
			s.ln.Close()
			<-s.loopDone
			s.ln = nil
		}
	}
	for _, s := range b.udp {
		if s.pc != nil {
			s.pc.Close()
			<-s.done
			s.pc = nil
		}
	}
}

func sortedKeys[V any](m map[int]V) []int {
	ks := make([]int, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Ints(ks)
	return ks
}

const nftTable = "pbtest"

// applyNft (re)installs table inet pbtest with drop rules for every served
// port, atomically (mu held).
func (b *Backend) applyNft() error {
	tcpPorts, udpPorts := sortedKeys(b.tcp), sortedKeys(b.udp)
	var sb strings.Builder
	fmt.Fprintf(&sb, "table inet %s\ndelete table inet %s\n", nftTable, nftTable)
	fmt.Fprintf(&sb, "table inet %s {\n\tchain input {\n\t\ttype filter hook input priority 0; policy accept;\n", nftTable)
	if len(tcpPorts) > 0 {
		fmt.Fprintf(&sb, "\t\ttcp dport { %s } tcp flags & (syn | ack) == syn drop\n", joinInts(tcpPorts))
	}
	if len(udpPorts) > 0 {
		fmt.Fprintf(&sb, "\t\tudp dport { %s } drop\n", joinInts(udpPorts))
	}
	sb.WriteString("\t}\n}\n")
	if _, err := runCmd(b.Command("nft", "-f", "-"), []byte(sb.String())); err != nil {
		return fmt.Errorf("testnet: %s blackhole: %w", b.Name, err)
	}
	b.nftOn = true
	return nil
}

func (b *Backend) removeNft() error {
	if !b.nftOn {
		return nil
	}
	script := fmt.Sprintf("table inet %s\ndelete table inet %s\n", nftTable, nftTable)
	if _, err := runCmd(b.Command("nft", "-f", "-"), []byte(script)); err != nil {
		return fmt.Errorf("testnet: %s unblackhole: %w", b.Name, err)
	}
	b.nftOn = false
	return nil
}

const shareTable = "pbtest_share"

// RefuseShare makes the backend refuse a share p of new TCP connections at
// random, whatever its mode: an nftables rule in its namespace (table inet
// pbtest_share, so IPv4 and IPv6 SYNs alike) answers that share of SYNs
// with a RST, as a closed port would, so clients see ECONNREFUSED. The way
// pods usually degrade: some connections fail, most do not. p = 0 removes
// the rule.
func (b *Backend) RefuseShare(p float64) error {
	if !(p >= 0 && p <= 1) {
		return fmt.Errorf("testnet: refuse share %v not within [0, 1]", p)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errClosed
	}
	return b.setShare(p)
}

// setShare installs or removes the refuse-share table (mu held).
func (b *Backend) setShare(p float64) error {
	script := fmt.Sprintf("table inet %s\ndelete table inet %s\n", shareTable, shareTable)
	if p == 0 && !b.share {
		return nil
	}
	ports := sortedKeys(b.tcp)
	if p > 0 && len(ports) == 0 {
		return fmt.Errorf("testnet: %s refuse share: no TCP port served yet (start its servers first)", b.Name)
	}
	if p > 0 {
		// numgen draws per packet; only SYNs reach the rule.
		script += fmt.Sprintf("table inet %s {\n\tchain input {\n\t\ttype filter hook input priority -1; policy accept;\n"+
			"\t\ttcp dport { %s } tcp flags & (syn | ack) == syn numgen random mod 10000 < %d reject with tcp reset\n\t}\n}\n",
			shareTable, joinInts(ports), int(p*10000+0.5))
	}
	if _, err := runCmd(b.Command("nft", "-f", "-"), []byte(script)); err != nil {
		return fmt.Errorf("testnet: %s refuse share: %w", b.Name, err)
	}
	b.share = p > 0
	return nil
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ", ")
}

// ReleaseHeld hands every held connection to the HTTP server, which then
// reads and answers its request. It returns how many were released.
func (b *Backend) ReleaseHeld() int {
	b.mu.Lock()
	var feeds []*chanListener
	for _, p := range sortedKeys(b.tcp) {
		feeds = append(feeds, b.tcp[p].feed)
	}
	b.mu.Unlock()
	b.heldMu.Lock()
	held := b.held
	b.held = nil
	b.heldMu.Unlock()
	for _, c := range held {
		port := c.LocalAddr().(*net.TCPAddr).Port
		fed := false
		for _, f := range feeds {
			if f.port == port {
				f.push(c)
				fed = true
			}
		}
		if !fed {
			c.Close()
		}
	}
	return len(held)
}

// CloseHeld closes every held connection and returns how many it closed.
// A client that already sent its request sees a reset (the kernel answers
// a close with unread data with RST); one that sent nothing sees EOF.
func (b *Backend) CloseHeld() int {
	b.heldMu.Lock()
	held := b.held
	b.held = nil
	b.heldMu.Unlock()
	for _, c := range held {
		c.Close()
	}
	return len(held)
}

// Close stops every server of the backend, closes held connections and
// removes the blackhole rules. Topology.Close calls it.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	close(b.stopped)
	b.stopListeners()
	for _, s := range b.tcp {
		s.feed.Close()
		s.srv.Close()
	}
	if b.delay != nil {
		b.delay.close()
		b.delay = nil
	}
	err := errors.Join(b.removeNft(), b.setShare(0))
	b.mu.Unlock()
	b.heldMu.Lock()
	held := b.held
	b.held = nil
	b.heldClosed = true
	b.heldMu.Unlock()
	for _, c := range held {
		c.Close()
	}
	return err
}

// chanListener is a net.Listener fed by the accept loop.
type chanListener struct {
	port   int
	addr   net.Addr
	ch     chan net.Conn
	done   chan struct{}
	closer sync.Once
}

func newChanListener(ap netip.AddrPort) *chanListener {
	return &chanListener{
		port: int(ap.Port()),
		addr: net.TCPAddrFromAddrPort(ap),
		ch:   make(chan net.Conn),
		done: make(chan struct{}),
	}
}

func (l *chanListener) push(c net.Conn) {
	select {
	case l.ch <- c:
	case <-l.done:
		c.Close()
	}
}

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *chanListener) Close() error {
	l.closer.Do(func() { close(l.done) })
	return nil
}

func (l *chanListener) Addr() net.Addr { return l.addr }

func nullLogger() *log.Logger { return log.New(io.Discard, "", 0) }
