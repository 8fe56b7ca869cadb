// Command server is the cluster test's backend pod. On its service port it
// answers each TCP connection with its pod name, or fails it on purpose, and
// an HTTP control port lets the test switch how:
//
//	serve   accept, write "POD_NAME\n", close
//	refuse  no listener at all, so the kernel answers SYNs with RST
//	reset   accept, then close with SO_LINGER 0, so the client gets a RST
//	        after the handshake
//
// The control port is always up, so the readiness probe keeps the pod Ready
// (and in the Service's endpoints) while its service port fails: the test is
// about the load balancer noticing failures that Kubernetes does not.
//
//	GET  /healthz               200 "ok"
//	GET  /stats                 {"pod":..,"mode":..,"accepted":N}
//	POST /mode?m=serve|refuse|reset   switch at once, reply with the stats
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/penaltybox/penaltybox/internal/clientlog"
)

const (
	modeServe  = "serve"
	modeRefuse = "refuse"
	modeReset  = "reset"
)

func validMode(m string) bool { return m == modeServe || m == modeRefuse || m == modeReset }

type server struct {
	pod      string
	addr     string       // service address, ":port" (IPv4 and IPv6)
	accepted atomic.Int64 // connections accepted on the service port

	mu   sync.Mutex // guards mode and ln: mode changes come from concurrent HTTP requests
	mode string
	ln   net.Listener // nil in refuse mode
}

type stats struct {
	Pod      string `json:"pod"`
	Mode     string `json:"mode"`
	Accepted int64  `json:"accepted"`
}

func (s *server) stats() stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return stats{Pod: s.pod, Mode: s.mode, Accepted: s.accepted.Load()}
}

// setMode switches to mode m, opening or closing the service listener as
// needed. Go sets SO_REUSEADDR on listeners, so re-listening right after a
// close works even with connections in TIME_WAIT.
func (s *server) setMode(m string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if m == modeRefuse && s.ln != nil {
		s.ln.Close() // also resets connections still in the accept queue
		s.ln = nil
	}
	if m != modeRefuse && s.ln == nil {
		ln, err := net.Listen("tcp", s.addr)
		if err != nil {
			return err
		}
		s.ln = ln
		go s.acceptLoop(ln)
	}
	if m != s.mode {
		slog.Info("mode", "pod", s.pod, "from", s.mode, "to", m)
	}
	s.mode = m
	return nil
}

func (s *server) currentMode() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mode
}

// acceptLoop serves one listener until setMode closes it.
func (s *server) acceptLoop(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			// e.g. EMFILE: back off instead of spinning.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		s.accepted.Add(1)
		go s.handle(c.(*net.TCPConn), s.currentMode())
	}
}

func (s *server) handle(c *net.TCPConn, mode string) {
	if mode == modeReset {
		c.SetLinger(0) // close sends RST instead of FIN
		c.Close()
		return
	}
	// The client sends nothing, so closing right after the write is a clean
	// FIN. The deadline bounds a client that never reads.
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	c.Write([]byte(s.pod + "\n"))
	c.Close()
}

// stream serves one long connection: a line every 100 ms for d, then
// "end" and a clean close: a download that takes d, which a load balancer
// must not cut. The last line tells a whole download from one whose server
// went away (its exit closes the socket cleanly too).
func stream(c net.Conn, pod string, d time.Duration) {
	defer c.Close()
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		c.SetWriteDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte(pod + "\n")); err != nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	c.Write([]byte(clientlog.StreamEnd))
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}

func (s *server) routes() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "ok")
	})
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, s.stats())
	})
	mux.HandleFunc("POST /mode", func(w http.ResponseWriter, r *http.Request) {
		m := r.URL.Query().Get("m")
		if !validMode(m) {
			http.Error(w, fmt.Sprintf("bad mode %q: want m=serve, m=refuse or m=reset", m), http.StatusBadRequest)
			return
		}
		if err := s.setMode(m); err != nil {
			http.Error(w, "switching to "+m+": "+err.Error(), http.StatusInternalServerError)
			return
		}
		writeJSON(w, s.stats())
	})
	return mux
}

func main() {
	port := flag.Int("port", 8080, "service port")
	controlPort := flag.Int("control-port", 8081, "HTTP control port (healthz, stats, mode)")
	mode := flag.String("mode", modeServe, "initial mode: serve, refuse or reset")
	streamPort := flag.Int("stream-port", 0, "a port whose connections each get a line every 100 ms for --stream-for, then a clean close (0: none)")
	streamFor := flag.Duration("stream-for", 8*time.Second, "how long each stream lasts")
	drain := flag.Duration("drain", 0, "told to stop, keep serving this long first (the time kube-proxy takes to drop the endpoint), then exit")
	flag.Parse()
	if !validMode(*mode) {
		fmt.Fprintf(os.Stderr, "server: bad --mode %q: want serve, refuse or reset\n", *mode)
		os.Exit(2)
	}

	pod := os.Getenv("POD_NAME")
	if pod == "" {
		pod, _ = os.Hostname()
	}
	s := &server{pod: pod, addr: fmt.Sprintf(":%d", *port), mode: "none"}
	if err := s.setMode(*mode); err != nil {
		slog.Error("service port", "err", err)
		os.Exit(1)
	}

	ctl, err := net.Listen("tcp", fmt.Sprintf(":%d", *controlPort))
	if err != nil {
		slog.Error("control port", "err", err)
		os.Exit(1)
	}
	slog.Info("listening", "pod", pod, "port", *port, "control-port", *controlPort)
	if *streamPort != 0 {
		sl, err := net.Listen("tcp", fmt.Sprintf(":%d", *streamPort))
		if err != nil {
			slog.Error("stream port", "err", err)
			os.Exit(1)
		}
		go func() {
			for {
				c, err := sl.Accept()
				if err != nil {
					time.Sleep(10 * time.Millisecond)
					continue
				}
				go stream(c, pod, *streamFor)
			}
		}()
	}

	// Caught so that a stop is a clean exit 0 (Go's own handling of SIGTERM
	// would exit with status 2).
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-sigs
		time.Sleep(*drain)
		os.Exit(0)
	}()

	srv := &http.Server{Handler: s.routes(), ReadHeaderTimeout: 5 * time.Second}
	slog.Error("control port", "err", srv.Serve(ctl))
	os.Exit(1)
}
