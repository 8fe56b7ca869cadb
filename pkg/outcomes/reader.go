// SPDX-License-Identifier: Apache-2.0

package outcomes

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"
)

// Reader drains the pb_events ring buffer in batches.
//
// It never blocks in a system call: it waits for the ring in Go's network
// poller, through a duplicate of the map's file descriptor, and reads with
// a deadline in the past. A goroutine parked in epoll_wait(2) instead, as
// ringbuf.Reader's own wait does, has its P handed off by the runtime's
// monitor, which then keeps polling every 20µs: under the e2e benchmark's
// load that was half of the agent's CPU time.
type Reader struct {
	rb   *ringbuf.Reader
	wake *os.File        // the ring's fd, registered with the netpoller
	raw  syscall.RawConn // wake's, for waiting without reading

	mu     sync.Mutex // closed, and rb's ring while Run looks at it
	closed bool

	offset int64

	// kicked: Kick asked for a read now (see wait).
	kicked atomic.Bool
	// poll is the current wait between unannounced reads (Poll to
	// PollMax, see nextPoll); ring the ring's size in bytes.
	poll time.Duration
	ring int
	// since: when the ring was last found empty (the events' clock),
	// and the bytes read since, for the ring's fill rate.
	since int64
	bytes int

	// Reuse, set before Run, lets Run hand every batch in the same
	// array: the handler must not keep a batch past its return. (A batch
	// of a busy ring's poll is thousands of events: allocated afresh
	// each time, they were much of the agent's garbage.)
	Reuse bool
	buf   []Event

	// onCaught: the hook OnCaughtUp set; readBy: when it last asked the
	// ring to be read by (the events' clock; 0: no sooner than the poll).
	onCaught func(at time.Time) (readBy time.Time)
	readBy   int64

	// Read counts events delivered; Bad counts records that did not decode.
	Read, Bad atomic.Uint64
	// caught: the time up to which every event has been read (when the
	// reader last found the ring empty), on the events' clock (kernel
	// monotonic time plus offset), so a step of the wall clock does not
	// move it. 0 until the ring was first found empty: a pinned ring can
	// hold a previous agent's backlog. The datapath stamps a record once
	// it is reserved, except NEW_FLOW, stamped with its flow's start (the
	// conntrack inserts earlier): it may land just behind the mark, but
	// it starts a wait and judges nothing, so the mark holds for every
	// verdict. (Its deadline may queue microseconds behind a later
	// stamped one of the same length: it is judged that much later.)
	caught atomic.Int64
}

// CaughtUp is a time up to which every event has been handed to Run's
// handler, on the events' clock: when the reader last found the ring
// empty; the zero time before it first did. While it lags (the ring is
// busier than the reader), deadlines after it cannot be judged.
func (r *Reader) CaughtUp() time.Time {
	if c := r.caught.Load(); c != 0 {
		return time.Unix(0, c)
	}
	return time.Time{}
}

// now is the current time on the events' clock.
func (r *Reader) now() int64 { return MonoNow() + r.offset }

// NewReader opens the ring buffer map.
func NewReader(m *ebpf.Map) (*Reader, error) {
	fd, err := unix.FcntlInt(uintptr(m.FD()), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("outcomes: dup ring buffer fd: %w", err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("outcomes: ring buffer fd: %w", err)
	}
	// A non-blocking fd given to os.NewFile goes into the netpoller when
	// the file supports poll, which a ring buffer map does.
	wake := os.NewFile(uintptr(fd), "pb_events")
	if err := wake.SetReadDeadline(time.Time{}); err != nil {
		wake.Close()
		return nil, fmt.Errorf("outcomes: ring buffer not pollable: %w", err)
	}
	raw, err := wake.SyscallConn()
	if err != nil {
		wake.Close()
		return nil, fmt.Errorf("outcomes: ring buffer: %w", err)
	}
	rb, err := ringbuf.NewReader(m)
	if err != nil {
		wake.Close()
		return nil, fmt.Errorf("outcomes: ring buffer: %w", err)
	}
	// Reads never wait: the ring is only read when it has data.
	rb.SetDeadline(time.Unix(1, 0))
	return &Reader{rb: rb, wake: wake, raw: raw, offset: MonoOffset(), poll: Poll, ring: int(m.MaxEntries())}, nil
}

// Offset is what the reader adds to kernel timestamps to get Unix time.
func (r *Reader) Offset() int64 { return r.offset }

// Poll and PollMax bound how often the reader collects the events that
// did not wake it (successes, flow starts and ends): every wake-up of the
// agent costs it scheduler and runtime work whatever it reads, which was
// most of its CPU per healthy connection when it polled every Poll (the
// agentcpu benchmark part). Nothing judged waits for these reads: a
// failure wakes the reader (and everything before it in the ring is read
// with it, in order), a probe's events too, a replay deadline bounds the
// wait (OnCaughtUp), and another deadline that needs the reader caught up
// kicks it (Kick). The reader polls as seldom as PollMax, and more often
// when the ring fills fast (nextPoll).
const (
	Poll    = 5 * time.Millisecond
	PollMax = 50 * time.Millisecond
)

// pollFill is the share of the ring one poll's events may fill at the
// rate seen: 1/8 leaves room for a burst eight times the rate.
const pollFill = 8

// recordBytes is what one event takes in the ring: its 8-byte header and
// the record, rounded up to 8 bytes.
const recordBytes = (8 + eventSize + 7) &^ 7

// nextPoll is the wait before the next unannounced read: the time the
// ring would take to fill 1/pollFill at the rate of the last interval's
// events (bytes over d nanoseconds), within [Poll, PollMax].
func nextPoll(ring, bytes int, d int64) time.Duration {
	if bytes <= 0 || d <= 0 {
		return PollMax
	}
	t := time.Duration(float64(ring/pollFill) / float64(bytes) * float64(d))
	return min(max(t, Poll), PollMax)
}

// OnCaughtUp, called before Run, has Run call f on its goroutine each
// time it has handed over every event up to at (the events' clock); f
// says by when the ring must be read again (the zero time: no sooner than
// the poll). The agent runs its replay deadlines there: one can fall due
// before the poll, and waking the agent's loop to kick the reader, then
// again once the reader had read, cost it measurably (the agentcpu
// benchmark part).
func (r *Reader) OnCaughtUp(f func(at time.Time) (readBy time.Time)) { r.onCaught = f }

// waitFor is the wait before the next read: the poll, or less to read by
// readBy (the events' clock, 0 for none) when now is that close to it.
func waitFor(poll time.Duration, readBy, now int64) time.Duration {
	if readBy == 0 {
		return poll
	}
	return min(poll, max(time.Duration(readBy-now), 0))
}

// caughtUp records that every event up to at was handed over.
func (r *Reader) caughtUp(at int64) {
	r.caught.Store(at)
	r.empty(at)
	if r.onCaught != nil {
		r.readBy = 0
		if t := r.onCaught(time.Unix(0, at)); !t.IsZero() {
			r.readBy = t.UnixNano()
		}
	}
}

// Kick asks the reader to read the ring to its end now, not at its next
// poll: the agent's loop does when a deadline falls due that the reader
// has not caught up with (CaughtUp). Safe from any goroutine.
func (r *Reader) Kick() {
	r.kicked.Store(true)
	// A deadline in the past wakes a waiting Run; a wait that starts
	// after this sees kicked.
	r.wake.SetReadDeadline(time.Unix(1, 0))
}

// MaxBatch bounds one batch, so a flood cannot starve the agent's loop.
const MaxBatch = 1024

// available is the number of unread bytes in the ring; ok is false once
// Close has been called.
func (r *Reader) available() (n int, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return 0, false
	}
	return r.rb.AvailableBytes(), true
}

// wait returns when the ring has data, after a forced wake-up, or after
// Poll: the datapath wakes the reader only for failures; successes and
// flow starts and ends are collected by this poll.
func (r *Reader) wait() error {
	if err := r.wake.SetReadDeadline(time.Now().Add(waitFor(r.poll, r.readBy, r.now()))); err != nil {
		return err
	}
	// The readiness check runs after the poller's state is reset, so a
	// wake-up between the check and the park is not lost; so does the
	// look at kicked, after the deadline a Kick may have set.
	err := r.raw.Read(func(uintptr) bool {
		if r.kicked.Load() {
			return true
		}
		n, ok := r.available()
		return n > 0 || !ok
	})
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return nil
	}
	return err
}

// Run reads until Close, handing batches of events to handle on its own
// goroutine (a hand-off to another would put a goroutine wake-up on the
// path of every ejection). It returns nil after Close.
func (r *Reader) Run(handle func([]Event)) error {
	var rec ringbuf.Record
	for {
		// A Kick from now on asks for another look.
		r.kicked.Store(false)
		// The time is taken before the ring is looked at: an event
		// stamped before it is in the ring by then.
		at := r.now()
		n, ok := r.available()
		if !ok {
			return nil
		}
		if n == 0 {
			r.caughtUp(at)
			if err := r.wait(); err != nil {
				if _, ok := r.available(); !ok {
					return nil
				}
				return fmt.Errorf("outcomes: wait: %w", err)
			}
			continue
		}
		var batch []Event
		if r.Reuse {
			batch = r.buf[:0]
		} else {
			batch = make([]Event, 0, 64)
		}
		var emptyAt int64 // when the ring was found empty after this batch
		bad := 0
		for len(batch) < MaxBatch {
			if err := r.rb.ReadInto(&rec); err != nil {
				if errors.Is(err, ringbuf.ErrClosed) {
					return nil
				}
				// Deadline: nothing left but discarded records.
				if errors.Is(err, os.ErrDeadlineExceeded) {
					break
				}
				return fmt.Errorf("outcomes: read: %w", err)
			}
			ev, err := Decode(rec.RawSample, r.offset)
			if err != nil {
				r.Bad.Add(1)
				bad++
			} else {
				batch = append(batch, ev)
			}
			// Take what is already there, and no more. (The time is read
			// only when the ring is empty, after the look: an event stamped
			// in the nanoseconds between would be missed by the mark, at
			// no cost to every other record.) The record says what was
			// behind it when it was read; only when that was nothing is
			// the ring looked at again, under the lock Close takes (once a
			// record, that lock was a few percent of the agent's CPU).
			if rec.Remaining > 0 {
				continue
			}
			n, ok := r.available()
			if !ok {
				return nil
			}
			if n == 0 {
				emptyAt = r.now()
				break
			}
		}
		r.bytes += (len(batch) + bad) * recordBytes
		r.Read.Add(uint64(len(batch)))
		if len(batch) > 0 {
			handle(batch)
		}
		if r.Reuse {
			clear(batch) // no client address kept alive
			r.buf = batch[:0]
		}
		if emptyAt != 0 {
			r.caughtUp(emptyAt)
		}
	}
}

// empty notes that the ring was found empty at (the events' clock): the
// events read since the last time set the next poll's wait.
func (r *Reader) empty(at int64) {
	if r.since != 0 {
		if r.bytes > 0 {
			r.poll = nextPoll(r.ring, r.bytes, at-r.since)
		} else if at-r.since >= int64(r.poll) {
			// A poll found nothing: the next may wait longer.
			r.poll = PollMax
		}
	}
	r.since, r.bytes = at, 0
}

// Close stops Run.
func (r *Reader) Close() error {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	r.wake.Close() // wakes a waiting Run
	return r.rb.Close()
}

// Undecodable counts the records that did not decode (Bad).
func (r *Reader) Undecodable() uint64 { return r.Bad.Load() }
