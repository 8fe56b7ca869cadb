// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/replay"
)

type failingOpts struct {
	Rounds   int
	Duration time.Duration
	Rate     float64 // new connections per second, open loop
}

// maxFailures is N for both penaltybox (maxFailures) and HAProxy
// (error-limit).
const maxFailures = 5

// delayedAfter: a successful connection slower than this was retried
// (an unloaded one takes about a millisecond; HAProxy's turn-around
// before a retry is 300 ms here, a client's SYN retransmission 1 s).
const delayedAfter = 250 * time.Millisecond

// pbAccrual is penaltybox's failure accrual in the failing-backend runs:
// the connect deadline equals HAProxy's `timeout connect`.
const pbAccrual = `    failureAccrual:
      maxFailures: 5
      minPenalty: 2s
      maxPenalty: 1m
      jitterRatio: 0.2
      connectTimeout: 300ms
`

func runFailing(res *Results, o failingOpts, agentBin string, logf func(string, ...any)) error {
	r, err := newRig(agentBin, 3)
	if err != nil {
		return err
	}
	defer r.close()
	version, said := haproxyCheck(r.dir)

	const (
		vPB   = "penaltybox"
		vNft  = "nftables DNAT (no accrual)"
		vHAP  = "HAProxy, passive L4 checks"
		vPBR  = "penaltybox, retryRefused"
		vHAPR = "HAProxy, passive L4 checks + option redispatch"
		sRef  = "refusing"
		sDrop = "dropping SYNs"
	)
	variants := []lbVariant{
		{vNft, r.nftables},
		{vHAP, func() (lb, error) { return r.haproxy(hapOpts{passive: true, errorLimit: maxFailures}) }},
		// Accrual alone: refusals reach the clients.
		{vPB, func() (lb, error) { return r.penaltybox(false, pbAccrual+"    retryRefused: false\n") }},
		// Each with its option to send a refused connect elsewhere: the
		// fair comparison for clients that must not see refusals.
		{vHAPR, func() (lb, error) {
			return r.haproxy(hapOpts{passive: true, errorLimit: maxFailures, redispatch: true})
		}},
		{vPBR, func() (lb, error) { return r.penaltybox(false, pbAccrual+"    retryRefused: true\n") }},
	}
	scenarios := []struct {
		name string
		mode testnet.Mode
	}{{sRef, testnet.Refuse}, {sDrop, testnet.Blackhole}}

	bad := r.topo.Backend(3)
	for round := range o.Rounds {
		for _, sc := range scenarios {
			for _, v := range variants {
				rs, err := r.badRun(v, func() error { return bad.SetMode(sc.mode) }, func() error { return bad.SetMode(testnet.Serve) },
					o.Rate, o.Duration, nil)
				if err != nil {
					return fmt.Errorf("%s/%s: %w", sc.name, v.name, err)
				}
				all := rs.SuccessRate()
				after, ok := rs.AfterFailures(maxFailures)
				if !ok {
					after = rs // fewer client-visible failures than N
				}
				last, slowest, delayed := 0.0, 0.0, 0
				var lat []float64
				t0 := rs[0].Scheduled
				for _, x := range rs {
					if x.Class.Failed() {
						last = math.Max(last, x.End().Sub(t0).Seconds())
					}
					if x.Class == testnet.OK {
						slowest = math.Max(slowest, x.Latency.Seconds())
						lat = append(lat, x.Latency.Seconds())
						if x.Latency > delayedAfter {
							delayed++
						}
					}
				}
				slices.Sort(lat)
				p99 := math.NaN()
				if len(lat) > 0 {
					p99 = lat[len(lat)*99/100]
				}
				add := func(what, unit string, v float64, digits int) {
					f := res.figure("failing", sc.name+": "+what, unit)
					f.Samples = append(f.Samples, v)
					f.Digits = digits
				}
				add(v.name+": success rate, all connections", "%", 100*all, 2)
				add(v.name+fmt.Sprintf(": success rate after the first %d failures", maxFailures), "%", 100*after.SuccessRate(), 3)
				add(v.name+": time until the last failure", "s", last, 2)
				add(v.name+": failed connections", "count", float64(rs.Failures()), 0)
				add(v.name+fmt.Sprintf(": successful connections slower than %v", delayedAfter), "count", float64(delayed), 0)
				add(v.name+": slowest successful connection", "s", slowest, 2)
				add(v.name+": p99 latency of successful connections", "ms", 1000*p99, 1)
				logf("failing: round %d/%d: %-14s %-28s %v; last failure at %.2fs", round+1, o.Rounds, sc.name, v.name, rs, last)
			}
		}
	}
	// Ratios: success rates and failures against HAProxy's passive checks,
	// each penaltybox variant against the HAProxy configured like it.
	for _, f := range res.Figures {
		if f.Part != "failing" {
			continue
		}
		for _, sc := range scenarios {
			for _, suffix := range []string{": success rate, all connections", fmt.Sprintf(": success rate after the first %d failures", maxFailures), ": failed connections"} {
				switch f.Name {
				case sc.name + ": " + vPB + suffix, sc.name + ": " + vNft + suffix:
					f.Baseline = sc.name + ": " + vHAP + suffix
				case sc.name + ": " + vPBR + suffix:
					f.Baseline = sc.name + ": " + vHAPR + suffix
				}
			}
		}
	}
	if err := runPartial(r, res, o, logf); err != nil {
		return err
	}
	sortFailing(res)

	res.note("failing", "Same topology as part 2; backend b3 refuses (its listener closed: the kernel answers SYN with RST) or drops SYNs (nftables in its namespace), for the whole run. Open loop: %.0f new connections per second for %v (one HTTP request each, scheduled by the clock whatever earlier attempts do), client connect timeout 3 s (room for one SYN retransmission) and 3 s for the response. A fresh load balancer per run; scenarios and variants interleaved in every round.", o.Rate, o.Duration)
	res.note("failing", "penaltybox: maxFailures %d, minPenalty 2s, maxPenalty 1m, jitterRatio 0.2, connectTimeout 300ms (its own connect deadline, equal to HAProxy's `timeout connect`). After the penalty a probe (one real connection) goes to the backend; while it still fails, that probe is a client-visible failure and the penalty doubles (2 s, then 4 s, ±20%%): how many of them fall inside a %v run shows in its failed connections and its time until the last failure. Dropped SYNs: the agent's 300 ms deadline ejects the backend, and the clients' retransmitted SYNs (after 1 s) are moved to a healthy backend in the kernel, so they succeed.", maxFailures, o.Duration)
	res.note("failing", "HAProxy (%s): `mode tcp`, `balance roundrobin`, `retries 3`, `timeout connect 300ms`, servers `check inter 60s observe layer4 error-limit %d on-error mark-down`. The documentation says observe needs health checks enabled; `haproxy -c` says: %s so `check` is on, with `inter 60s` so active checks stay out of a run (a marked-down server then stays down for the run: no probe, so no late failure, but also no way back until an active check passes). Without `option redispatch` a failed connect is retried on the same server (HAProxy's default); with `option redispatch 1` every retry may go to another server, the quickest way round a refusing server HAProxy has. penaltybox: the accrual with `retryRefused: false`, so refusals reach the clients. penaltybox, retryRefused (the default): the same accrual, and a refused new connection's RST is kept from the client while the agent replays its SYN at once, which the datapath sends to another backend (the client's own retransmission, after 1 s, when the agent cannot).", version, maxFailures, said)
	res.note("failing", noFailureNote)
	// As the agent decides: where the kernel refuses the mode (not where
	// the probe could not run), replays go through a raw socket, or are
	// off without one.
	if err := replay.Probe(); errors.Is(err, replay.ErrLiveFramesRefused) {
		if sock, serr := replay.OpenSocket(); serr != nil {
			res.note("failing", liveFramesRefusedNote+" (%v), and the agent could open no raw socket (%v): it replays nothing here, so the rows that say SYNs are replayed measure clients waiting for their own retransmission (about 1 s) instead.", err, serr)
		} else {
			sock.Close()
			res.note("failing", "This machine's kernel refuses BPF_PROG_RUN's live-frame mode (%v): the agent sends its SYN replays through a raw socket here (the datapath runs on each in the ordinary mode, and the agent sends the packet it returns).", err)
		}
	}

	for _, sc := range scenarios {
		pbAfter := res.median("failing", sc.name+": "+vPB+fmt.Sprintf(": success rate after the first %d failures", maxFailures))
		hapAll := res.median("failing", sc.name+": "+vHAP+": success rate, all connections")
		pbAll := res.median("failing", sc.name+": "+vPB+": success rate, all connections")
		res.Targets = append(res.Targets, aboveHAProxy(sc.name, "penaltybox", "HAProxy passive checks'", pbAll-hapAll))
		// The HAProxy (passive checks, no redispatch) against
		// penaltybox with its option on; with redispatch, HAProxy is a
		// figure above, not a target.
		pbRAll := res.median("failing", sc.name+": "+vPBR+": success rate, all connections")
		res.Targets = append(res.Targets, aboveHAProxy(sc.name, "penaltybox with retryRefused", "HAProxy passive checks'", pbRAll-hapAll))
		res.target("failing", sc.name+fmt.Sprintf(": penaltybox success rate after the first %d failures ≥ 99.9%%", maxFailures), pbAfter, 99.9, false, "%.3f%%")
		// Issue 14's latency targets, for the default (retryRefused on):
		// refused SYNs replayed at once, unanswered ones after the
		// adaptive deadline.
		p99 := res.median("failing", sc.name+": "+vPBR+": p99 latency of successful connections")
		if sc.name == sRef {
			res.target("failing", sc.name+": penaltybox (default: SYNs replayed) p99 latency < 10 ms", p99, 10, true, "%.1f ms")
		} else {
			res.target("failing", sc.name+": penaltybox (default: SYNs replayed) p99 latency < 100 ms", p99, 100, true, "%.1f ms")
		}
	}
	return nil
}

// lbVariant is a load balancer a failing-part run starts afresh.
type lbVariant struct {
	name  string
	start func() (lb, error)
}

// badRun is one failing-part run: a fresh v, backend b3 spoiled by spoil
// and healed by heal around an open-loop load of rate for d (connect and
// response timeouts of 3 s: room for one SYN retransmission). inspect, if
// set, sees the results while v still runs.
func (r *rig) badRun(v lbVariant, spoil, heal func() error, rate float64, d time.Duration, inspect func(lb, testnet.Results)) (testnet.Results, error) {
	l, err := r.fresh(v.name, v.start)
	if err != nil {
		return nil, err
	}
	if err := spoil(); err != nil {
		l.stop()
		return nil, err
	}
	rs, err := testnet.Load(context.Background(), r.topo.Client, testnet.LoadSpec{
		Target: vipTarget, Rate: rate, Duration: d,
		ConnectTimeout: 3 * time.Second, RequestTimeout: 3 * time.Second,
	})
	if err == nil && inspect != nil {
		inspect(l, rs)
	}
	herr := heal()
	if lerr := l.stop(); lerr != nil && herr == nil {
		herr = lerr
	}
	if err != nil {
		return nil, fmt.Errorf("load: %w", err)
	}
	return rs, herr
}

func sortFailing(res *Results) {
	other, fl := res.split("failing")
	// Group by scenario then metric, keeping variant order.
	order := []string{"success rate, all connections", fmt.Sprintf("success rate after the first %d failures", maxFailures),
		"success rate after the first 1s", "failed connections", "time until the last failure", "time to the first ejection",
		fmt.Sprintf("successful connections slower than %v", delayedAfter), "slowest successful connection",
		"p99 latency of successful connections"}
	var out []*Figure
	for _, sc := range []string{"refusing:", "dropping SYNs:", sPartial + ":"} {
		for _, m := range order {
			for _, f := range fl {
				if len(f.Name) > len(sc) && f.Name[:len(sc)] == sc && hasSuffix(f.Name, m) {
					out = append(out, f)
				}
			}
		}
	}
	res.Figures = append(other, out...)
}

func hasSuffix(s, suf string) bool { return len(s) >= len(suf) && s[len(s)-len(suf):] == suf }

// aboveHAProxy judges "success rate above HAProxy's passive checks":
// strictly above, so a tie is not a win.
func aboveHAProxy(scenario, ours, theirs string, diff float64) Target {
	t := Target{Part: "failing", What: scenario + ": " + ours + " success rate above " + theirs + " (difference, points)",
		Measured: fmt.Sprintf("%+.2f pts", diff), Met: diff > 0}
	if !t.Met {
		t.Missing = "not above"
		if diff == 0 {
			t.Missing = "a tie, not above"
		}
	}
	return t
}

const noFailureNote = "nftables DNAT has no notion of failure: one third of new connections go to b3 all run long. A time until the last failure of 0 means no client-visible failure at all; success rates count every scheduled connection."
