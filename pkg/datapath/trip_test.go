// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

const evfTripped = uint8(bpf.LbPbEventFlagPB_EVF_TRIPPED)

// clientN is the n-th client port: a new flow each.
func clientN(n int) netip.AddrPort {
	return netip.AddrPortFrom(client.Addr(), uint16(41000+n))
}

// tripFixture: every slot of the table on backend 1, both backends listed
// (so a flow steered off backend 1 finds backend 2), and kernel trips at
// maxFailures with budget.
func tripFixture(t *testing.T, maxFailures uint32, kinds uint32, budget int64) *fixture {
	f := newFixture(t)
	f.must(f.Maps.SetServiceBackends(svcID, nil, []uint32{id1, id2}))
	f.svc.BackendCount = 2
	f.table(id1)
	f.Maps.SetServiceTrip(svcID, maps.TripSettings{MaxFailures: maxFailures, Kinds: kinds, Settle: time.Second}, budget)
	return f
}

// refuse runs one flow that backend 1 refuses and returns its REFUSED
// event's flags.
func (f *fixture) refuse(n int) uint8 {
	f.t.Helper()
	c := clientN(n)
	_, p, _ := f.run(bpftest.TCP(c, vip, bpftest.SYN, nil))
	if p.Dst != be1 {
		f.t.Fatalf("flow %d went to %v, want %v", n, p.Dst, be1)
	}
	f.run(bpftest.TCP(be1, c, bpftest.RST, nil))
	evs := f.events()
	if len(evs) != 2 || evs[1].Type != evRefused {
		f.t.Fatalf("flow %d: events %+v, want NEW_FLOW and REFUSED", n, evs)
	}
	return evs[1].Flags
}

func (f *fixture) state(id uint32) maps.BackendState {
	f.t.Helper()
	b, err := f.Maps.Backend(id)
	f.must(err)
	return maps.BackendState(b.State)
}

// The datapath ejects a backend itself at its maxFailures-th consecutive
// refusal: the very next new flow that would pick it is steered to another
// backend, with no agent running.
func TestKernelTripEjectsAtMaxFailures(t *testing.T) {
	f := tripFixture(t, 3, maps.TripRefused, 1)
	for i := range 3 {
		flags := f.refuse(i)
		if tripped := flags&evfTripped != 0; tripped != (i == 2) {
			t.Fatalf("refusal %d: tripped %v, want it on the 3rd only", i+1, tripped)
		}
		if want := map[bool]maps.BackendState{false: maps.BackendActive, true: maps.BackendEjected}[i == 2]; f.state(id1) != want {
			t.Fatalf("after refusal %d backend 1 is %v, want %v", i+1, f.state(id1), want)
		}
	}
	_, p, _ := f.run(bpftest.TCP(clientN(9), vip, bpftest.SYN, nil))
	if p.Dst != be2 {
		t.Fatalf("the flow after the trip went to %v, want %v", p.Dst, be2)
	}
	st := f.Maps.ServiceTrip(svcID)
	if st.Trips != 1 || st.Budget != 0 || st.Suppressed != 0 {
		t.Errorf("pb_svc_trip %+v: want 1 trip, the budget spent", st)
	}
	bt := f.Maps.BackendTrip(id1)
	if bt.Failures != 3 || bt.TrippedNs == 0 {
		t.Errorf("pb_be_trip %+v: want 3 failures and the trip's time", bt)
	}
	gs, err := f.Maps.GlobalStats()
	f.must(err)
	if gs.Steered != 1 {
		t.Errorf("steered = %d, want 1", gs.Steered)
	}
}

// The budget (what maxEjectionPercent leaves) holds a trip back, counted;
// a trip needs an active backend and a kind the service counts; 0 turns
// trips off.
func TestKernelTripLimits(t *testing.T) {
	t.Run("no budget", func(t *testing.T) {
		f := tripFixture(t, 2, maps.TripRefused, 0)
		for i := range 3 {
			if f.refuse(i)&evfTripped != 0 {
				t.Fatal("tripped without budget")
			}
		}
		if st := f.Maps.ServiceTrip(svcID); st.Suppressed != 2 || st.Trips != 0 || st.Budget != 0 {
			t.Errorf("pb_svc_trip %+v: want 2 suppressed (refusals 2 and 3), no trip, budget 0", st)
		}
		if f.state(id1) != maps.BackendActive {
			t.Errorf("backend 1 is %v", f.state(id1))
		}
	})
	t.Run("off", func(t *testing.T) {
		f := tripFixture(t, 0, maps.TripRefused, 5)
		for i := range 4 {
			if f.refuse(i)&evfTripped != 0 {
				t.Fatal("tripped with maxFailures 0")
			}
		}
		if bt := f.Maps.BackendTrip(id1); bt.Failures != 0 {
			t.Errorf("counted %d failures with trips off", bt.Failures)
		}
	})
	t.Run("kind not counted", func(t *testing.T) {
		f := tripFixture(t, 1, maps.TripReset, 5)
		if f.refuse(0)&evfTripped != 0 || f.state(id1) != maps.BackendActive {
			t.Fatal("a refusal tripped a service that counts only resets")
		}
		// A reset after the handshake does.
		c := clientN(1)
		f.handshake(c, be1)
		f.run(bpftest.TCP(be1, c, bpftest.RST, nil))
		evs := f.events()
		if len(evs) != 3 || evs[2].Type != evReset || evs[2].Flags&evfTripped == 0 {
			t.Fatalf("events %+v: want a tripping RESET", evs)
		}
		if f.state(id1) != maps.BackendEjected {
			t.Errorf("backend 1 is %v after the tripping reset", f.state(id1))
		}
	})
	t.Run("no endpoint under the id", func(t *testing.T) {
		// A flow kept from before pb_backends was recreated (a new
		// --max-backends): its backend's entry is zeroed, whose state
		// reads active. Its refusal may not eject that id.
		f := tripFixture(t, 1, maps.TripRefused, 5)
		c := clientN(0)
		if _, p, _ := f.run(bpftest.TCP(c, vip, bpftest.SYN, nil)); p.Dst != be1 {
			t.Fatalf("flow went to %v, want %v", p.Dst, be1)
		}
		f.must(f.Maps.ClearBackend(id1))
		f.run(bpftest.TCP(be1, c, bpftest.RST, nil))
		evs := f.events()
		if len(evs) != 2 || evs[1].Type != evRefused || evs[1].Flags&evfTripped != 0 {
			t.Fatalf("events %+v: want NEW_FLOW and a REFUSED that trips nothing", evs)
		}
		if f.state(id1) != maps.BackendActive {
			t.Errorf("the cleared entry's state is %v, want it left zeroed", f.state(id1))
		}
		if st := f.Maps.ServiceTrip(svcID); st.Trips != 0 || st.Budget != 5 {
			t.Errorf("pb_svc_trip %+v: want no trip, the budget untouched", st)
		}
	})
	t.Run("probation never trips", func(t *testing.T) {
		f := tripFixture(t, 1, maps.TripRefused, 5)
		f.must(f.Maps.SetBackend(id1, maps.NewBackend(be1, svcID, maps.BackendProbation, 1)))
		f.must(f.Maps.SetFallback(svcID, fill(id2)))
		if flags := f.refuse(0); flags&evfTripped != 0 {
			t.Fatal("a probe's refusal tripped")
		}
		if f.state(id1) != maps.BackendProbation {
			t.Errorf("backend 1 is %v, want still in probation (the agent judges probes)", f.state(id1))
		}
	})
}

// The streak ends where the agent's tracker decides a success: at the
// SYN-ACK when the service's successes are not decided by data
// (QUIET_DATA), at the first data otherwise, and at a clean close always.
func TestKernelTripStreakEndsAtSuccess(t *testing.T) {
	for _, c := range []struct {
		name   string
		flags  uint32
		data   bool // the backend sends data
		closes bool // FIN both ways
		ends   bool // the streak ends
	}{
		{"SYN-ACK, success on SYN-ACK", maps.ServiceQuietData | maps.ServiceQuietEnd, false, false, true},
		{"SYN-ACK, success on data", maps.ServiceQuietEnd, false, false, false},
		{"data, success on data", maps.ServiceQuietEnd, true, false, true},
		{"data, success on close", 0, true, false, false},
		{"close, success on close", 0, false, true, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := tripFixture(t, 10, maps.TripRefused, 5)
			f.svc.Flags = c.flags
			f.writeService()
			f.refuse(0)
			f.refuse(1)
			cl := clientN(2)
			f.run(bpftest.TCP(cl, vip, bpftest.SYN, nil))
			f.run(bpftest.TCP(be1, cl, bpftest.SYNACK, nil))
			f.run(bpftest.TCP(cl, vip, bpftest.ACK, nil))
			if c.data {
				f.run(bpftest.TCP(be1, cl, bpftest.ACK, []byte("hello")))
			}
			if c.closes {
				f.run(bpftest.TCP(cl, vip, bpftest.FIN, nil))
				f.run(bpftest.TCP(be1, cl, bpftest.FIN, nil))
			}
			want := uint32(2)
			if c.ends {
				want = 0
			}
			if got := f.Maps.BackendTrip(id1).Failures; got != want {
				t.Errorf("streak %d after the connection, want %d", got, want)
			}
			f.events()
		})
	}
}

// Trips on many backends take exactly the budget, even when each one's
// deciding failure comes interleaved with the others'.
func TestKernelTripBudgetIsExact(t *testing.T) {
	f := tripFixture(t, 1, maps.TripRefused, 1)
	f.refuse(0)
	// Backend 2 takes the table; its own refusal finds no budget.
	f.table(id2)
	c := clientN(1)
	_, p, _ := f.run(bpftest.TCP(c, vip, bpftest.SYN, nil))
	if p.Dst != be2 {
		t.Fatalf("flow went to %v", p.Dst)
	}
	f.run(bpftest.TCP(be2, c, bpftest.RST, nil))
	evs := f.events()
	if len(evs) != 2 || evs[1].Flags&evfTripped != 0 {
		t.Fatalf("events %+v: want backend 2's refusal without a trip", evs)
	}
	if f.state(id1) != maps.BackendEjected || f.state(id2) != maps.BackendActive {
		t.Errorf("states %v, %v: want only backend 1 ejected", f.state(id1), f.state(id2))
	}
	if st := f.Maps.ServiceTrip(svcID); st.Trips != 1 || st.Suppressed != 1 {
		t.Errorf("pb_svc_trip %+v", st)
	}

}

// A reset counts only while the agent could still call it a failure:
// within the connect timeout (settle) of the flow's SYN. A reset of an
// older flow, which the agent has judged a success, does not.
func TestKernelTripIgnoresResetsOfSettledFlows(t *testing.T) {
	f := tripFixture(t, 1, maps.TripReset, 5)
	f.Maps.SetServiceTrip(svcID, maps.TripSettings{MaxFailures: 1, Kinds: maps.TripReset, Settle: time.Nanosecond}, 5)
	c := clientN(1)
	f.handshake(c, be1)
	f.run(bpftest.TCP(be1, c, bpftest.RST, nil))
	evs := f.events()
	if len(evs) != 3 || evs[2].Type != evReset || evs[2].Flags&evfTripped != 0 {
		t.Fatalf("events %+v: want a RESET that does not trip", evs)
	}
	if bt := f.Maps.BackendTrip(id1); bt.Failures != 0 || f.state(id1) != maps.BackendActive {
		t.Errorf("streak %d, state %v: a settled flow's reset was counted", bt.Failures, f.state(id1))
	}
}
