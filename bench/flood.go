// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// floodOpts size the flood part: legit load at Legit per second for
// Duration, a SYN flood at each of Rates for Duration-2s from 1 s in.
type floodOpts struct {
	Rounds   int
	Duration time.Duration
	Legit    float64
	Rates    []int
}

const longConns = 6

// runFlood puts penaltybox and nftables DNAT through the same SYN flood:
// what legit clients and long-lived connections see, and (penaltybox)
// whether a healthy endpoint is ejected.
func runFlood(res *Results, o floodOpts, agentBin string, logf func(string, ...any)) error {
	r, err := newRig(agentBin, 3)
	if err != nil {
		return err
	}
	defer r.close()
	if err := r.topo.Client.AddAddrs(testnet.FloodSources...); err != nil {
		return err
	}
	const vPB, vPBR, vPBNative, vPBNoGuard, vNft = "penaltybox", "penaltybox, XDP_REDIRECT", "penaltybox, native XDP on the veths", "penaltybox, no SYN guard", "nftables DNAT"
	variants := []struct {
		name  string
		start func() (lb, error)
	}{
		{vNft, r.nftables},
		{vPB, func() (lb, error) { return r.penaltybox(false, "") }},
		{vPBR, func() (lb, error) { return r.penaltybox(true, "") }},
		// What generic XDP on veths (--xdp-mode auto) is worth.
		{vPBNative, func() (lb, error) { return r.penaltybox(false, "", "--xdp-mode", "native") }},
		// What the guard is worth, in the same run.
		{vPBNoGuard, func() (lb, error) {
			a, err := r.startAgent(r.pbConfig(false, ""), "--syn-guard-rate", "0")
			if err != nil {
				return nil, err
			}
			return &pbLB{a: a}, nil
		}},
	}
	floodFor := o.Duration - 2*time.Second
	if floodFor <= 0 {
		floodFor = o.Duration / 2
	}
	for round := range o.Rounds {
		for _, rate := range o.Rates {
			for _, v := range variants {
				l, err := r.fresh(v.name, v.start)
				if err != nil {
					return err
				}
				out, err := floodRun(r, rate, floodFor, o)
				ejected, guarded := 0.0, 0.0
				if pb, ok := l.(*pbLB); ok && err == nil {
					m, merr := pb.a.Metrics(context.Background())
					if merr != nil {
						err = merr
					}
					ejected = m.Get("penaltybox_accrual_transitions_total", "svc_name", "web", "reason", "consecutive-failures")
					guarded = m.Get("penaltybox_datapath_syn_guard_syns_total", "verdict", "dropped")
				}
				if serr := l.stop(); err == nil {
					err = serr
				}
				if err != nil {
					return fmt.Errorf("%s at %d SYNs/s: %w", v.name, rate, err)
				}
				name := func(what string) string { return fmt.Sprintf("%d SYNs/s offered: %s: %s", rate, v.name, what) }
				add := func(what, unit string, x float64, digits int) {
					f := res.figure("flood", name(what), unit)
					f.Samples = append(f.Samples, x)
					f.Digits = digits
				}
				add("SYNs sent per second", "/s", out.sent, 0)
				add("legit connections ok during the flood", "%", 100*out.legit, 2)
				add("long-lived connections intact", "of 6", float64(out.intact), 0)
				add("client veth drops during the flood", "packets", float64(out.drops), 0)
				if v.name != vNft {
					add("healthy endpoints ejected", "count", ejected, 0)
				}
				if v.name == vPB || v.name == vPBR {
					add("SYNs the SYN guard dropped", "SYNs", guarded, 0)
				}
				logf("flood: round %d/%d: %-14s %7d SYNs/s offered, %.0f sent: legit %.2f%% ok, %d/6 long-lived intact, %d veth drops, %v ejected, %v dropped by the SYN guard",
					round+1, o.Rounds, v.name, rate, out.sent, 100*out.legit, out.intact, out.drops, ejected, guarded)
			}
		}
	}
	for _, rate := range o.Rates {
		pre := fmt.Sprintf("%d SYNs/s offered: ", rate)
		for _, what := range []string{"legit connections ok during the flood", "long-lived connections intact"} {
			if f := res.find("flood", pre+vPB+": "+what); f != nil {
				f.Baseline = pre + vNft + ": " + what
			}
		}
		res.target("flood", pre+"no healthy endpoint ejected", res.median("flood", pre+vPB+": healthy endpoints ejected"), 0, true, "%.0f")
		res.target("flood", pre+"every long-lived connection intact", res.median("flood", pre+vPB+": long-lived connections intact"), longConns, false, "%.0f of 6")
		res.target("flood", pre+"legit connections ≥ 99.9% ok during the flood", res.median("flood", pre+vPB+": legit connections ok during the flood"), 99.9, false, "%.2f%%")
	}
	res.note("flood", "Same topology as part 2, three healthy backends. Each run: %d long-lived keep-alive connections opened, %.0f legit new connections per second for %v (client connect timeout 1 s), and from 1 s in a SYN flood for %v from four more addresses of the client's namespace (a raw-socket sender, every SYN a new flow: source ports walk; the client's kernel answers the backends' SYN-ACKs with RST), then one more request on each long-lived connection. \"legit ok\" counts the legit connections started during the flood. Client veth drops: packets the client's veth dropped (its TX queue into the node: legit SYNs go with the flood's). penaltybox with default accrual (7 consecutive failures, connect timeout 1 s).", longConns, o.Legit, o.Duration, floodFor)
	res.note("flood", "How the sender is held back decides what the veths drop. nftables and generic XDP (penaltybox's default on veths, `--xdp-mode auto`) run in the receive path of the sender's own softirq, behind the per-CPU backlog: the sender pays for each SYN before it sends the next, so nothing overflows, and what differs is the price (the whole netfilter path per SYN, against a drop in XDP). A veth with native XDP (the \"native XDP on the veths\" rows, `--xdp-mode native`) instead queues the sender's packets in a 256-entry ring that its NAPI drains, on whichever CPU scheduled it; when that CPU is busy the ring overflows and legit SYNs are dropped with the flood's, before any XDP program runs. Without the SYN guard, XDP also forwards every SYN, so the backends answer each (SYN cookies) and the client's RSTs come back through the same path. With it (the default) SYNs from sources no backend has sent payload to are dropped at the first XDP pass beyond 2,000 a second per CPU, from the moment the CPU taking the flood sees more than 2,000 SYNs to the service in 100 ms (it arms the guard itself; the agent's flood mode then holds it). \"SYNs sent per second\" below the offered rate is what the sender managed: the machine's ceiling, reached at the highest offered rate.")
	return nil
}

type floodOutcome struct {
	sent   float64 // SYNs per second actually sent
	legit  float64 // success rate of legit connections started during the flood
	intact int     // long-lived connections still on their backend after it
	drops  uint64  // client veth TX drops during the run
}

func floodRun(r *rig, rate int, floodFor time.Duration, o floodOpts) (floodOutcome, error) {
	var out floodOutcome
	ctx := context.Background()
	type kc struct {
		c     net.Conn
		br    *bufio.Reader
		first string
	}
	var long []kc
	defer func() {
		for _, k := range long {
			k.c.Close()
		}
	}()
	for range longConns {
		c, err := r.topo.Client.Dialer(time.Second).DialContext(ctx, "tcp", vipTarget)
		if err != nil {
			return out, err
		}
		k := kc{c: c, br: bufio.NewReader(c)}
		if k.first, err = keepAliveGet(k.c, k.br); err != nil {
			c.Close()
			return out, err
		}
		long = append(long, k)
	}
	drops0 := r.topo.Client.TxDrops("eth0")
	var rs testnet.Results
	var fr testnet.FloodResult
	var lerr, ferr error
	var start time.Time
	var wg sync.WaitGroup
	wg.Go(func() {
		rs, lerr = testnet.Load(ctx, r.topo.Client, testnet.LoadSpec{Target: vipTarget, Rate: o.Legit, Duration: o.Duration,
			ConnectTimeout: time.Second, RequestTimeout: 3 * time.Second})
	})
	time.Sleep(time.Second)
	start = time.Now()
	fr, ferr = r.topo.Client.SYNFlood(ctx, testnet.FloodSpec{Sources: testnet.FloodSources,
		Target: netip.MustParseAddrPort(vipTarget), Rate: rate, Duration: floodFor})
	end := time.Now()
	wg.Wait()
	if lerr != nil {
		return out, lerr
	}
	if ferr != nil {
		return out, ferr
	}
	out.sent = fr.Rate()
	var during testnet.Results
	for _, x := range rs.Since(start) {
		if x.Scheduled.Before(end) {
			during = append(during, x)
		}
	}
	out.legit = during.SuccessRate()
	out.drops = r.topo.Client.TxDrops("eth0") - drops0
	for _, k := range long {
		if got, err := keepAliveGet(k.c, k.br); err == nil && got == k.first {
			out.intact++
		}
	}
	return out, nil
}

// keepAliveGet sends one request on a keep-alive connection and returns the
// backend that answered.
func keepAliveGet(c net.Conn, br *bufio.Reader) (string, error) {
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: vip\r\n\r\n"); err != nil {
		return "", err
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b := make([]byte, 64)
	n, _ := resp.Body.Read(b)
	return testnet.BackendOf(string(b[:n])), nil
}
