// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
)

// TestMain lets this test binary be the reaction part's wake-up floor
// process, which the part starts by re-executing its own binary.
func TestMain(m *testing.M) {
	if slices.Contains(os.Args[1:], "--"+wakeFloorFlag) {
		if err := wakeFloorChild(); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestSmoke runs every part once with tiny sizes (--quick): it proves that
// each part runs to the end, produces numbers, and that the per-path
// checks of the packet part hold (runPacket fails when a counter shows a
// run took another path). It asserts nothing about speed: `make bench`
// measures.
func TestSmoke(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for BPF and network namespaces (CI runs as root)")
	}
	t.Cleanup(func() {
		if agentPath != "" {
			os.RemoveAll(filepath.Dir(agentPath))
		}
	})
	for _, part := range allParts {
		t.Run(part, func(t *testing.T) {
			if part == "e2e" || part == "failing" || part == "flood" {
				for _, bin := range []string{"nft", "haproxy"} {
					if _, err := exec.LookPath(bin); err != nil {
						t.Skipf("%s not installed (make deps)", bin)
					}
				}
			}
			res, _, err := run(options{only: []string{part}, rounds: 1, quick: true}, t.Logf)
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for _, f := range res.Figures {
				n++
				if len(f.Samples) != 1 || math.IsNaN(f.Samples[0]) || math.IsInf(f.Samples[0], 0) {
					t.Errorf("%s / %s: samples %v", f.Part, f.Name, f.Samples)
				}
			}
			if n == 0 {
				t.Fatalf("part %s produced no figures", part)
			}
			t.Logf("part %s: %d figures", part, n)
		})
	}
}
