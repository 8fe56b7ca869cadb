package outcomes

import (
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
	p := Policy{Tracked: s.Mode != accrual.ModeNone, Datagram: !tcp, ConnectTimeout: s.ConnectTimeout}
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

type flowKey struct {
	backend uint32
	client  netip.AddrPort
}

type phase uint8

const (
	connecting phase = iota + 1 // waiting for SYN-ACK or RST
	settling                    // established, success not yet decided
	timedOut                    // our deadline judged it; later news changes nothing
	settled                     // our deadline judged it a success; a later reset is no second verdict
)

// timedOutMemory is how many connect timeouts a timed-out flow is
// remembered, so a late SYN-ACK, RST or retransmission signal for it is not
// a second verdict.
const timedOutMemory = 10

type pending struct {
	seq   uint64
	gen   uint64    // Tracker.gen when the connection started waiting
	start time.Time // the connection's first event (its SYN)
	// handshake: SYN to SYN-ACK, for a settling connection (0: unknown).
	handshake time.Duration
	phase     phase
	probe     bool
	settle    Settle
	datagram  bool // a datagram flow waiting for its reply (see Tracker.datagrams)
}

type deadline struct {
	key flowKey
	seq uint64
	at  time.Time
}

// fifo holds deadlines of one length. Events arrive in time order, so
// appending keeps each queue sorted and expiry only looks at heads.
type fifo struct {
	q    []deadline
	head int
}

func (f *fifo) push(d deadline) { f.q = append(f.q, d) }

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
// Not safe for concurrent use: the agent's loop owns it.
type Tracker struct {
	policy  PolicyFunc
	pending map[flowKey]pending
	queues  map[time.Duration]*fifo
	// replays: the replay deadlines of connecting flows (Policy.Replay),
	// queued by length like the connect deadlines.
	replays map[time.Duration]*fifo
	seq     uint64
	// MaxPending bounds memory under a SYN flood; beyond it new flows get
	// only the kernel's retransmission signal. Overflow counts them.
	MaxPending int
	Overflow   uint64
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
		queues:     map[time.Duration]*fifo{},
		replays:    map[time.Duration]*fifo{},
		MaxPending: 1 << 20,
	}
}

// drop forgets key's pending entry.
func (t *Tracker) drop(key flowKey) {
	if p, ok := t.pending[key]; ok && p.datagram {
		t.datagrams--
	}
	delete(t.pending, key)
}

// Pending is the number of connections without a verdict yet.
func (t *Tracker) Pending() int { return len(t.pending) }

// PendingConnects is Pending without the datagram flows waiting for a
// reply: those are no connects (a fire-and-forget UDP service has one per
// flow), so they tell nothing of a SYN flood.
func (t *Tracker) PendingConnects() int { return len(t.pending) - t.datagrams }

func (t *Tracker) wait(key flowKey, p pending, at time.Time, d time.Duration) bool {
	if len(t.pending) >= t.MaxPending {
		t.Overflow++
		return false
	}
	t.seq++
	p.seq = t.seq
	p.gen = t.gen
	if old, ok := t.pending[key]; ok && old.datagram {
		t.datagrams--
	}
	if p.datagram {
		t.datagrams++
	}
	t.pending[key] = p
	q := t.queues[d]
	if q == nil {
		q = &fifo{}
		t.queues[d] = q
	}
	q.push(deadline{key: key, seq: t.seq, at: at.Add(d)})
	return true
}

// Classify turns one event into an outcome. ok is false when the event
// decides nothing (yet).
func (t *Tracker) Classify(ev Event) (o accrual.Outcome, ok bool) {
	pol := t.policy(ev.Backend)
	if !pol.Tracked {
		return o, false
	}
	key := flowKey{ev.Backend, ev.Client}
	p, known := t.pending[key]
	if known && (p.phase == timedOut || p.phase == settled) && ev.Type != NewFlow {
		if ev.Type == FlowEnd || ev.Type == Refused || ev.Type == Reset {
			t.drop(key)
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
		if t.wait(key, pending{phase: connecting, probe: o.Probe, start: ev.At, datagram: pol.Datagram}, ev.At, pol.ConnectTimeout) &&
			pol.Replay > 0 && pol.Replay < pol.ConnectTimeout && ev.Flags&FlagRepick == 0 {
			q := t.replays[pol.Replay]
			if q == nil {
				q = &fifo{}
				t.replays[pol.Replay] = q
			}
			q.push(deadline{key: key, seq: t.seq, at: ev.At.Add(pol.Replay)})
		}
		return o, false
	case Established:
		// The handshake's length, for the slow-connect rule: both ends
		// are the datapath's own timestamps of the SYN and the SYN-ACK.
		if known && p.phase == connecting && ev.At.After(p.start) {
			o.Handshake = ev.At.Sub(p.start)
		}
		if pol.Settle != SettleOnSynAck &&
			t.wait(key, pending{phase: settling, probe: o.Probe, settle: pol.Settle, start: o.Started, handshake: o.Handshake}, ev.At, pol.ConnectTimeout) {
			return o, false
		}
		t.drop(key)
		o.Success = true
		return o, true
	case FirstData:
		if known && p.phase == settling && p.settle == SettleOnData {
			t.drop(key)
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
		t.wait(key, pending{phase: timedOut}, ev.At, timedOutMemory*pol.ConnectTimeout)
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

// Expire decides every connection whose deadline passed by now: a
// connecting one timed out, a settling one succeeded. now must be a time up
// to which every event has been read (the reader's CaughtUp): a deadline
// judged while its connection's SYN-ACK is still unread in the ring would
// turn a late event into a false timeout.
func (t *Tracker) Expire(now time.Time, emit func(accrual.Outcome)) {
	for dur, q := range t.queues {
		for {
			d, ok := q.peek()
			if !ok || d.at.After(now) {
				break
			}
			q.pop()
			if t.decided(d) {
				continue
			}
			p := t.pending[d.key]
			t.drop(d.key)
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
					t.wait(d.key, pending{phase: settled}, d.at, timedOutMemory*t.policy(d.key.backend).ConnectTimeout)
					break
				}
				o.Kind = accrual.KindTimeout
				t.wait(d.key, pending{phase: timedOut}, d.at, timedOutMemory*t.policy(d.key.backend).ConnectTimeout)
			case settling:
				o.Success, o.Handshake = true, p.handshake
				t.wait(d.key, pending{phase: settled}, d.at, timedOutMemory*t.policy(d.key.backend).ConnectTimeout)
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
			q.pop()
			if t.decided(d) || t.pending[d.key].phase != connecting {
				continue
			}
			emit(d.key.backend, d.key.client)
		}
	}
}

// decided reports whether d's connection was decided already, or
// superseded by a newer flow on the tuple: its deadline is void.
func (t *Tracker) decided(d deadline) bool {
	p, live := t.pending[d.key]
	return !live || p.seq != d.seq
}

// NextDeadline is the earliest deadline of a connection still pending.
// It drops the decided ones it finds at the heads of the queues on the
// way: nearly every connection is decided by its events long before its
// deadline, and a stale head would wake the agent for nothing (under
// load, once per connection).
func (t *Tracker) NextDeadline() (time.Time, bool) {
	var best time.Time
	found := false
	for _, qs := range []map[time.Duration]*fifo{t.queues, t.replays} {
		for _, q := range qs {
			for {
				d, ok := q.peek()
				if !ok {
					break
				}
				if t.decided(d) {
					q.pop()
					continue
				}
				if !found || d.at.Before(best) {
					best, found = d.at, true
				}
				break
			}
		}
	}
	return best, found
}

// Due reports whether a pending connection's deadline has passed by now.
func (t *Tracker) Due(now time.Time) bool {
	next, ok := t.NextDeadline()
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
