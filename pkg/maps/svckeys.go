// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"bytes"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
)

// pb_svc_keys holds, by service id, the pb_services key the id's service
// is written under: the datapath checks a service value it copied against
// it (service_copy in bpf/lb.c), since pb_services reuses a replaced entry
// at once, for any key. The agent writes it through a memory map, so a
// service's write costs no system call more; the key is in place before
// the bpf(2) call that writes the value. The mapping costs the agent's RSS
// the whole array at once (the kernel maps every page when it is made):
// 1.5 MB at the default 65,536 services, where a bpf(2) write per service
// would have cost a cold start of 10,000 services about 15 ms.

// svcKeyStride is an entry's room in the array (8-byte aligned).
var svcKeyStride = (len(raw(&bpf.LbSvcKey{})) + 7) &^ 7

// openServiceKeys maps pb_svc_keys and makes it hold the key of every
// service pb_services holds, and nothing for other ids: a previous
// version's pins have no such map, and an agent rolled back to one leaves
// it stale. Entries already right are not written, so a running datapath
// of this layout sees no service's key change (but where two pinned
// services hold one id, which adoption then settles).
func (m *Maps) openServiceKeys() error {
	b, err := mmapArray(m.m.PbSvcKeys)
	if err != nil {
		return fmt.Errorf("pb_svc_keys: %w", err)
	}
	m.keys = b
	svcs, err := m.Services()
	if err != nil {
		return fmt.Errorf("pb_services: %w", err)
	}
	held := map[uint32]bool{}
	for k, v := range svcs {
		if m.setServiceKey(v.Id, k) {
			held[v.Id] = true
		}
	}
	for id := range m.m.PbSvcKeys.MaxEntries() {
		if !held[id] {
			m.setServiceKey(id, bpf.LbSvcKey{})
		}
	}
	return nil
}

// keySlot is pb_svc_keys[id]'s bytes in the mapping; nil when there is
// no mapping (read-only) or id is past the array (whose mapping is
// longer: a whole page).
func (m *Maps) keySlot(id uint32) []byte {
	if m.keys == nil || id >= m.m.PbSvcKeys.MaxEntries() {
		return nil
	}
	off := int(id) * svcKeyStride
	return m.keys[off : off+len(raw(&bpf.LbSvcKey{}))]
}

// setServiceKey writes pb_svc_keys[id] unless it holds k already; false if
// there is no such entry (keySlot).
func (m *Maps) setServiceKey(id uint32, k bpf.LbSvcKey) bool {
	dst := m.keySlot(id)
	if dst == nil {
		return false
	}
	if kb := raw(&k); !bytes.Equal(dst, kb) {
		copy(dst, kb)
	}
	return true
}

// clearServiceKey zeroes pb_svc_keys[id] if it holds k, the deleted
// service's key, and leaves a key of another service's alone.
func (m *Maps) clearServiceKey(id uint32, k bpf.LbSvcKey) {
	if dst := m.keySlot(id); dst != nil && bytes.Equal(dst, raw(&k)) {
		clear(dst)
	}
}

// closeServiceKeys unmaps pb_svc_keys.
func (m *Maps) closeServiceKeys() {
	if m.keys != nil {
		unix.Munmap(m.keys)
		m.keys = nil
	}
}

// ServiceKeyOf reads pb_svc_keys[id]: the key the datapath takes the id's
// values for (the zero key: none).
func (m *Maps) ServiceKeyOf(id uint32) (bpf.LbSvcKey, error) {
	var k bpf.LbSvcKey
	if err := m.m.PbSvcKeys.Lookup(id, &k); err != nil {
		return k, fmt.Errorf("pb_svc_keys[%d]: %w", id, err)
	}
	return k, nil
}
