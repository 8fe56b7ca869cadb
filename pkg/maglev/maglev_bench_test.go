// SPDX-License-Identifier: Apache-2.0

package maglev

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
)

// BenchmarkBuild measures one default-size table for services of various
// sizes, with a reused Builder and output buffer (the agent's steady state).
//
// It cycles through distinct key sets: rebuilding one key set over and over
// lets the CPU's branch predictor learn that table's probe pattern and
// reports up to twice the real speed.
func BenchmarkBuild(b *testing.B) {
	const sets = 32
	for _, n := range []int{3, 10, 100, 1000} {
		b.Run(fmt.Sprintf("backends=%d", n), func(b *testing.B) {
			keys := make([][]string, sets)
			for s := range keys {
				keys[s] = backendKeys(s, n)
			}
			bld := NewBuilder(DefaultTableSize)
			out := make([]int32, DefaultTableSize)
			if _, err := bld.Build(keys[0], out); err != nil { // size scratch buffers
				b.Fatal(err)
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if _, err := bld.Build(keys[i%sets], out); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}

// BenchmarkBuild10kServices rebuilds the tables of 10,000 services with 10
// backends each, as a full agent resync would, on one Builder and one
// output buffer. ns/table is the cost of one service's table.
func BenchmarkBuild10kServices(b *testing.B) {
	const services, perService = 10000, 10
	keys := make([][]string, services)
	for s := range keys {
		keys[s] = backendKeys(s, perService)
	}
	bld := NewBuilder(DefaultTableSize)
	out := make([]int32, DefaultTableSize)
	if _, err := bld.Build(keys[0], out); err != nil { // size scratch buffers
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		for _, k := range keys {
			if _, err := bld.Build(k, out); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*services), "ns/table")
}

// BenchmarkBuild10kServicesParallel is BenchmarkBuild10kServices spread
// over GOMAXPROCS goroutines, one Builder and output buffer each: the wall
// time of a full resync on this machine.
func BenchmarkBuild10kServicesParallel(b *testing.B) {
	const services, perService = 10000, 10
	keys := make([][]string, services)
	for s := range keys {
		keys[s] = backendKeys(s, perService)
	}
	workers := runtime.GOMAXPROCS(0)
	builders := make([]*Builder, workers)
	outs := make([][]int32, workers)
	for w := range builders {
		builders[w] = NewBuilder(DefaultTableSize)
		outs[w] = make([]int32, DefaultTableSize)
		if _, err := builders[w].Build(keys[0], outs[w]); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				for s := w; s < services; s += workers {
					if _, err := builders[w].Build(keys[s], outs[w]); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*services), "ns/table")
}
