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

// floorTimes are the floor process's measurements, in µs: Wake, each
// event's kernel timestamp → the reader's handler running (on
// CLOCK_MONOTONIC); BPF, the first bpf() system call the handler makes
// then (a map lookup), and BPFAgain the same call at once after it.
type floorTimes struct {
	Wake, BPF, BPFAgain []float64
}

// wakeFloorChild submits one event every wakeFloorEvery until stdin
// closes, then writes its floorTimes to stdout as JSON.
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
		out floorTimes
	)
	val := make([]byte, objs.LbBackends.ValueSize())
	done := make(chan error, 1)
	go func() {
		done <- rd.Run(func(b []outcomes.Event) {
			now := outcomes.MonoNow()
			// What an agent's first map write after its wake-up pays for
			// the system call alone (some hosts trace bpf() calls: a cold
			// first one costs more there), and what the next pays.
			var lookups [2]float64
			for i := range lookups {
				t0 := outcomes.MonoNow()
				if err := objs.LbBackends.Lookup(uint32(0), val); err != nil {
					lookups[i] = -1 // left out (JSON has no NaN)
					continue
				}
				lookups[i] = float64(outcomes.MonoNow()-t0) / 1e3
			}
			mu.Lock()
			defer mu.Unlock()
			for _, ev := range b {
				out.Wake = append(out.Wake, float64(now-(ev.At.UnixNano()-rd.Offset()))/1e3)
			}
			if lookups[0] >= 0 && lookups[1] >= 0 {
				out.BPF = append(out.BPF, lookups[0])
				out.BPFAgain = append(out.BPFAgain, lookups[1])
			}
		})
	}()

	stop := make(chan struct{})
	go func() { io.Copy(io.Discard, os.Stdin); close(stop) }()
	runtime.LockOSThread()
	pkt := tcpFrame(pkClient, pkA, bpftest.ACK)
	frame := make([]byte, 2048)
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
		if _, _, _, err := testRun(objs.EmitEvent, pkt, frame, 1); err != nil {
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
	if len(out.Wake) != sent {
		return fmt.Errorf("wake floor: %d events submitted, %d read", sent, len(out.Wake))
	}
	return json.NewEncoder(os.Stdout).Encode(out)
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

// stop ends the floor's process and returns its measurements.
func (w *wakeFloor) stop() (floorTimes, error) {
	w.stdin.Close()
	var ft floorTimes
	if err := w.cmd.Wait(); err != nil {
		return ft, fmt.Errorf("wake floor: %w", err)
	}
	if err := json.Unmarshal(w.out.Bytes(), &ft); err != nil {
		return ft, fmt.Errorf("wake floor: %w", err)
	}
	return ft, nil
}
