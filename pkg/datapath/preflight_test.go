// SPDX-License-Identifier: Apache-2.0

package datapath

import (
	"errors"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

func TestCheckKernelNamesWhatIsMissing(t *testing.T) {
	have := func() error { return nil }
	lacks := func() error { return ebpf.ErrNotSupported }
	fs := []KernelFeature{{"a", "4.8", have}, {"bpf_loop", "5.17", lacks}, {"bpf_xdp_load_bytes", "5.18", lacks}}
	err := CheckKernel(fs)
	if err == nil {
		t.Fatal("no error for a kernel without bpf_loop")
	}
	msg := err.Error()
	for _, want := range []string{"lacks bpf_loop (Linux 5.17), bpf_xdp_load_bytes (Linux 5.18)", "needs Linux " + MinKernel + " or newer"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not say %q", msg, want)
		}
	}
	if strings.Contains(msg, "a (") {
		t.Errorf("error %q names a feature the kernel has", msg)
	}
	if strings.Contains(msg, "\n") {
		t.Errorf("error %q is more than one line", msg)
	}
	if err := CheckKernel(fs[:1]); err != nil {
		t.Errorf("kernel with everything: %v", err)
	}
	if err := CheckKernel([]KernelFeature{{"x", "5.8", func() error { return errors.New("operation not permitted") }}}); err == nil ||
		!strings.Contains(err.Error(), "cannot probe") {
		t.Errorf("a probe that cannot tell: %v", err)
	}
}

// The kernel running the tests (the host's, or 6.1 and 6.12 under qemu:
// scripts/kernel-matrix.sh) has everything.
func TestThisKernelHasEverything(t *testing.T) {
	if err := CheckKernel(KernelFeatures); err != nil {
		if strings.Contains(err.Error(), "cannot probe") {
			t.Skip("needs root for BPF (CI runs as root):", err)
		}
		t.Fatal(err)
	}
}
