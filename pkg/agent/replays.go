// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"errors"
	"math/bits"
	"net/netip"
	"slices"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
	"github.com/penaltybox/penaltybox/pkg/reconcile"
	"github.com/penaltybox/penaltybox/pkg/replay"
)

// A SYN a backend leaves unanswered is replayed to another backend after
// the service's replay deadline: four times the recent 99th percentile of
// its handshakes (SYN to SYN-ACK, as the datapath timed them), at least
// replayFloor, at most half the connect timeout, rounded up to a power of
// two milliseconds (a few deadline queues, not one per value). On a LAN a
// silent backend then costs its clients tens of milliseconds, not their
// own SYN retransmission (1 s on Linux); on a slow link, in proportion.
// The connect timeout still judges the backend: a timeout failure at its
// own deadline if it never answers; its late SYN-ACK, which the datapath
// reports and keeps from the client (PB_CT_MOVED), is an answer. Replays
// change what clients see, not accrual.
const (
	replayFloor   = 16 * time.Millisecond
	replayFactor  = 4
	replaySamples = 128 // handshakes kept per service
	replayFirst   = 8   // handshakes before the first estimate
	replayEvery   = 32  // the deadline is recomputed every this many
)

// Replayer replays the SYN client sent to vip, which backend refused
// (pkg/replay).
type Replayer interface {
	Replay(client, vip, backend netip.AddrPort) error
}

// replays send a refused or unanswered SYN again at once, for the
// datapath to move its flow to another backend (pkg/replay), and keep
// each service's replay deadline from its recent handshakes.
type replays struct {
	*core
	replayer Replayer
	// failed: a replay failure has been logged (the metric counts the
	// rest).
	failed bool
	// handshakes: per service, recent handshake times.
	handshakes map[uint32]*handshakes
	// flood: no replays in flood mode.
	flood *floodMode
	// unsent: flows whose replay moved them but was never sent, for
	// applyVoids.
	unsent []unsentFlow
}

// unsentFlow is a flow an unsent replay moved to backend.
type unsentFlow struct {
	backend uint32
	client  netip.AddrPort
}

// applyVoids tells the tracker of the flows whose replay was not sent
// (Tracker.Void). Called with mu held, after the event that led to the
// replay was classified (the flow may have moved back to the backend
// that refused it, whose refusal is a verdict) and outside the tracker's
// walk of its replay deadlines.
func (r *replays) applyVoids() {
	now := r.clk.Now()
	for _, u := range r.unsent {
		r.tracker.Void(u.backend, u.client, now)
	}
	r.unsent = r.unsent[:0]
}

// maxReplayAge: a refusal older than this, or a replay deadline passed
// this long before it is read, is not replayed. Linux clients retransmit a
// SYN after 1 s, after which the flow has moved on its own.
const maxReplayAge = 200 * time.Millisecond

// refused sends a refused flow's SYN again, so that the datapath moves it
// to another backend now rather than on the client's retransmission.
func (r *replays) refused(ev *outcomes.Event) {
	if r.replayer == nil {
		return
	}
	s, ok := r.rec.Service(ev.Service)
	b, bok := r.rec.Backend(ev.Backend)
	if !ok || !bok {
		// Its service or backend left the desired state since.
		r.metrics.Replays.WithLabelValues("refused", "stale").Inc()
		return
	}
	// An old refusal (a backlog after a restart, a reader far behind) has
	// had the client's own retransmission by now; and in a flood, a replay
	// per refused SYN would be the flood's work done twice.
	if r.clk.Now().Sub(ev.At) > maxReplayAge {
		r.metrics.Replays.WithLabelValues("refused", "stale").Inc()
		return
	}
	if r.flood.on {
		r.metrics.Replays.WithLabelValues("refused", "flood").Inc()
		return
	}
	vip := netip.AddrPortFrom(s.Spec.Key.VIP, s.Spec.Key.Port)
	r.count("refused", s.Spec.Name, ev.Client, r.replayer.Replay(ev.Client, vip, b.Addr))
}

// handshakes are a service's recent handshake times.
type handshakes struct {
	ring  [replaySamples]time.Duration
	n     int // samples taken, all time
	after time.Duration
}

// replayAfter is the replay deadline of a service with these settings and
// recent handshakes (nil: none seen yet); 0: no replays.
func replayAfter(spec *desired.Service, h *handshakes) time.Duration {
	if !spec.RetryRefused || spec.Key.Protocol != desired.TCP || spec.Accrual.Mode == accrual.ModeNone {
		return 0
	}
	limit := spec.Accrual.ConnectTimeout / 2
	if limit < replayFloor {
		return 0 // a connect timeout this short judges before a replay could help
	}
	if h == nil || h.n < replayFirst {
		return limit // nothing known yet: the cautious end
	}
	n := min(h.n, replaySamples)
	p99 := largest(h.ring[:n], n-(n*99)/100)
	d := max(replayFactor*p99, replayFloor)
	ms := uint64((d + time.Millisecond - 1) / time.Millisecond)
	d = time.Duration(uint64(1)<<bits.Len64(ms-1)) * time.Millisecond
	return min(d, limit)
}

// largest is the k-th largest of s (k ≥ 1). The 99th percentile of a
// ring of replaySamples is its first or second largest: one pass keeping
// the k largest, not a sort, which was the agent's costliest step per
// handshake (every replayEvery-th) in the e2e benchmark's profile.
func largest(s []time.Duration, k int) time.Duration {
	if k < 1 || k > len(s) {
		return 0
	}
	if k > maxTop {
		c := slices.Clone(s)
		slices.Sort(c)
		return c[len(c)-k]
	}
	var top [maxTop]time.Duration // top[:k], descending
	filled := 0
	for _, v := range s {
		if filled == k && v <= top[k-1] {
			continue
		}
		i := min(filled, k-1)
		for i > 0 && top[i-1] < v {
			top[i] = top[i-1]
			i--
		}
		top[i] = v
		filled = min(filled+1, k)
	}
	return top[k-1]
}

const maxTop = 4

// noteHandshake records a success's handshake time for its service's
// replay deadline, and moves the deadline when it changes. Called with mu
// held.
func (r *replays) noteHandshake(o accrual.Outcome) {
	if o.Handshake <= 0 {
		return
	}
	b, ok := r.rec.Backend(o.Endpoint)
	if !ok {
		return
	}
	s, ok := r.rec.Service(b.Service)
	if !ok || !s.Spec.RetryRefused {
		return
	}
	h := r.handshakes[s.ID]
	if h == nil {
		h = &handshakes{}
		r.handshakes[s.ID] = h
	}
	h.ring[h.n%replaySamples] = o.Handshake
	h.n++
	// A service's first handshakes set its deadline soon (after 8 and
	// 16): until then every unanswered SYN waits the cautious half of
	// the connect timeout, which at a new agent's start or a new
	// service's was the p99 of a silent backend's clients.
	if h.n%replayEvery == 0 || h.n == replayFirst || h.n == 2*replayFirst {
		r.retune(s)
	}
}

// unansweredToo: the agent can replay unanswered SYNs (without a
// replayer no deadline is set, or the tracker would hold due replays no
// one takes).
func (r *replays) unansweredToo() bool {
	_, ok := r.replayer.(unansweredReplayer)
	return ok
}

// after is service s's replay deadline now; 0: no replays (none for the
// service, or no replayer that can move an unanswered SYN).
func (r *replays) after(s *reconcile.Service) time.Duration {
	if !r.unansweredToo() {
		return 0
	}
	return replayAfter(&s.Spec, r.handshakes[s.ID])
}

// retune writes a service's replay deadline into its policy.
func (r *replays) retune(s *reconcile.Service) {
	if !r.unansweredToo() {
		return
	}
	d := r.after(s)
	if h := r.handshakes[s.ID]; h != nil {
		if d != h.after && h.after != 0 {
			r.log.Debug("replay deadline moved", "service", s.Spec.Name, "from", h.after.String(), "to", d.String())
		}
		h.after = d
	}
	if int(s.ID) < len(r.svcPolicy) {
		r.svcPolicy[s.ID].Replay = d
	}
}

// unanswered replays a SYN that backend has left unanswered past its
// service's replay deadline, for the datapath to move it to another
// backend. Called with mu held.
func (r *replays) unanswered(backend uint32, client netip.AddrPort) {
	ur, ok := r.replayer.(unansweredReplayer)
	if !ok {
		return
	}
	b, ok := r.rec.Backend(backend)
	if !ok {
		return
	}
	s, ok := r.rec.Service(b.Service)
	if !ok {
		return
	}
	if r.flood.on {
		r.metrics.Replays.WithLabelValues("unanswered", "flood").Inc()
		return
	}
	vip := netip.AddrPortFrom(s.Spec.Key.VIP, s.Spec.Key.Port)
	r.count("unanswered", s.Spec.Name, client, ur.ReplayUnanswered(client, vip, b.Addr, backend))
}

// late counts an unanswered SYN whose replay deadline was read too late
// to replay it (runReplays). Called with mu held.
func (r *replays) late(uint32, netip.AddrPort) {
	r.metrics.Replays.WithLabelValues("unanswered", "stale").Inc()
}

// unansweredReplayer is a Replayer that can also move an unanswered SYN.
type unansweredReplayer interface {
	ReplayUnanswered(client, vip, backend netip.AddrPort, backendID uint32) error
}

// count counts a replay's result, and logs the first failure.
func (r *replays) count(reason, service string, client netip.AddrPort, err error) {
	var notSent *replay.NotSentError
	switch {
	case err == nil:
		r.metrics.Replays.WithLabelValues(reason, "sent").Inc()
	case errors.Is(err, replay.ErrStale):
		r.metrics.Replays.WithLabelValues(reason, "stale").Inc()
	case errors.Is(err, replay.ErrNoCopy):
		r.metrics.Replays.WithLabelValues(reason, "no_copy").Inc()
	case errors.Is(err, replay.ErrDropped):
		r.metrics.Replays.WithLabelValues(reason, "dropped").Inc()
	case errors.As(err, &notSent):
		// The datapath moved the flow, but its SYN never left (the raw
		// socket's send failed): the new backend's silence until the
		// client's own retransmission is no evidence against it.
		r.metrics.Replays.WithLabelValues(reason, "not_sent").Inc()
		if notSent.Backend != 0 {
			r.unsent = append(r.unsent, unsentFlow{notSent.Backend, client})
		}
		r.logFailure(service, client, err)
	default:
		r.metrics.Replays.WithLabelValues(reason, "error").Inc()
		r.logFailure(service, client, err)
	}
}

// logFailure logs a replay's failure, the first only.
func (r *replays) logFailure(service string, client netip.AddrPort, err error) {
	if !r.failed {
		r.failed = true
		r.log.Error("replaying a SYN failed; clients wait for their own retransmission (further failures are only counted)",
			"service", service, "client", client.String(), "err", err)
	}
}
