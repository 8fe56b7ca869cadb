// SPDX-License-Identifier: Apache-2.0

package outcomes

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

var t0 = time.Unix(1_700_000_000, 0)

type step struct {
	at   time.Duration // since t0
	typ  Type          // 0: only run Expire at `at`
	flag uint8
	port uint16
}

func TestTrackerVerdicts(t *testing.T) {
	kinds := func(ks ...accrual.Kind) accrual.Settings {
		s := accrual.Defaults()
		s.FailureKinds = accrual.KindsOf(ks...)
		return s
	}
	all := kinds(accrual.KindRefused, accrual.KindTimeout, accrual.KindReset)
	withData := kinds(accrual.KindRefused, accrual.KindTimeout, accrual.KindReset, accrual.KindResetAfterData)
	noReset := kinds(accrual.KindRefused, accrual.KindTimeout)
	ms := time.Millisecond

	cases := []struct {
		name     string
		settings accrual.Settings
		steps    []step
		want     []string
	}{
		{"refused", all, []step{{0, NewFlow, 0, 1}, {1 * ms, Refused, 0, 1}, {5 * time.Second, 0, 0, 0}},
			[]string{"refused@1ms"}},
		{"timeout by our deadline, late news ignored", all, []step{
			{0, NewFlow, 0, 1}, {999 * ms, 0, 0, 0}, {1000 * ms, 0, 0, 0},
			{1010 * ms, SynRetrans, 0, 1}, {1500 * ms, Established, 0, 1}, {9 * time.Second, 0, 0, 0}},
			[]string{"timeout@1s"}},
		{"timeout by the kernel first, deadline void", all, []step{
			{0, NewFlow, 0, 1}, {900 * ms, SynRetrans, 0, 1}, {5 * time.Second, 0, 0, 0}},
			[]string{"timeout@900ms"}},
		{"timeout by the kernel, late refusal ignored", all, []step{
			{0, NewFlow, 0, 1}, {900 * ms, SynRetrans, 0, 1}, {1200 * ms, Refused, 0, 1}, {5 * time.Second, 0, 0, 0}},
			[]string{"timeout@900ms"}},
		{"timeout by the kernel, late SYN-ACK ignored", all, []step{
			{0, NewFlow, 0, 1}, {900 * ms, SynRetrans, 0, 1}, {1200 * ms, Established, 0, 1}, {5 * time.Second, 0, 0, 0}},
			[]string{"timeout@900ms"}},
		{"success at SYN-ACK when resets do not count", noReset, []step{
			{0, NewFlow, 0, 1}, {2 * ms, Established, 0, 1}, {3 * ms, Reset, 0, 1}},
			[]string{"success@2ms", "reset@3ms"}},
		{"reset before data is the verdict, not a success", all, []step{
			{0, NewFlow, 0, 1}, {2 * ms, Established, 0, 1}, {3 * ms, Reset, 0, 1}, {4 * ms, FlowEnd, 0, 1},
			{5 * time.Second, 0, 0, 0}},
			[]string{"reset@3ms"}},
		{"first data settles the success", all, []step{
			{0, NewFlow, 0, 1}, {2 * ms, Established, 0, 1}, {4 * ms, FirstData, 0, 1},
			{9 * ms, Reset, FlagBackendData, 1}},
			[]string{"success@4ms", "reset-after-data@9ms"}},
		{"reset after data counts when configured", withData, []step{
			{0, NewFlow, 0, 1}, {2 * ms, Established, 0, 1}, {4 * ms, FirstData, 0, 1},
			{9 * ms, Reset, FlagBackendData, 1}, {5 * time.Second, 0, 0, 0}},
			[]string{"reset-after-data@9ms"}},
		{"normal close settles", all, []step{
			{0, NewFlow, 0, 1}, {2 * ms, Established, 0, 1}, {7 * ms, FlowEnd, 0, 1}},
			[]string{"success@7ms"}},
		{"quiet connection settles after the connect timeout", all, []step{
			{0, NewFlow, 0, 1}, {2 * ms, Established, 0, 1}, {1001 * ms, 0, 0, 0}, {1002 * ms, 0, 0, 0}},
			[]string{"success@1.002s"}},
		{"probe flag carries to the verdict", all, []step{
			{0, NewFlow, FlagProbe, 1}, {2 * ms, Established, 0, 1}, {3 * ms, FirstData, 0, 1}},
			[]string{"probe-success@3ms"}},
		{"flows are told apart by client port", all, []step{
			{0, NewFlow, 0, 1}, {1 * ms, NewFlow, 0, 2}, {2 * ms, Refused, 0, 2}, {3 * ms, Established, 0, 1},
			{4 * ms, FirstData, 0, 1}},
			[]string{"refused@2ms", "success@4ms"}},
		{"verdict without a seen new flow (agent restarted)", all, []step{{5 * ms, Refused, 0, 1}},
			[]string{"refused@5ms"}},
		// The backend reset a connection whose client sent a wrong
		// handshake ACK: no success, no failure, and no deadline after.
		{"a void end decides nothing", all, []step{
			{0, NewFlow, 0, 1}, {2 * ms, Established, 0, 1}, {3 * ms, FlowEnd, FlagVoid, 1}, {5 * time.Second, 0, 0, 0}},
			nil},
		{"a probe's void end is inconclusive", all, []step{
			{0, NewFlow, FlagProbe, 1}, {2 * ms, Established, 0, 1}, {3 * ms, FlowEnd, FlagVoid, 1}, {5 * time.Second, 0, 0, 0}},
			[]string{"probe-inconclusive@3ms"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pol := PolicyFor(c.settings, true)
			tr := NewTracker(func(uint32) Policy { return pol })
			var got []string
			record := func(o accrual.Outcome) {
				s := "success"
				switch {
				case o.Inconclusive:
					s = "inconclusive"
				case !o.Success:
					s = o.Kind.String()
				}
				if o.Probe {
					s = "probe-" + s
				}
				got = append(got, fmt.Sprintf("%s@%v", s, o.At.Sub(t0)))
			}
			for _, s := range c.steps {
				now := t0.Add(s.at)
				if s.typ == 0 {
					tr.Expire(now, record)
					continue
				}
				ev := Event{Type: s.typ, Flags: s.flag, Backend: 7,
					Client: netip.AddrPortFrom(netip.MustParseAddr("198.18.0.2"), 40000+s.port), At: now}
				if o, ok := tr.Classify(ev); ok {
					record(o)
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(c.want) {
				t.Fatalf("verdicts %v, want %v", got, c.want)
			}
		})
	}
}

func TestTrackerUntracked(t *testing.T) {
	off := accrual.Defaults()
	off.Mode = accrual.ModeNone
	tr := NewTracker(func(uint32) Policy { return PolicyFor(off, true) })
	ev := Event{Type: NewFlow, Backend: 1, At: t0}
	tr.Classify(ev)
	ev.Type = Refused
	if _, ok := tr.Classify(ev); ok {
		t.Fatal("a backend with accrual off produced an outcome")
	}
	if tr.Pending() != 0 {
		t.Fatal("untracked flow is pending")
	}
}

// A UDP flow: its first reply is the success, a port unreachable (the
// datapath's REFUSED) the refusal. Unanswered at the deadline it is
// reported and judges nothing (silence after a burst of refusals is the
// host's ICMP rate limit, no success), except a probe, which passes; a late
// refusal of that probe's flow is no second verdict. Waiting datagram
// flows are no pending connects.
func TestTrackerDatagrams(t *testing.T) {
	pol := PolicyFor(accrual.Defaults(), false)
	if !pol.Tracked || !pol.Datagram || pol.Settle != SettleOnSynAck {
		t.Fatalf("UDP policy %+v", pol)
	}
	var unanswered []uint32
	tr := NewTracker(func(uint32) Policy { return pol })
	tr.OnUnanswered = func(b uint32) { unanswered = append(unanswered, b) }
	c := func(port uint16) netip.AddrPort { return netip.AddrPortFrom(netip.MustParseAddr("198.18.0.2"), port) }

	tr.Classify(Event{Type: NewFlow, Backend: 1, Client: c(1), At: t0})
	if o, ok := tr.Classify(Event{Type: Established, Backend: 1, Client: c(1), At: t0.Add(time.Millisecond)}); !ok || !o.Success {
		t.Errorf("reply: %+v %v, want a success", o, ok)
	}
	tr.Classify(Event{Type: NewFlow, Backend: 1, Client: c(2), At: t0})
	if o, ok := tr.Classify(Event{Type: Refused, Backend: 1, Client: c(2), At: t0.Add(time.Millisecond)}); !ok || o.Kind != accrual.KindRefused {
		t.Errorf("port unreachable: %+v %v, want refused", o, ok)
	}
	tr.Classify(Event{Type: NewFlow, Backend: 2, Client: c(3), At: t0})
	tr.Classify(Event{Type: NewFlow, Backend: 3, Client: c(4), At: t0, Flags: FlagProbe})
	if tr.Pending() != 2 || tr.PendingConnects() != 0 {
		t.Errorf("pending %d, connects %d: want 2 datagram flows, no connect", tr.Pending(), tr.PendingConnects())
	}
	var got []accrual.Outcome
	tr.Expire(t0.Add(pol.ConnectTimeout), func(o accrual.Outcome) { got = append(got, o) })
	if len(got) != 1 || got[0].Endpoint != 3 || !got[0].Success || !got[0].Probe {
		t.Errorf("at the deadline: %+v, want only the probe, a success", got)
	}
	if !slices.Equal(unanswered, []uint32{2, 3}) && !slices.Equal(unanswered, []uint32{3, 2}) {
		t.Errorf("unanswered %v, want backends 2 and 3", unanswered)
	}
	if _, ok := tr.Classify(Event{Type: Refused, Backend: 3, Client: c(4), At: t0.Add(2 * pol.ConnectTimeout)}); ok {
		t.Error("a late refusal of the passed probe's flow was a second verdict")
	}
	if tr.PendingConnects() != 0 {
		t.Errorf("%d pending connects after the deadline", tr.PendingConnects())
	}

	// Events lost while a probe waited: no verdict from its silence.
	tr.Classify(Event{Type: NewFlow, Backend: 3, Client: c(5), At: t0, Flags: FlagProbe})
	tr.EventsLost()
	got = nil
	tr.Expire(t0.Add(pol.ConnectTimeout), func(o accrual.Outcome) { got = append(got, o) })
	if len(got) != 0 {
		t.Errorf("after lost events: %+v, want no verdict", got)
	}
}

func TestTrackerBoundsPending(t *testing.T) {
	pol := PolicyFor(accrual.Defaults(), true)
	tr := NewTracker(func(uint32) Policy { return pol })
	tr.MaxPending = 10
	for i := range 25 {
		tr.Classify(Event{Type: NewFlow, Backend: 1, Client: netip.AddrPortFrom(netip.MustParseAddr("198.18.0.2"), uint16(i)), At: t0})
	}
	if tr.Pending() != 10 || tr.Overflow != 15 {
		t.Fatalf("pending %d overflow %d, want 10 and 15", tr.Pending(), tr.Overflow)
	}
	n := 0
	tr.Expire(t0.Add(time.Minute), func(accrual.Outcome) { n++ })
	if n != 10 {
		t.Fatalf("%d timeouts, want 10", n)
	}
}

func TestDecode(t *testing.T) {
	b := make([]byte, eventSize)
	b[0] = 100 // ts
	b[8] = 3   // svc
	b[12] = 9  // backend
	copy(b[16:], []byte{198, 18, 0, 2})
	b[32], b[33] = 0x9c, 0x40 // port 40000, network order
	b[34] = byte(Reset)
	b[35] = FlagBackendData
	ev, err := Decode(b, 1000)
	if err != nil {
		t.Fatal(err)
	}
	want := Event{Type: Reset, Flags: FlagBackendData, Service: 3, Backend: 9,
		Client: netip.MustParseAddrPort("198.18.0.2:40000"), Mono: 100, At: time.Unix(0, 1100)}
	if ev != want {
		t.Fatalf("decoded %+v, want %+v", ev, want)
	}
	if _, err := Decode(b[:10], 0); err == nil {
		t.Fatal("short record decoded")
	}
}

// The next deadline is that of a connection still pending: connections
// their events decided do not wake the agent.
func TestTrackerNextDeadlineSkipsDecided(t *testing.T) {
	pol := PolicyFor(accrual.Defaults(), true)
	tr := NewTracker(func(uint32) Policy { return pol })
	client := func(i int) netip.AddrPort {
		return netip.AddrPortFrom(netip.MustParseAddr("198.18.0.2"), uint16(40000+i))
	}
	// 100 connections a millisecond apart, each refused at once, then one
	// that stays unanswered.
	for i := range 100 {
		at := t0.Add(time.Duration(i) * time.Millisecond)
		tr.Classify(Event{Type: NewFlow, Backend: 1, Client: client(i), At: at})
		tr.Classify(Event{Type: Refused, Backend: 1, Client: client(i), At: at})
	}
	if d, ok := tr.NextDeadline(); ok {
		t.Fatalf("next deadline %v with nothing pending", d.Sub(t0))
	}
	last := t0.Add(time.Second)
	tr.Classify(Event{Type: NewFlow, Backend: 1, Client: client(100), At: last})
	if d, ok := tr.NextDeadline(); !ok || !d.Equal(last.Add(pol.ConnectTimeout)) {
		t.Fatalf("next deadline %v, %v; want the unanswered connection's, %v", d.Sub(t0), ok, last.Add(pol.ConnectTimeout).Sub(t0))
	}
	n := 0
	tr.Expire(last.Add(pol.ConnectTimeout), func(o accrual.Outcome) {
		if o.Kind == accrual.KindTimeout {
			n++
		}
	})
	if n != 1 {
		t.Fatalf("%d timeouts at the deadline, want 1", n)
	}
}

// A success carries its handshake's length (SYN to SYN-ACK, the
// datapath's timestamps) whenever the success is decided: at the SYN-ACK,
// at first data or at the settle deadline.
func TestTrackerHandshake(t *testing.T) {
	ms := time.Millisecond
	client := netip.AddrPortFrom(netip.MustParseAddr("198.18.0.2"), 40000)
	for _, tc := range []struct {
		name  string
		kinds accrual.Kinds
		after Type // event that settles; 0: the settle deadline
	}{
		{"at the SYN-ACK", accrual.KindsOf(accrual.KindRefused), Established},
		{"at first data", accrual.KindsOf(accrual.KindRefused, accrual.KindReset), FirstData},
		{"at a normal close", accrual.KindsOf(accrual.KindRefused, accrual.KindReset), FlowEnd},
		{"at the settle deadline", accrual.KindsOf(accrual.KindRefused, accrual.KindReset), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := accrual.Defaults()
			s.FailureKinds = tc.kinds
			pol := PolicyFor(s, true)
			tr := NewTracker(func(uint32) Policy { return pol })
			var got []accrual.Outcome
			keep := func(o accrual.Outcome, ok bool) {
				if ok {
					got = append(got, o)
				}
			}
			keep(tr.Classify(Event{Type: NewFlow, Backend: 1, Client: client, At: t0}))
			keep(tr.Classify(Event{Type: Established, Backend: 1, Client: client, At: t0.Add(50 * ms)}))
			if tc.after == 0 {
				tr.Expire(t0.Add(time.Minute), func(o accrual.Outcome) { got = append(got, o) })
			} else if tc.after != Established {
				keep(tr.Classify(Event{Type: tc.after, Backend: 1, Client: client, At: t0.Add(60 * ms)}))
			}
			if len(got) != 1 || !got[0].Success || got[0].Handshake != 50*ms {
				t.Fatalf("outcomes %+v, want one success with a 50ms handshake", got)
			}
		})
	}
	// A SYN-ACK for a flow whose SYN was not seen has no known length.
	s := accrual.Defaults()
	s.FailureKinds = accrual.KindsOf(accrual.KindRefused)
	tr := NewTracker(func(uint32) Policy { return PolicyFor(s, true) })
	o, ok := tr.Classify(Event{Type: Established, Backend: 1, Client: client, At: t0})
	if !ok || o.Handshake != 0 {
		t.Fatalf("outcome %+v, want a success of unknown handshake", o)
	}
}

func TestTrackedModes(t *testing.T) {
	for _, m := range []accrual.Mode{accrual.ModeConsecutive, accrual.ModeFailureRate, accrual.ModeUnified, accrual.ModeNone} {
		s := accrual.Defaults()
		s.Mode = m
		if got := PolicyFor(s, true).Tracked; got != (m != accrual.ModeNone) {
			t.Errorf("mode %s: tracked %v", m, got)
		}
	}
}

// A connection still waiting for its backend's first answer at the replay
// deadline is due a replay (a probe too); one answered, refused or moved
// already is not.
func TestTrackerDueReplays(t *testing.T) {
	pol := PolicyFor(accrual.Defaults(), true)
	pol.Replay = 20 * time.Millisecond
	tr := NewTracker(func(uint32) Policy { return pol })
	c := func(port uint16) netip.AddrPort { return netip.AddrPortFrom(netip.MustParseAddr("198.18.0.2"), port) }
	ev := func(typ Type, port uint16, flags uint8, at time.Duration) {
		tr.Classify(Event{Type: typ, Backend: 7, Client: c(port), Flags: flags, At: t0.Add(at)})
	}
	ev(NewFlow, 1, 0, 0) // silent: due
	ev(NewFlow, 2, 0, 0) // answered in time
	ev(Established, 2, 0, 5*time.Millisecond)
	ev(NewFlow, 3, 0, 0) // refused
	ev(Refused, 3, 0, time.Millisecond)
	ev(NewFlow, 4, FlagRepick, 0) // already moved once
	ev(NewFlow, 5, FlagProbe, 0)  // a probe: its client need not wait
	if next, ok := tr.NextDeadline(); !ok || !next.Equal(t0.Add(20*time.Millisecond)) {
		t.Fatalf("next deadline %v, %v: want the replay deadline at 20ms", next, ok)
	}
	// Apart: the replays' for the reader, which runs them; the connect
	// deadlines' for the loop, which Due speaks of.
	if next, ok := tr.NextReplay(); !ok || !next.Equal(t0.Add(20*time.Millisecond)) {
		t.Fatalf("next replay %v, %v: want 20ms", next, ok)
	}
	if next, ok := tr.NextExpiry(); !ok || !next.Equal(t0.Add(pol.ConnectTimeout)) {
		t.Fatalf("next expiry %v, %v: want the connect timeout", next, ok)
	}
	if tr.Due(t0.Add(20 * time.Millisecond)) {
		t.Fatal("Due at a replay deadline: nothing for Expire there")
	}
	var due []uint16
	tr.DueReplays(t0.Add(19*time.Millisecond), func(_ uint32, cl netip.AddrPort) { due = append(due, cl.Port()) })
	if len(due) != 0 {
		t.Fatalf("due before the deadline: %v", due)
	}
	tr.DueReplays(t0.Add(20*time.Millisecond), func(b uint32, cl netip.AddrPort) {
		if b != 7 {
			t.Errorf("backend %d", b)
		}
		due = append(due, cl.Port())
	})
	slices.Sort(due)
	if fmt.Sprint(due) != "[1 5]" {
		t.Fatalf("due replays %v, want the silent connection and the probe [1 5]", due)
	}
	// Its connect deadline still judges the backend.
	var got []accrual.Outcome
	tr.Expire(t0.Add(2*time.Second), func(o accrual.Outcome) { got = append(got, o) })
	timeouts := 0
	for _, o := range got {
		if !o.Success && o.Kind == accrual.KindTimeout {
			timeouts++
		}
	}
	if timeouts != 3 { // ports 1, 4 and 5 never heard back
		t.Errorf("%d timeouts at the connect deadline, want 3: %+v", timeouts, got)
	}
}

// IPv6 clients are flows like any other: keyed by address and port, an
// IPv6 client and an IPv4 one on the same port and backend are two flows.
func TestTrackerIPv6Clients(t *testing.T) {
	pol := PolicyFor(accrual.Defaults(), true)
	tr := NewTracker(func(uint32) Policy { return pol })
	v4 := netip.MustParseAddrPort("198.18.0.2:40000")
	v6 := netip.MustParseAddrPort("[2001:1::2]:40000")
	other6 := netip.MustParseAddrPort("[2001:1::3]:40000")
	var got []string
	classify := func(typ Type, c netip.AddrPort, at time.Duration) {
		if o, ok := tr.Classify(Event{Type: typ, Backend: 7, Client: c, At: t0.Add(at)}); ok {
			s := "success"
			if !o.Success {
				s = o.Kind.String()
			}
			got = append(got, fmt.Sprintf("%s@%v", s, o.At.Sub(t0)))
		}
	}
	classify(NewFlow, v4, 0)
	classify(NewFlow, v6, 0)
	classify(NewFlow, other6, 0)
	if tr.Pending() != 3 {
		t.Fatalf("%d pending, want 3 flows", tr.Pending())
	}
	classify(Refused, v6, time.Millisecond)
	classify(Established, v4, 2*time.Millisecond)
	classify(FlowEnd, v4, 3*time.Millisecond)
	tr.Expire(t0.Add(2*time.Second), func(o accrual.Outcome) {
		got = append(got, fmt.Sprintf("%s@%v", o.Kind, o.At.Sub(t0)))
	})
	if want := "[refused@1ms success@3ms timeout@1s]"; fmt.Sprint(got) != want {
		t.Errorf("verdicts %v, want %s", got, want)
	}

	// A due replay names the IPv6 client as it is (the agent decides
	// whether it can replay it).
	pol.Replay = 20 * time.Millisecond
	tr = NewTracker(func(uint32) Policy { return pol })
	tr.Classify(Event{Type: NewFlow, Backend: 7, Client: v6, At: t0})
	var due []netip.AddrPort
	tr.DueReplays(t0.Add(20*time.Millisecond), func(_ uint32, c netip.AddrPort) { due = append(due, c) })
	if len(due) != 1 || due[0] != v6 {
		t.Errorf("due replays %v, want %v", due, v6)
	}
}

// A flow the agent voided (its replay moved it here but was never sent):
// its repick's NEW_FLOW starts no wait and nothing before the client's own
// retransmission decides anything; that SYN_RETRANS starts the connect
// deadline from there. Another NEW_FLOW on the tuple is another flow. The
// void takes no part in the connect counts, and is forgotten in time.
func TestTrackerVoid(t *testing.T) {
	const void = Type(255) // a step that calls Void
	ms := time.Millisecond
	cases := []struct {
		name  string
		steps []step
		want  []string
	}{
		{"the unsent flow's silence, then its answer", []step{
			{0, void, 0, 1}, {0, NewFlow, FlagRepick, 1}, {1500 * ms, 0, 0, 0},
			{2 * time.Second, SynRetrans, 0, 1}, {2001 * ms, Established, 0, 1}, {2002 * ms, FirstData, 0, 1}},
			[]string{"success@2.002s"}},
		{"silent after the retransmission too: a timeout from it", []step{
			{0, void, 0, 1}, {0, NewFlow, FlagRepick, 1}, {2 * time.Second, SynRetrans, 0, 1},
			{2999 * ms, 0, 0, 0}, {3 * time.Second, 0, 0, 0}},
			[]string{"timeout@3s"}},
		{"a refusal before the retransmission decides nothing", []step{
			{0, void, 0, 1}, {0, NewFlow, FlagRepick, 1}, {5 * ms, Refused, 0, 1}, {9 * time.Second, 0, 0, 0}},
			nil},
		{"a second repick is another flow", []step{
			{0, void, 0, 1}, {0, NewFlow, FlagRepick, 1}, {10 * ms, NewFlow, FlagRepick, 1}, {1010 * ms, 0, 0, 0}},
			[]string{"timeout@1.01s"}},
		{"a new flow on the tuple is tracked", []step{
			{0, void, 0, 1}, {10 * ms, NewFlow, 0, 1}, {1010 * ms, 0, 0, 0}},
			[]string{"timeout@1.01s"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pol := PolicyFor(accrual.Defaults(), true)
			pol.ConnectTimeout = time.Second
			tr := NewTracker(func(uint32) Policy { return pol })
			var got []string
			record := func(o accrual.Outcome) {
				s := "success"
				if !o.Success {
					s = o.Kind.String()
				}
				got = append(got, fmt.Sprintf("%s@%v", s, o.At.Sub(t0)))
			}
			client := func(port uint16) netip.AddrPort {
				return netip.AddrPortFrom(netip.MustParseAddr("198.18.0.2"), 40000+port)
			}
			for _, s := range c.steps {
				now := t0.Add(s.at)
				switch s.typ {
				case 0:
					tr.Expire(now, record)
				case void:
					tr.Void(7, client(s.port), now)
					if n := tr.PendingConnects(); n != 0 {
						t.Fatalf("a void counts as %d connects waiting, want 0", n)
					}
				default:
					if o, ok := tr.Classify(Event{Type: s.typ, Flags: s.flag, Backend: 7, Client: client(s.port), At: now}); ok {
						record(o)
					}
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(c.want) {
				t.Fatalf("verdicts %v, want %v", got, c.want)
			}
			tr.Expire(t0.Add(time.Minute), record)
			if n := tr.Pending(); n != 0 {
				t.Errorf("%d flows still held a minute on, want none", n)
			}
		})
	}
}
