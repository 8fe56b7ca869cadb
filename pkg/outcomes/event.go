// Package outcomes turns the datapath's ring buffer of per-flow events into
// L4 outcomes for failure accrual: it reads and decodes the events, and it
// classifies them, adding the agent's own connect deadline to the kernel's
// retransmitted-SYN signal so a silent backend is caught whichever comes
// first.
package outcomes

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Type is enum pb_event_type.
type Type uint8

const (
	NewFlow     Type = 1
	Established Type = 2
	Refused     Type = 3
	Reset       Type = 4
	SynRetrans  Type = 5
	FlowEnd     Type = 6
	Rejected    Type = 7
	FirstData   Type = 8
)

func (t Type) String() string {
	switch t {
	case NewFlow:
		return "new_flow"
	case Established:
		return "established"
	case Refused:
		return "refused"
	case Reset:
		return "reset"
	case SynRetrans:
		return "syn_retransmit"
	case FlowEnd:
		return "flow_end"
	case Rejected:
		return "rejected"
	case FirstData:
		return "first_data"
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// Event flags (PB_EVF_*).
const (
	FlagProbe       uint8 = 0x01
	FlagBackendData uint8 = 0x02
	FlagRepick      uint8 = 0x04
	FlagClient      uint8 = 0x08
)

// Event is one decoded struct event.
type Event struct {
	Type    Type
	Flags   uint8
	Service uint32
	Backend uint32
	Client  netip.AddrPort
	// Mono is the kernel's bpf_ktime_get_ns (CLOCK_MONOTONIC).
	Mono int64
	// At is Mono on the wall clock.
	At time.Time
}

// eventSize is sizeof(struct event).
const eventSize = 40

// Decode parses a raw ring buffer record. offset converts CLOCK_MONOTONIC
// nanoseconds to Unix nanoseconds (see MonoOffset).
func Decode(b []byte, offset int64) (Event, error) {
	if len(b) < eventSize {
		return Event{}, fmt.Errorf("event: %d bytes, want %d", len(b), eventSize)
	}
	ne := binary.NativeEndian
	ts := int64(ne.Uint64(b[0:]))
	return Event{
		Mono:    ts,
		At:      time.Unix(0, ts+offset),
		Service: ne.Uint32(b[8:]),
		Backend: ne.Uint32(b[12:]),
		Client:  netip.AddrPortFrom(maps.AddrFromV4(ne.Uint32(b[16:])), maps.Port(ne.Uint16(b[32:]))),
		Type:    Type(b[34]),
		Flags:   b[35],
	}, nil
}

// MonoNow reads CLOCK_MONOTONIC, the clock of the kernel's timestamps.
func MonoNow() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// MonoOffset is what to add to a CLOCK_MONOTONIC reading to get Unix time.
func MonoOffset() int64 {
	return time.Now().UnixNano() - MonoNow()
}
