// SPDX-License-Identifier: Apache-2.0

package maps_test

import (
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// Many tables at once are created on several goroutines: each request
// gets its own table of its size at its own key, and a request that
// cannot be met fails the whole call without leaving a table or a handle
// behind.
func TestInstallTablesSideBySide(t *testing.T) {
	l := bpftest.Shared(t)
	m := l.Maps
	defer maps.SetTableWorkers(4, 4)() // 40 tables: 4 goroutines of 10
	var reqs []maps.TableInstall
	var svcs []uint32
	for svc := uint32(30); svc < 50; svc++ {
		svcs = append(svcs, svc)
		for n := range uint32(2) {
			reqs = append(reqs, maps.TableInstall{SvcID: svc, N: n, Size: 1021 + 1018*n*(svc&1)})
		}
	}
	defer func() {
		for _, svc := range svcs {
			m.DeleteTables(svc)
		}
	}()
	handles := m.TableHandles()
	if err := m.InstallTables(reqs); err != nil {
		t.Fatal(err)
	}
	if got := m.TableHandles() - handles; got != len(reqs) {
		t.Errorf("%d handles more, want %d", got, len(reqs))
	}
	for _, r := range reqs {
		slots, err := m.Table(r.SvcID, r.N)
		if err != nil {
			t.Fatalf("table %d of service %d: %v", r.N, r.SvcID, err)
		}
		if len(slots) != int(r.Size) || slices.ContainsFunc(slots, func(v uint32) bool { return v != 0 }) {
			t.Errorf("table %d of service %d: %d slots, want %d zeros", r.N, r.SvcID, len(slots), r.Size)
		}
	}

	// A table of no slots cannot be made: nothing of the call stays.
	bad := slices.Clone(reqs)
	for i := range bad {
		bad[i].SvcID += 20
	}
	bad[len(bad)-3].Size = 0
	handles, files := m.TableHandles(), openFiles(t)
	err := m.InstallTables(bad)
	if err == nil || !strings.Contains(err.Error(), "service 68") {
		t.Fatalf("err %v, want table 1 of service 68's", err)
	}
	if got := m.TableHandles(); got != handles {
		t.Errorf("%d handles after the failed call, want %d", got, handles)
	}
	// The tables made before the failing one are closed, not leaked.
	if got := openFiles(t); got != files {
		t.Errorf("%d open files after the failed call, want %d", got, files)
	}
	if main, _ := m.InstalledTables(); slices.ContainsFunc(main, func(k uint32) bool { return k >= maps.TableKey(50, 0) }) {
		t.Errorf("tables of the failed call installed: %v", main)
	}
}

// openFiles counts the process's open files.
func openFiles(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}
