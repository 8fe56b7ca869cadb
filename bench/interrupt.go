// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"os"
	"os/signal"
	"slices"
	"sync"
	"syscall"
)

// An interrupted benchmark (Ctrl-C, SIGTERM) must not leave network
// namespaces, agents, HAProxy or bpffs mounts behind: whatever holds one
// registers its cleanup here while it lives, and an interrupt runs the
// registered cleanups, newest first, before the process exits.
var interrupts struct {
	sync.Mutex
	next int
	fns  map[int]func()
}

// atInterrupt registers fn; the returned func unregisters it (call it
// from the normal cleanup path).
func atInterrupt(fn func()) (unregister func()) {
	interrupts.Lock()
	defer interrupts.Unlock()
	if interrupts.fns == nil {
		interrupts.fns = map[int]func(){}
	}
	id := interrupts.next
	interrupts.next++
	interrupts.fns[id] = fn
	return func() {
		interrupts.Lock()
		defer interrupts.Unlock()
		delete(interrupts.fns, id)
	}
}

// cleanUpOnInterrupt installs the handler.
func cleanUpOnInterrupt() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		s := <-ch
		fmt.Fprintf(os.Stderr, "bench: %v: cleaning up\n", s)
		interrupts.Lock()
		ids := make([]int, 0, len(interrupts.fns))
		for id := range interrupts.fns {
			ids = append(ids, id)
		}
		fns := interrupts.fns
		interrupts.fns = nil
		interrupts.Unlock()
		slices.Sort(ids)
		for _, id := range slices.Backward(ids) {
			fns[id]()
		}
		os.Exit(130)
	}()
}
