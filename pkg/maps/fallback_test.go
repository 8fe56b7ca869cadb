// SPDX-License-Identifier: Apache-2.0

package maps_test

import (
	"errors"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// TestMain releases the datapath the tests share (bpftest.Shared).
func TestMain(m *testing.M) { bpftest.Main(m) }

// A service's first ejection installs its fallback table in the
// background, so that its first probation fills that table in place
// instead of installing one (an RCU grace period on the agent's loop).
// Until then the table is empty, and the probation's SetFallback writes
// into the same table.
func TestFallbackPreparedOnEjection(t *testing.T) {
	l := bpftest.Shared(t)
	m := l.Maps
	const (
		svc  = 7
		size = 1021
		id1  = 11
		id2  = 12
	)
	be := netip.MustParseAddrPort("198.18.1.2:8080")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(m.InstallTables([]maps.TableInstall{{SvcID: svc, N: 0, Size: size}, {SvcID: svc, N: 1, Size: size}}))
	must(m.SetBackend(id1, maps.NewBackend(be, svc, maps.BackendActive, 0)))
	// An active backend asks for nothing: listing waits for any install.
	if _, fb := m.InstalledTables(); len(fb) != 0 {
		t.Fatalf("fallback tables %v before any ejection", fb)
	}
	must(m.SetBackend(id2, maps.NewBackend(be, svc, maps.BackendEjected, 0)))
	if _, fb := m.InstalledTables(); !slices.Equal(fb, []uint32{svc}) {
		t.Fatalf("fallback tables %v after an ejection, want [%d]", fb, svc)
	}
	innerID := func() ebpf.MapID {
		t.Helper()
		var id ebpf.MapID
		must(l.PbMaglevFb.Lookup(uint32(svc), &id))
		return id
	}
	prepared := innerID()
	got, err := m.Fallback(svc)
	must(err)
	if len(got) != size || slices.ContainsFunc(got, func(v uint32) bool { return v != 0 }) {
		t.Fatalf("prepared fallback: %d slots, not all empty", len(got))
	}

	slots := slices.Repeat([]uint32{id1}, size)
	must(m.SetFallback(svc, slots))
	if id := innerID(); id != prepared {
		t.Errorf("SetFallback replaced the prepared table (inner map %d, prepared %d)", id, prepared)
	}
	got, err = m.Fallback(svc)
	must(err)
	if !slices.Equal(got, slots) {
		t.Errorf("fallback after SetFallback: %d slots, want %d of backend %d", len(got), size, id1)
	}

	// Another ejection prepares nothing more; deleting removes the table.
	must(m.SetBackend(id2, maps.NewBackend(be, svc, maps.BackendEjected, 0)))
	if id := innerID(); id != prepared {
		t.Errorf("a second ejection replaced the fallback table")
	}
	m.DeleteTables(svc)
	var id ebpf.MapID
	if err := l.PbMaglevFb.Lookup(uint32(svc), &id); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("fallback after DeleteTables: %v (inner map %d)", err, id)
	}
}

// A previous agent's fallback table (one this Maps did not install) is
// left alone by the background install; SetFallback replaces it as
// before.
func TestFallbackKeepsAPreviousAgentsTable(t *testing.T) {
	l := bpftest.Shared(t)
	const (
		svc  = 9
		size = 1021
		id1  = 21
	)
	be := netip.MustParseAddrPort("198.18.2.2:8080")
	prev, err := maps.New(&l.LbMaps, l.InnerSpec)
	if err != nil {
		t.Fatal(err)
	}
	if err := prev.SetFallback(svc, slices.Repeat([]uint32{id1}, size)); err != nil {
		t.Fatal(err)
	}
	prev.Close() // its table stays in the outer map, as a pinned one would
	var before ebpf.MapID
	if err := l.PbMaglevFb.Lookup(uint32(svc), &before); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.PbMaglevFb.Delete(uint32(svc)) })

	m := l.Maps
	if err := m.InstallTables([]maps.TableInstall{{SvcID: svc, N: 0, Size: size}, {SvcID: svc, N: 1, Size: size}}); err != nil {
		t.Fatal(err)
	}
	if err := m.SetBackend(id1, maps.NewBackend(be, svc, maps.BackendEjected, 0)); err != nil {
		t.Fatal(err)
	}
	if _, fb := m.InstalledTables(); len(fb) != 0 {
		t.Errorf("installed fallback tables %v over a previous agent's", fb)
	}
	var after ebpf.MapID
	if err := l.PbMaglevFb.Lookup(uint32(svc), &after); err != nil || after != before {
		t.Errorf("previous agent's fallback table: inner map %d → %d (%v)", before, after, err)
	}
	got, err := m.Fallback(svc)
	if err != nil || len(got) != size || got[0] != id1 {
		t.Errorf("previous agent's fallback table read back: %d slots, first %v (%v)", len(got), got[:min(1, len(got))], err)
	}
}
