package inspect

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/admin"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/maps/mapsfake"
)

// kernel is the shared in-memory maps holding svcs and bes, with the
// counters the tests below read: 7 events lost, each service's flows ten
// times its id, each backend's its id, every odd backend one failure into
// its kernel streak.
func kernel(t *testing.T, svcs map[bpf.LbSvcKey]bpf.LbSvcValue, bes map[uint32]bpf.LbBackend) *mapsfake.Maps {
	f := mapsfake.New(t)
	// The maps as a datapath left them, set whole: no writes to check.
	f.Check = nil
	f.PbServices = svcs
	if bes != nil {
		f.PbBackends = bes
	}
	f.Global.EventsLost = 7
	for _, v := range svcs {
		f.SvcStats[v.Id] = bpf.LbSvcStats{Flows: 10 * uint64(v.Id)}
	}
	for id := range bes {
		f.BeStats[id] = bpf.LbBeStats{Flows: uint64(id)}
		f.PbBeTrip[id] = bpf.LbBeTrip{Failures: id % 2}
	}
	return f
}

// failTables makes every table read fail with err.
func failTables(f *mapsfake.Maps, err error) {
	f.Fail["Table"], f.Err["Table"] = 1<<30, err
}

func backend(addr string, svc uint32, st maps.BackendState, grants int32) bpf.LbBackend {
	return maps.NewBackend(netip.MustParseAddrPort(addr), svc, st, grants)
}

// Read turns the maps into the operator's terms: addresses and ports in
// the usual notation, each endpoint's table share, datapath and accrual
// states, the penalty left; removed backends and other services' left out.
func TestReadDescribesServicesAndEndpoints(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	f := kernel(t, map[bpf.LbSvcKey]bpf.LbSvcValue{
		maps.ServiceKey(netip.MustParseAddr("198.18.100.2"), 443, 6): {Id: 2, Table: 1, TableSize: 5, Flags: maps.ServiceRetryRefused},
		maps.ServiceKey(netip.MustParseAddr("198.18.100.1"), 80, 17): {Id: 1, Table: 0, TableSize: 3, MaxInflight: 9},
	}, map[uint32]bpf.LbBackend{
		1: backend("198.18.1.2:8080", 2, maps.BackendActive, 0),
		2: backend("198.18.2.2:8080", 2, maps.BackendEjected, 0),
		3: backend("198.18.3.2:8080", 2, maps.BackendProbation, 1),
		4: backend("198.18.4.2:8080", 2, maps.BackendRemoved, 0),
		5: backend("198.18.5.2:53", 1, maps.BackendActive, 0),
	})
	f.PbHealth = map[uint32]bpf.LbEndpointHealth{
		2: {SvcId: 2, State: uint8(accrual.Ejected), ConsecutiveFailures: 5, Ejections: 2, PenaltyNs: uint64(4 * time.Second),
			ProbationAtNs: now.Add(1500 * time.Millisecond).UnixNano(), LastFailureKind: uint8(accrual.KindRefused),
			LastFailureNs: now.Add(-2 * time.Second).UnixNano()},
		3: {SvcId: 2, State: uint8(accrual.Probation)},
		5: {SvcId: 9, State: uint8(accrual.Ejected)}, // a record of another service: stale
	}
	f.PbMaglev[maps.TableKey(2, 1)] = []uint32{1, 1, 3, 1, 1}
	f.PbMaglev[maps.TableKey(1, 0)] = []uint32{5, 5, 5}
	f.PbSvcTrip[2] = bpf.LbSvcTrip{MaxFailures: 5, Kinds: maps.TripRefused, Budget: 1, Trips: 3}
	f.SvcInflight[2], f.BeInflight[1], f.BeInflight[3] = 4, 3, 1
	r, err := Read(f, now, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Services) != 2 || r.Services[0].ID != 1 || r.Datapath.EventsLost != 7 {
		t.Fatalf("services %+v, datapath %+v: want both, by id", r.Services, r.Datapath)
	}
	udp, web := r.Services[0], r.Services[1]
	if udp.VIP != "198.18.100.1:80" || udp.Protocol != "udp" || udp.MaxInflight != 9 || udp.KernelTrips != nil || udp.RetryRefused {
		t.Errorf("service 1: %+v", udp)
	}
	if e := udp.Endpoints; len(e) != 1 || e[0].Accrual.State != "ready" || e[0].Accrual.Recorded || e[0].Slots != 3 {
		t.Errorf("service 1's endpoints %+v: want one, ready (its record is another service's), all 3 slots", e)
	}
	if web.VIP != "198.18.100.2:443" || !web.RetryRefused || web.Inflight != 4 || web.Counters.Flows != 20 ||
		web.KernelTrips == nil || web.KernelTrips.Trips != 3 || web.KernelTrips.Kinds[0] != "refused" {
		t.Errorf("service 2: %+v", web)
	}
	if len(web.Endpoints) != 3 {
		t.Fatalf("service 2's endpoints %+v: want 3 (the removed one left out)", web.Endpoints)
	}
	a, ej, pr := web.Endpoints[0], web.Endpoints[1], web.Endpoints[2]
	if a.Addr != "198.18.1.2:8080" || a.Datapath != "active" || a.Slots != 4 || a.Inflight != 3 || a.Accrual.State != "ready" || a.KernelStreak != 1 {
		t.Errorf("active endpoint %+v", a)
	}
	if ej.Datapath != "ejected" || ej.Slots != 0 || ej.Accrual.State != "ejected" || ej.Accrual.PenaltyLeft != "1.5s" ||
		ej.Accrual.Penalty != "4s" || ej.Accrual.LastFailureKind != "refused" || ej.Accrual.Ejections != 2 {
		t.Errorf("ejected endpoint %+v", ej)
	}
	if pr.Datapath != "probation" || pr.ProbeGrants != 1 || pr.Slots != 1 || pr.Accrual.State != "probation" || pr.Accrual.PenaltyLeft != "" {
		t.Errorf("probation endpoint %+v", pr)
	}

	var out bytes.Buffer
	if err := r.Text(&out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"service 2  198.18.100.2:443/tcp", "retryRefused", "kernel trips at 5 failures (refused): 3 trips",
		"198.18.2.2:8080", "refused 2s ago", "probation (1 grant)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("text output lacks %q:\n%s", want, out.String())
		}
	}
}

// Without CAP_SYS_ADMIN (the DaemonSet's capabilities) the tables cannot
// be opened: everything else is still read, slots are unknown.
func TestReadWithoutTables(t *testing.T) {
	f := kernel(t, map[bpf.LbSvcKey]bpf.LbSvcValue{
		maps.ServiceKey(netip.MustParseAddr("198.18.100.1"), 80, 6): {Id: 1, TableSize: 3},
	}, map[uint32]bpf.LbBackend{1: backend("198.18.1.2:8080", 1, maps.BackendEjected, 0)})
	failTables(f, fmt.Errorf("open map: %w", unix.EPERM))
	r, err := Read(f, time.Now(), 0)
	if err != nil {
		t.Fatal(err)
	}
	s := r.Services[0]
	if s.TableUnread == "" || s.Endpoints[0].Slots != -1 || s.Endpoints[0].Datapath != "ejected" {
		t.Errorf("service %+v: want the table unread, slots unknown, the rest read", s)
	}
	var out bytes.Buffer
	r.Text(&out)
	if !strings.Contains(out.String(), "slots unknown") {
		t.Errorf("text output:\n%s", out.String())
	}
	failTables(f, errors.New("boom"))
	if _, err := Read(f, time.Now(), 0); err == nil {
		t.Error("another table error was not reported")
	}
}

// An IPv6 service and its endpoints print in the usual notation, beside
// an IPv4 service on the same port.
func TestReadIPv6(t *testing.T) {
	f := kernel(t, map[bpf.LbSvcKey]bpf.LbSvcValue{
		maps.ServiceKey(netip.MustParseAddr("198.18.100.1"), 80, 6): {Id: 1, TableSize: 3},
		maps.ServiceKey(netip.MustParseAddr("2001:2::10"), 80, 6):   {Id: 2, TableSize: 3},
	}, map[uint32]bpf.LbBackend{
		1: backend("198.18.1.2:8080", 1, maps.BackendActive, 0),
		2: backend("[2001:2::1:2]:8080", 2, maps.BackendActive, 0),
		3: backend("[2001:2::2:2]:8080", 2, maps.BackendEjected, 0),
	})
	f.PbMaglev[maps.TableKey(1, 0)] = []uint32{1, 1, 1}
	f.PbMaglev[maps.TableKey(2, 0)] = []uint32{2, 2, 2}
	r, err := Read(f, time.Now(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Services) != 2 {
		t.Fatalf("services %+v", r.Services)
	}
	v4, v6 := r.Services[0], r.Services[1]
	if v4.VIP != "198.18.100.1:80" || len(v4.Endpoints) != 1 || v4.Endpoints[0].Addr != "198.18.1.2:8080" {
		t.Errorf("IPv4 service %+v", v4)
	}
	if v6.VIP != "[2001:2::10]:80" || len(v6.Endpoints) != 2 ||
		v6.Endpoints[0].Addr != "[2001:2::1:2]:8080" || v6.Endpoints[0].Slots != 3 ||
		v6.Endpoints[1].Addr != "[2001:2::2:2]:8080" || v6.Endpoints[1].Datapath != "ejected" {
		t.Errorf("IPv6 service %+v", v6)
	}
	var out bytes.Buffer
	if err := r.Text(&out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"service 2  [2001:2::10]:80/tcp", "[2001:2::1:2]:8080", "[2001:2::2:2]:8080"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("text output lacks %q:\n%s", want, out.String())
		}
	}
}

// Who takes new flows, as the datapath decides it from pb_config_v2: the
// datapath while the heartbeat is fresh, kube-proxy once it is older than
// the dead-man's bound or while the install goes; and the services named
// and their reason to be served when the agent answers.
func TestReadSaysWhoTakesNewFlows(t *testing.T) {
	const sec = uint64(time.Second)
	f := kernel(t, map[bpf.LbSvcKey]bpf.LbSvcValue{
		maps.ServiceKey(netip.MustParseAddr("198.18.100.1"), 80, 6): {Id: 1, Flags: maps.ServiceTakenOver},
		maps.ServiceKey(netip.MustParseAddr("198.18.100.2"), 80, 6): {Id: 2},
	}, nil)
	for _, c := range []struct {
		name     string
		cfg      maps.Config
		now      uint64
		to, why  string
		age, bnd string
	}{
		{"fresh", maps.Config{Heartbeat: 100 * sec, DeadMan: 30 * time.Second}, 101 * sec, "penaltybox", "", "1s", "30s"},
		{"away", maps.Config{Heartbeat: 100 * sec, DeadMan: 30 * time.Second}, 131*sec + 1, "kube-proxy", "agent-away", "31s", "30s"},
		{"at the bound", maps.Config{Heartbeat: 100 * sec, DeadMan: 30 * time.Second}, 130 * sec, "penaltybox", "", "30s", "30s"},
		{"no switch", maps.Config{Heartbeat: 100 * sec}, 1000 * sec, "penaltybox", "", "15m0s", ""},
		{"a tick ahead", maps.Config{Heartbeat: 100 * sec, DeadMan: 30 * time.Second}, 100*sec - 4e6, "penaltybox", "", "0s", "30s"},
		{"never beat", maps.Config{DeadMan: time.Second}, 1000 * sec, "penaltybox", "", "", "1s"},
		{"draining", maps.Config{Heartbeat: 100 * sec, DeadMan: 30 * time.Second, Drain: true}, 101 * sec, "kube-proxy", "uninstalling", "1s", "30s"},
	} {
		f.PbConfig = c.cfg
		r, err := Read(f, time.Now(), c.now)
		if err != nil {
			t.Fatal(err)
		}
		want := NewFlows{To: c.to, Why: c.why, HeartbeatAge: c.age, DeadMan: c.bnd}
		if r.NewFlows != want {
			t.Errorf("%s: %+v, want %+v", c.name, r.NewFlows, want)
		}
	}

	f.PbConfig = maps.Config{}
	r, err := Read(f, time.Now(), 0)
	if err != nil {
		t.Fatal(err)
	}
	r.AddAgentView(admin.ServicesView{Services: []admin.Service{{ID: 1, Name: "team-a/web:http", Served: "namespace-label"}}}, nil)
	if s := r.Services[0]; s.Name != "team-a/web:http" || s.Served != "namespace-label" || !s.TakenOver {
		t.Errorf("service 1: %+v", s)
	}
	if s := r.Services[1]; s.Name != "" || s.TakenOver {
		t.Errorf("service 2, unknown to the agent: %+v", s)
	}
	var b bytes.Buffer
	if err := r.Text(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"new flows go to penaltybox", "agent: answering", "team-a/web:http (served: namespace-label)", "taken over"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("text lacks %q:\n%s", want, b.String())
		}
	}
	r.AddAgentView(admin.ServicesView{}, errors.New("connection refused"))
	if !strings.Contains(r.Agent, "connection refused") {
		t.Errorf("agent: %q", r.Agent)
	}
}
