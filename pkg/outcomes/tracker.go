// SPDX-License-Identifier: Apache-2.0

package outcomes

import (
	"math"
	"net/netip"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// Policy is how a backend's outcomes are judged, from its service's
// failure-accrual settings.
type Policy struct {
	// Tracked is false for backends whose outcomes do not matter (accrual
	// off): their events produce no outcomes.
	Tracked bool
	// Datagram: a UDP service's flow. A port unreachable from the backend
	// is its refusal, its first reply its success. One still unanswered at
	// ConnectTimeout is reported (OnUnanswered) and judges nothing, since
	// many UDP protocols never answer and a closed port's host rate-limits
	// its ICMP errors (silence after a burst of refusals is no success);
	// but a probe passes on it, or an endpoint of a service that never
	// answers could never come back.
	Datagram bool
	// ConnectTimeout: no SYN-ACK within it is a timeout failure. It is also
	// how long a connection must survive after its SYN-ACK, without a
	// reset and without backend data, to count as a success (see Settle).
	ConnectTimeout time.Duration
	// Replay > 0: a new connection whose SYN is still unanswered this long
	// after it was sent is due a replay to another backend (DueReplays),
	// long before its ConnectTimeout judges the backend.
	Replay time.Duration
	// Settle is when an established connection counts as a success. A
	// backend that accepts and then resets every connection must not
	// alternate success and failure, or it would never be ejected.
	Settle Settle
	// Service is the backend's service: the tracker's per-service caps
	// (Tracker.MaxPendingPerService, SetConnectShare) count by it.
	Service uint32
}

// Settle says when a connection's success is decided.
type Settle uint8

const (
	// SettleOnSynAck: the SYN-ACK is the success (resets do not count).
	SettleOnSynAck Settle = iota
	// SettleOnData: the backend's first payload byte, a normal close, or
	// ConnectTimeout without a reset (resets before data count).
	SettleOnData
	// SettleOnEnd: a normal close or ConnectTimeout without a reset (resets
	// after data count too).
	SettleOnEnd
)

// PolicyFor derives a Policy from accrual settings.
func PolicyFor(s accrual.Settings, tcp bool) Policy {
	// Clamped as the accrual engine clamps it: settings that skipped
	// Validate must not make a tracked flow live for ever.
	p := Policy{Tracked: s.Mode != accrual.ModeNone, Datagram: !tcp, ConnectTimeout: min(s.ConnectTimeout, accrual.ConnectTimeoutLimit)}
	switch {
	case !tcp:
		// No resets in UDP: the reply is the success.
	case s.FailureKinds.Has(accrual.KindResetAfterData):
		p.Settle = SettleOnEnd
	case s.FailureKinds.Has(accrual.KindReset):
		p.Settle = SettleOnData
	}
	return p
}

// PolicyFunc gives a backend's policy.
type PolicyFunc func(backend uint32) Policy

// flowKey names a flow by its backend and client. It holds the client's
// address as bytes, not as a netip.Addr, whose pointer would make every
// lookup hash and compare through it and the GC scan the tracker's map
// and queues (the map is looked up once per event).
type flowKey struct {
	addr    [16]byte
	backend uint32
	port    uint16
	v4      bool
}

func keyOf(backend uint32, client netip.AddrPort) flowKey {
	a := client.Addr()
	return flowKey{addr: a.As16(), backend: backend, port: client.Port(), v4: a.Is4()}
}

// client is the key's client address and port, as the event had it.
func (k flowKey) client() netip.AddrPort {
	a := netip.AddrFrom16(k.addr)
	if k.v4 {
		a = a.Unmap()
	}
	return netip.AddrPortFrom(a, k.port)
}

type phase uint8

const (
	connecting     phase = iota + 1 // waiting for SYN-ACK or RST
	settling                        // established, success not yet decided
	timedOut                        // our deadline judged it; later news changes nothing
	settled                         // our deadline judged it a success; a later reset is no second verdict
	voided                          // a replay moved it here but was never sent (Void): its repick's NEW_FLOW is still to come
	voidedRepicked                  // voided, its NEW_FLOW read: the backend has yet to see its SYN
)

// void reports whether p is a flow whose replay was never sent (Void).
func (p pending) void() bool { return p.phase == voided || p.phase == voidedRepicked }

// timedOutMemory is how many connect timeouts a timed-out flow is
// remembered, so a late SYN-ACK, RST or retransmission signal for it is not
// a second verdict.
const timedOutMemory = 10

// memory is how long a decided flow is remembered under connect timeout
// d: timedOutMemory × d, saturating, so that no setting wraps it into the
// past (and a late event into a second verdict).
func memory(d time.Duration) time.Duration {
	if d > math.MaxInt64/timedOutMemory {
		return math.MaxInt64
	}
	return timedOutMemory * d
}

type pending struct {
	seq   uint64
	gen   uint64    // Tracker.gen when the connection started waiting
	start time.Time // the connection's first event (its SYN)
	// handshake: SYN to SYN-ACK, for a settling connection (0: unknown).
	handshake time.Duration
	svc       uint32 // Policy.Service when it started waiting
	phase     phase
	probe     bool
	settle    Settle
	datagram  bool // a datagram flow waiting for its reply (see Tracker.datagrams)
}

// waiting reports whether p awaits a verdict (the per-service cap counts
// these), as opposed to remembering one.
func (p pending) waiting() bool { return p.phase == connecting || p.phase == settling }

// connect reports whether p is a TCP connect still waiting for its
// backend's first answer: the only entries that say anything of a SYN
// flood (a settling connection is established; a datagram flow is no
// connect).
func (p pending) connect() bool { return p.phase == connecting && !p.datagram }

// EntryBytes is what one tracked flow costs the agent at most: its map
// entry (key, value and the map's overhead) and the deadlines queued for
// it (a connect or settle deadline, a replay deadline, and the decided
// ones the queues hold until compacted), with the slack of the slices'
// growth: about 480 bytes measured at worst (just past a growth of the
// map), rounded up. TestEntryBytes checks it; the node's tracker memory
// ceiling (--tracker-memory) is divided by it.
const EntryBytes = 640

// svcCount is what one service has in the tracker.
type svcCount struct {
	waiting  int // connecting and settling entries
	connects int // TCP connects waiting for their first answer
	// shed: new flows not tracked, over the service's cap and over the
	// node's ceiling, since the last DrainShed.
	shedCap, shedMemory uint64
}

type deadline struct {
	key flowKey
	seq uint64
	at  time.Time
}

// fifo holds deadlines of one length, d. Events arrive in time order, so
// appending keeps each queue sorted and expiry only looks at heads.
type fifo struct {
	d    time.Duration
	q    []deadline
	head int
}

// queueSet holds a fifo per deadline length. There are few lengths (one
// per connect timeout and replay delay in use): a slice searched in
// order costs less than a map on every push and every scan of the heads.
type queueSet []*fifo

// of returns the queue of deadlines d long, made if there is none.
func (qs *queueSet) of(d time.Duration) *fifo {
	for _, q := range *qs {
		if q.d == d {
			return q
		}
	}
	q := &fifo{d: d}
	*qs = append(*qs, q)
	return q
}

func (f *fifo) push(d deadline) { f.q = append(f.q, d) }

func (f *fifo) len() int { return len(f.q) - f.head }

// keep drops the queued deadlines live says no, keeping the order.
func (f *fifo) keep(live func(deadline) bool) {
	n := 0
	for _, d := range f.q[f.head:] {
		if live(d) {
			f.q[n] = d
			n++
		}
	}
	clear(f.q[n:])
	f.q, f.head = f.q[:n], 0
	if cap(f.q) > 4096 && n < cap(f.q)/4 {
		f.q = append([]deadline(nil), f.q...) // give a flood's backing array back
	}
}

func (f *fifo) peek() (deadline, bool) {
	if f.head == len(f.q) {
		return deadline{}, false
	}
	return f.q[f.head], true
}

func (f *fifo) pop() {
	f.q[f.head] = deadline{}
	f.head++
	if f.head == len(f.q) {
		f.q, f.head = f.q[:0], 0
	} else if f.head > 4096 && f.head*2 > len(f.q) {
		n := copy(f.q, f.q[f.head:])
		f.q, f.head = f.q[:n], 0
	}
}

// Tracker classifies events into outcomes: one verdict per connection,
// success or a failure kind. It runs the connect deadline of every
// unanswered new flow and the settle deadline of every established one.
// Not safe for concurrent use: the agent calls it under its lock, from its
// loop and from the events' reader.
type Tracker struct {
	policy  PolicyFunc
	pending map[flowKey]pending
	queues  queueSet
	// replays: the replay deadlines of connecting flows (Policy.Replay),
	// queued by length like the connect deadlines.
	replays queueSet
	seq     uint64
	// queued counts the deadlines in queues and replays, decided ones
	// included (compact drops those).
	queued int
	// MaxPending is the node's ceiling on tracked flows (memory: EntryBytes
	// each); beyond it new flows are not tracked and get only the kernel's
	// signals (a RST, a retransmitted SYN). Overflow counts them.
	MaxPending int
	Overflow   uint64
	// MaxPendingPerService (> 0) caps the flows one service may have
	// awaiting a verdict (connecting or settling): beyond it that
	// service's new flows are not tracked, as beyond MaxPending, so one
	// tenant's idle or half-open connections cannot take the node's
	// ceiling. Probes are exempt from it: an endpoint in probation needs
	// its probe's verdict.
	MaxPendingPerService int
	// svcs: per service, what it has waiting and what was shed.
	svcs map[uint32]*svcCount
	// connects counts the TCP connects waiting for a first answer;
	// floodConnects is their sum over services with each service's share
	// capped at share (SetConnectShare).
	connects, floodConnects, share int
	// gen counts event losses the agent reported (EventsLost): a connect
	// deadline of a connection that waited across one is no evidence, as
	// its SYN-ACK may be among the lost events. Withheld counts those.
	gen      uint64
	Withheld uint64
	// NotBefore: connections that started before it (a previous agent's
	// backlog in a pinned ring, whose losses this agent cannot know) get
	// no timeout from their deadline either; WithheldOld counts them.
	NotBefore   time.Time
	WithheldOld uint64
	// datagrams counts the pending datagram flows (Pending's share that
	// is no connect waiting: see PendingConnects).
	datagrams int
	// OnUnanswered, if set, hears of each datagram flow (Policy.Datagram)
	// still unanswered at its deadline.
	OnUnanswered func(backend uint32)
}

// EventsLost tells the tracker that the datapath dropped events (the ring
// buffer was full): connections waiting now get no timeout verdict from
// their deadline, only from what still arrives (a RST, the kernel's
// retransmission signal, a SYN-ACK).
func (t *Tracker) EventsLost() { t.gen++ }

// NewTracker returns a tracker using policy for each backend.
func NewTracker(policy PolicyFunc) *Tracker {
	return &Tracker{
		policy:     policy,
		pending:    map[flowKey]pending{},
		MaxPending: 1 << 20,
		svcs:       map[uint32]*svcCount{},
	}
}

// SetConnectShare caps what each service adds to FloodConnects at n
// (0: no cap).
func (t *Tracker) SetConnectShare(n int) {
	t.share = n
	t.floodConnects = 0
	for _, c := range t.svcs {
		t.floodConnects += t.capped(c.connects)
	}
}

func (t *Tracker) capped(n int) int {
	if t.share > 0 {
		return min(n, t.share)
	}
	return n
}

// count adds (d = 1) or removes (d = −1) p from the per-service counts.
func (t *Tracker) count(p pending, d int) {
	if p.datagram {
		t.datagrams += d
	}
	if !p.waiting() {
		return
	}
	c := t.svcs[p.svc]
	if c == nil {
		c = &svcCount{}
		t.svcs[p.svc] = c
	}
	c.waiting += d
	if p.connect() {
		before := t.capped(c.connects)
		c.connects += d
		t.connects += d
		t.floodConnects += t.capped(c.connects) - before
	}
	// A service left with nothing waiting keeps its entry (one per
	// service id, and ids are reused): deleted, it was allocated again by
	// the service's next connection, twice per connection at a low rate.
}

// drop forgets key's pending entry.
func (t *Tracker) drop(key flowKey) {
	if p, ok := t.pending[key]; ok {
		t.forget(key, p)
	}
}

// forget drops key's entry p, which the caller looked up.
func (t *Tracker) forget(key flowKey, p pending) {
	t.count(p, -1)
	delete(t.pending, key)
}

// Pending is the number of flows the tracker holds: those without a
// verdict yet and those whose verdict it remembers.
func (t *Tracker) Pending() int { return len(t.pending) }

// PendingConnects is the number of TCP connects waiting for their
// backend's first answer (SYN-ACK or RST). Established connections still
// settling, datagram flows waiting for a reply (a fire-and-forget UDP
// service has one per flow) and remembered verdicts are none: they tell
// nothing of a SYN flood.
func (t *Tracker) PendingConnects() int { return t.connects }

// FloodConnects is PendingConnects with each service's share capped
// (SetConnectShare): what may count as a sign of flood. One service's
// half-open connections, a tenant's doing, cannot reach a node-wide
// threshold above the cap alone; the datapath's SYN-rate signals judge a
// flood of one service.
func (t *Tracker) FloodConnects() int { return t.floodConnects }

// DrainShed hands f, per service, the new flows not tracked since the
// last call: over the service's cap (MaxPendingPerService) and over the
// node's ceiling (MaxPending).
func (t *Tracker) DrainShed(f func(service uint32, overCap, overMemory uint64)) {
	for id, c := range t.svcs {
		if c.shedCap == 0 && c.shedMemory == 0 {
			continue
		}
		f(id, c.shedCap, c.shedMemory)
		c.shedCap, c.shedMemory = 0, 0
		if c.waiting == 0 {
			delete(t.svcs, id)
		}
	}
}

// shed counts a new flow of service svc that wait did not track.
func (t *Tracker) shed(svc uint32, r shedReason) {
	if r == tracked {
		return
	}
	c := t.svcs[svc]
	if c == nil {
		c = &svcCount{}
		t.svcs[svc] = c
	}
	if r == overMemory {
		c.shedMemory++
		t.Overflow++
	} else {
		c.shedCap++
	}
}

// Why wait did not track a flow.
type shedReason uint8

const (
	tracked    shedReason = iota
	overCap               // its service's MaxPendingPerService
	overMemory            // the node's MaxPending
)

// wait makes key's entry p, with a deadline d after at. A new entry is
// refused over the node's ceiling, or over its service's cap if it awaits
// a verdict and is no probe; replacing key's entry always succeeds, as it
// takes no more room. The caller counts what was refused (shed), once per
// flow.
func (t *Tracker) wait(key flowKey, p pending, at time.Time, d time.Duration) shedReason {
	old, replace := t.pending[key]
	return t.put(key, old, replace, p, at, d)
}

// put is wait with key's entry looked up by the caller: old, if replace.
func (t *Tracker) put(key flowKey, old pending, replace bool, p pending, at time.Time, d time.Duration) shedReason {
	if !replace {
		if len(t.pending) >= t.MaxPending {
			return overMemory
		}
		if t.MaxPendingPerService > 0 && p.waiting() && !p.probe {
			if c := t.svcs[p.svc]; c != nil && c.waiting >= t.MaxPendingPerService {
				return overCap
			}
		}
	}
	t.seq++
	p.seq = t.seq
	p.gen = t.gen
	if replace {
		t.count(old, -1)
	}
	t.count(p, 1)
	t.pending[key] = p
	t.enqueue(&t.queues, d, deadline{key: key, seq: t.seq, at: at.Add(d)})
	return tracked
}

// enqueue queues dl in qs under its length d, compacting the queues when
// decided deadlines have piled up.
func (t *Tracker) enqueue(qs *queueSet, d time.Duration, dl deadline) {
	// Nearly every flow is decided long before its deadline, which stays
	// queued until it comes up: at a high rate of new flows the queues
	// would hold rate × deadline entries whatever MaxPending says. Live
	// deadlines are at most two per entry (its own and a replay's), so
	// past three per entry and then some, drop the decided ones: the next
	// compaction is at least an entry's worth of pushes away, amortised
	// O(1) a push.
	if t.queued > 3*len(t.pending)+4096 {
		t.compact()
	}
	qs.of(d).push(dl)
	t.queued++
}

// compact drops every decided deadline, and the queues left empty. The
// sets are made anew, not filtered in place: Expire may be ranging over
// the old one (its wait can compact).
func (t *Tracker) compact() {
	t.queued = 0
	for _, qs := range []*queueSet{&t.queues, &t.replays} {
		var kept queueSet
		for _, q := range *qs {
			q.keep(func(dl deadline) bool { return !t.decided(dl) })
			if q.len() > 0 {
				kept = append(kept, q)
			}
			t.queued += q.len()
		}
		*qs = kept
	}
}

// pop takes q's head.
func (t *Tracker) pop(q *fifo) {
	q.pop()
	t.queued--
}

// Classify turns one event into an outcome. ok is false when the event
// decides nothing (yet).
func (t *Tracker) Classify(ev Event) (o accrual.Outcome, ok bool) {
	pol := t.policy(ev.Backend)
	if !pol.Tracked {
		return o, false
	}
	key := keyOf(ev.Backend, ev.Client)
	p, known := t.pending[key]
	if known && p.void() {
		switch {
		case ev.Type == NewFlow && ev.Flags&FlagRepick != 0 && p.phase == voided:
			// The unsent replay's own report of the move: no wait
			// starts. Another flow on the tuple replaces the entry.
			p.phase = voidedRepicked
			t.pending[key] = p
			return o, false
		case ev.Type == SynRetrans:
			// The client's own retransmission: the backend gets the SYN
			// now, and its answer (or silence) from here is a verdict.
			t.put(key, p, true, pending{phase: connecting, start: ev.At, svc: pol.Service}, ev.At, pol.ConnectTimeout)
			return o, false
		}
	}
	if known && (p.phase == timedOut || p.phase == settled || p.void()) && ev.Type != NewFlow {
		if ev.Type == FlowEnd || ev.Type == Refused || ev.Type == Reset {
			t.forget(key, p)
		}
		return o, false
	}
	o = accrual.Outcome{Endpoint: ev.Backend, Probe: ev.Flags&FlagProbe != 0 || (known && p.probe), At: ev.At, Started: ev.At}
	if known && !p.start.IsZero() {
		o.Started = p.start
	}

	switch ev.Type {
	case NewFlow:
		o.Started = ev.At
		// A flow moved to another backend is already a replay (or the
		// client's own retry): it gets none of its own. A probe gets one:
		// its client need not wait for our experiment (its verdict is
		// still the connect deadline's).
		r := t.put(key, p, known, pending{phase: connecting, probe: o.Probe, start: ev.At, datagram: pol.Datagram, svc: pol.Service}, ev.At, pol.ConnectTimeout)
		t.shed(pol.Service, r)
		if r == tracked && pol.Replay > 0 && pol.Replay < pol.ConnectTimeout && ev.Flags&FlagRepick == 0 {
			t.enqueue(&t.replays, pol.Replay, deadline{key: key, seq: t.seq, at: ev.At.Add(pol.Replay)})
		}
		return o, false
	case Established:
		// The handshake's length, for the slow-connect rule: both ends
		// are the datapath's own timestamps of the SYN and the SYN-ACK.
		if known && p.phase == connecting && ev.At.After(p.start) {
			o.Handshake = ev.At.Sub(p.start)
		}
		// A connection the caps left untracked is a success at its
		// SYN-ACK, as one whose resets do not count: counting its resets
		// and none of its successes would turn a healthy endpoint's odd
		// reset into a streak.
		// (Counted as shed at its SYN, if it was.)
		if pol.Settle != SettleOnSynAck &&
			t.put(key, p, known, pending{phase: settling, probe: o.Probe, settle: pol.Settle, start: o.Started, handshake: o.Handshake, svc: pol.Service}, ev.At, pol.ConnectTimeout) == tracked {
			return o, false
		}
		if known {
			t.forget(key, p)
		}
		o.Success = true
		return o, true
	case FirstData:
		if known && p.phase == settling && p.settle == SettleOnData {
			t.forget(key, p)
			o.Success, o.Handshake = true, p.handshake
			return o, true
		}
		return o, false
	case FlowEnd:
		// A void end decides nothing: the backend reset a connection the
		// client had not conducted right. A probe's is inconclusive, and
		// accrual grants a new one.
		if ev.Flags&FlagVoid != 0 {
			t.drop(key)
			if known && o.Probe {
				o.Inconclusive = true
				return o, true
			}
			return o, false
		}
		// A reset ends a flow too, but its Reset event came first and took
		// the pending entry; what is left here closed normally.
		if known && p.phase == settling {
			t.drop(key)
			o.Success, o.Handshake = true, p.handshake
			return o, true
		}
		t.drop(key)
		// Ended before any answer the datapath judges: the client reset
		// it, as a client does when the backend answers its SYN with a
		// bare ACK (a TIME_WAIT socket of an earlier connection on the same
		// ports). Nothing to count, but a probe must not go without a
		// verdict: it is inconclusive, and accrual grants a new one at once.
		if known && p.phase == connecting && o.Probe {
			o.Inconclusive = true
			return o, true
		}
		return o, false
	case Refused:
		o.Kind = accrual.KindRefused
	case SynRetrans:
		// The client gave up waiting before our own deadline: that is the
		// timeout. The deadline for this flow is void now, and what the
		// backend answers later (a RST, a late SYN-ACK) is not a second
		// verdict on the same connection, as after our own deadline.
		o.Kind = accrual.KindTimeout
		t.drop(key)
		t.wait(key, pending{phase: timedOut, svc: pol.Service}, ev.At, memory(pol.ConnectTimeout))
		return o, true
	case Reset:
		o.Kind = accrual.KindReset
		if ev.Flags&FlagBackendData != 0 {
			o.Kind = accrual.KindResetAfterData
		}
	default:
		return o, false
	}
	t.drop(key)
	return o, true
}

// Void says that the agent's replay moved client's flow to backend at
// at, but its SYN was never sent there: until the client's own
// retransmission reaches the backend, its silence says nothing of it. The
// flow's NEW_FLOW (a repick, which the datapath reported and the reader
// has yet to read) starts no wait; the retransmission (SYN_RETRANS) starts
// the connect deadline, from when the backend gets the SYN; anything else
// before it decides nothing. The entry is forgotten after
// memory(ConnectTimeout).
func (t *Tracker) Void(backend uint32, client netip.AddrPort, at time.Time) {
	pol := t.policy(backend)
	if !pol.Tracked {
		return
	}
	key := keyOf(backend, client)
	t.drop(key)
	t.wait(key, pending{phase: voided, svc: pol.Service}, at, memory(pol.ConnectTimeout))
}

// Expire decides every connection whose deadline passed by now: a
// connecting one timed out, a settling one succeeded. now must be a time up
// to which every event has been read (the reader's CaughtUp): a deadline
// judged while its connection's SYN-ACK is still unread in the ring would
// turn a late event into a false timeout.
func (t *Tracker) Expire(now time.Time, emit func(accrual.Outcome)) {
	for _, q := range t.queues {
		dur := q.d
		for {
			d, ok := q.peek()
			if !ok || d.at.After(now) {
				break
			}
			t.pop(q)
			p, live := t.pending[d.key]
			if !live || p.seq != d.seq {
				continue // decided (see decided)
			}
			t.forget(d.key, p)
			o := accrual.Outcome{Endpoint: d.key.backend, Probe: p.probe, At: d.at, Started: p.start}
			switch p.phase {
			case connecting:
				datagram := t.policy(d.key.backend).Datagram
				if datagram {
					if t.OnUnanswered != nil {
						t.OnUnanswered(d.key.backend)
					}
					if !p.probe {
						continue
					}
				}
				if p.gen != t.gen {
					t.Withheld++
					continue
				}
				if d.at.Add(-dur).Before(t.NotBefore) {
					t.WithheldOld++
					continue
				}
				if datagram {
					// A probe no refusal answered: the port is open.
					// Remembered, so a late refusal is no second verdict.
					o.Success = true
					t.wait(d.key, pending{phase: settled, svc: p.svc}, d.at, memory(t.policy(d.key.backend).ConnectTimeout))
					break
				}
				o.Kind = accrual.KindTimeout
				t.wait(d.key, pending{phase: timedOut, svc: p.svc}, d.at, memory(t.policy(d.key.backend).ConnectTimeout))
			case settling:
				o.Success, o.Handshake = true, p.handshake
				t.wait(d.key, pending{phase: settled, svc: p.svc}, d.at, memory(t.policy(d.key.backend).ConnectTimeout))
			default:
				continue
			}
			emit(o)
		}
	}
}

// DueReplays hands emit each connection whose replay deadline passed by
// now while it still waits for its backend's first answer. now must be a
// time up to which every event has been read, as for Expire.
func (t *Tracker) DueReplays(now time.Time, emit func(backend uint32, client netip.AddrPort)) {
	for _, q := range t.replays {
		for {
			d, ok := q.peek()
			if !ok || d.at.After(now) {
				break
			}
			t.pop(q)
			if p, live := t.pending[d.key]; !live || p.seq != d.seq || p.phase != connecting {
				continue // decided (see decided), or answered
			}
			emit(d.key.backend, d.key.client())
		}
	}
}

// decided reports whether d's connection was decided already, or
// superseded by a newer flow on the tuple: its deadline is void.
func (t *Tracker) decided(d deadline) bool {
	p, live := t.pending[d.key]
	return !live || p.seq != d.seq
}

// NextDeadline is the earliest deadline of a connection still pending,
// its connect, settle or replay deadline.
func (t *Tracker) NextDeadline() (time.Time, bool) {
	next, ok := t.NextExpiry()
	if r, rok := t.NextReplay(); rok && (!ok || r.Before(next)) {
		next, ok = r, true
	}
	return next, ok
}

// NextExpiry is the earliest connect or settle deadline still pending:
// when Expire next has work.
func (t *Tracker) NextExpiry() (time.Time, bool) { return t.next(t.queues) }

// NextReplay is the earliest replay deadline still pending: when
// DueReplays next has work.
func (t *Tracker) NextReplay() (time.Time, bool) { return t.next(t.replays) }

// next is the earliest live deadline in qs. It drops the decided ones it
// finds at the heads of the queues on the way: nearly every connection is
// decided by its events long before its deadline, and a stale head would
// wake the agent for nothing (under load, once per connection).
func (t *Tracker) next(qs queueSet) (time.Time, bool) {
	var best time.Time
	found := false
	for _, q := range qs {
		for {
			d, ok := q.peek()
			if !ok {
				break
			}
			if t.decided(d) {
				t.pop(q)
				continue
			}
			if !found || d.at.Before(best) {
				best, found = d.at, true
			}
			break
		}
	}
	return best, found
}

// ReplayDue reports whether a connection's replay deadline has passed by
// now: whether DueReplays has work.
func (t *Tracker) ReplayDue(now time.Time) bool {
	next, ok := t.NextReplay()
	return ok && !next.After(now)
}

// Due reports whether a pending connection's connect or settle deadline
// has passed by now: whether Expire has work.
func (t *Tracker) Due(now time.Time) bool {
	next, ok := t.NextExpiry()
	return ok && !next.After(now)
}

// Forget drops pending connections of backends that left the desired state.
func (t *Tracker) Forget(backends map[uint32]bool) {
	if len(backends) == 0 {
		return
	}
	for k := range t.pending {
		if backends[k.backend] {
			t.drop(k)
		}
	}
}
