// SPDX-License-Identifier: Apache-2.0

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
	"unsafe"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Type is enum pb_event_type (bpf/include/pb_consts.h), as carried in the
// __u8 type of struct event. The values come from the bpf2go-generated
// constants, so they cannot drift from the C enum.
type Type uint8

const (
	NewFlow     = Type(bpf.LbPbEventTypePB_EV_NEW_FLOW)
	Established = Type(bpf.LbPbEventTypePB_EV_ESTABLISHED)
	Refused     = Type(bpf.LbPbEventTypePB_EV_REFUSED)
	Reset       = Type(bpf.LbPbEventTypePB_EV_RESET)
	SynRetrans  = Type(bpf.LbPbEventTypePB_EV_SYN_RETRANS)
	FlowEnd     = Type(bpf.LbPbEventTypePB_EV_FLOW_END)
	FirstData   = Type(bpf.LbPbEventTypePB_EV_FIRST_DATA)

	// Rejected is 7, which enum pb_event_type reserves and the datapath
	// never sends (circuit-breaker rejections are counted, not reported).
	Rejected Type = 7
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

// Event flags: enum pb_event_flag (PB_EVF_*), from the generated constants.
const (
	FlagProbe       = uint8(bpf.LbPbEventFlagPB_EVF_PROBE)
	FlagBackendData = uint8(bpf.LbPbEventFlagPB_EVF_BACKEND_DATA)
	FlagRepick      = uint8(bpf.LbPbEventFlagPB_EVF_REPICK)
	FlagClient      = uint8(bpf.LbPbEventFlagPB_EVF_CLIENT)
	// FlagTripped: this failure made the datapath eject its backend (a kernel trip).
	FlagTripped = uint8(bpf.LbPbEventFlagPB_EVF_TRIPPED)
	// FlagRescued: a refusal kept from the client; its SYN may be replayed.
	FlagRescued = uint8(bpf.LbPbEventFlagPB_EVF_RESCUED)
	// FlagVoid: a flow ended with no verdict (the backend reset a
	// connection whose client sent a wrong handshake ACK).
	FlagVoid = uint8(bpf.LbPbEventFlagPB_EVF_VOID)
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

// The layout of struct event, taken from its bpf2go twin bpf.LbEvent.
const (
	eventSize     = int(unsafe.Sizeof(bpf.LbEvent{}))
	offTs         = int(unsafe.Offsetof(bpf.LbEvent{}.TsNs))
	offService    = int(unsafe.Offsetof(bpf.LbEvent{}.SvcId))
	offBackend    = int(unsafe.Offsetof(bpf.LbEvent{}.BackendId))
	offClient     = int(unsafe.Offsetof(bpf.LbEvent{}.Client) + unsafe.Offsetof(bpf.LbEvent{}.Client.Bytes))
	offClientPort = int(unsafe.Offsetof(bpf.LbEvent{}.ClientPort))
	offType       = int(unsafe.Offsetof(bpf.LbEvent{}.Type))
	offFlags      = int(unsafe.Offsetof(bpf.LbEvent{}.Flags))
	// offFamily: __u8 family follows flags, in what was the trailing pad
	// (struct event stays 40 bytes). It is read by offset rather than by a
	// generated field, so that this builds with bpf.LbEvent before and
	// after bpf2go regenerates it (TestFamilyOffset checks the field once
	// it exists).
	offFamily = offFlags + 1
)

// The family byte lies inside the record.
var _ [eventSize - offFamily - 1]struct{}

// Decode reads the fields at these widths: this stops compiling if a
// generated field type changes (TestDecodeMatchesGenerated checks values).
func _(e bpf.LbEvent) (uint64, uint32, uint32, [16]uint8, uint16, uint8, uint8) {
	return e.TsNs, e.SvcId, e.BackendId, e.Client.Bytes, e.ClientPort, e.Type, e.Flags
}

// Decode parses a raw ring buffer record. offset converts CLOCK_MONOTONIC
// nanoseconds to Unix nanoseconds (see MonoOffset). The client address is
// read by the record's family byte: PB_AF_INET6 the 16 bytes, PB_AF_INET
// or 0 (a datapath from before IPv6, whose pad was zero) the first four;
// any other family is an error (the record counts as undecodable).
func Decode(b []byte, offset int64) (Event, error) {
	if len(b) < eventSize {
		return Event{}, fmt.Errorf("event: %d bytes, want %d", len(b), eventSize)
	}
	var client netip.Addr
	switch f := b[offFamily]; f {
	case 0, maps.FamilyIPv4:
		client = netip.AddrFrom4([4]byte(b[offClient : offClient+4]))
	case maps.FamilyIPv6:
		client = netip.AddrFrom16([16]byte(b[offClient : offClient+16]))
	default:
		return Event{}, fmt.Errorf("event: unknown address family %d", f)
	}
	ne := binary.NativeEndian
	ts := int64(ne.Uint64(b[offTs:]))
	return Event{
		Mono:    ts,
		At:      time.Unix(0, ts+offset),
		Service: ne.Uint32(b[offService:]),
		Backend: ne.Uint32(b[offBackend:]),
		Client:  netip.AddrPortFrom(client, maps.Port(ne.Uint16(b[offClientPort:]))),
		Type:    Type(b[offType]),
		Flags:   b[offFlags],
	}, nil
}

// MonoNow reads CLOCK_MONOTONIC, the clock of the kernel's timestamps
// (bpf_ktime_get_ns). It is the Go runtime's own monotonic clock, read
// through the vDSO: tens of nanoseconds, where a clock_gettime system call
// costs 1.7-1.9 µs on the bench's VM, and the agent reads the clock for
// every batch of events and every ejection's reaction time.
func MonoNow() int64 { return nanotime() }

// nanotime is CLOCK_MONOTONIC in nanoseconds (the runtime's clock_gettime
// through the vDSO on Linux). The runtime keeps it reachable by linkname
// for the many packages that read it so; TestMonoNowIsClockMonotonic
// checks it against the system call.
//
//go:linkname nanotime runtime.nanotime
func nanotime() int64

// MonoOffset is what to add to a CLOCK_MONOTONIC reading to get Unix time.
func MonoOffset() int64 {
	return time.Now().UnixNano() - MonoNow()
}
