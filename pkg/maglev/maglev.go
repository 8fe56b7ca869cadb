// SPDX-License-Identifier: Apache-2.0

// Package maglev builds Maglev consistent-hashing lookup tables (Eisenbud et
// al., "Maglev: A Fast and Reliable Software Network Load Balancer", NSDI
// 2016, section 3.4).
//
// A table has M slots (M prime). The agent writes it into a per-service BPF
// array (slot -> backend id) and the XDP program picks a backend with
// table[hash % M]. Maglev gives two properties the datapath relies on:
//
//   - balance: with equal weights every backend owns floor(M/N) or
//     ceil(M/N) slots, because the population loop hands out exactly one slot
//     per backend per round;
//   - near-minimal disruption: removing or adding one of N backends moves
//     about 1/N of the slots (the departed backend's share plus a little
//     churn among the others: on average ~0.5% of M for N=10 and ~1.3% for
//     N=100 at the default size), so most flows that miss conntrack (e.g.
//     after an agent restart, or on another node) keep their backend.
//
// Tables are a pure function of the set of backend keys and M: keys are
// hashed with a fixed, hand-written hash (never hash/maphash, whose seeds are
// random per process) and sorted before population, so a restarted agent, or
// another node, rebuilds byte-identical tables whatever order it learns the
// backends in.
package maglev

import (
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"strings"
)

const (
	// DefaultTableSize is the default number of slots. It is prime (as
	// required, see ValidateTableSize) and matches Cilium's default and
	// PB_MAGLEV_DEFAULT_SIZE in bpf/include/pb_consts.h. The paper
	// recommends M > 100*N to keep the per-backend share within 1%, so this
	// suits services of up to ~160 backends.
	DefaultTableSize = 16381

	// MinTableSize is the smallest accepted size. Smaller tables cannot
	// spread even a handful of backends meaningfully and are almost
	// certainly configuration mistakes; 7 still admits the paper's worked
	// example (Table 1, M = 7) and small test tables.
	MinTableSize = 7

	// MaxTableSize is the largest accepted size: the largest prime below
	// 1<<20, so that it is itself a valid size. It bounds per-service BPF
	// memory (4 bytes per slot, 4 MiB per table) and build time, and keeps
	// slot arithmetic far inside int32, which advance relies on.
	MaxTableSize = 1048573
)

var (
	// ErrNoBackends is returned by Build for an empty key set. There is no
	// meaningful table to build; the caller decides what the service does
	// without backends (drop, or leave the previous table).
	ErrNoBackends = errors.New("maglev: no backends")

	// ErrDuplicateKey is returned by Build when a key appears more than
	// once. Duplicates would double a backend's share and make the table
	// depend on which duplicate index is reported, so they are rejected.
	ErrDuplicateKey = errors.New("maglev: duplicate backend key")

	// ErrTooManyBackends is returned by Build when there are more backends
	// than slots: some backends could then own no slot at all.
	ErrTooManyBackends = errors.New("maglev: more backends than table slots")
)

// IsPrime reports whether n is prime. Table sizes must be prime so that every
// skip in [1, M-1] is coprime with M and each backend's preference list is a
// full permutation of the slots.
func IsPrime(n uint32) bool {
	if n < 2 {
		return false
	}
	if n%2 == 0 {
		return n == 2
	}
	if n%3 == 0 {
		return n == 3
	}
	// Trial division by 6k±1; d*d fits in uint64 for every uint32 n.
	for d := uint64(5); d*d <= uint64(n); d += 6 {
		if uint64(n)%d == 0 || uint64(n)%(d+2) == 0 {
			return false
		}
	}
	return true
}

// TableSizeError is the error ValidateTableSize returns: which part of
// the rule size breaks, so callers (pkg/config) can word it their way.
type TableSizeError struct {
	Size uint32
	// NotPrime: size is in [MinTableSize, MaxTableSize] but not prime.
	// Otherwise it is out of that range.
	NotPrime bool
}

func (e *TableSizeError) Error() string {
	switch {
	case e.NotPrime:
		return fmt.Sprintf("maglev: table size %d is not prime", e.Size)
	case e.Size < MinTableSize:
		return fmt.Sprintf("maglev: table size %d is below the minimum %d", e.Size, MinTableSize)
	default:
		return fmt.Sprintf("maglev: table size %d exceeds the maximum %d", e.Size, MaxTableSize)
	}
}

// ValidateTableSize returns nil if size is a prime in
// [MinTableSize, MaxTableSize], and a *TableSizeError naming the value
// otherwise.
func ValidateTableSize(size uint32) error {
	switch {
	case size < MinTableSize || size > MaxTableSize:
		return &TableSizeError{Size: size}
	case !IsPrime(size):
		return &TableSizeError{Size: size, NotPrime: true}
	}
	return nil
}

// Builder builds tables of one size. It keeps its scratch buffers between
// calls, so building many tables allocates nothing in steady state (the
// agent builds one table per service, tens of thousands per sync).
//
// A Builder is not safe for concurrent use; use one per goroutine (builds
// are CPU-bound and independent, so a resync can spread services over one
// Builder per core).
type Builder struct {
	size uint32
	err  error // size validation error, reported by every Build

	// Per backend, indexed by position in sorted key order.
	order []int32  // index into the caller's keys
	perms []walker // permutation state

	// used marks filled slots, one byte each (16 KiB at the default size,
	// L1-resident; bytes make the 4-wide probe below cheaper than a bitmap).
	used []uint8
}

// walker is one backend's position in its permutation
// permutation[j] = (offset + j*skip) % M, plus skip multiples so the
// population loop can look four positions ahead at once.
type walker struct {
	next uint32    // permutation[j] for the next unexamined j
	skip [4]uint32 // k*skip % M for k = 1..4
}

// NewBuilder returns a Builder for tables of size slots. An invalid size
// (see ValidateTableSize) is not a panic: every Build returns the
// validation error instead.
func NewBuilder(size uint32) *Builder {
	b := &Builder{size: size, err: ValidateTableSize(size)}
	if b.err == nil {
		b.used = make([]uint8, size)
	}
	return b
}

// Size returns the number of slots in the tables b builds.
func (b *Builder) Size() uint32 { return b.size }

// Build fills out with a Maglev table for keys: out[slot] = i means keys[i]
// owns slot. If out is nil a new slice of Size() entries is allocated;
// otherwise len(out) must equal Size(). It returns the filled table.
//
// Keys identify backends stably (e.g. "198.18.1.2:8080"). The result
// depends only on the set of keys, not their order: each key's permutation
// comes from hashing the key alone, and the population rounds visit
// backends in sorted (byte-wise) key order. The returned indexes of course
// refer to the caller's keys slice.
//
// Errors: the size validation error for a Builder with an invalid size;
// ErrNoBackends for no keys; ErrDuplicateKey if a key repeats;
// ErrTooManyBackends if len(keys) > Size(); an error if len(out) is wrong.
// On error out is not modified and the returned slice is nil.
func (b *Builder) Build(keys []string, out []int32) ([]int32, error) {
	if b.err != nil {
		return nil, b.err
	}
	n := len(keys)
	switch {
	case n == 0:
		return nil, ErrNoBackends
	case uint64(n) > uint64(b.size):
		return nil, fmt.Errorf("%w: %d backends, %d slots", ErrTooManyBackends, n, b.size)
	case out != nil && len(out) != int(b.size):
		return nil, fmt.Errorf("maglev: output has %d entries, want %d", len(out), b.size)
	}

	b.order = slices.Grow(b.order[:0], n)[:n]
	for i := range b.order {
		b.order[i] = int32(i)
	}
	slices.SortFunc(b.order, func(x, y int32) int { return strings.Compare(keys[x], keys[y]) })
	for p := 1; p < n; p++ {
		if k := keys[b.order[p]]; k == keys[b.order[p-1]] {
			return nil, fmt.Errorf("%w: %q", ErrDuplicateKey, k)
		}
	}

	// Hashing a key costs tens of nanoseconds against 100-200µs to populate
	// a default-size table, so (offset, skip) is recomputed on every build
	// rather than cached across builds.
	b.perms = slices.Grow(b.perms[:0], n)[:n]
	m := uint64(b.size)
	for p, i := range b.order {
		h1, h2 := keyHashes(keys[i])
		skip := h2%(m-1) + 1
		w := &b.perms[p]
		w.next = uint32(h1 % m)
		for k := range w.skip {
			w.skip[k] = uint32(uint64(k+1) * skip % m)
		}
	}

	if out == nil {
		out = make([]int32, b.size)
	}
	b.populate(out)
	return out, nil
}

// populate runs the paper's population loop (Pseudocode 1): round-robin over
// backends, each taking the next slot of its permutation that is still empty,
// until the table is full. b.perms holds each backend's walk in round order;
// b.order maps round position to the output index.
//
// Because M is prime every skip is coprime with M, each walk visits every
// slot, and the search for an empty slot always ends while the table is not
// full.
//
// Speed: permutation positions are advanced by addition and a conditional
// subtract (advance), never a division. Searching one position at a time is
// bound by that add-compare chain and by a hard-to-predict branch per probe
// near the end of the fill, when most slots are taken; instead four
// positions are computed independently from the current one (using the
// precomputed multiples of skip) and tested with one branch. The result is
// exactly the sequential algorithm's: the first empty slot in permutation
// order is taken, and the walk resumes right after it.
func (b *Builder) populate(out []int32) {
	clear(b.used)
	m := b.size
	used := b.used[:m]
	out = out[:m]
	order := b.order
	perms := b.perms[:len(order)]

	for filled := uint32(0); ; {
		for p := range perms {
			w := &perms[p]
			c := w.next
			if used[c] != 0 {
				for {
					c1 := advance(c, w.skip[0], m)
					c2 := advance(c, w.skip[1], m)
					c3 := advance(c, w.skip[2], m)
					c4 := advance(c, w.skip[3], m)
					full := uint32(used[c1]) | uint32(used[c2])<<1 | uint32(used[c3])<<2 | uint32(used[c4])<<3
					if full != 0b1111 {
						cand := [4]uint32{c1, c2, c3, c4}
						c = cand[bits.TrailingZeros32(^full)&3]
						break
					}
					c = c4
				}
			}
			used[c] = 1
			out[c] = order[p]
			w.next = advance(c, w.skip[0], m)
			if filled++; filled == m {
				return
			}
		}
	}
}

// advance returns (c + s) % m for c, s < m <= MaxTableSize without dividing
// or branching: c+s-m is negative exactly when no reduction is needed, and
// the sign mask adds m back. Operands below 2^21 keep int32 exact.
func advance(c, s, m uint32) uint32 {
	d := int32(c + s - m)
	return uint32(d + int32(m)&(d>>31))
}

// Seeds of the two key hashes. They are arbitrary fixed constants and part of
// the on-node format: changing them, or the hash, reshuffles every table
// (TestGolden catches accidental changes).
const (
	seedOffset = 0x5bd1e9955bd1e995
	seedSkip   = 0x9e3779b97f4a7c15
)

// keyHashes returns the two hashes used for a key's offset and skip: FNV-1a
// 64 over the key from two different seeded starting states, each finished
// with the splitmix64 finalizer so that all output bits (and hence the
// residues mod M) depend on all input bits. It is deterministic across
// processes, architectures and restarts.
func keyHashes(key string) (h1, h2 uint64) {
	const (
		fnvOffset = 14695981039346656037
		fnvPrime  = 1099511628211
	)
	h1 = fnvOffset ^ seedOffset
	h2 = fnvOffset ^ seedSkip
	for i := 0; i < len(key); i++ {
		c := uint64(key[i])
		h1 = (h1 ^ c) * fnvPrime
		h2 = (h2 ^ c) * fnvPrime
	}
	n := uint64(len(key))
	return mix64(h1 ^ n), mix64(h2 ^ n ^ seedSkip)
}

// mix64 is the splitmix64 / MurmurHash3 style 64-bit finalizer.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
