// Command client is the cluster test's load generator. It opens --rate new
// TCP connections per second to --target, evenly spaced, and reads each to
// EOF. Every second, on the wall-clock second boundary, it prints one JSON
// line to stdout for the attempts that completed in that second:
//
//	{"t":"2006-01-02T15:04:05Z","ok":N,"refused":N,"reset":N,"timeout":N,
//	 "other":N,"skipped":N,"backends":{"<pod>":N}}
//
// t is the end of the second, in UTC; backends counts the "ok" replies by pod
// name. New connections, not one long-lived one, because the load balancer
// picks a backend per connection: that is what the test measures. On SIGTERM
// (or after --duration) it stops starting attempts, waits for those in flight
// (each ends within --timeout), prints the last partial second and exits 0.
// Nothing else goes to stdout.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/penaltybox/penaltybox/internal/clientlog"
)

// classify names the outcome of one attempt: err is the first error of the
// dial or the read, reply what was read before it.
func classify(err error, reply string) string {
	var ne net.Error
	switch {
	case err == nil && reply != "":
		return "ok"
	case err == nil:
		return "other" // a clean EOF with no reply: not what any mode sends
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, syscall.ECONNRESET):
		return "reset"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	}
	return "other"
}

// attempt opens one connection and reads it to EOF, all within timeout.
func attempt(target string, timeout time.Duration) (reply string, err error) {
	deadline := time.Now().Add(timeout)
	c, err := (&net.Dialer{Deadline: deadline}).Dial("tcp", target)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(deadline)
	b, err := io.ReadAll(io.LimitReader(c, 4096))
	return string(b), err
}

// counts is the current second, shared by the attempts and the reporter.
type counts struct {
	mu  sync.Mutex
	cur clientlog.Second
}

func (c *counts) add(err error, reply string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch classify(err, reply) {
	case "ok":
		c.cur.OK++
		pod, _, _ := strings.Cut(reply, "\n")
		c.cur.Backends[strings.TrimSpace(pod)]++
	case "refused":
		c.cur.Refused++
	case "reset":
		c.cur.Reset++
	case "timeout":
		c.cur.Timeout++
	default:
		c.cur.Other++
	}
}

func (c *counts) streamEnded(cut bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if cut {
		c.cur.StreamsCut++
	} else {
		c.cur.StreamsOK++
	}
}

// streams starts a stream from target every every, each read to its end:
// the server's length over every streams are open at once. A stream that
// ends in an error, or without the server's last line, is cut.
func streams(ctx context.Context, target string, every time.Duration, c *counts) {
	var wg sync.WaitGroup
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return
		case <-tick.C:
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := (&net.Dialer{Timeout: 2 * time.Second}).Dial("tcp", target)
			if err != nil {
				c.streamEnded(true)
				return
			}
			defer conn.Close()
			var tail []byte
			buf := make([]byte, 4096)
			for {
				conn.SetReadDeadline(time.Now().Add(5 * time.Second))
				k, err := conn.Read(buf)
				tail = append(tail, buf[:k]...)
				tail = tail[max(0, len(tail)-len(clientlog.StreamEnd)):]
				if err == io.EOF {
					c.streamEnded(string(tail) != clientlog.StreamEnd)
					return
				}
				if err != nil {
					c.streamEnded(true)
					return
				}
			}
		}()
	}
}

func (c *counts) skip() {
	c.mu.Lock()
	c.cur.Skipped++
	c.mu.Unlock()
}

// flush prints the current second as ending at end, and starts a new one.
func (c *counts) flush(end time.Time) {
	c.mu.Lock()
	s := c.cur
	c.cur = clientlog.Second{Backends: map[string]int{}}
	c.mu.Unlock()
	s.T = end.UTC()
	line, _ := json.Marshal(s)
	os.Stdout.Write(append(line, '\n'))
}

// generate starts one attempt per tick until ctx ends, then waits for the
// attempts in flight.
func generate(ctx context.Context, target string, rate int, timeout time.Duration, c *counts) {
	// Attempts end within timeout, so about rate*timeout are in flight; the
	// cap only bites if something (e.g. the scheduler) stalls them, and then
	// dropping attempts, counted as skipped, beats piling up goroutines.
	slots := make(chan struct{}, int(float64(rate)*timeout.Seconds()*2)+10)
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return
		case <-tick.C:
		}
		select {
		case slots <- struct{}{}:
		default:
			c.skip()
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			reply, err := attempt(target, timeout)
			c.add(err, reply)
			<-slots
		}()
	}
}

func main() {
	target := flag.String("target", "", "host:port to connect to (required)")
	rate := flag.Int("rate", 50, "new connections per second")
	timeout := flag.Duration("timeout", time.Second, "per-connection dial+read timeout")
	duration := flag.Duration("duration", 0, "how long to run (0: until SIGTERM)")
	streamTarget := flag.String("stream-target", "", "host:port of streams (the server's --stream-port) to keep open (none: no streams)")
	streamEvery := flag.Duration("stream-every", 2*time.Second, "start a stream this often")
	flag.Parse()
	if *target == "" || *rate < 1 || *rate > 100000 || *timeout <= 0 {
		fmt.Fprintln(os.Stderr, "client: need --target host:port, 1 <= --rate <= 100000 and --timeout > 0")
		os.Exit(2)
	}

	// SIGTERM (the kubelet stopping the pod) ends the run cleanly: the
	// attempts in flight finish and the last second is printed.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if *duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *duration)
		defer cancel()
	}

	c := &counts{cur: clientlog.Second{Backends: map[string]int{}}}
	done := make(chan struct{})
	go func() {
		var wg sync.WaitGroup
		if *streamTarget != "" {
			wg.Go(func() { streams(ctx, *streamTarget, *streamEvery, c) })
		}
		generate(ctx, *target, *rate, *timeout, c)
		wg.Wait()
		close(done)
	}()

	// Lines are printed from this goroutine only, so they never interleave.
	for {
		end := time.Now().Truncate(time.Second).Add(time.Second)
		timer := time.NewTimer(time.Until(end))
		select {
		case <-timer.C:
			c.flush(end)
		case <-done:
			timer.Stop()
			c.flush(end) // the last, partial second
			return
		}
	}
}
