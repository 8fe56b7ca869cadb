// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"maps"
	"slices"
	"time"

	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// fakeSweeper reports inUse as live, and sweeps as kernel and kernelErr
// say.
type fakeSweeper struct {
	inUse     conntrack.InUse
	kernel    bool
	kernelErr error
}

func (s *fakeSweeper) Sweep() (conntrack.Result, error) {
	return conntrack.Result{InUse: s.inUse, Kernel: s.kernel, KernelErr: s.kernelErr}, nil
}

type noInflight struct{}

func (noInflight) Service(uint32) int64 { return 0 }
func (noInflight) Backend(uint32) int64 { return 0 }

// fakeHooks are XDP attachments to the interfaces of links; attaches
// counts the calls of Attach by name. With exists set, Attach fails for
// an interface it says is absent, as the datapath's does.
type fakeHooks struct {
	attached map[string]bool
	attaches map[string]int
	exists   func(name string) bool
}

func (h *fakeHooks) Attach(n string) error {
	if h.exists != nil && !h.exists(n) {
		return &netErr{n}
	}
	h.attached[n] = true
	if h.attaches == nil {
		h.attaches = map[string]int{}
	}
	h.attaches[n]++
	return nil
}
func (h *fakeHooks) Detach(n string) error { delete(h.attached, n); return nil }
func (h *fakeHooks) Attached() []string    { return slices.Sorted(maps.Keys(h.attached)) }

// fakeEvents is the ring buffer reader; caught, when set, is how far it
// has read (else it is always caught up).
type fakeEvents struct {
	bad    uint64
	kicks  int
	caught *time.Time
	clk    interface{ Now() time.Time }
	// onCaught: the agent's hook (OnCaughtUp).
	onCaught func(time.Time) time.Time
}

// Kick counts the kicks.
func (e *fakeEvents) Kick() { e.kicks++ }

// OnCaughtUp keeps the agent's hook, for a test to call as the reader
// would.
func (e *fakeEvents) OnCaughtUp(f func(time.Time) time.Time) { e.onCaught = f }

func (e *fakeEvents) CaughtUp() time.Time {
	if e.caught != nil {
		return *e.caught
	}
	return time.Unix(1<<40, 0)
}

// Offset puts the events' clock on the test's (a millisecond early, so the
// agent's start is before the first event a test sends).
func (e *fakeEvents) Offset() int64 {
	return e.clk.Now().Add(-time.Millisecond).UnixNano() - outcomes.MonoNow()
}
func (e *fakeEvents) Undecodable() uint64 { return e.bad }
