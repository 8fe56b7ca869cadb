// SPDX-License-Identifier: Apache-2.0

package outcomes

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// testEvent has a distinct, non-zero value in every field of struct event,
// so a decoder reading any field at another's offset gets it wrong. The
// family byte and the pad after it are set in the raw record (see
// withFamily), not through generated fields: bpf.LbEvent gains its Family
// field only when bpf2go regenerates it.
func testEvent() bpf.LbEvent {
	var e bpf.LbEvent
	e.TsNs = 0x0102030405060708
	e.SvcId = 0x11121314
	e.BackendId = 0x21222324
	for i := range e.Client.Bytes {
		e.Client.Bytes[i] = byte(0xa0 + i)
	}
	copy(e.Client.Bytes[:4], []byte{10, 1, 2, 3})
	e.ClientPort = maps.Port(40123)
	e.Type = uint8(FirstData)
	e.Flags = FlagProbe | FlagClient
	return e
}

// withFamily is e's raw record with family in its family byte and the pad
// after it non-zero.
func withFamily(t testing.TB, e bpf.LbEvent, family uint8) []byte {
	var buf bytes.Buffer
	if err := binary.Write(&buf, binary.NativeEndian, &e); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	b[offFamily] = family
	for i := offFamily + 1; i < eventSize; i++ {
		b[i] = byte(0xd0 + i)
	}
	return b
}

// TestDecodeMatchesGenerated fails when Decode and the bpf2go-generated
// layout of struct event ever disagree.
func TestDecodeMatchesGenerated(t *testing.T) {
	if n := binary.Size(bpf.LbEvent{}); n != eventSize {
		t.Fatalf("binary.Size(bpf.LbEvent) = %d, eventSize = %d", n, eventSize)
	}
	if eventSize != 40 {
		t.Errorf("struct event is %d bytes, want 40", eventSize)
	}
	in := testEvent()
	raw := withFamily(t, in, maps.FamilyIPv4)
	const offset = 1_700_000_000_000_000_000
	got, err := Decode(raw, offset)
	if err != nil {
		t.Fatal(err)
	}
	want := Event{
		Type:    FirstData,
		Flags:   FlagProbe | FlagClient,
		Service: 0x11121314,
		Backend: 0x21222324,
		Client:  netip.MustParseAddrPort("10.1.2.3:40123"),
		Mono:    0x0102030405060708,
		At:      time.Unix(0, 0x0102030405060708+offset),
	}
	if !got.At.Equal(want.At) {
		t.Errorf("At = %v, want %v", got.At, want.At)
	}
	got.At, want.At = time.Time{}, time.Time{}
	if got != want {
		t.Errorf("Decode =\n %+v, want\n %+v", got, want)
	}

	if _, err := Decode(raw[:eventSize-1], 0); err == nil {
		t.Errorf("Decode of %d bytes: no error", eventSize-1)
	}

	// Family 0 is an older datapath's record: IPv4.
	if got, err := Decode(withFamily(t, in, 0), offset); err != nil || got.Client != want.Client {
		t.Errorf("family 0: client %v (%v), want %v", got.Client, err, want.Client)
	}

	// Family 6: all sixteen bytes are the client's address.
	in6 := in
	a6 := netip.MustParseAddr("2001:1::a0b:c0d")
	in6.Client.Bytes = a6.As16()
	got, err = Decode(withFamily(t, in6, maps.FamilyIPv6), offset)
	if err != nil {
		t.Fatal(err)
	}
	want.Client = netip.AddrPortFrom(a6, 40123)
	got.At = time.Time{}
	if got != want {
		t.Errorf("Decode of an IPv6 event =\n %+v, want\n %+v", got, want)
	}
	if s := got.Client.String(); s != "[2001:1::a0b:c0d]:40123" {
		t.Errorf("IPv6 client prints as %q", s)
	}

	for _, f := range []uint8{1, 5, 10, 0xef} {
		if _, err := Decode(withFamily(t, in, f), offset); err == nil {
			t.Errorf("family %d: no error", f)
		}
	}
}

// TestFamilyOffset: the family byte Decode reads is the generated
// struct's family field once bpf2go has one, and lies in the old pad
// until then.
func TestFamilyOffset(t *testing.T) {
	typ := reflect.TypeFor[bpf.LbEvent]()
	if f, ok := typ.FieldByName("Family"); ok {
		if f.Type.Kind() != reflect.Uint8 || int(f.Offset) != offFamily {
			t.Errorf("bpf.LbEvent.Family: %s at %d, Decode reads a byte at %d", f.Type, f.Offset, offFamily)
		}
		return
	}
	pad, ok := typ.FieldByName("Pad")
	if !ok || int(pad.Offset) > offFamily || int(pad.Offset+pad.Type.Size()) <= offFamily {
		t.Errorf("bpf.LbEvent has neither Family nor a Pad over byte %d", offFamily)
	}
}

// The strings are metric label values: they must not change.
func TestTypeStrings(t *testing.T) {
	for typ, want := range map[Type]string{
		NewFlow: "new_flow", Established: "established", Refused: "refused",
		Reset: "reset", SynRetrans: "syn_retransmit", FlowEnd: "flow_end",
		Rejected: "rejected", FirstData: "first_data", 9: "type(9)",
	} {
		if got := typ.String(); got != want {
			t.Errorf("Type(%d).String() = %q, want %q", uint8(typ), got, want)
		}
	}
}

func BenchmarkDecode(b *testing.B) {
	raw := withFamily(b, testEvent(), maps.FamilyIPv4)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Decode(raw, 0); err != nil {
			b.Fatal(err)
		}
	}
}

// MonoNow is CLOCK_MONOTONIC, the clock of the datapath's timestamps: a
// system call's reading falls between two of MonoNow's around it.
func TestMonoNowIsClockMonotonic(t *testing.T) {
	for range 100 {
		before := MonoNow()
		var ts unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
			t.Fatal(err)
		}
		after := MonoNow()
		if sys := ts.Nano(); sys < before || sys > after {
			t.Fatalf("clock_gettime(CLOCK_MONOTONIC) %d, not between MonoNow's %d and %d", sys, before, after)
		}
	}
}
