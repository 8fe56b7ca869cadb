// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"time"

	"github.com/penaltybox/penaltybox/bench/xdpbase"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// The reaction time's floor: how long a ring buffer event takes to reach
// a reader that is waiting for it, with nothing else on the path. It is
// measured in a process of its own (this binary, re-executed), idle but
// for the measurement like the agent between events, while the reaction
// part's load runs: the agent's reaction can be no faster than this.

// floorName prefixes the floor's rows (p50, p99, max).
const floorName = "baseline: ring buffer wake-up alone (event → idle reader in its own process), "

// wakeFloorFlag re-executes the benchmark as the floor's process.
const wakeFloorFlag = "wake-floor-child"

// wakeFloorEvery spaces the events so the reader has always caught up
// and parked when the next one comes, as it has between failures.
const wakeFloorEvery = 10 * time.Millisecond

// wakeFloorChild submits one event every wakeFloorEvery until stdin
// closes, then writes the latencies (µs; kernel timestamp of the event →
// the reader's handler running, on CLOCK_MONOTONIC) to stdout as JSON.
func wakeFloorChild() error {
	var objs xdpbase.BaseObjects
	// Its own ring buffer (base.c's, 4 MiB like the agent's): emit_event
	// submits with flags 0, which wakes a reader that has read everything
	// before, as this one has.
	if err := xdpbase.LoadBaseObjects(&objs, nil); err != nil {
		return err
	}
	defer objs.Close()
	rd, err := outcomes.NewReader(objs.Events)
	if err != nil {
		return err
	}
	var (
		mu  sync.Mutex
		lat []float64
	)
	done := make(chan error, 1)
	go func() {
		done <- rd.Run(func(b []outcomes.Event) {
			now := outcomes.MonoNow()
			mu.Lock()
			defer mu.Unlock()
			for _, ev := range b {
				lat = append(lat, float64(now-(ev.At.UnixNano()-rd.Offset()))/1e3)
			}
		})
	}()

	stop := make(chan struct{})
	go func() { io.Copy(io.Discard, os.Stdin); close(stop) }()
	runtime.LockOSThread()
	pkt := tcpFrame(pkClient, pkA, bpftest.ACK)
	out := make([]byte, 2048)
	sent := 0
	tick := time.NewTicker(wakeFloorEvery)
	defer tick.Stop()
loop:
	for {
		select {
		case <-stop:
			break loop
		case <-tick.C:
		}
		if _, _, _, err := testRun(objs.EmitEvent, pkt, out, 1); err != nil {
			return err
		}
		sent++
	}
	runtime.UnlockOSThread()
	// The last one is read within the reader's poll at worst.
	time.Sleep(3 * outcomes.Poll)
	rd.Close()
	if err := <-done; err != nil {
		return err
	}
	mu.Lock()
	defer mu.Unlock()
	if len(lat) != sent {
		return fmt.Errorf("wake floor: %d events submitted, %d read", sent, len(lat))
	}
	return json.NewEncoder(os.Stdout).Encode(lat)
}

// wakeFloor is the parent's handle on the floor's process.
type wakeFloor struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   bytes.Buffer
}

func startWakeFloor() (*wakeFloor, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	w := &wakeFloor{cmd: exec.Command(self, "--"+wakeFloorFlag)}
	w.cmd.Stdout = &w.out
	w.cmd.Stderr = os.Stderr
	if w.stdin, err = w.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := w.cmd.Start(); err != nil {
		return nil, fmt.Errorf("wake floor: %w", err)
	}
	return w, nil
}

// stop ends the floor's process and returns its latencies in µs.
func (w *wakeFloor) stop() ([]float64, error) {
	w.stdin.Close()
	if err := w.cmd.Wait(); err != nil {
		return nil, fmt.Errorf("wake floor: %w", err)
	}
	var lat []float64
	if err := json.Unmarshal(w.out.Bytes(), &lat); err != nil {
		return nil, fmt.Errorf("wake floor: %w", err)
	}
	return lat, nil
}
