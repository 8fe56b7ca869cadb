// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/penaltybox/penaltybox/bench/xdpbase"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

// Part bulk: one TCP stream of a fixed size through a VIP, beside the same
// stream to the backend's own address, in the same rounds (issue 35, part
// 6: the VIP at ≥ 0.95× the direct stream).

type bulkOpts struct {
	Rounds int
	Bytes  int64 // per stream
}

// bulkPort is the bulk server's port on b1, and the VIP's.
const bulkPort = 9000

// The bulk protocol: the client sends one byte (bulkDown: the server
// sends; bulkUp: the client sends) and the size (8 bytes, big endian).
// Down: the server writes size bytes and closes. Up: the client writes
// size bytes and shuts its side; the server answers with the count it
// read (8 bytes) once it has read them all.
const (
	bulkDown = 'd'
	bulkUp   = 'u'
	bulkBuf  = 256 << 10
)

// bulkServer serves the bulk protocol on ln until it is closed.
func bulkServer(ln net.Listener) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		wg.Go(func() {
			defer c.Close()
			c.SetDeadline(time.Now().Add(2 * time.Minute))
			var hdr [9]byte
			if _, err := io.ReadFull(c, hdr[:]); err != nil {
				return
			}
			size := int64(binary.BigEndian.Uint64(hdr[1:]))
			switch hdr[0] {
			case bulkDown:
				writeN(c, size)
			case bulkUp:
				n, _ := io.Copy(io.Discard, c)
				var ack [8]byte
				binary.BigEndian.PutUint64(ack[:], uint64(n))
				c.Write(ack[:])
			}
		})
	}
}

var bulkZeros = make([]byte, bulkBuf)

// writeN writes size zero bytes to w.
func writeN(w io.Writer, size int64) error {
	for size > 0 {
		n := min(size, int64(len(bulkZeros)))
		if _, err := w.Write(bulkZeros[:n]); err != nil {
			return err
		}
		size -= n
	}
	return nil
}

// bulkStream moves size bytes over one new connection from ns to target,
// in direction dir, and returns the throughput in Gbit/s: the bytes over
// the time from the connect to the last byte read (down) or to the
// server's count (up), which says it read them all.
func bulkStream(ns *testnet.NS, target string, dir byte, size int64) (float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	t0 := time.Now()
	c, err := ns.Dialer(5*time.Second).DialContext(ctx, "tcp", target)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Minute))
	var hdr [9]byte
	hdr[0] = dir
	binary.BigEndian.PutUint64(hdr[1:], uint64(size))
	if _, err := c.Write(hdr[:]); err != nil {
		return 0, err
	}
	switch dir {
	case bulkDown:
		buf := make([]byte, bulkBuf)
		var got int64
		for got < size {
			n, err := c.Read(buf)
			got += int64(n)
			if err != nil {
				if errors.Is(err, io.EOF) && got == size {
					break
				}
				return 0, fmt.Errorf("read %d of %d bytes: %w", got, size, err)
			}
		}
	case bulkUp:
		if err := writeN(c, size); err != nil {
			return 0, err
		}
		if cw, ok := c.(interface{ CloseWrite() error }); ok {
			if err := cw.CloseWrite(); err != nil {
				return 0, err
			}
		}
		var ack [8]byte
		if _, err := io.ReadFull(c, ack[:]); err != nil {
			return 0, fmt.Errorf("server's count: %w", err)
		}
		if n := int64(binary.BigEndian.Uint64(ack[:])); n != size {
			return 0, fmt.Errorf("server read %d of %d bytes", n, size)
		}
	}
	d := time.Since(t0)
	return float64(size) * 8 / d.Seconds() / 1e9, nil
}

// The bulk part's rows: direction, then what carried the stream.
var (
	bulkDirs   = []string{"download (backend → client)", "upload (client → backend)"}
	bulkDirect = "no load balancer (client → backend, routed)"
	// The floor of any XDP load balancer on these veths: a program that
	// returns XDP_PASS and does nothing else, attached as the agent
	// attaches its own by default (generic XDP on every node interface).
	bulkXDPFloor = "floor: an XDP program that only returns XDP_PASS, generic XDP on the node's veths"
	bulkPB       = []string{"penaltybox, XDP_PASS after NAT", "penaltybox, XDP redirect", "penaltybox, native XDP on the veths, XDP_PASS after NAT"}
)

func bulkRow(dir, what string) string { return dir + ": " + what }

// bulkPassRatios are, round by round, the stream through the VIP over the
// stream to the backend's address with the same agent attached.
func bulkPassRatios(r *Results, dir, v string) []float64 {
	return bulkRatios(r, dir, v+", through the VIP", "diagnostic: "+v+", to the backend's address (pass-through)")
}

// bulkRatios are, round by round, one row of a direction over another.
func bulkRatios(r *Results, dir, num, den string) []float64 {
	nf, df := r.find("bulk", bulkRow(dir, num)), r.find("bulk", bulkRow(dir, den))
	if nf == nil || df == nil {
		return nil
	}
	var rs []float64
	for i := range min(len(nf.Samples), len(df.Samples)) {
		rs = append(rs, nf.Samples[i]/df.Samples[i])
	}
	return rs
}

// bulkBest is the best mode's median ratio of the stream through the VIP
// to the stream with no program attached, and to the pass-through.
func bulkBest(r *Results, dir string) (direct, pass float64) {
	direct, pass = math.NaN(), math.NaN()
	for _, v := range bulkPB {
		if x := r.ratio("bulk", bulkRow(dir, v+", through the VIP")); !math.IsNaN(x) && !(x <= direct) {
			direct = x
		}
		if x := median(bulkPassRatios(r, dir, v)); !math.IsNaN(x) && !(x <= pass) {
			pass = x
		}
	}
	return direct, pass
}

// bulkFloorBest is the best mode's median ratio of the stream through the
// VIP to the stream with only an XDP_PASS program attached.
func bulkFloorBest(r *Results, dir string) float64 {
	best := math.NaN()
	for _, v := range bulkPB {
		if x := median(bulkRatios(r, dir, v+", through the VIP", bulkXDPFloor)); !math.IsNaN(x) && !(x <= best) {
			best = x
		}
	}
	return best
}

// attachXDPPass attaches bench/xdpbase's xdp_pass in generic mode to
// every interface named, in ns; the function returned detaches it.
func attachXDPPass(ns *testnet.NS, ifaces []string) (func() error, error) {
	// xdp_pass alone: it uses no map, and the other baselines would load
	// theirs (the floor's flow tables among them) for nothing.
	var objs struct {
		XdpPass *ebpf.Program `ebpf:"xdp_pass"`
	}
	spec, err := xdpbase.LoadBase()
	if err == nil {
		err = spec.LoadAndAssign(&objs, nil)
	}
	if err != nil {
		return nil, fmt.Errorf("load xdp_pass: %w", err)
	}
	var links []link.Link
	detach := func() error {
		for _, l := range links {
			l.Close()
		}
		return objs.XdpPass.Close()
	}
	err = ns.Do(func() error {
		for _, name := range ifaces {
			ifc, err := net.InterfaceByName(name)
			if err != nil {
				return err
			}
			l, err := link.AttachXDP(link.XDPOptions{Program: objs.XdpPass, Interface: ifc.Index, Flags: link.XDPGenericMode})
			if err != nil {
				return fmt.Errorf("attach to %s: %w", name, err)
			}
			links = append(links, l)
		}
		return nil
	})
	if err != nil {
		detach()
		return nil, err
	}
	return detach, nil
}

func runBulk(res *Results, o bulkOpts, agentBin string, logf func(string, ...any)) error {
	r, err := newRig(agentBin, 1)
	if err != nil {
		return err
	}
	defer r.close()
	ln, err := r.topo.Backend(1).Listen("tcp", fmt.Sprintf(":%d", bulkPort))
	if err != nil {
		return err
	}
	served := make(chan struct{})
	go func() { bulkServer(ln); close(served) }()
	defer func() { ln.Close(); <-served }()

	direct := fmt.Sprintf("198.18.1.2:%d", bulkPort)
	vip := fmt.Sprintf("%s:%d", testnet.VIP, bulkPort)
	vPB, vPBRed, vPBNat := bulkPB[0], bulkPB[1], bulkPB[2]
	// Each variant: an agent (or none), and the streams measured while it
	// runs: through the VIP, and, as a diagnostic, to the backend's own
	// address through the attached program (pass-through).
	type variant struct {
		name     string
		agent    bool
		redirect bool
		args     []string
	}
	variants := []variant{{bulkDirect, false, false, nil}, {bulkXDPFloor, false, false, nil}, {vPB, true, false, nil}, {vPBRed, true, true, nil}, {vPBNat, true, false, []string{"--xdp-mode", "native"}}}
	dirs := []struct {
		b    byte
		name string
	}{{bulkDown, bulkDirs[0]}, {bulkUp, bulkDirs[1]}}
	for round := range o.Rounds {
		order := slices.Clone(variants)
		if round%2 == 1 {
			slices.Reverse(order) // drift over a round falls on each variant alike
		}
		for _, v := range order {
			if err := r.flushConntrack(); err != nil {
				return err
			}
			var stop func() error
			if v.agent {
				a, err := r.startAgent(r.serviceConfig(v.redirect, "bulk", bulkPort, fmt.Sprintf("%q", direct), ""), v.args...)
				if err != nil {
					return fmt.Errorf("%s: %w", v.name, err)
				}
				stop = a.Close
			}
			if v.name == bulkXDPFloor {
				if stop, err = attachXDPPass(r.topo.Node, r.topo.NodeIfaces()); err != nil {
					return fmt.Errorf("%s: %w", v.name, err)
				}
			}
			type stream struct{ row, target string }
			streams := []stream{{v.name, direct}}
			if v.agent {
				streams = []stream{{v.name + ", through the VIP", vip}, {"diagnostic: " + v.name + ", to the backend's address (pass-through)", direct}}
			}
			var ferr error
			for _, d := range dirs {
				for _, s := range streams {
					gbps, err := bulkStream(r.topo.Client, s.target, d.b, o.Bytes)
					if err != nil {
						ferr = fmt.Errorf("%s: %s: %w", s.row, d.name, err)
						break
					}
					f := res.figure("bulk", bulkRow(d.name, s.row), "Gbit/s")
					f.Samples = append(f.Samples, gbps)
					f.Digits = 2
					if s.row != bulkDirect {
						f.Baseline = bulkRow(d.name, bulkDirect)
					}
					logf("bulk: round %d/%d: %-28s %-75s %6.2f Gbit/s", round+1, o.Rounds, d.name, s.row, gbps)
				}
				if ferr != nil {
					break
				}
			}
			if stop != nil {
				if err := stop(); err != nil && ferr == nil {
					ferr = err
				}
			}
			if ferr != nil {
				return ferr
			}
		}
	}
	// Rows in a stable order: per direction, the floor first.
	other, mine := res.split("bulk")
	slices.SortStableFunc(mine, func(a, b *Figure) int {
		return strings.Compare(strings.SplitN(a.Name, ":", 2)[0], strings.SplitN(b.Name, ":", 2)[0])
	})
	res.Figures = append(other, mine...)

	res.note("bulk", "One TCP connection moves %d MiB of zeros between the client namespace and b1 (a Go server on 198.18.1.2:%d reading or writing 256 KiB at a time), through the node's routing: the VIP %s:%d (one service, b1 its only backend) with the agent attached as `--xdp-mode auto` does (generic XDP on the veths; \"XDP redirect\" adds `redirectInterfaces`; \"native XDP\" is `--xdp-mode native`), and the backend's own address. Download: the backend sends, the client reads; upload: the client sends, the backend reads and answers with its count. Throughput = bytes ÷ (connect → last byte read, or → the backend's count), per stream, one stream per row per round, the variants in alternating order from round to round, a fresh agent per variant per round. The baseline is the same stream with no load balancer on the node (no program attached); the floor row is the same stream with only bench/xdpbase's xdp_pass attached in generic mode to every node interface (what attaching any XDP program there costs, before it does anything); the diagnostic rows are the stream to the backend's own address while the agent is attached, which its program passes through untouched.", o.Bytes>>20, bulkPort, testnet.VIP, bulkPort)
	for _, d := range bulkDirs {
		for _, v := range bulkPB {
			lo, med, hi := stats(bulkPassRatios(res, d, v))
			res.extra("bulk", "%s, %s: through the VIP ÷ to the backend's address with the same agent attached, round by round: %.2f / **%.2f×** / %.2f (min / median / max).", d, v, lo, med, hi)
			lo, med, hi = stats(bulkRatios(res, d, v+", through the VIP", bulkXDPFloor))
			res.extra("bulk", "%s, %s: through the VIP ÷ the XDP_PASS-only floor, round by round: %.2f / **%.2f×** / %.2f (min / median / max).", d, v, lo, med, hi)
		}
	}
	for _, d := range bulkDirs {
		direct, pass := bulkBest(res, d)
		floor := bulkFloorBest(res, d)
		res.target("bulk", "the same through the VIP ≥ 0.95× to the backend's address with only an XDP_PASS program attached the same way (the floor), "+d+" (best mode, ratio)", floor, 0.95, false, "%.2f×")
		res.target("bulk", "single TCP stream through a VIP ≥ 0.95× the same stream direct (no program attached), "+d+" (best mode, ratio)", direct, 0.95, false, "%.2f×")
		res.target("bulk", "the same through the VIP ≥ 0.95× to the backend's address with the agent attached, "+d+" (best mode, ratio)", pass, 0.95, false, "%.2f×")
	}
	return nil
}
