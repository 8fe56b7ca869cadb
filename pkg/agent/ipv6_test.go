// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// fakeReplayer records the replays asked of it, and answers each with err.
type fakeReplayer struct {
	refused, unanswered []netip.AddrPort // clients
	err                 error
}

func (r *fakeReplayer) Replay(client, _, _ netip.AddrPort) error {
	r.refused = append(r.refused, client)
	return r.err
}

func (r *fakeReplayer) ReplayUnanswered(client, _, _ netip.AddrPort, _ uint32) error {
	r.unanswered = append(r.unanswered, client)
	return r.err
}

var (
	vip6    = netip.MustParseAddr("2001:2::10")
	client6 = netip.MustParseAddr("2001:1::2")
)

// web6 is web on the IPv6 VIP, with endpoints [2001:2::n:2]:8080.
func web6(port uint16, n int) desired.Service {
	s := desired.Service{Name: "web6", Key: desired.Key{VIP: vip6, Port: port, Protocol: desired.TCP},
		Accrual: settings(), RetryRefused: true}
	for i := range n {
		a := netip.AddrFrom16([16]byte{0x20, 0x01, 0, 0x02, 12: 0, 13: byte(i + 1), 14: 0, 15: 2})
		s.Endpoints = append(s.Endpoints, desired.Endpoint{Addr: netip.AddrPortFrom(a, 8080)})
	}
	return s
}

// IPv6 clients' SYNs are replayed as IPv4 ones are (pb_syns_v2 holds both
// families): an IPv6 service gets a replay deadline, and both a rescued
// refusal and an unanswered SYN of an IPv6 client are replayed.
func TestIPv6IsReplayed(t *testing.T) {
	e := newEnv(t)
	rp := &fakeReplayer{}
	e.a.replays.replayer = rp
	v6 := web6(80, 2)
	e.start(state(v6))
	s6, be6 := e.ids(v6)
	for _, id := range be6 {
		if e.a.policyOf(id).Replay == 0 {
			t.Errorf("IPv6 backend %d: no replay deadline", id)
		}
	}
	c6 := netip.AddrPortFrom(client6, e.nextPort())
	e.a.HandleEvents([]outcomes.Event{{Type: outcomes.Refused, Flags: outcomes.FlagRescued, Service: s6, Backend: be6[0],
		Client: c6, At: e.clk.Now()}})
	if len(rp.refused) != 1 || rp.refused[0] != c6 {
		t.Errorf("IPv6 refusal replays %v, want %v", rp.refused, c6)
	}
	if got := testutil.ToFloat64(e.a.metrics.Replays.WithLabelValues("refused", "sent")); got != 1 {
		t.Errorf("replays_total{refused,sent} = %v, want 1", got)
	}
	c6b := netip.AddrPortFrom(client6, e.nextPort())
	e.a.HandleEvents([]outcomes.Event{{Type: outcomes.NewFlow, Service: s6, Backend: be6[1], Client: c6b, At: e.clk.Now()}})
	e.clk.Step(600 * time.Millisecond) // past the cautious deadline, half the connect timeout
	e.a.Advance()
	if len(rp.unanswered) != 1 || rp.unanswered[0] != c6b {
		t.Errorf("unanswered replays %v, want %v", rp.unanswered, c6b)
	}
}

// Without a replayer (the agent on a kernel that refuses live frames)
// no SYN is replayed: no replay deadline in a backend's policy, and none
// shown in /admin/services, though the service keeps retryRefused.
func TestNoReplayerNoReplayDeadline(t *testing.T) {
	e := newEnv(t) // no replayer
	v6 := web6(80, 2)
	e.start(state(v6))
	_, be6 := e.ids(v6)
	for _, id := range be6 {
		if d := e.a.policyOf(id).Replay; d != 0 {
			t.Errorf("backend %d: replay deadline %v, want none", id, d)
		}
	}
	sv := e.a.ServicesView().Services[0]
	if !sv.RetryRefused || sv.ReplayAfter != "" {
		t.Errorf("/admin/services: retryRefused %v, replayAfter %q; want true and none", sv.RetryRefused, sv.ReplayAfter)
	}
}

// Names print in the usual notation: "[2001:2::1:2]:8080" for an IPv6
// endpoint, the bare address for a VIP with its port beside it.
func TestIPv6Names(t *testing.T) {
	e := newEnv(t)
	v6 := web6(443, 2)
	e.start(state(v6))
	_, bes := e.ids(v6)
	if got := e.a.endpointName(bes[0]); got != "[2001:2::1:2]:8080" {
		t.Errorf("endpoint name %q", got)
	}
	sv := e.a.ServicesView()
	if len(sv.Services) != 1 || sv.Services[0].VIP != "2001:2::10" || sv.Services[0].Port != 443 {
		t.Fatalf("/admin/services: %+v", sv.Services)
	}
	if got := e.endpoint(bes[1]).Endpoint; got != "[2001:2::2:2]:8080" {
		t.Errorf("/admin/endpoints endpoint %q", got)
	}
	for _, s := range e.a.Services() {
		for _, b := range s.Backends {
			if a, err := netip.ParseAddrPort(b.Endpoint); err != nil || !a.Addr().Is6() {
				t.Errorf("metrics endpoint label %q", b.Endpoint)
			}
		}
	}
	if got := v6.Key.String(); got != "[2001:2::10]:443/tcp" {
		t.Errorf("key %q", got)
	}
}
