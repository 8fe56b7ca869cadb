// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
)

// affinityBatch is how many pb_affinity entries one batch call reads.
const affinityBatch = 4096

// ForgetAffinity deletes every pb_affinity entry of service id: its
// clients' next flows get a fresh pick. Called when a service stops
// asking for affinity, or goes, so that a service given the id later
// starts with no client pinned.
func (m *Maps) ForgetAffinity(id uint32) error {
	var doomed []bpf.LbAffinityKey
	err := m.eachAffinity(func(k *bpf.LbAffinityKey) {
		if k.SvcId == id {
			doomed = append(doomed, *k)
		}
	})
	if err != nil {
		return fmt.Errorf("pb_affinity: %w", err)
	}
	for i := range doomed {
		if err := m.m.PbAffinity.Delete(&doomed[i]); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("pb_affinity: delete: %w", err)
		}
	}
	return nil
}

// AffinityFill is how many clients pb_affinity remembers, and how many it
// can: past that, the least recently seen go first.
func (m *Maps) AffinityFill() (entries, capacity int, err error) {
	err = m.eachAffinity(func(*bpf.LbAffinityKey) { entries++ })
	if err != nil {
		return 0, 0, fmt.Errorf("pb_affinity: %w", err)
	}
	return entries, int(m.m.PbAffinity.MaxEntries()), nil
}

// eachAffinity calls f with each pb_affinity key, read in batches (one
// system call per affinityBatch entries: the map can hold many).
func (m *Maps) eachAffinity(f func(*bpf.LbAffinityKey)) error {
	return EachBatch(m.m.PbAffinity, affinityBatch, func(keys []bpf.LbAffinityKey, _ []bpf.LbAffinityValue) error {
		for i := range keys {
			f(&keys[i])
		}
		return nil
	})
}
