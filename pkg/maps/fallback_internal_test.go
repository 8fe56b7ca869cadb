// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"os"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
)

// A probation that comes while its service's fallback table is still
// being installed (a penalty shorter than an RCU grace period) fills the
// table being installed and returns at once; the install then puts that
// very table in place.
func TestFallbackFilledWhileInstalling(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for BPF (CI runs as root)")
	}
	const (
		svc  = 3
		size = 31
		id1  = 5
	)
	inner := &ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: size,
		Flags: unix.BPF_F_INNER_MAP | unix.BPF_F_MMAPABLE}
	outer := func() *ebpf.Map {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.ArrayOfMaps, KeySize: 4, ValueSize: 4, MaxEntries: 8, InnerMap: inner})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	m := &Maps{m: &bpf.LbMaps{PbMaglev: outer(), PbMaglevFb: outer()}, inner: inner.Copy()}
	m.t.init()
	t.Cleanup(m.t.close)
	if err := m.InstallTables([]TableInstall{{SvcID: svc, N: 0, Size: size}}); err != nil {
		t.Fatal(err)
	}
	created, release := make(chan struct{}), make(chan struct{})
	m.t.installing = func() { close(created); <-release }
	m.prepareFallback(svc)
	<-created // the table exists; its install waits for release

	slots := slices.Repeat([]uint32{id1}, size)
	if err := m.SetFallback(svc, slots); err != nil { // must not wait for the install
		t.Fatal(err)
	}
	var id ebpf.MapID
	if err := m.m.PbMaglevFb.Lookup(uint32(svc), &id); err == nil {
		t.Fatalf("fallback installed (inner map %d) before the install was released", id)
	}
	close(release)
	if _, fb := m.InstalledTables(); !slices.Equal(fb, []uint32{svc}) { // waits for the install
		t.Fatalf("fallback tables %v, want [%d]", fb, svc)
	}
	got, err := m.readTable(m.m.PbMaglevFb, svc)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, slots) {
		t.Errorf("installed fallback holds %v, want the %d slots SetFallback wrote", got, size)
	}
}
