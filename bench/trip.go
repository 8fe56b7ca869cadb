// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"net/netip"
	"runtime"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// The kernel trip's service in part 1: one backend, which refuses every
// flow in these runs.
var (
	pkVIPTrip  = netip.MustParseAddrPort("198.18.100.15:80")
	pkTripBE   = netip.MustParseAddrPort("198.18.1.2:8080")
	pkTripSvc  = uint32(6)
	pkTripBEID = uint32(40)
)

// tripRuns times the RST of n refused flows, one BPF_PROG_TEST_RUN
// (repeat=1) each: with trip, each RST is its backend's deciding failure
// (max_failures 1, the backend active again before each flow), so the run
// that parses it also ejects the backend; without, the same RST is counted
// in the streak but never reaches max_failures. Every run is checked: the
// RST leaves reverse-NATed to the client, the backend's state and the
// service's trip counter say whether it tripped, and the trip's kernel
// timestamp (pb_be_trip.tripped_ns) lies within that very call. Returns the
// kernel's ns per run.
func (r *packetRig) tripRuns(trip bool, n int) ([]float64, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	settings := maps.TripSettings{MaxFailures: 1 << 30, Kinds: maps.TripRefused, Settle: 1e9}
	if trip {
		settings.MaxFailures = 1
	}
	const budget = 1 << 40
	r.m.SetServiceTrip(pkTripSvc, settings, budget)
	r.m.ResetBackendTrip(pkTripBEID)
	active := maps.NewBackend(pkTripBE, pkTripSvc, maps.BackendActive, 0)
	before := r.m.ServiceTrip(pkTripSvc).Trips
	read0 := r.read.Load()

	syn := tcpFrame(pkClient, pkVIPTrip, bpftest.SYN)
	durs := make([]float64, 0, n)
	clients := make([]netip.AddrPort, 0, n)
	picked := make([]netip.AddrPort, 0, n)
	for range n {
		if err := r.m.SetBackend(pkTripBEID, active); err != nil {
			return nil, err
		}
		c := r.nextClient()
		syn.setSrc(c)
		if ret, sz, _, err := testRun(r.dp.PbXdp, syn, r.out, 1); err != nil || ret != bpftest.XDPPass || dstOf(r.out[:sz]) != pkTripBE {
			return nil, fmt.Errorf("trip: SYN from %v: verdict %d, to %v, %v", c, ret, dstOf(r.out[:sz]), err)
		}
		rst := frame(bpftest.Refusal(pkTripBE, c, 1000))
		t0 := outcomes.MonoNow()
		ret, sz, ns, err := testRun(r.dp.PbXdp, rst, r.out, 1)
		t1 := outcomes.MonoNow()
		if err != nil {
			return nil, err
		}
		if ret != bpftest.XDPPass || srcOf(r.out[:sz]) != pkVIPTrip || dstOf(r.out[:sz]) != c {
			return nil, fmt.Errorf("trip: RST to %v: verdict %d, %v -> %v, want passed from %v", c, ret, srcOf(r.out[:sz]), dstOf(r.out[:sz]), pkVIPTrip)
		}
		b, err := r.m.Backend(pkTripBEID)
		if err != nil {
			return nil, err
		}
		if tripped := maps.BackendState(b.State) == maps.BackendEjected; tripped != trip {
			return nil, fmt.Errorf("trip: %w: backend state %v after the RST (trips on: %v)", errPath, maps.BackendState(b.State), trip)
		}
		if trip {
			if at := int64(r.m.BackendTrip(pkTripBEID).TrippedNs); at < t0 || at > t1 {
				return nil, fmt.Errorf("trip: %w: tripped_ns %d outside the run's call [%d, %d]", errPath, at, t0, t1)
			}
		}
		durs = append(durs, float64(ns))
		clients = append(clients, c)
		picked = append(picked, pkTripBE)
	}
	want := before
	if trip {
		want += uint64(n)
	}
	if got := r.m.ServiceTrip(pkTripSvc).Trips; got != want {
		return nil, fmt.Errorf("trip: %w: pb_svc_trip.trips %d, want %d", errPath, got, want)
	}
	r.waitRead(read0 + 2*uint64(n)) // NEW_FLOW and REFUSED per flow
	if got := r.read.Load() - read0; got != 2*uint64(n) {
		return nil, fmt.Errorf("trip: %w: %d events read, want %d", errPath, got, 2*n)
	}
	if err := r.m.SetBackend(pkTripBEID, active); err != nil {
		return nil, err
	}
	return durs, r.forget(pkVIPTrip, clients, picked, false, pkTripSvc)
}

const (
	fTripNo = "refused flow's RST, not deciding (streak counted)"
	fTrip   = "refused flow's RST that trips its backend (deciding failure → excluded)"
)

// tripFigures adds one round of the kernel-trip rows: p50, p99 and max of
// the RST's run, tripping against not.
func tripFigures(r *packetRig, res *Results, n int) error {
	no, err := r.tripRuns(false, n)
	if err != nil {
		return err
	}
	yes, err := r.tripRuns(true, n)
	if err != nil {
		return err
	}
	for _, p := range []struct {
		name string
		q    float64
	}{{"p50", 50}, {"p99", 99}, {"max", 100}} {
		b := res.figure("trip", fTripNo+", "+p.name, "ns")
		b.Samples = append(b.Samples, percentile(no, p.q))
		f := res.figure("trip", fTrip+", "+p.name, "ns")
		f.Samples = append(f.Samples, percentile(yes, p.q))
		f.Baseline = b.Name
	}
	return nil
}
