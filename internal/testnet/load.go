// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sort"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// LoadSpec describes an open-loop HTTP load: attempt i is scheduled at
// start + i/Rate by the wall clock, each on a new connection, regardless of
// how earlier attempts are doing (no coordinated omission). An attempt
// whose scheduled time comes while Concurrency attempts are in flight is
// not started and is recorded as NotStarted.
type LoadSpec struct {
	// Target is a literal "ip:port" or "[ipv6]:port", e.g.
	// "198.18.100.1:80" or "[2001:2:0:100::1]:80" (VIP6); it is also the
	// requests' Host header.
	Target string
	Path   string // request path; default "/"

	Rate     float64       // attempts per second (> 0)
	Duration time.Duration // run for this long ...
	Count    int           // ... or this many attempts (whichever is fewer if both are set)

	Concurrency    int           // max attempts in flight; default 1000
	ConnectTimeout time.Duration // default 1s
	RequestTimeout time.Duration // after connecting, until the body is read; default 2s

	// ConnectOnly makes each attempt a bare TCP connect + close (OK =
	// connected; Backend stays empty): L4 outcomes without HTTP.
	ConnectOnly bool
	// Abort ends each attempt with a RST (SO_LINGER 0) instead of a FIN:
	// a close the load balancer does not see complete.
	Abort bool

	// Sources, if set, are the addresses attempts come from, in turn
	// (addresses of the namespace: AddAddrs): many clients, whose flows'
	// tuples are not reused for as long as one address's would be.
	Sources []netip.Addr
}

// Result is the outcome of one attempt.
type Result struct {
	Seq       int           // attempt number, 0-based
	Scheduled time.Time     // wall-clock time the attempt was due
	Started   time.Time     // when it actually started (zero if NotStarted)
	Latency   time.Duration // from Started to the outcome
	Connect   time.Duration // from Started to the connection's handshake (zero if it never connected)
	Backend   string        // responding backend (body, trimmed) if OK
	Class     Class
	Err       error

	// SYNRetransmits: how often the client sent its SYN again before the
	// handshake (TCP_INFO's total retransmissions, read once connected:
	// no data is sent before). One on the retransmission timer is a second
	// or more of waiting; one after an answer that acknowledged another
	// connection (a TIME_WAIT socket's ACK) goes two jiffies later (at
	// most once).
	SYNRetransmits int
}

// End is when the attempt's outcome was known (Scheduled if NotStarted).
func (r Result) End() time.Time {
	if r.Started.IsZero() {
		return r.Scheduled
	}
	return r.Started.Add(r.Latency)
}

// Load runs spec from inside ns and returns one Result per scheduled
// attempt, in schedule order. It returns after every started attempt has
// finished (each is bounded by its timeouts). If ctx ends first, it stops
// scheduling and returns the attempts so far with ctx's error.
func Load(ctx context.Context, ns *NS, spec LoadSpec) (Results, error) {
	if spec.Rate <= 0 {
		return nil, errors.New("testnet: LoadSpec.Rate must be > 0")
	}
	target, err := netip.ParseAddrPort(spec.Target)
	if err != nil {
		return nil, fmt.Errorf("testnet: LoadSpec.Target (want ip:port or [ipv6]:port): %w", err)
	}
	n := spec.Count
	if spec.Duration > 0 {
		byDur := int(spec.Duration.Seconds() * spec.Rate)
		if n == 0 || byDur < n {
			n = byDur
		}
	}
	if n <= 0 {
		return nil, errors.New("testnet: LoadSpec needs Count or Duration (and enough Rate for one attempt)")
	}
	if spec.Concurrency <= 0 {
		spec.Concurrency = 1000
	}
	if spec.ConnectTimeout <= 0 {
		spec.ConnectTimeout = time.Second
	}
	if spec.RequestTimeout <= 0 {
		spec.RequestTimeout = 2 * time.Second
	}
	if spec.Path == "" {
		spec.Path = "/"
	}
	// AddrPort.String brackets an IPv6 address, as a Host header needs.
	req := []byte("GET " + spec.Path + " HTTP/1.1\r\nHost: " + target.String() +
		"\r\nUser-Agent: penaltybox-testnet\r\nConnection: close\r\n\r\n")
	dialers := []*Dialer{ns.Dialer(spec.ConnectTimeout)}
	if len(spec.Sources) > 0 {
		dialers = dialers[:0]
		for _, a := range spec.Sources {
			dialers = append(dialers, &Dialer{NS: ns, Timeout: spec.ConnectTimeout, LocalAddr: netip.AddrPortFrom(a, 0),
				// The port chosen at connect, by the whole tuple, as for
				// an unbound socket: bind's own search for a port free
				// on the address slowed the client below its rate.
				Control: func(fd int) error {
					return unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_BIND_ADDRESS_NO_PORT, 1)
				}})
		}
	}

	results := make(Results, n)
	sem := make(chan struct{}, spec.Concurrency)
	var wg sync.WaitGroup
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	start := time.Now()
	interval := float64(time.Second) / spec.Rate
	scheduled := 0
loop:
	for i := 0; i < n; i++ {
		due := start.Add(time.Duration(float64(i) * interval))
		if wait := time.Until(due); wait > 0 {
			timer.Reset(wait)
			select {
			case <-timer.C:
			case <-ctx.Done():
				break loop
			}
		} else if ctx.Err() != nil {
			break
		}
		scheduled = i + 1
		select {
		case sem <- struct{}{}:
		default:
			results[i] = Result{Seq: i, Scheduled: due, Class: NotStarted}
			continue
		}
		wg.Add(1)
		go func(i int, due time.Time) {
			defer wg.Done()
			defer func() { <-sem }()
			results[i] = attempt(ctx, dialers[i%len(dialers)], spec, req)
			results[i].Seq = i
			results[i].Scheduled = due
		}(i, due)
	}
	wg.Wait()
	if scheduled < n {
		return results[:scheduled], ctx.Err()
	}
	return results, nil
}

func attempt(ctx context.Context, d *Dialer, spec LoadSpec, req []byte) Result {
	r := Result{Started: time.Now()}
	finish := func(err error) Result {
		r.Latency = time.Since(r.Started)
		r.Err = err
		r.Class = Classify(err)
		return r
	}
	c, err := d.DialContext(ctx, "tcp", spec.Target)
	if err != nil {
		return finish(err)
	}
	defer c.Close()
	if spec.Abort {
		tc, ok := c.(*net.TCPConn)
		if !ok {
			return finish(fmt.Errorf("testnet: Abort: a %T is no TCP connection", c))
		}
		if err := tc.SetLinger(0); err != nil {
			return finish(fmt.Errorf("testnet: Abort: %w", err))
		}
	}
	r.Connect = time.Since(r.Started)
	r.SYNRetransmits = SYNRetransmits(c)
	if spec.ConnectOnly {
		return finish(nil)
	}
	dl := time.Now().Add(spec.RequestTimeout)
	if cdl, ok := ctx.Deadline(); ok && cdl.Before(dl) {
		dl = cdl
	}
	c.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(aLongTimeAgo) })
	defer stop()
	if _, err := c.Write(req); err != nil {
		return finish(err)
	}
	resp, err := http.ReadResponse(bufio.NewReaderSize(c, 1024), nil)
	if err != nil {
		return finish(err)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	if err != nil {
		return finish(err)
	}
	if resp.StatusCode != http.StatusOK {
		return finish(fmt.Errorf("testnet: HTTP %s", resp.Status))
	}
	r.Backend = BackendOf(string(body))
	return finish(nil)
}

// SYNRetransmits is how many times a just-connected TCP socket
// retransmitted (its SYN: nothing else was sent yet); -1 if unknown.
func SYNRetransmits(c net.Conn) int {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return -1
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return -1
	}
	n := -1
	raw.Control(func(fd uintptr) {
		if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			n = int(info.Total_retrans)
		}
	})
	return n
}

// Results are the attempts of one Load run, in schedule order.
type Results []Result

// Count returns how many results have class c.
func (rs Results) Count(c Class) int {
	n := 0
	for _, r := range rs {
		if r.Class == c {
			n++
		}
	}
	return n
}

// Counts returns the number of results per class (classes with none are
// omitted).
func (rs Results) Counts() map[Class]int {
	m := map[Class]int{}
	for _, r := range rs {
		m[r.Class]++
	}
	return m
}

// Failures counts started attempts that failed.
func (rs Results) Failures() int {
	n := 0
	for _, r := range rs {
		if r.Class.Failed() {
			n++
		}
	}
	return n
}

// ByBackend counts successful attempts per responding backend.
func (rs Results) ByBackend() map[string]int {
	m := map[string]int{}
	for _, r := range rs {
		if r.Class == OK {
			m[r.Backend]++
		}
	}
	return m
}

// SuccessRate is OK / all results (NotStarted included); 0 if empty.
func (rs Results) SuccessRate() float64 {
	if len(rs) == 0 {
		return 0
	}
	return float64(rs.Count(OK)) / float64(len(rs))
}

// Since returns the results scheduled at or after t.
func (rs Results) Since(t time.Time) Results {
	var out Results
	for _, r := range rs {
		if !r.Scheduled.Before(t) {
			out = append(out, r)
		}
	}
	return out
}

// AfterFailures returns the results that started after the n-th failure's
// outcome was known (failures ordered by End), i.e. the traffic an
// ejecting load balancer should have protected; ok is false if there were
// fewer than n failures. n <= 0 returns all results.
func (rs Results) AfterFailures(n int) (out Results, ok bool) {
	if n <= 0 {
		return rs, true
	}
	var ends []time.Time
	for _, r := range rs {
		if r.Class.Failed() {
			ends = append(ends, r.End())
		}
	}
	if len(ends) < n {
		return nil, false
	}
	sort.Slice(ends, func(i, j int) bool { return ends[i].Before(ends[j]) })
	return rs.startedAfter(ends[n-1]), true
}

func (rs Results) startedAfter(t time.Time) Results {
	var out Results
	for _, r := range rs {
		s := r.Started
		if s.IsZero() {
			s = r.Scheduled
		}
		if s.After(t) {
			out = append(out, r)
		}
	}
	return out
}

// Bucket aggregates the results scheduled in [Start, Start+Width) relative
// to the first result's scheduled time.
type Bucket struct {
	Start     time.Duration
	Width     time.Duration
	Total     int
	Counts    map[Class]int
	ByBackend map[string]int // OK results only
}

// SuccessRate is OK / Total; 0 if the bucket is empty.
func (b Bucket) SuccessRate() float64 {
	if b.Total == 0 {
		return 0
	}
	return float64(b.Counts[OK]) / float64(b.Total)
}

// Buckets groups the results by scheduled time into buckets of width w
// (e.g. time.Second for per-second success rates). Empty buckets between
// non-empty ones are included.
func (rs Results) Buckets(w time.Duration) []Bucket {
	if len(rs) == 0 || w <= 0 {
		return nil
	}
	t0 := rs[0].Scheduled
	for _, r := range rs {
		if r.Scheduled.Before(t0) {
			t0 = r.Scheduled
		}
	}
	var out []Bucket
	for _, r := range rs {
		i := int(r.Scheduled.Sub(t0) / w)
		for len(out) <= i {
			out = append(out, Bucket{Start: time.Duration(len(out)) * w, Width: w,
				Counts: map[Class]int{}, ByBackend: map[string]int{}})
		}
		b := &out[i]
		b.Total++
		b.Counts[r.Class]++
		if r.Class == OK {
			b.ByBackend[r.Backend]++
		}
	}
	return out
}

// String summarises the results, e.g. "120 attempts: ok=100 refused=20".
func (rs Results) String() string {
	s := fmt.Sprintf("%d attempts:", len(rs))
	counts := rs.Counts()
	for _, c := range Classes {
		if counts[c] > 0 {
			s += fmt.Sprintf(" %s=%d", c, counts[c])
		}
	}
	if bb := rs.ByBackend(); len(bb) > 0 {
		names := make([]string, 0, len(bb))
		for k := range bb {
			names = append(names, k)
		}
		sort.Strings(names)
		s += " |"
		for _, k := range names {
			s += fmt.Sprintf(" %s=%d", k, bb[k])
		}
	}
	return s
}
