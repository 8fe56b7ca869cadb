// SPDX-License-Identifier: Apache-2.0

package maps

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/bpf"
)

// Inflight gives the agent the circuit-breaker counters the datapath
// updates with atomic adds: pb_svc_inflight and pb_be_inflight are
// memory-mapped, so the agent's atomic adds (releasing expired flows) and
// the kernel's land on the same words and no update is lost.
type Inflight struct {
	svc, be []byte
}

// OpenInflight maps both counter arrays.
func (m *Maps) OpenInflight() (*Inflight, error) {
	svc, be, err := mmapPair(m.m.PbSvcInflight, "pb_svc_inflight", m.m.PbBeInflight, "pb_be_inflight")
	if err != nil {
		return nil, err
	}
	return &Inflight{svc: svc, be: be}, nil
}

// mmapPair maps two arrays, both or neither.
func mmapPair(a *ebpf.Map, aName string, b *ebpf.Map, bName string) ([]byte, []byte, error) {
	am, err := mmapArray(a)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", aName, err)
	}
	bm, err := mmapArray(b)
	if err != nil {
		unix.Munmap(am)
		return nil, nil, fmt.Errorf("%s: %w", bName, err)
	}
	return am, bm, nil
}

func mmapArray(m *ebpf.Map) ([]byte, error) {
	elem := (int(m.ValueSize()) + 7) &^ 7 // array elements are 8-byte aligned
	size := int(m.MaxEntries()) * elem
	page := os.Getpagesize()
	size = (size + page - 1) / page * page
	return unix.Mmap(m.FD(), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
}

func counter(b []byte, id uint32) *int64 {
	off := int(id) * 8
	if off+8 > len(b) {
		return nil
	}
	return (*int64)(unsafe.Pointer(&b[off]))
}

// Service is the number of counted live flows of a service.
func (in *Inflight) Service(id uint32) int64 { return load(counter(in.svc, id)) }

// Backend is the number of counted live flows of a backend.
func (in *Inflight) Backend(id uint32) int64 { return load(counter(in.be, id)) }

func load(p *int64) int64 {
	if p == nil {
		return 0
	}
	return atomic.LoadInt64(p)
}

func add(p *int64, d int64) {
	if p != nil {
		atomic.AddInt64(p, d)
	}
}

// release gives back one flow's slots.
func (in *Inflight) release(svc, be uint32) {
	add(counter(in.svc, svc), -1)
	add(counter(in.be, be), -1)
}

// ResetService zeroes a service's count. Only for an id no flow refers to
// (a fresh or recycled id).
func (in *Inflight) ResetService(id uint32) {
	if p := counter(in.svc, id); p != nil {
		atomic.StoreInt64(p, 0)
	}
}

// ResetBackend zeroes a backend's count, as ResetService.
func (in *Inflight) ResetBackend(id uint32) {
	if p := counter(in.be, id); p != nil {
		atomic.StoreInt64(p, 0)
	}
}

// Close unmaps the counters.
func (in *Inflight) Close() error {
	return errors.Join(unix.Munmap(in.svc), unix.Munmap(in.be))
}

// Flow is one pb_flows entry: a live flow counted by a circuit breaker.
type Flow struct {
	Key   bpf.LbCtKey
	Value bpf.LbFlowValue
}

// Flows returns every pb_flows entry.
// It reads in batches, like Conntrack, so deletions meanwhile cannot abort it.
func (m *Maps) Flows() ([]Flow, error) {
	var out []Flow
	err := EachBatch(m.m.PbFlows, 4096, func(keys []bpf.LbCtKey, vals []bpf.LbFlowValue) error {
		for i := range keys {
			out = append(out, Flow{keys[i], vals[i]})
		}
		return nil
	})
	if err != nil {
		return out, fmt.Errorf("pb_flows: %w", err)
	}
	return out, nil
}

// ReleaseFlow ends the accounting of a flow: it deletes the pb_flows entry
// and, if this call is the one that deleted it (the datapath may have
// raced it on a FIN or RST), gives back the flow's slots.
func (m *Maps) ReleaseFlow(in *Inflight, f Flow) (bool, error) {
	err := m.m.PbFlows.Delete(f.Key)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("pb_flows: delete: %w", err)
	}
	in.release(f.Value.SvcId, f.Value.BackendId)
	return true, nil
}
