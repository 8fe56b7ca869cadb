// SPDX-License-Identifier: Apache-2.0

package outcomes

import (
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// The reader calls its OnCaughtUp hook each time it has read the ring to
// its end, and a time the hook asks the ring to be read by wakes it: with
// its poll an hour long, nothing else could. It does not read before that
// time.
func TestReaderReadsByTheHooksTime(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for BPF (CI runs as root)")
	}
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.RingBuf, MaxEntries: 4096})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	r, err := NewReader(m)
	if err != nil {
		t.Fatal(err)
	}
	r.poll = time.Hour
	const wait = 20 * time.Millisecond
	calls := make(chan time.Time, 8)
	asked := 0
	r.OnCaughtUp(func(at time.Time) time.Time {
		select {
		case calls <- at:
		default: // a spinning reader fails on the times, not here
		}
		asked++
		if asked == 1 {
			return at.Add(wait)
		}
		return time.Time{}
	})
	done := make(chan error, 1)
	go func() { done <- r.Run(func([]Event) {}) }()
	next := func(what string) time.Time {
		t.Helper()
		select {
		case at := <-calls:
			return at
		case <-time.After(10 * time.Second):
			t.Fatalf("no %s call of the hook in 10s (the poll is an hour)", what)
			return time.Time{}
		}
	}
	first := next("first")
	second := next("second")
	if second.Before(first.Add(wait)) {
		t.Errorf("read again %v after the first catch-up, before the %v the hook asked", second.Sub(first), wait)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
}
