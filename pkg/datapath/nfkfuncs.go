package datapath

import (
	"errors"
	"sync"

	"github.com/cilium/ebpf/btf"
)

// nfKfuncs are the kernel's conntrack kfuncs the datapath calls where
// kube-proxy's path and its own meet (bpf/lb.c, nf_forget).
var nfKfuncs = []string{"bpf_xdp_ct_lookup", "bpf_ct_release", "bpf_ct_change_timeout"}

var haveNF = sync.OnceValue(func() bool {
	for _, load := range []func() (*btf.Spec, error){
		btf.LoadKernelSpec,
		func() (*btf.Spec, error) { return btf.LoadKernelModuleSpec("nf_conntrack") },
	} {
		spec, err := load()
		if err != nil {
			continue
		}
		found := 0
		for _, name := range nfKfuncs {
			var fn *btf.Func
			if err := spec.TypeByName(name, &fn); err == nil {
				found++
			} else if !errors.Is(err, btf.ErrNotFound) {
				break
			}
		}
		if found == len(nfKfuncs) {
			return true
		}
	}
	return false
})

// HaveNFKfuncs says whether the kernel has the conntrack kfuncs (Linux
// 6.0, nf_conntrack loaded or built in, with BTF). Without them the
// datapath cannot clear the kernel's conntrack where kube-proxy's path and
// its own meet, and a connection from a client port the other path used
// minutes before can fail while services change hands.
func HaveNFKfuncs() bool { return haveNF() }
