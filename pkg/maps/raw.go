// SPDX-License-Identifier: Apache-2.0

package maps

import "unsafe"

// raw is the memory of *v as bytes, for a map update that cilium/ebpf
// takes as it is. A struct passed by value is marshalled through
// encoding/binary's reflection instead, a fifth of an ejection's
// programming in a profile of the reaction benchmark. The bpf2go types
// have the kernel's layout (structs.HostLayout, padding spelled out) and
// no pointers; cilium/ebpf still checks the length against the map's key
// or value size.
func raw[T any](v *T) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v))
}
