package outcomes

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
)

// Reader drains the pb_events ring buffer in batches.
type Reader struct {
	rb     *ringbuf.Reader
	offset int64

	// Read counts events delivered; Bad counts records that did not decode.
	Read, Bad atomic.Uint64
}

// NewReader opens the ring buffer map.
func NewReader(m *ebpf.Map) (*Reader, error) {
	rb, err := ringbuf.NewReader(m)
	if err != nil {
		return nil, fmt.Errorf("outcomes: ring buffer: %w", err)
	}
	return &Reader{rb: rb, offset: MonoOffset()}, nil
}

// Offset is what the reader adds to kernel timestamps to get Unix time.
func (r *Reader) Offset() int64 { return r.offset }

// Poll is how often the reader collects events that did not wake it.
const Poll = 5 * time.Millisecond

// MaxBatch bounds one batch, so a flood cannot starve the agent's loop.
const MaxBatch = 1024

// Run reads until Close, handing batches of events to handle on its own
// goroutine (a hand-off to another would put a goroutine wake-up on the
// path of every ejection). It returns nil after Close.
func (r *Reader) Run(handle func([]Event)) error {
	var rec ringbuf.Record
	for {
		// The datapath wakes the reader only for failures; successes and
		// flow starts and ends are collected by this poll.
		r.rb.SetDeadline(time.Now().Add(Poll))
		if err := r.rb.ReadInto(&rec); err != nil {
			if errors.Is(err, ringbuf.ErrClosed) {
				return nil
			}
			if errors.Is(err, os.ErrDeadlineExceeded) {
				continue
			}
			return fmt.Errorf("outcomes: read: %w", err)
		}
		batch := make([]Event, 0, 64)
		for {
			ev, err := Decode(rec.RawSample, r.offset)
			if err != nil {
				r.Bad.Add(1)
			} else {
				batch = append(batch, ev)
			}
			// Take what is already there without blocking again.
			if len(batch) >= MaxBatch || r.rb.AvailableBytes() == 0 {
				break
			}
			if err := r.rb.ReadInto(&rec); err != nil {
				break
			}
		}
		r.Read.Add(uint64(len(batch)))
		if len(batch) > 0 {
			handle(batch)
		}
	}
}

// Close stops Run.
func (r *Reader) Close() error { return r.rb.Close() }
