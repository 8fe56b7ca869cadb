// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// floodRate is about twice the SYN rate nftables DNAT carries on this
// kind of machine: enough to saturate it (its veths drop packets, legit
// ones with the flood's, and the backends answer with SYN cookies).
const floodRate = 120000

// A SYN flood does not make healthy endpoints look sick, nor cost legit
// clients their connections: with three healthy backends, 100 legit
// connections a second and six long-lived connections through the VIP,
// 10 s of new flows from four more client addresses at floodRate eject no
// endpoint and cut no long-lived connection. Within milliseconds the CPU
// taking the flood arms the SYN guard itself (the agent's flood mode then
// leases it): the flood's sources never proved themselves (no backend sent
// them payload), so their SYNs beyond a small budget are dropped at the
// first XDP pass, and the legit client, trusted from its connections
// before the flood, keeps connecting. Without the guard the machine drops
// packets at this rate, legit ones with the flood's (one slow hour: 50% of
// legit connects ok without it, 99.8-99.9% with it).
func TestSYNFloodEjectsNoHealthyEndpoint(t *testing.T) {
	e := newEnv(t, 3)
	a := e.startAgent(config(e.topo, all(3), ""))
	long, first := e.longLived(6)
	drops := e.topo.Client.TxDrops("eth0")
	rs, fr, floodStart := e.floodDuringLoad(floodRate)
	drops = e.topo.Client.TxDrops("eth0") - drops
	during := rs.Since(floodStart)
	m := e.metrics()
	ejections := m.Get("penaltybox_accrual_transitions_total", "svc_name", "web", "reason", "consecutive-failures")
	withheld := m.Get("penaltybox_connect_timeouts_withheld_total", "reason", "service_wide") + m.Get("penaltybox_connect_timeouts_withheld_total", "reason", "flood") +
		m.Get("penaltybox_connect_timeouts_withheld_total", "reason", "events_lost")
	dropped := m.Get("penaltybox_datapath_syn_guard_syns_total", "verdict", "dropped")
	trusted := m.Get("penaltybox_datapath_syn_guard_syns_total", "verdict", "trusted")
	t.Logf("flood: %d SYNs in %v (%.0f/s); legit connections during it: %d, %.2f%% ok (%v); ejections %v; timeouts withheld %v; SYN guard: %v dropped, %v trusted, %v admitted; client veth drops %d",
		fr.Sent, fr.Elapsed.Round(time.Millisecond), fr.Rate(), len(during), 100*during.SuccessRate(), during.Counts(), ejections, withheld,
		dropped, trusted, m.Get("penaltybox_datapath_syn_guard_syns_total", "verdict", "admitted"), drops)
	if ejections != 0 || a.LogContains("endpoint ejected") {
		t.Errorf("%v healthy endpoints ejected during the flood", ejections)
	}
	// When the flood saturated the node (many legit connects timed out),
	// the agent judged those timeouts and withheld them: no ejection was
	// not luck. A few timeouts on a node that carried the flood (a CI run:
	// 6 of 1,099) are ordinary losses, counted against their endpoints
	// like any other, and consecutive accrual absorbs them.
	if n := during.Count(testnet.ConnectTimeout); n > len(during)/10 && withheld == 0 {
		t.Errorf("%d of %d legit connects timed out and no timeout was withheld", n, len(during))
	}
	e.checkLongLived(long, first)
	if fr.Rate() < floodRate/2 {
		t.Fatalf("the flood reached only %.0f SYNs/s: the test did not flood", fr.Rate())
	}
	// The guard's budget is 2,000 SYNs a second per CPU: of the flood's
	// 1.2 million, all but some tens of thousands are dropped (1.15 million
	// measured). Half is a margin no working guard misses.
	if dropped < float64(fr.Sent)/2 {
		t.Errorf("the SYN guard dropped %v of the flood's %d SYNs, want most", dropped, fr.Sent)
	}
	if trusted < float64(len(during))/2 {
		t.Errorf("%v SYNs from trusted sources while the guard was on, for %d legit connects", trusted, len(during))
	}
	if armed := m.Get("penaltybox_datapath_syn_guard_armed_total"); armed < 1 {
		t.Errorf("the datapath never armed the SYN guard itself")
	}
	// What legit connects still lose are SYNs the client's veth dropped
	// before XDP (its 256-entry ring overflows while the NAPI that drains
	// it waits on a busy CPU): 1 or 2 of 1,099 in a slow hour, when without
	// the guard half of them failed. 99% leaves five times that for this
	// noisy machine; make bench measures against the 99.9% target.
	if during.SuccessRate() < 0.99 {
		t.Errorf("legit connections during the flood %.2f%% ok, want >= 99%%", 100*during.SuccessRate())
	}
}

// Half-open flows cannot cut established ones, even through a conntrack
// table far too small for the flood (4,096 entries against 60,000 new
// entries a second, two per SYN): busy flows stay in the LRU, and an idle
// flow whose entries were evicted is picked up again by its next packet on
// the same backend, because the tables do not change (no endpoint is
// ejected).
func TestSYNFloodThroughTinyConntrackCutsNoConnection(t *testing.T) {
	e := newEnv(t, 3)
	// No SYN guard: the flood is to go through conntrack.
	a := e.startAgent(config(e.topo, all(3), ""), "--conntrack-size", "4096", "--syn-guard-rate", "0")
	long, first := e.longLived(6)
	rs, fr, _ := e.floodDuringLoad(30000)
	t.Logf("flood: %.0f SYNs/s; legit %.2f%% ok (%v)", fr.Rate(), 100*rs.SuccessRate(), rs.Counts())
	e.checkLongLived(long, first)
	if a.LogContains("endpoint ejected") {
		t.Error("an endpoint was ejected during the flood")
	}
	// 30,000 SYNs/s is well within what this machine carries, so what
	// legit connections lose is the conntrack's doing, not the veths'
	// (at 60,000 a CI run measured 92.75%: SYNs dropped before XDP, the
	// flood part of make bench measures that). The margin is the noise of
	// a shared 2-core machine.
	if rs.SuccessRate() < 0.95 {
		t.Errorf("legit connections %.2f%% ok, want >= 95%%", 100*rs.SuccessRate())
	}
}

// floodDuringLoad runs 100 legit new connections a second for 12 s and,
// from 1 s in, a SYN flood at rate for 10 s from testnet.FloodSources. It
// returns the legit results, what the flood sent, and when it began.
func (e *env) floodDuringLoad(rate int) (testnet.Results, testnet.FloodResult, time.Time) {
	e.t.Helper()
	if err := e.topo.Client.AddAddrs(testnet.FloodSources...); err != nil {
		e.t.Fatal(err)
	}
	var fr testnet.FloodResult
	var err error
	var start time.Time
	var wg sync.WaitGroup
	rs := e.loadAround(100, 12*time.Second, func() {
		time.Sleep(time.Second)
		wg.Go(func() {
			start = time.Now()
			fr, err = e.topo.Client.SYNFlood(e.ctx, testnet.FloodSpec{Sources: testnet.FloodSources,
				Target: netip.MustParseAddrPort(testnet.VIP + ":80"), Rate: rate, Duration: 10 * time.Second})
		})
	})
	wg.Wait()
	if err != nil {
		e.t.Fatal(err)
	}
	return rs, fr, start
}
