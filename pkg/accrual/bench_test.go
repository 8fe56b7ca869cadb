// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"math/rand/v2"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"
)

// benchEngine returns an engine with services × perService endpoints
// (dense ids) under settings st.
func benchEngine(services, perService int, st Settings) (*Engine, *testingclock.FakePassiveClock) {
	clk := testingclock.NewFakePassiveClock(t0)
	e := New(clk, rand.New(rand.NewPCG(1, 2)).Float64)
	id := uint32(0)
	for s := range services {
		eps := make([]uint32, perService)
		for i := range eps {
			eps[i] = id
			id++
		}
		e.SetService(uint32(s), "svc", st, eps)
	}
	return e, clk
}

func reportRate(b *testing.B, what string) {
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), what+"/s")
}

// BenchmarkObserve is the agent's steady state: mixed successes and
// failures (counted and ignored kinds) spread over 64 services × 64
// endpoints, none reaching MaxFailures, so nothing transitions.
func BenchmarkObserve(b *testing.B) {
	const services, perService = 64, 64
	e, _ := benchEngine(services, perService, Defaults())
	r := rand.New(rand.NewPCG(3, 4))
	outcomes := make([]Outcome, 1<<14)
	streak := make([]int, services*perService)
	last := map[int]int{} // endpoint → index of its last outcome
	at := t0
	for i := range outcomes {
		ep := uint32(r.IntN(services * perService))
		o := Outcome{Endpoint: ep, At: at}
		switch {
		case streak[ep] >= 3 || r.IntN(2) == 0:
			o.Success = true
			streak[ep] = 0
		case r.IntN(8) == 0:
			o.Kind = KindResetAfterData // ignored by default
		default:
			o.Kind = []Kind{KindRefused, KindTimeout, KindReset}[r.IntN(3)]
			streak[ep]++
		}
		outcomes[i] = o
		last[int(ep)] = i
	}
	// End every endpoint's sequence on a success, so the streaks (at most
	// 3) do not carry over when the sequence repeats.
	for ep, i := range last {
		if streak[ep] > 0 {
			outcomes[i] = Outcome{Endpoint: uint32(ep), Success: true, At: at}
		}
	}
	// One pass to warm up; the sequence then repeats without transitions.
	for _, o := range outcomes {
		if e.Observe(o) != nil {
			b.Fatal("transition in warm-up")
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if ts := e.Observe(outcomes[i&(len(outcomes)-1)]); ts != nil {
			b.Fatalf("unexpected transition %v", ts)
		}
	}
	reportRate(b, "outcomes")
}

// BenchmarkObserveTransitions exercises the transition paths: every
// outcome changes a state.
func BenchmarkObserveTransitions(b *testing.B) {
	// A single-endpoint service with MaxFailures 1: a failure ejects it and
	// starts fail-open, a success returns it and ends fail-open (two
	// transitions per outcome).
	b.Run("fail-open cycle", func(b *testing.B) {
		e, _ := benchEngine(1, 1, testSettings(func(s *Settings) { s.MaxFailures = 1; s.JitterRatio = 0.5 }))
		cycle := [2]Outcome{fail(0, KindRefused), succ(0)}
		b.ReportAllocs()
		for i := range b.N {
			if len(e.Observe(cycle[i&1])) != 2 {
				b.Fatal("expected two transitions")
			}
		}
		reportRate(b, "outcomes")
	})
	// The full state machine over 1024 endpoints of one service: eject
	// (heap push), Advance to probation (heap pop), probe success; one
	// Observe and a share of Advance per transition.
	b.Run("eject-probation-ready", func(b *testing.B) {
		const n = 1024
		e, clk := benchEngine(1, n, testSettings(func(s *Settings) { s.MaxFailures = 1; s.JitterRatio = 0.5 }))
		b.ReportAllocs()
		transitions := 0
		for i := 0; i < b.N; {
			for ep := uint32(0); ep < n && i < b.N; ep++ {
				transitions += len(e.Observe(fail(ep, KindTimeout)))
				i++
			}
			clk.SetTime(clk.Now().Add(2 * time.Minute))
			transitions += len(e.Advance())
			for ep := uint32(0); ep < n && i < b.N; ep++ {
				transitions += len(e.Observe(probeOK(ep)))
				i++
			}
		}
		reportRate(b, "outcomes")
		b.ReportMetric(float64(transitions)/b.Elapsed().Seconds(), "transitions/s")
	})
}

// BenchmarkSnapshot sizes the admin API's cost: 64 services × 64 endpoints.
func BenchmarkSnapshot(b *testing.B) {
	e, _ := benchEngine(64, 64, Defaults())
	b.ReportAllocs()
	for range b.N {
		e.Snapshot()
	}
}
