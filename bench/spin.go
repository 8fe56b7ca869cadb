// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/penaltybox/penaltybox/internal/bpftest"
)

// spin runs one path of part 1 over and over for d, for a profiler
// (`perf record -a -g -- go run ./bench --spin newflow`) to look at. It
// prints the kernel's median time per run every second.
//
//	established  reply  passthrough  newflow  newflow-noreader  dnat
//	floor-known  floor-new (the conntracking floor, bench/floor.go)
func spin(path string, d time.Duration) error {
	r, err := newPacketRig()
	if err != nil {
		return err
	}
	defer r.close()
	if path == "newflow-noreader" {
		// Stop draining: after the first event the consumer is behind and
		// bpf_ringbuf_submit no longer wakes it (events are lost once the
		// ring is full; that path is counted, and short).
		r.reader.Close()
		<-r.drained
		r.reader = nil
	}
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		// One round, made again when the kernel's loop was interrupted and
		// its runs before that broke a path's count check (counted).
		v, err := counted(func() (float64, error) { return spinOnce(r, path) })
		if err != nil {
			return err
		}
		fmt.Printf("%s: %.1f ns/run\n", path, v)
	}
	return nil
}

// spinOnce runs path's measurement once.
func spinOnce(r *packetRig, path string) (v float64, err error) {
	switch path {
	case "established":
		v, err = r.established(pkClient, pkA, pkB, 10, 11, 1_000_001)
	case "reply":
		v, err = r.reply(1_000_001)
	case "passthrough":
		in := tcpFrame(pkClient, pkNode, bpftest.ACK)
		v, err = r.passThrough(in, 1_000_001)
	case "dnat":
		v, err = r.repeatRun(r.base.MinDnat, tcpFrame(pkClient, pkA, bpftest.ACK), 1_000_001, ended(pkClient, pkB))
	case "floor-known":
		v, err = r.floorKnown(1_000_001, false)
	case "floor-new":
		v, err = r.floorNew(20000, false, false)
	case "newflow", "newflow-noreader":
		v, err = r.spinNewFlows(20000)
	default:
		return 0, fmt.Errorf("--spin: unknown path %q", path)
	}
	return v, err
}

// spinNewFlows is newFlows without the event checks (the reader may be
// stopped).
func (r *packetRig) spinNewFlows(n int) (float64, error) {
	pkt := tcpFrame(pkClient, pkVIPNew, bpftest.SYN)
	durs := make([]float64, 0, n)
	var clients, picked []netip.AddrPort
	for range n {
		c := r.nextClient()
		pkt.setSrc(c)
		ret, sz, ns, err := testRun(r.dp.PbXdp, pkt, r.out, 1)
		if err != nil {
			return 0, err
		}
		if ret != bpftest.XDPPass {
			return 0, fmt.Errorf("verdict %d", ret)
		}
		durs = append(durs, float64(ns))
		clients = append(clients, c)
		picked = append(picked, dstOf(r.out[:sz]))
	}
	// Same conntrack occupancy every batch, as in the measurement.
	if err := r.forget(pkVIPNew, clients, picked, false, 1); err != nil {
		return 0, err
	}
	return median(durs), nil
}
