// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"slices"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// The agent's reader waits in Go's netpoller, not in epoll_wait(2): the
// events that force a wake-up (a refusal) and those that wait for its poll
// (a new flow, a handshake) both arrive, and Close ends a waiting Run.
// The bounds below are liveness bounds, seconds where milliseconds are
// expected, not speed assertions.
func TestOutcomesReaderDeliversAndCloses(t *testing.T) {
	f := newFixture(t) // its own ring reader stays unused here
	f.table(id1)
	r, err := outcomes.NewReader(f.PbEvents)
	if err != nil {
		t.Fatal(err)
	}
	batches := make(chan []outcomes.Event, 64)
	done := make(chan error, 1)
	go func() { done <- r.Run(func(b []outcomes.Event) { batches <- slices.Clone(b) }) }()

	var got []outcomes.Type
	collect := func(want ...outcomes.Type) {
		t.Helper()
		deadline := time.After(10 * time.Second)
		for len(got) < len(want) {
			select {
			case b := <-batches:
				for _, e := range b {
					if e.Backend != id1 || e.Client != client {
						t.Errorf("event %+v, want backend %d and client %s", e, id1, client)
					}
					got = append(got, e.Type)
				}
			case <-deadline:
				t.Fatalf("events %v after 10s, want %v", got, want)
			}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("events %v, want %v", got, want)
		}
		got = got[:0]
	}

	// Refused: the RST's event forces a wake-up.
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, client, bpftest.RST, nil))
	collect(outcomes.NewFlow, outcomes.Refused)

	// A handshake wakes nobody: the reader's poll collects it.
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil))
	f.run(bpftest.TCP(be1, client, bpftest.SYNACK, nil))
	collect(outcomes.NewFlow, outcomes.Established)

	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run after Close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run still waiting 10s after Close")
	}
	if n := r.Read.Load(); n != 4 {
		t.Errorf("Read = %d, want 4", n)
	}
}

// CaughtUp says how far the reader has read, on the events' clock: nothing
// before it first found the ring empty (a pinned ring may hold a backlog),
// then a time no earlier than every event it handed over.
func TestOutcomesReaderCaughtUp(t *testing.T) {
	f := newFixture(t)
	f.table(id1)
	f.run(bpftest.TCP(client, vip, bpftest.SYN, nil)) // a backlog
	r, err := outcomes.NewReader(f.PbEvents)
	if err != nil {
		t.Fatal(err)
	}
	if c := r.CaughtUp(); !c.IsZero() {
		t.Fatalf("caught up to %v before reading anything", c)
	}
	batches := make(chan []outcomes.Event, 64)
	done := make(chan error, 1)
	go func() { done <- r.Run(func(b []outcomes.Event) { batches <- slices.Clone(b) }) }()
	defer func() { r.Close(); <-done }()
	var last time.Time
	select {
	case b := <-batches:
		last = b[len(b)-1].At
	case <-time.After(10 * time.Second):
		t.Fatal("the backlog was not read")
	}
	deadline := time.Now().Add(10 * time.Second)
	for r.CaughtUp().Before(last) {
		if time.Now().After(deadline) {
			t.Fatalf("caught up to %v, behind the last event read at %v", r.CaughtUp(), last)
		}
		time.Sleep(time.Millisecond)
	}
}
