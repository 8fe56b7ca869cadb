// SPDX-License-Identifier: Apache-2.0

package main

import (
	"os"
	"path/filepath"
	"testing"
)

func TestFittedLimit(t *testing.T) {
	const mi = 1 << 20
	tests := []struct {
		name                          string
		goLimit, cgLimit, cur, goUsed int64
		want                          int64
		ok                            bool
	}{
		{"the container's limit less the maps", 1024 * mi, 1024 * mi, 300 * mi, 40 * mi, 764 * mi, true},
		{"an operator's own limit is left alone", 200 * mi, 1024 * mi, 300 * mi, 40 * mi, 200 * mi, false},
		{"nothing outside Go", 1024 * mi, 1024 * mi, 40 * mi, 50 * mi, 1024 * mi, true},
		{"a limit too small keeps a floor", 256 * mi, 256 * mi, 250 * mi, 10 * mi, minGoMemoryLimit, true},
	}
	for _, tt := range tests {
		got, ok := fittedLimit(tt.goLimit, tt.cgLimit, tt.cur, tt.goUsed)
		if got != tt.want || ok != tt.ok {
			t.Errorf("%s: %d MiB %v, want %d MiB %v", tt.name, got/mi, ok, tt.want/mi, tt.ok)
		}
	}
}

func TestCgroupMemory(t *testing.T) {
	write := func(dir, name, v string) {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	v2 := t.TempDir()
	write(v2, "memory.max", "1073741824\n")
	write(v2, "memory.current", "314572800\n")
	if l, c, ok := cgroupMemory(v2); !ok || l != 1<<30 || c != 300<<20 {
		t.Errorf("v2: %d %d %v", l, c, ok)
	}
	none := t.TempDir()
	write(none, "memory.max", "max\n")
	write(none, "memory.current", "314572800\n")
	if _, _, ok := cgroupMemory(none); ok {
		t.Error("v2 without a limit read as one")
	}
	v1 := t.TempDir()
	write(v1, "memory/memory.limit_in_bytes", "536870912\n")
	write(v1, "memory/memory.usage_in_bytes", "104857600\n")
	if l, c, ok := cgroupMemory(v1); !ok || l != 512<<20 || c != 100<<20 {
		t.Errorf("v1: %d %d %v", l, c, ok)
	}
	write(v1, "memory/memory.limit_in_bytes", "9223372036854771712\n")
	if _, _, ok := cgroupMemory(v1); ok {
		t.Error("v1 without a limit read as one")
	}
	if _, _, ok := cgroupMemory(t.TempDir()); ok {
		t.Error("no cgroup files read as a limit")
	}
}
