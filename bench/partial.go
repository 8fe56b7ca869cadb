// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// sPartial is the failing part's scenario of an endpoint that refuses a
// share of its connections at random: the way pods usually degrade.
const (
	sPartial     = "30% refused at random"
	partialShare = 0.3
)

// partialSettle: the failure-rate figures count from this long after
// the load began (the window's first ejection comes within it).
const partialSettle = time.Second

// runPartial measures sPartial on the failing part's rig: b3 refuses 30%
// of new connections (testnet.Backend.RefuseShare), for twice the other
// scenarios' run time, since a window of recent connections is what the
// failure-rate rule judges.
func runPartial(r *rig, res *Results, o failingOpts, logf func(string, ...any)) error {
	const (
		vNft  = "nftables DNAT (no accrual)"
		vHAP  = "HAProxy, passive L4 checks"
		vCons = "penaltybox, consecutive"
		vRate = "penaltybox, failure-rate"
		vRR   = "penaltybox, failure-rate + retryRefused"
	)
	variants := []lbVariant{
		{vNft, r.nftables},
		{vHAP, func() (lb, error) { return r.haproxy(hapOpts{passive: true, errorLimit: maxFailures}) }},
		{vCons, func() (lb, error) { return r.penaltybox(false, pbAccrual+"    retryRefused: false\n") }},
		{vRate, func() (lb, error) {
			return r.penaltybox(false, pbAccrual+"      mode: failure-rate\n    retryRefused: false\n")
		}},
		// HAProxy retries a refused connect (retries 3), which hides most
		// of b3's refusals before it is marked down; retryRefused is
		// penaltybox's way to the same.
		{vRR, func() (lb, error) {
			return r.penaltybox(false, pbAccrual+"      mode: failure-rate\n    retryRefused: true\n")
		}},
	}
	d := 2 * o.Duration
	settle := partialSettle
	bad := r.topo.Backend(3)
	for round := range o.Rounds {
		for _, v := range variants {
			eject, ours := -1.0, false
			rs, err := r.badRun(v, func() error { return bad.RefuseShare(partialShare) }, func() error { return bad.RefuseShare(0) },
				o.Rate, d, func(l lb, rs testnet.Results) {
					pb, ok := l.(*pbLB)
					ours = ok
					if ok && len(rs) > 0 {
						if at, ok := firstEjection(pb.a.LogPath()); ok {
							eject = at.Sub(rs[0].Scheduled).Seconds()
						}
					}
				})
			if err != nil {
				return fmt.Errorf("%s/%s: %w", sPartial, v.name, err)
			}
			add := func(what, unit string, x float64, digits int) {
				f := res.figure("failing", sPartial+": "+v.name+": "+what, unit)
				f.Samples = append(f.Samples, x)
				f.Digits = digits
			}
			after := rs.Since(rs[0].Scheduled.Add(settle))
			add("success rate, all connections", "%", 100*rs.SuccessRate(), 2)
			add(fmt.Sprintf("success rate after the first %v", settle), "%", 100*after.SuccessRate(), 3)
			add("failed connections", "count", float64(rs.Failures()), 0)
			if ours {
				if eject < 0 {
					eject = d.Seconds() // never ejected within the run
				}
				add("time to the first ejection", "s", eject, 2)
			}
			logf("failing: round %d/%d: %-22s %-28s %v; first ejection at %.2fs", round+1, o.Rounds, sPartial, v.name, rs, eject)
		}
	}
	for _, f := range res.Figures {
		if f.Part == "failing" && f.Name == sPartial+": "+vRate+": failed connections" {
			f.Baseline = sPartial + ": " + vCons + ": failed connections"
		}
	}
	res.note("failing", "%s: b3 refuses %.0f%% of new connections at random (an nftables `numgen random` rule in its namespace answers that share of SYNs with a RST) for %v per run, the rest as above. penaltybox, consecutive: the accrual above (%d in a row). penaltybox, failure-rate: the same with `mode: failure-rate` (a window of 10 s, 5 connections at least, failure rate above 0.2 ejects); + retryRefused (the default; the other two set it off): a refused new connection's RST is kept from the client and its SYN replayed at once to another backend, the counterpart of HAProxy's `retries 3`, which retries a refused connect (on the same server, where 70%% of retries succeed) until the server is marked down. Time to the first ejection: the agent log's first ejection after the load began; the run's length when there was none.", sPartial, 100*partialShare, d, maxFailures)
	rate := res.median("failing", sPartial+": "+vRate+fmt.Sprintf(": success rate after the first %v", settle))
	cons := res.median("failing", sPartial+": "+vCons+": success rate, all connections")
	hap := res.median("failing", sPartial+": "+vHAP+": success rate, all connections")
	rateAll := res.median("failing", sPartial+": "+vRate+": success rate, all connections")
	rrAll := res.median("failing", sPartial+": "+vRR+": success rate, all connections")
	res.target("failing", fmt.Sprintf("%s: penaltybox failure-rate success rate after the first %v ≥ 99.9%%", sPartial, settle), rate, 99.9, false, "%.3f%%")
	res.Targets = append(res.Targets, aboveHAProxy(sPartial, "penaltybox failure-rate", "penaltybox consecutive's", rateAll-cons))
	res.Targets = append(res.Targets, aboveHAProxy(sPartial, "penaltybox failure-rate + retryRefused", "HAProxy passive checks'", rrAll-hap))
	return nil
}

// firstEjection returns the time of the first "endpoint ejected" line of
// the agent's JSON log.
func firstEjection(path string) (time.Time, bool) {
	f, err := os.Open(path)
	if err != nil {
		return time.Time{}, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var line struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "endpoint ejected" {
			return line.Time, true
		}
	}
	return time.Time{}, false
}
