package outcomes

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// testEvent has a distinct, non-zero value in every field of struct event,
// so a decoder reading any field at another's offset gets it wrong.
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
	e.Pad = 0xdeadbeef
	return e
}

// TestDecodeMatchesGenerated fails when Decode and the bpf2go-generated
// layout of struct event ever disagree.
func TestDecodeMatchesGenerated(t *testing.T) {
	if n := binary.Size(bpf.LbEvent{}); n != eventSize {
		t.Fatalf("binary.Size(bpf.LbEvent) = %d, eventSize = %d", n, eventSize)
	}
	in := testEvent()
	var buf bytes.Buffer
	if err := binary.Write(&buf, binary.NativeEndian, &in); err != nil {
		t.Fatal(err)
	}
	const offset = 1_700_000_000_000_000_000
	got, err := Decode(buf.Bytes(), offset)
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

	if _, err := Decode(buf.Bytes()[:eventSize-1], 0); err == nil {
		t.Errorf("Decode of %d bytes: no error", eventSize-1)
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
	in := testEvent()
	var buf bytes.Buffer
	if err := binary.Write(&buf, binary.NativeEndian, &in); err != nil {
		b.Fatal(err)
	}
	raw := buf.Bytes()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Decode(raw, 0); err != nil {
			b.Fatal(err)
		}
	}
}
