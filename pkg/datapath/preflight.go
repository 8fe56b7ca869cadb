// SPDX-License-Identifier: Apache-2.0

package datapath

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"golang.org/x/sys/unix"
)

// MinKernel is the oldest kernel the datapath is tested on (make test runs
// its suites on 6.1, 6.12 and the host's). Every feature below is older
// (bpf_map_lookup_percpu_elem, the newest, came in 5.19), but no kernel
// between 5.19 and 6.1 has been tried.
const MinKernel = "6.1"

// KernelFeature is something the datapath uses that an older kernel lacks:
// its name, the Linux version it came with, and how to probe for it.
type KernelFeature struct {
	Name  string
	Since string
	Probe func() error
}

func helper(fn asm.BuiltinFunc) func() error {
	return func() error { return features.HaveProgramHelper(ebpf.XDP, fn) }
}

// KernelFeatures are what pb_xdp and the agent need of the kernel, oldest
// first.
var KernelFeatures = []KernelFeature{
	{"XDP programs", "4.8", func() error { return features.HaveProgramType(ebpf.XDP) }},
	{"bpf_fib_lookup", "4.18", helper(asm.FnFibLookup)},
	{"memory-mapped arrays (BPF_F_MMAPABLE)", "5.5", func() error { return features.HaveMapFlag(features.BPF_F_MMAPABLE) }},
	{"BPF ring buffer", "5.8", func() error { return features.HaveMapType(ebpf.RingBuf) }},
	{"inner maps of any size (BPF_F_INNER_MAP)", "5.10", func() error { return features.HaveMapFlag(features.BPF_F_INNER_MAP) }},
	{"bpf_ktime_get_coarse_ns", "5.11", helper(asm.FnKtimeGetCoarseNs)},
	{"bpf_loop", "5.17", helper(asm.FnLoop)},
	{"bpf_xdp_load_bytes", "5.18", helper(asm.FnXdpLoadBytes)},
	{"bpf_map_lookup_percpu_elem", "5.19", helper(asm.FnMapLookupPercpuElem)},
}

// CheckKernel probes the running kernel for every feature fs names and
// returns nil, or one error naming the kernel, each feature it lacks and
// the minimum to run on: an operator reads what to do in one line instead
// of a verifier's dump. A probe that cannot tell (not root, no BPF at all)
// is an error too.
func CheckKernel(fs []KernelFeature) error {
	var missing, failed []string
	for _, f := range fs {
		err := f.Probe()
		switch {
		case err == nil:
		case errors.Is(err, ebpf.ErrNotSupported):
			missing = append(missing, fmt.Sprintf("%s (Linux %s)", f.Name, f.Since))
		default:
			failed = append(failed, fmt.Sprintf("%s: %v", f.Name, err))
		}
	}
	switch {
	case len(missing) > 0:
		return fmt.Errorf("kernel %s lacks %s: penaltybox needs Linux %s or newer",
			kernelRelease(), strings.Join(missing, ", "), MinKernel)
	case len(failed) > 0:
		return fmt.Errorf("kernel %s: cannot probe for BPF features (run as root, with BPF enabled): %s",
			kernelRelease(), strings.Join(failed, "; "))
	}
	return nil
}

func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "(unknown)"
	}
	return unix.ByteSliceToString(u.Release[:])
}
