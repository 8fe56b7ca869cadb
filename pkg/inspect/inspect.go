// SPDX-License-Identifier: Apache-2.0

// Package inspect reads a node's pinned datapath state and says it in
// human terms: services with their VIPs, endpoints with their datapath and
// accrual states, penalty left, probe grants, in-flight counts and
// counters (`agent inspect`). It reads only, from the pinned maps, so it
// works with the agent stopped or gone; what only the agent holds in
// memory (pod names, pending connects, the accrual windows) is not there.
package inspect

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/admin"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Reader is what inspect reads: pkg/maps over the pinned maps.
type Reader interface {
	Services() (map[bpf.LbSvcKey]bpf.LbSvcValue, error)
	Backends() (map[uint32]bpf.LbBackend, error)
	Persisted() (map[uint32]bpf.LbEndpointHealth, error)
	Table(svcID, n uint32) ([]uint32, error)
	GlobalStats() (bpf.LbGlobalStats, error)
	ServiceStats(id uint32) (bpf.LbSvcStats, error)
	BackendStats(id uint32) (bpf.LbBeStats, error)
	ServiceTrip(id uint32) bpf.LbSvcTrip
	BackendTrip(id uint32) bpf.LbBeTrip
	InflightCounts(svcID, backendID uint32) (svc, be int64, err error)
	Config() (maps.Config, error)
}

// Report is a node's datapath state at one moment.
type Report struct {
	At       time.Time              `json:"at"`
	Datapath admin.DatapathCounters `json:"datapath"`
	NewFlows NewFlows               `json:"newFlows"`
	// Agent says whether the node's agent answered (see AddAgentView):
	// without it the services have no names and no reason to be served.
	Agent    string    `json:"agent,omitempty"`
	Services []Service `json:"services"`
}

// NewFlows is who takes new flows to the services here: the datapath, or
// kube-proxy when the dead-man's switch has tripped or the install is
// going (pb_config_v2).
type NewFlows struct {
	// To is "penaltybox" or "kube-proxy".
	To string `json:"to"`
	// Why kube-proxy does: agent-away or uninstalling.
	Why string `json:"why,omitempty"`
	// HeartbeatAge is how long ago the agent last wrote its heartbeat
	// (absent before its first), DeadMan the age at which the switch
	// trips (absent: never).
	HeartbeatAge string `json:"heartbeatAge,omitempty"`
	DeadMan      string `json:"deadMan,omitempty"`
}

// Service is one pb_services entry.
type Service struct {
	ID uint32 `json:"id"`
	// Name and Served (why the agent serves it: scope-all, a label, a
	// BackendPolicy) come from the agent, when it answers.
	Name     string `json:"name,omitempty"`
	Served   string `json:"served,omitempty"`
	VIP      string `json:"vip"`
	Protocol string `json:"protocol"`
	// Table is the live Maglev table (of the service's two) and its size.
	Table     uint32 `json:"table"`
	TableSize uint32 `json:"tableSize"`
	// TableUnread says why the table's slots could not be read (reading a
	// table takes CAP_SYS_ADMIN, which the DaemonSet does not grant): the
	// endpoints' Slots are then -1.
	TableUnread            string `json:"tableUnread,omitempty"`
	MaxInflight            uint32 `json:"maxInflight"`
	MaxInflightPerEndpoint uint32 `json:"maxInflightPerEndpoint"`
	Inflight               int64  `json:"inflight"`
	RetryRefused           bool   `json:"retryRefused"`
	// TakenOver: lately kube-proxy's, so packets of flows the datapath has
	// no entry for (begun through kube-proxy) are still left to it.
	TakenOver   bool                  `json:"takenOver,omitempty"`
	Counters    admin.ServiceCounters `json:"counters"`
	KernelTrips *admin.KernelTrips    `json:"kernelTrips,omitempty"`
	Endpoints   []Endpoint            `json:"endpoints"`
}

// Endpoint is one backend of a service.
type Endpoint struct {
	ID   uint32 `json:"id"`
	Addr string `json:"addr"`
	// Datapath is the state the XDP program acts on: active, probation
	// (takes ProbeGrants more probe flows), ejected.
	Datapath    string `json:"datapath"`
	ProbeGrants int32  `json:"probeGrants"`
	// Slots the endpoint holds in the live Maglev table (-1: unknown, see
	// Service.TableUnread).
	Slots int `json:"slots"`
	// Accrual is the agent's persisted judgement (pb_health).
	Accrual      Accrual               `json:"accrual"`
	Inflight     int64                 `json:"inflight"`
	KernelStreak uint32                `json:"kernelStreak"`
	Counters     admin.BackendCounters `json:"counters"`
}

// Accrual is an endpoint's pb_health record. An endpoint the agent never
// judged has none (Recorded false): it is ready.
type Accrual struct {
	Recorded            bool       `json:"recorded"`
	State               string     `json:"state"`
	ConsecutiveFailures uint32     `json:"consecutiveFailures"`
	Ejections           uint64     `json:"ejections"`
	PenaltyLevel        uint8      `json:"penaltyLevel"`
	Penalty             string     `json:"penalty,omitempty"`
	EjectedAt           *time.Time `json:"ejectedAt,omitempty"`
	ProbationAt         *time.Time `json:"probationAt,omitempty"`
	// PenaltyLeft is until ProbationAt, while ejected.
	PenaltyLeft     string     `json:"penaltyLeft,omitempty"`
	LastFailureKind string     `json:"lastFailureKind,omitempty"`
	LastFailureAt   *time.Time `json:"lastFailureAt,omitempty"`
}

// Read gathers the report at now, monotonic being the same moment on the
// kernel's CLOCK_MONOTONIC (nanoseconds), the clock of the heartbeat.
func Read(r Reader, now time.Time, monotonic uint64) (*Report, error) {
	svcs, err := r.Services()
	if err != nil {
		return nil, fmt.Errorf("pb_services: %w", err)
	}
	bes, err := r.Backends()
	if err != nil {
		return nil, fmt.Errorf("pb_backends: %w", err)
	}
	persisted, err := r.Persisted()
	if err != nil {
		return nil, fmt.Errorf("pb_health: %w", err)
	}
	g, err := r.GlobalStats()
	if err != nil {
		return nil, err
	}
	cfg, err := r.Config()
	if err != nil {
		return nil, err
	}
	rep := &Report{At: now, Datapath: *admin.NewDatapathCounters(g), NewFlows: newFlows(cfg, monotonic), Services: []Service{}}
	// Each element of the per-service and per-backend counters read once.
	var counters interface {
		ServiceStats(id uint32) (bpf.LbSvcStats, error)
		BackendStats(id uint32) (bpf.LbBeStats, error)
	} = r
	if c, ok := r.(maps.Counters); ok {
		counters = maps.Snapshot(c)
	}

	bySvc := map[uint32][]uint32{}
	for id, b := range bes {
		if b.SvcId != 0 && maps.BackendState(b.State) != maps.BackendRemoved {
			bySvc[b.SvcId] = append(bySvc[b.SvcId], id)
		}
	}
	for k, v := range svcs {
		s := Service{ID: v.Id, VIP: addrPort(k.Vip.Bytes, k.Family, k.Port).String(), Protocol: protocol(k.Proto),
			Table: v.Table, TableSize: v.TableSize, MaxInflight: v.MaxInflight, MaxInflightPerEndpoint: v.MaxInflightPerBackend,
			RetryRefused: v.Flags&maps.ServiceRetryRefused != 0, TakenOver: v.Flags&maps.ServiceTakenOver != 0,
			Endpoints: []Endpoint{}}
		if st, err := counters.ServiceStats(v.Id); err == nil {
			s.Counters = *admin.NewServiceCounters(st)
		}
		s.KernelTrips = admin.NewKernelTrips(r.ServiceTrip(v.Id))
		slots := map[uint32]int{}
		if v.TableSize > 0 {
			tbl, err := r.Table(v.Id, v.Table)
			switch {
			case errors.Is(err, unix.EPERM):
				// A table is found by its id, and opening a map by id
				// takes CAP_SYS_ADMIN: the rest reads without it.
				s.TableUnread = "reading a Maglev table takes CAP_SYS_ADMIN"
				slots = nil
			case err != nil:
				return nil, fmt.Errorf("service %d's table: %w", v.Id, err)
			}
			for _, id := range tbl {
				slots[id]++
			}
		}
		// The service's own count, whether or not it has endpoints left
		// (scaled to zero, its flows live on).
		if svcIn, _, err := r.InflightCounts(v.Id, 0); err == nil {
			s.Inflight = svcIn
		}
		ids := bySvc[v.Id]
		slices.Sort(ids)
		for _, id := range ids {
			b := bes[id]
			ep := Endpoint{ID: id, Addr: addrPort(b.Addr.Bytes, b.Family, b.Port).String(),
				Datapath: maps.BackendState(b.State).String(), ProbeGrants: b.ProbeGrants, Slots: slots[id],
				KernelStreak: r.BackendTrip(id).Failures}
			if slots == nil {
				ep.Slots = -1
			}
			if maps.BackendState(b.State) != maps.BackendProbation {
				ep.ProbeGrants = 0
			}
			if _, beIn, err := r.InflightCounts(v.Id, id); err == nil {
				ep.Inflight = beIn
			}
			if st, err := counters.BackendStats(id); err == nil {
				ep.Counters = *admin.NewBackendCounters(st)
			}
			ep.Accrual = accrualOf(persisted, id, v.Id, now)
			s.Endpoints = append(s.Endpoints, ep)
		}
		rep.Services = append(rep.Services, s)
	}
	slices.SortFunc(rep.Services, func(a, b Service) int { return cmp.Compare(a.ID, b.ID) })
	return rep, nil
}

func newFlows(c maps.Config, now uint64) NewFlows {
	nf := NewFlows{To: "penaltybox", Why: c.HandedOver(now)}
	if nf.Why != "" {
		nf.To = "kube-proxy"
	}
	if c.Heartbeat != 0 {
		// The datapath's coarse clock may read a tick behind.
		nf.HeartbeatAge = max(0, time.Duration(int64(now-c.Heartbeat))).Round(time.Millisecond).String()
	}
	if c.DeadMan > 0 {
		nf.DeadMan = c.DeadMan.String()
	}
	return nf
}

// AddAgentView names the services from the agent's /admin/services view
// and says why each is served; err is why the agent could not be asked.
func (rep *Report) AddAgentView(v admin.ServicesView, err error) {
	if err != nil {
		rep.Agent = fmt.Sprintf("not answering (%v): services unnamed", err)
		return
	}
	rep.Agent = "answering"
	byID := map[uint32]admin.Service{}
	for _, s := range v.Services {
		byID[s.ID] = s
	}
	for i := range rep.Services {
		if s, ok := byID[rep.Services[i].ID]; ok {
			rep.Services[i].Name, rep.Services[i].Served = s.Name, s.Served
		}
	}
}

func accrualOf(persisted map[uint32]bpf.LbEndpointHealth, id, svc uint32, now time.Time) Accrual {
	h, ok := persisted[id]
	if !ok || h.SvcId != svc {
		return Accrual{State: accrual.Ready.String()}
	}
	a := Accrual{Recorded: true, State: accrual.State(h.State).String(), ConsecutiveFailures: h.ConsecutiveFailures,
		Ejections: h.Ejections, PenaltyLevel: h.PenaltyLevel, EjectedAt: unixTime(h.EjectedAtNs),
		ProbationAt: unixTime(h.ProbationAtNs), LastFailureAt: unixTime(h.LastFailureNs)}
	if h.PenaltyNs > 0 {
		a.Penalty = time.Duration(h.PenaltyNs).String()
	}
	if h.LastFailureNs != 0 {
		a.LastFailureKind = accrual.Kind(h.LastFailureKind).String()
	}
	if accrual.State(h.State) == accrual.Ejected && a.ProbationAt != nil {
		a.PenaltyLeft = max(a.ProbationAt.Sub(now), 0).Round(time.Millisecond).String()
	}
	return a
}

func unixTime(ns int64) *time.Time {
	if ns == 0 {
		return nil
	}
	t := time.Unix(0, ns).UTC()
	return &t
}

// addrPort reads a union addr by its family: IPv4 the first four bytes,
// IPv6 all sixteen. An entry of an unknown family still prints, as the
// sixteen bytes read as IPv6.
func addrPort(b [16]uint8, family uint8, port uint16) netip.AddrPort {
	a := maps.AddrFromFamily(family, b)
	if !a.IsValid() {
		a = netip.AddrFrom16(b)
	}
	return netip.AddrPortFrom(a, maps.Port(port))
}

func protocol(p uint8) string {
	switch p {
	case 6:
		return "tcp"
	case 17:
		return "udp"
	}
	return fmt.Sprintf("proto-%d", p)
}

// Text writes the report for a person: one block per service, a table of
// its endpoints.
func (rep *Report) Text(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	g := rep.Datapath
	fmt.Fprintf(tw, "datapath at %s, services: %d; events lost %d, no-backend flows %d, steered %d (failed %d), re-picked %d, refusals kept from clients %d (retried %d), breaker rejections %d, malformed %d\n",
		rep.At.Format(time.RFC3339), len(rep.Services), g.EventsLost, g.NoBackend, g.Steered, g.SteerFailed, g.Repicked,
		g.RefusedRescued, g.Retried, g.InflightRejected, g.Malformed)
	nf := rep.NewFlows
	fmt.Fprintf(tw, "new flows go to %s", nf.To)
	if nf.Why != "" {
		fmt.Fprintf(tw, " (%s)", nf.Why)
	}
	fmt.Fprintf(tw, "; agent heartbeat %s ago, dead-man's switch at %s\n", cmp.Or(nf.HeartbeatAge, "never"), cmp.Or(nf.DeadMan, "never"))
	if rep.Agent != "" {
		fmt.Fprintf(tw, "agent: %s\n", rep.Agent)
	}
	for _, s := range rep.Services {
		fmt.Fprintf(tw, "\nservice %d  %s/%s", s.ID, s.VIP, s.Protocol)
		if s.Name != "" {
			fmt.Fprintf(tw, "  %s (served: %s)", s.Name, cmp.Or(s.Served, "config"))
		}
		fmt.Fprintf(tw, "  table %d (%d slots)  in flight %d", s.Table, s.TableSize, s.Inflight)
		if s.MaxInflight > 0 {
			fmt.Fprintf(tw, " of %d", s.MaxInflight)
		}
		if s.MaxInflightPerEndpoint > 0 {
			fmt.Fprintf(tw, " (%d per endpoint)", s.MaxInflightPerEndpoint)
		}
		if s.RetryRefused {
			fmt.Fprint(tw, "  retryRefused")
		}
		if s.TakenOver {
			fmt.Fprint(tw, "  taken over (kube-proxy's flows left to it)")
		}
		if s.TableUnread != "" {
			fmt.Fprintf(tw, "  (slots unknown: %s)", s.TableUnread)
		}
		c := s.Counters
		fmt.Fprintf(tw, "\n  flows %d  packets %d  bytes %d  no-backend %d  breaker-rejected %d\n", c.Flows, c.Packets, c.Bytes, c.NoBackend, c.OverLimit)
		if t := s.KernelTrips; t != nil {
			fmt.Fprintf(tw, "  kernel trips at %d failures (%s): %d trips, %d suppressed, budget %d\n",
				t.MaxFailures, strings.Join(t.Kinds, ", "), t.Trips, t.Suppressed, t.Budget)
		}
		fmt.Fprintln(tw, "  ENDPOINT\tDATAPATH\tACCRUAL\tSLOTS\tPENALTY LEFT\tFAILURES\tEJECTIONS\tLAST FAILURE\tIN FLIGHT\tFLOWS\tREPLIES")
		for _, e := range s.Endpoints {
			dp := e.Datapath
			if e.Datapath == maps.BackendProbation.String() {
				dp = fmt.Sprintf("%s (%d grant)", dp, e.ProbeGrants)
			}
			a := e.Accrual
			left := cmp.Or(a.PenaltyLeft, "-")
			last := "-"
			if a.LastFailureAt != nil {
				last = fmt.Sprintf("%s %s ago", a.LastFailureKind, rep.At.Sub(*a.LastFailureAt).Round(time.Second))
			}
			slots := fmt.Sprint(e.Slots)
			if e.Slots < 0 {
				slots = "?"
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%d\t%d\t%s\t%d\t%d\t%d\n", e.Addr, dp, a.State, slots, left,
				a.ConsecutiveFailures, a.Ejections, last, e.Inflight, e.Counters.Flows, e.Counters.ReplyPackets)
		}
	}
	return tw.Flush()
}
