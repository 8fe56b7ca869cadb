// SPDX-License-Identifier: Apache-2.0

// Package admin is the agent's HTTP surface: Prometheus metrics, health
// and readiness probes, and JSON views of what the agent programmed, for
// people and scrapers alike.
//
// Two listeners: the metrics one (/metrics, /healthz, /readyz) for
// Prometheus and the kubelet, and the admin one (/admin/*) for people,
// which the DaemonSet keeps on the node's loopback. Both are read-only and
// unauthenticated, with every timeout set, so a slow or hostile client
// costs a connection and a goroutine for a bounded time and nothing more.
package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Timeouts bound what one connection may take of either server.
type Timeouts struct {
	// ReadHeader and Read: the request's headers, and the whole request.
	ReadHeader, Read time.Duration
	// Write: from the end of the request's headers to the end of the
	// response; a client that stops reading is cut off after it.
	Write time.Duration
	// Idle: a keep-alive connection between requests.
	Idle time.Duration
	// MaxHeaderBytes bounds a request's headers (http.Server's default is
	// 1 MiB, far more than a GET of these paths needs).
	MaxHeaderBytes int
}

// DefaultTimeouts: a scrape (Prometheus' timeout is 10s by default) and
// the largest view (every service of a big node, a few MB) are written
// well within Write; nothing here reads a body.
func DefaultTimeouts() Timeouts {
	return Timeouts{ReadHeader: 5 * time.Second, Read: 10 * time.Second, Write: 30 * time.Second,
		Idle: 60 * time.Second, MaxHeaderBytes: 16 << 10}
}

// Server serves /metrics, /healthz and /readyz on one listener and the
// /admin/ JSON views on another.
type Server struct {
	metrics *http.ServeMux
	admin   *http.ServeMux
	log     *slog.Logger
	// Timeouts apply to both listeners (set before Serve).
	Timeouts Timeouts
}

// New builds the server. ready returns nil once the datapath is attached
// and the maps are programmed.
func New(reg *prometheus.Registry, ready func() error, log *slog.Logger) *Server {
	s := &Server{metrics: http.NewServeMux(), admin: http.NewServeMux(), log: log, Timeouts: DefaultTimeouts()}
	s.metrics.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	s.metrics.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte("ok\n"))
	})
	s.metrics.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := ready(); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok\n"))
	})
	return s
}

// JSON serves view() at path on the admin listener, indented so curl
// output reads well. view takes whatever lock it needs and returns a
// snapshot that shares nothing it will change; the document is encoded
// and written after it returns, so a slow or stalled client never holds
// the agent's lock, only its own connection, until the write timeout.
func (s *Server) JSON(path string, view func() any) {
	s.admin.HandleFunc("GET "+path, func(w http.ResponseWriter, _ *http.Request) {
		var b bytes.Buffer
		enc := json.NewEncoder(&b)
		enc.SetIndent("", "  ")
		if err := enc.Encode(view()); err != nil {
			s.log.Warn("admin: encode", "path", path, "err", err)
			http.Error(w, "encoding the view failed", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		if _, err := w.Write(b.Bytes()); err != nil {
			s.log.Debug("admin: write", "path", path, "err", err)
		}
	})
}

// MetricsHandler serves /metrics, /healthz and /readyz.
func (s *Server) MetricsHandler() http.Handler { return s.metrics }

// AdminHandler serves the /admin/ views.
func (s *Server) AdminHandler() http.Handler { return s.admin }

// Addrs are where Serve listens; Admin is nil when it serves no views.
type Addrs struct {
	Metrics, Admin net.Addr
}

// Serve listens on metricsAddr and adminAddr ("" serves no /admin views)
// until ctx ends. Both listeners are opened before Serve returns, so a bad
// address fails the agent's start, the error naming its flag. done yields
// once both servers have stopped: the first error, or nil.
func (s *Server) Serve(ctx context.Context, metricsAddr, adminAddr string) (Addrs, <-chan error, error) {
	var addrs Addrs
	mln, err := net.Listen("tcp", metricsAddr)
	if err != nil {
		return addrs, nil, fmt.Errorf("--metrics-addr %s: %w", metricsAddr, err)
	}
	addrs.Metrics = mln.Addr()
	lns := []net.Listener{mln}
	handlers := []http.Handler{s.metrics}
	if adminAddr != "" {
		aln, err := net.Listen("tcp", adminAddr)
		if err != nil {
			mln.Close()
			return Addrs{}, nil, fmt.Errorf("--admin-addr %s: %w", adminAddr, err)
		}
		addrs.Admin = aln.Addr()
		lns = append(lns, aln)
		handlers = append(handlers, s.admin)
	}
	errs := make(chan error, len(lns))
	for i, ln := range lns {
		srv := s.server(handlers[i])
		go func() {
			err := srv.Serve(ln)
			if errors.Is(err, http.ErrServerClosed) {
				err = nil
			}
			errs <- err
		}()
		go func() {
			<-ctx.Done()
			sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			if srv.Shutdown(sctx) != nil {
				srv.Close() // a stalled client does not hold the stop up
			}
		}()
	}
	done := make(chan error, 1)
	go func() {
		var first error
		for range lns {
			if err := <-errs; err != nil && first == nil {
				first = err
			}
		}
		done <- first
	}()
	return addrs, done, nil
}

func (s *Server) server(h http.Handler) *http.Server {
	t := s.Timeouts
	return &http.Server{Handler: h, ReadHeaderTimeout: t.ReadHeader, ReadTimeout: t.Read,
		WriteTimeout: t.Write, IdleTimeout: t.Idle, MaxHeaderBytes: t.MaxHeaderBytes,
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug)}
}
