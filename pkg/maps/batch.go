// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"errors"

	"github.com/cilium/ebpf"
)

// EachBatch hands f the entries of m, up to chunk at a time, read with
// the kernel's batch lookup: a system call per chunk, and a walk that a
// deletion meanwhile cannot abort (a key-by-key iteration restarts from
// the first bucket when its cursor key is deleted, and on a busy LRU then
// gives up). K and V are the map's key and value types (not per-CPU
// values). An error from f ends the walk and is returned.
func EachBatch[K, V any](m *ebpf.Map, chunk int, f func(keys []K, vals []V) error) error {
	keys, vals := make([]K, chunk), make([]V, chunk)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		if n > 0 {
			if ferr := f(keys[:n], vals[:n]); ferr != nil {
				return ferr
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}
