// SPDX-License-Identifier: Apache-2.0

package bpftest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// shared is the datapath a test binary loads once (see Shared).
var shared struct {
	sync.Mutex
	d *datapath.Datapath
	// last is the previous test's view of the maps: the tables it
	// installed are the only slots of pb_maglev and pb_maglev_fb to clear.
	last *maps.Maps
	dir  string // the temporary directory holding its private bpffs
	err  error
}

// Shared returns the datapath loaded once for the whole test binary, every
// map emptied, as Load would give a fresh one: the verifier's pass over
// pb_xdp is most of what a test costs (about half a second here, ten times
// that on an older kernel under qemu), and no test needs it twice. Tests
// that use it do not run in parallel with each other (each holds it until
// its end). A package that uses it calls ReleaseShared from its TestMain, so
// the private bpffs is unmounted when the binary ends.
func Shared(tb testing.TB) *Loaded {
	tb.Helper()
	RequireRoot(tb)
	shared.Lock()
	tb.Cleanup(shared.Unlock)
	if shared.d == nil && shared.err == nil {
		shared.d, shared.dir, shared.err = loadShared()
	}
	if shared.err != nil {
		tb.Fatal(shared.err)
	}
	if err := reset(shared.d, shared.last); err != nil {
		tb.Fatalf("emptying the shared datapath's maps: %v", err)
	}
	m := newMaps(tb, shared.d, true)
	shared.last = m
	// Closed by the next test's reset, after it read what m installed.
	return &Loaded{Datapath: shared.d, Maps: m}
}

func loadShared() (*datapath.Datapath, string, error) {
	dir, err := os.MkdirTemp("", "pb-bpffs-shared-")
	if err != nil {
		return nil, "", err
	}
	mnt := filepath.Join(dir, "bpffs")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return nil, dir, err
	}
	if err := unix.Mount("bpf", mnt, "bpf", 0, "mode=0700"); err != nil {
		return nil, dir, fmt.Errorf("mount bpffs: %w", err)
	}
	d, err := datapath.Load(loadOptions(filepath.Join(mnt, "penaltybox")))
	if err != nil {
		unix.Unmount(mnt, unix.MNT_DETACH)
		return nil, dir, err
	}
	return d, dir, nil
}

// Main is the TestMain of a package whose tests use Shared: it runs them,
// then releases the shared datapath (ReleaseShared), and exits with their
// result.
func Main(m *testing.M) {
	code := m.Run()
	ReleaseShared()
	os.Exit(code)
}

// ReleaseShared closes the shared datapath and unmounts its bpffs; Main
// calls it after the tests.
func ReleaseShared() {
	shared.Lock()
	defer shared.Unlock()
	if shared.last != nil {
		shared.last.Close()
		shared.last = nil
	}
	if shared.d != nil {
		shared.d.Close()
		shared.d = nil
	}
	if shared.dir != "" {
		unix.Unmount(filepath.Join(shared.dir, "bpffs"), unix.MNT_DETACH)
		os.RemoveAll(shared.dir)
		shared.dir = ""
	}
}

// reset empties every map of d, as a fresh load leaves them: arrays
// zeroed, hashes emptied, the ring buffer drained, and the Maglev tables
// that last (the previous test's maps, nil for none) installed removed.
func reset(d *datapath.Datapath, last *maps.Maps) error {
	if last != nil {
		// Only the slots a table was installed in: on older kernels
		// (6.1) every lookup or delete in a map-in-map waits an RCU grace
		// period (tens of milliseconds each under qemu), so a scan of
		// every slot costs seconds.
		main, fallback := last.InstalledTables()
		last.Close()
		for _, del := range []struct {
			m    *ebpf.Map
			keys []uint32
		}{{d.PbMaglev, main}, {d.PbMaglevFb, fallback}} {
			for _, k := range del.keys {
				if err := del.m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
					return err
				}
			}
		}
	}
	v := reflect.ValueOf(d.LbMaps)
	for i := range v.NumField() {
		m, ok := v.Field(i).Interface().(*ebpf.Map)
		if !ok || m == nil || m.Type() == ebpf.ArrayOfMaps {
			continue
		}
		if err := clearMap(m); err != nil {
			return fmt.Errorf("%s: %w", v.Type().Field(i).Name, err)
		}
	}
	return nil
}

func clearMap(m *ebpf.Map) error {
	switch m.Type() {
	case ebpf.Array, ebpf.PerCPUArray:
		return zeroArray(m)
	case ebpf.RingBuf:
		return drain(m)
	default: // hashes of every kind, the devmap
		var keys [][]byte
		key := make([]byte, m.KeySize())
		it := m.Iterate()
		var skip []byte
		for it.Next(&key, &skip) {
			keys = append(keys, append([]byte(nil), key...))
		}
		if err := it.Err(); err != nil && m.Type() != ebpf.DevMapHash {
			return err
		}
		for _, k := range keys {
			if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return err
			}
		}
		return nil
	}
}

// zeroArray writes zeros to every slot of an array in one batch.
func zeroArray(m *ebpf.Map) error {
	n := int(m.MaxEntries())
	elem := reflect.ArrayOf(int(m.ValueSize()), reflect.TypeFor[byte]())
	per := 1
	if m.Type() == ebpf.PerCPUArray {
		ncpu, err := ebpf.PossibleCPU()
		if err != nil {
			return err
		}
		per = ncpu
	}
	keys := make([]uint32, n)
	for i := range keys {
		keys[i] = uint32(i)
	}
	values := reflect.MakeSlice(reflect.SliceOf(elem), n*per, n*per).Interface()
	_, err := m.BatchUpdate(keys, values, nil)
	return err
}

// drain reads whatever records an earlier test left in a ring buffer.
func drain(m *ebpf.Map) error {
	rd, err := ringbuf.NewReader(m)
	if err != nil {
		return err
	}
	defer rd.Close()
	for range 1 << 20 {
		rd.SetDeadline(time.Now())
		if _, err := rd.Read(); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return nil
			}
			return err
		}
	}
	return errors.New("ring buffer does not drain")
}
