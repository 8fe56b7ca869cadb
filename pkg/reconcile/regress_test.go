// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/desired"
	pbmaps "github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/maps/mapsfake"
)

// Regression tests for bugs a review of the double-table design found in
// reconcile.go; each failed before its fix.

// The fallback table is no longer removed when probation ends, but
// nothing keeps its contents valid afterwards: it keeps the ids of the
// backends that were active then. One of them leaves the service, is
// freed by Sweep after its cooldown (Sweep knows nothing of fallbacks),
// and its id is handed to another service's new endpoint. lb.c consults
// the fallback for every slot whose backend is not active (not only for
// spent probes: ejected and removed ones too), and table_lookup does not
// compare the backend's svc_id: from then on, whenever web's live table
// has a non-active slot (an ejection's window before the flip, a removed
// backend between Apply and ProgramService, or, for as long as it lasts,
// a probe that is the only admitted backend), web's new flows are steered
// to the other service's backend.
func TestKnownBugStaleFallbackSteersToAnotherService(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep(beA), ep(beB), ep(beC))
	api := svc("api", vip2, 443)
	e.apply(web, api)
	webID := e.service(web.Key).ID
	a, b, c := e.bid(web.Key, beA), e.bid(web.Key, beB), e.bid(web.Key, beC)
	e.program(webID, []uint32{a, b, c}, nil, false)
	e.program(webID, []uint32{a, b}, []uint32{c}, false) // fallback over {a, b}
	e.program(webID, []uint32{a, b, c}, nil, false)      // probe succeeded; the fallback stays
	if !slices.Contains(e.f.PbMaglevFb[webID], b) {
		t.Fatal("setup: b not in the fallback")
	}

	// b's endpoint leaves web; the agent reprograms web right away.
	web.Endpoints = []desired.Endpoint{ep(beA), ep(beC)}
	e.apply(web, api)
	e.program(webID, []uint32{a, c}, nil, false)

	// After its cooldown b's id is freed, and api's new endpoint gets it.
	e.clk.Step(testCooldown)
	e.sweep(InUse{})
	e.sweep(InUse{})
	api.Endpoints = []desired.Endpoint{ep("198.19.2.1:8443")}
	e.apply(web, api)
	apiS := e.service(api.Key)
	if apiS.Backends[0] != b {
		t.Fatalf("setup: api's backend got id %d, not the freed %d", apiS.Backends[0], b)
	}
	e.program(apiS.ID, apiS.Backends, nil, false) // the fake's invariant check fails here

	// c fails, a is ejected meanwhile, c goes back on probation alone:
	// its grant spent, every new flow of web consults the fallback.
	e.program(webID, []uint32{a}, nil, false)
	e.program(webID, nil, []uint32{c}, false)
	e.spendGrants(c)
	for h := range uint32(4 * testTableSize) {
		id, _, ok := e.f.Pick(keyOf(web.Key), h*2654435761, true)
		if ok && e.f.PbBackends[id].SvcId != webID {
			be, _ := e.r.Backend(id)
			t.Fatalf("a new flow to web's VIP went to backend %d (%s) of service %d", id, be.Addr, be.Service)
		}
	}
}

// ProgramService carries on when SetFallback fails: the endpoint enters
// probation and the table with it goes live, without the fallback the
// datapath needs to steer the flows a spent probe does not take (step 2
// only appends the error). Those flows are rehashed instead, and sent to
// the backend in probation when the rehashes miss: more flows to an
// endpoint that is failing than its probe grants.
func TestKnownBugFailedFallbackStillEntersProbation(t *testing.T) {
	e, web, id := webEnv(t)
	a, b, c := e.bid(web.Key, beA), e.bid(web.Key, beB), e.bid(web.Key, beC)
	e.program(id, []uint32{a, b, c}, nil, false)
	e.apply(web)
	e.f.TakeOps()

	e.f.Fail[opSetFallback] = 1
	if err := e.r.ProgramService(id, []uint32{a, b}, []uint32{c}, false, 0); err == nil {
		t.Error("no error")
	}
	// The fake's invariant check fails at c's probation state; and:
	if _, ok := e.f.PbMaglevFb[id]; !ok {
		if st := pbmaps.BackendState(e.f.PbBackends[c].State); st == pbmaps.BackendProbation {
			t.Errorf("backend %d entered probation with no fallback table: %s", c, opsString(e.f.TakeOps()))
		}
	}
}

// prepareTables only prepares the table that is not live when Apply (or
// SetTableSize) runs. The agent calls Apply on configuration changes
// only, so after a service's first table goes live its other table does
// not exist yet, and the first ejection's ProgramService installs it
// itself: an RCU grace period (milliseconds) between the ejected state and
// the table without the endpoint, the cost Apply's batching was meant to
// keep off the path of an ejection; for every service after a start, and
// again after every resize (the table that was live, now the spare, has
// the old size).
func TestKnownBugFirstEjectionInstallsTable(t *testing.T) {
	t.Run("after start", func(t *testing.T) {
		e, web, id := webEnv(t) // Apply: table 0 installed
		all := slices.Clone(e.service(web.Key).Backends)
		e.program(id, all, nil, false) // start-up: table 0 goes live
		e.prepare()                    // what the agent does after programming
		e.f.TakeOps()
		e.program(id, all[1:], nil, false) // an ejection, no Apply since
		if ops := e.f.TakeOps(); count(ops, kindIs(opInstallTables)) != 0 {
			t.Errorf("ejection installed a table: %s", opsString(ops))
		}
	})
	t.Run("after a resize", func(t *testing.T) {
		e, web, id := webEnv(t)
		all := slices.Clone(e.service(web.Key).Backends)
		e.program(id, all, nil, false)
		e.apply(web) // both tables at 31
		if err := e.r.SetTableSize(61); err != nil {
			t.Fatal(err)
		}
		e.program(id, all, nil, false) // the agent reprograms: table 1 of 61 slots goes live
		e.prepare()
		e.f.TakeOps()
		e.program(id, all[1:], nil, false) // an ejection
		if ops := e.f.TakeOps(); count(ops, kindIs(opInstallTables)) != 0 {
			t.Errorf("ejection installed a table: %s", opsString(ops))
		}
	})
}

// Apply forgets a removed service even when its DeleteService failed, and
// never retries it: the entry stays in pb_services with its live table,
// whose backends Sweep frees after the cooldown (the table then points at
// cleared entries: flows to the old VIP dropped), and whose id Sweep
// reuses. The next service with that id has its table 0 installed and
// filled while the forgotten entry still has it live (an empty live
// table, then the old VIP's flows sent to the new service's backends).
func TestKnownBugFailedDeleteServiceNotRetried(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep(beA))
	api := svc("api", vip2, 443, ep("198.19.2.1:8443"))
	e.apply(web, api)
	e.programAll()
	apiID := e.service(api.Key).ID

	e.f.Fail[opDeleteService] = 1
	if _, err := e.r.Apply(state(web), e.acc); err == nil {
		t.Fatal("no error")
	}
	// The next Apply (or PrepareTables) finishes the removal.
	e.apply(web)
	if _, ok := e.f.PbServices[keyOf(api.Key)]; ok {
		t.Errorf("removed service %d still in pb_services after the next Apply", apiID)
	}

	e.clk.Step(testCooldown)
	e.sweep(InUse{})
	e.sweep(InUse{})
	dns := svc("dns", vip3, 53, ep("198.19.3.1:53"))
	e.apply(web, dns)
	if id := e.service(dns.Key).ID; id != apiID {
		t.Logf("dns got id %d, not %d", id, apiID)
	}
	e.programAll()
	for h := range uint32(4 * testTableSize) {
		if id, _, ok := e.f.Pick(keyOf(api.Key), h*2654435761, true); ok {
			be, _ := e.r.Backend(id)
			t.Fatalf("a new flow to removed service api's VIP went to %s of service %d", be.Addr, be.Service)
		}
	}
}

// nextTable masks the table index only when a table is live: an adopted
// entry whose table field is not 0 or 1 while table_size is 0 (a pinned
// map written by another version, or corrupted) makes prepareTables index
// Service.sizes out of range, and the agent panics at every start.
func TestKnownBugAdoptedTableIndexOutOfRange(t *testing.T) {
	f := mapsfake.New(t)
	k := pbmaps.ServiceKey(netip.MustParseAddr(vip1), 80, uint8(desired.TCP))
	f.PbServices[k] = bpf.LbSvcValue{Id: 5, Table: 2, TableSize: 0}
	f.PbVIPSlots[pbmaps.VIPSlot(netip.MustParseAddr(vip1))] = true
	f.PbBackends[7] = pbmaps.NewBackend(mustAP(beA), 5, pbmaps.BackendEjected, 0)
	r, err := New(f, Options{MaxServices: 64, MaxBackends: 256, TableSize: testTableSize, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if p := recover(); p != nil {
			t.Errorf("panic: %v", p)
		}
	}()
	if _, err := r.Apply(state(svc("web", vip1, 80, ep(beA))), heard{}); err != nil {
		t.Error(err)
	}
	if err := r.ProgramService(5, []uint32{7}, nil, false, 0); err != nil {
		t.Error(err)
	}
}

// retryRefused is a flag of the service's pb_services value: turning it
// on or off rewrites that one entry and touches no backend.
func TestRetryRefusedFlagFollowsTheService(t *testing.T) {
	e := newEnv(t)
	web := svc("web", vip1, 80, ep(beA), ep(beB))
	web.RetryRefused = true
	e.apply(web)
	e.programAll()
	e.prepare() // the spare table, so that only the flag change is left to write
	s := e.service(web.Key)
	key := pbmaps.ServiceKey(web.Key.VIP, web.Key.Port, uint8(web.Key.Protocol))
	if got := e.f.PbServices[key].Flags; got&pbmaps.ServiceRetryRefused == 0 {
		t.Fatalf("pb_services flags %#x, want retry-refused", got)
	}
	e.f.TakeOps()
	web.RetryRefused = false
	e.apply(web)
	ops := e.f.TakeOps()
	if len(ops) != 1 || count(ops, kindIs(opUpsertService)) != 1 {
		t.Fatalf("turning retryRefused off wrote %s, want one service entry", opsString(ops))
	}
	if got := e.f.PbServices[key]; got.Flags&pbmaps.ServiceRetryRefused != 0 || got != s.value {
		t.Fatalf("pb_services value %+v after turning it off, want no retry-refused and the rest as before", got)
	}
	// Applying the same again writes nothing.
	e.apply(web)
	if ops := e.f.TakeOps(); len(ops) != 0 {
		t.Fatalf("second apply wrote %s", opsString(ops))
	}
}

// The quiet flags follow what the service's verdicts wait for: data when
// resets before data count, the end when resets after data count, the
// SYN-ACK otherwise; untracked services need no events at all.
func TestQuietFlagsFollowTheSettings(t *testing.T) {
	both := pbmaps.ServiceQuietData | pbmaps.ServiceQuietEnd
	for _, tc := range []struct {
		name  string
		kinds accrual.Kinds
		mode  accrual.Mode
		udp   bool
		want  uint32
	}{
		{"resets count: verdict at first data", accrual.KindsOf(accrual.KindRefused, accrual.KindReset), accrual.ModeConsecutive, false, pbmaps.ServiceQuietEnd},
		{"resets after data count: verdict at the end", accrual.KindsOf(accrual.KindReset, accrual.KindResetAfterData), accrual.ModeFailureRate, false, 0},
		{"no resets: verdict at the SYN-ACK", accrual.KindsOf(accrual.KindRefused, accrual.KindTimeout), accrual.ModeUnified, false, both},
		{"accrual off", accrual.KindsOf(accrual.KindReset), accrual.ModeNone, false, both},
		{"UDP", accrual.KindsOf(accrual.KindReset), accrual.ModeConsecutive, true, both},
	} {
		s := svc("web", vip1, 80)
		s.Accrual = accrual.Defaults()
		s.Accrual.Mode, s.Accrual.FailureKinds = tc.mode, tc.kinds
		if tc.udp {
			s.Key.Protocol = desired.UDP
		}
		if got := quietFlags(&s); got != tc.want {
			t.Errorf("%s: flags %#x, want %#x", tc.name, got, tc.want)
		}
	}
}
