// Package admin is the agent's HTTP surface: Prometheus metrics, health
// and readiness probes, and JSON views of what the agent programmed, for
// people and scrapers alike.
package admin

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Server serves /metrics, /healthz, /readyz and the /admin/ JSON views.
type Server struct {
	mux *http.ServeMux
	log *slog.Logger
}

// New builds the server. ready returns nil once the datapath is attached
// and the maps are programmed.
func New(reg *prometheus.Registry, ready func() error, log *slog.Logger) *Server {
	s := &Server{mux: http.NewServeMux(), log: log}
	s.mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte("ok\n"))
	})
	s.mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := ready(); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok\n"))
	})
	return s
}

// JSON serves view() at path, indented so curl output reads well.
func (s *Server) JSON(path string, view func() any) {
	s.mux.HandleFunc("GET "+path, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if err := enc.Encode(view()); err != nil {
			s.log.Warn("admin: encode", "path", path, "err", err)
		}
	})
}

// Handler returns the server's handler (for tests).
func (s *Server) Handler() http.Handler { return s.mux }

// Serve listens on addr until ctx ends. The listener is opened before
// Serve returns an error, so a bad address fails the agent's start.
func (s *Server) Serve(ctx context.Context, addr string) (net.Addr, <-chan error, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, err
	}
	srv := &http.Server{Handler: s.mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan error, 1)
	go func() {
		err := srv.Serve(ln)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		done <- err
	}()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	return ln.Addr(), done, nil
}
