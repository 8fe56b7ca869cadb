// SPDX-License-Identifier: Apache-2.0

package admin

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func newServer(t *testing.T) *Server {
	t.Helper()
	s := New(prometheus.NewRegistry(), func() error { return nil }, slog.New(slog.NewTextHandler(io.Discard, nil)))
	s.JSON("/admin/services", func() any { return map[string]string{"ok": "yes"} })
	return s
}

// serve runs s on two loopback listeners until the test ends.
func serve(t *testing.T, s *Server) (metrics, admin string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addrs, done, err := s.Serve(ctx, "127.0.0.1:0", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return addrs.Metrics.String(), addrs.Admin.String()
}

func get(t *testing.T, addr, path string) int {
	t.Helper()
	resp, err := http.Get("http://" + addr + path)
	if err != nil {
		t.Fatalf("GET %s%s: %v", addr, path, err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// Metrics and probes on one listener, the /admin views on the other: the
// admin address can stay on loopback while Prometheus and the kubelet
// reach the metrics one.
func TestListenersAreSplit(t *testing.T) {
	m, a := serve(t, newServer(t))
	for _, c := range []struct {
		addr, path string
		want       int
	}{
		{m, "/metrics", 200}, {m, "/healthz", 200}, {m, "/readyz", 200}, {m, "/admin/services", 404},
		{a, "/admin/services", 200}, {a, "/metrics", 404}, {a, "/healthz", 404},
	} {
		if got := get(t, c.addr, c.path); got != c.want {
			t.Errorf("GET %s on the %s listener: %d, want %d", c.path, map[string]string{m: "metrics", a: "admin"}[c.addr], got, c.want)
		}
	}
}

// No admin address: no admin listener, and the views are nowhere.
func TestNoAdminListener(t *testing.T) {
	s := newServer(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	addrs, done, err := s.Serve(ctx, "127.0.0.1:0", "")
	if err != nil {
		t.Fatal(err)
	}
	if addrs.Admin != nil {
		t.Fatalf("admin listener %v with no address", addrs.Admin)
	}
	if got := get(t, addrs.Metrics.String(), "/admin/services"); got != 404 {
		t.Fatalf("/admin/services on the metrics listener: %d", got)
	}
	cancel()
	<-done
}

// A bad address fails the start, naming which.
func TestServeBadAddress(t *testing.T) {
	s := newServer(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m, _, err := s.Serve(ctx, "127.0.0.1:0", "127.0.0.1:99999")
	if err == nil || !strings.Contains(err.Error(), "--admin-addr 127.0.0.1:99999") {
		t.Fatalf("err %v, want one naming --admin-addr", err)
	}
	if m.Metrics != nil {
		// The metrics listener opened first must be closed again.
		if c, err := net.Dial("tcp", m.Metrics.String()); err == nil {
			c.Close()
			t.Fatal("the metrics listener stayed open after the admin one failed")
		}
	}
}

func shortTimeouts() Timeouts {
	return Timeouts{ReadHeader: 200 * time.Millisecond, Read: 300 * time.Millisecond, Write: 300 * time.Millisecond,
		Idle: 300 * time.Millisecond, MaxHeaderBytes: 4 << 10}
}

// A client that sends half a request and waits is cut off.
func TestReadTimeout(t *testing.T) {
	s := newServer(t)
	s.Timeouts = shortTimeouts()
	_, a := serve(t, s)
	c, err := net.Dial("tcp", a)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprint(c, "GET /admin/services HTTP/1.1\r\nHost: x\r\n") // no end of headers
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	if _, err := io.ReadAll(c); err != nil {
		t.Fatalf("connection not closed by the server: %v", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("closed after %v", d)
	}
}

// An idle keep-alive connection is closed.
func TestIdleTimeout(t *testing.T) {
	s := newServer(t)
	s.Timeouts = shortTimeouts()
	m, _ := serve(t, s)
	c, err := net.Dial("tcp", m)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprint(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
	r := bufio.NewReader(c)
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := r.ReadByte(); err != io.EOF {
		t.Fatalf("idle connection: %v, want closed by the server", err)
	}
}

// Headers past the limit are refused.
func TestHeaderLimit(t *testing.T) {
	s := newServer(t)
	s.Timeouts = shortTimeouts()
	m, _ := serve(t, s)
	req, _ := http.NewRequest(http.MethodGet, "http://"+m+"/healthz", nil)
	req.Header.Set("X-Big", strings.Repeat("x", 64<<10))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("64 KiB header: %d, want 431", resp.StatusCode)
	}
}

// The defaults are set on both servers: no timeout is left at zero
// (unbounded) and headers are limited.
func TestDefaultTimeouts(t *testing.T) {
	d := DefaultTimeouts()
	if d.ReadHeader <= 0 || d.Read <= 0 || d.Write <= 0 || d.Idle <= 0 || d.MaxHeaderBytes <= 0 || d.MaxHeaderBytes > 64<<10 {
		t.Fatalf("default timeouts %+v", d)
	}
	if s := newServer(t); s.Timeouts != d {
		t.Fatalf("a new server's timeouts %+v, want the defaults", s.Timeouts)
	}
}

// A client that asks for a view and never reads it holds nothing but its
// own connection: the view is built under the caller's lock and written
// after it is released, and the write times out.
func TestStalledClientHoldsNoLock(t *testing.T) {
	var mu sync.Mutex // the agent's
	big := strings.Repeat("x", 8<<20)
	logged := &logTap{msgs: make(chan string, 16)}
	s := New(prometheus.NewRegistry(), func() error { return nil }, slog.New(logged))
	s.Timeouts = shortTimeouts()
	built := make(chan struct{}, 1)
	s.JSON("/admin/big", func() any {
		mu.Lock()
		defer mu.Unlock()
		built <- struct{}{}
		return []string{big}
	})
	_, a := serve(t, s)
	c, err := net.Dial("tcp", a)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprint(c, "GET /admin/big HTTP/1.1\r\nHost: x\r\n\r\n") // and never read
	<-built
	locked := make(chan struct{})
	go func() {
		mu.Lock()
		mu.Unlock()
		close(locked)
	}()
	select {
	case <-locked:
	case <-time.After(2 * time.Second):
		t.Fatal("a client that does not read holds the lock")
	}
	// The server gives up on the write: reading now finds the response cut
	// short, not 8 MiB.
	for waiting := true; waiting; {
		select {
		case m := <-logged.msgs:
			waiting = m != "admin: write"
		case <-time.After(5 * time.Second):
			t.Fatal("the write to a client that does not read never timed out")
		}
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, _ := io.Copy(io.Discard, c)
	if n >= int64(len(big)) {
		t.Fatalf("read %d bytes after the write timeout: the server kept writing", n)
	}
}

// logTap hands over every log message.
type logTap struct{ msgs chan string }

func (l *logTap) Enabled(context.Context, slog.Level) bool { return true }
func (l *logTap) Handle(_ context.Context, r slog.Record) error {
	select {
	case l.msgs <- r.Message:
	default:
	}
	return nil
}
func (l *logTap) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logTap) WithGroup(string) slog.Handler      { return l }
