// SPDX-License-Identifier: Apache-2.0

package maglev

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// backendKeys returns n distinct "ip:port" keys for a service.
func backendKeys(service, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("198.%d.%d.%d:%d", 18+service>>16, service>>8&0xff, service&0xff, 8000+i)
	}
	return keys
}

// ipKeys returns n distinct keys differing in the address, as a service
// with one port and many backend pods would have.
func ipKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("10.%d.%d.%d:8080", i>>16&0xff, i>>8&0xff, i&0xff)
	}
	return keys
}

func mustBuild(t testing.TB, b *Builder, keys []string) []int32 {
	t.Helper()
	tab, err := b.Build(keys, nil)
	if err != nil {
		t.Fatalf("Build(%d keys): %v", len(keys), err)
	}
	return tab
}

func counts(tab []int32, n int) []int {
	c := make([]int, n)
	for _, i := range tab {
		c[i]++
	}
	return c
}

// referenceTable is the paper's Pseudocode 1 written as plainly as
// possible (a modulo per step, -1 for empty slots, sort.Strings for the
// round order): populate's speed tricks must not change its output.
func referenceTable(m uint32, keys []string) []int32 {
	sorted := slices.Clone(keys)
	sort.Strings(sorted)
	index := make(map[string]int32, len(keys))
	for i, k := range keys {
		index[k] = int32(i)
	}
	n := len(sorted)
	offset, skip, next := make([]uint64, n), make([]uint64, n), make([]uint64, n)
	for i, k := range sorted {
		h1, h2 := keyHashes(k)
		offset[i] = h1 % uint64(m)
		skip[i] = h2%uint64(m-1) + 1
	}
	entry := make([]int32, m)
	for i := range entry {
		entry[i] = -1
	}
	filled := uint32(0)
	for {
		for i := range n {
			c := (offset[i] + next[i]*skip[i]) % uint64(m)
			for entry[c] >= 0 {
				next[i]++
				c = (offset[i] + next[i]*skip[i]) % uint64(m)
			}
			entry[c] = index[sorted[i]]
			next[i]++
			filled++
			if filled == m {
				return entry
			}
		}
	}
}

func TestIsPrime(t *testing.T) {
	// Cross-check against a sieve for small n.
	const limit = 20000
	composite := make([]bool, limit)
	for i := 2; i < limit; i++ {
		if !composite[i] {
			for j := i * i; j < limit; j += i {
				composite[j] = true
			}
		}
	}
	for n := range uint32(limit) {
		if want := n >= 2 && !composite[n]; IsPrime(n) != want {
			t.Fatalf("IsPrime(%d) = %v, want %v", n, !want, want)
		}
	}
	for _, tc := range []struct {
		n    uint32
		want bool
	}{
		{DefaultTableSize, true},
		{16383, false}, // 3 * 43 * 127
		{65537, true},
		{MaxTableSize, true},
		{1 << 20, false},
		{1048575, false},
		{4294967291, true}, // largest uint32 prime
		{4294967295, false},
		{65521 * 65519, false}, // product of two large primes
	} {
		if got := IsPrime(tc.n); got != tc.want {
			t.Errorf("IsPrime(%d) = %v, want %v", tc.n, got, tc.want)
		}
	}
}

func TestValidateTableSize(t *testing.T) {
	for _, tc := range []struct {
		size    uint32
		wantErr string // substring; "" means valid
	}{
		{MinTableSize, ""},
		{61, ""},
		{DefaultTableSize, ""},
		{65537, ""},
		{MaxTableSize, ""},
		{0, "below the minimum"},
		{1, "below the minimum"},
		{2, "below the minimum"},
		{5, "below the minimum"},
		{16383, "not prime"},
		{65536, "not prime"},
		{1 << 20, "exceeds the maximum"},
		{1048583, "exceeds the maximum"}, // prime, but too big
		{4294967291, "exceeds the maximum"},
	} {
		err := ValidateTableSize(tc.size)
		if tc.wantErr == "" {
			if err != nil {
				t.Errorf("ValidateTableSize(%d) = %v, want nil", tc.size, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("ValidateTableSize(%d) = nil, want error", tc.size)
			continue
		}
		msg := err.Error()
		if !strings.Contains(msg, tc.wantErr) || !strings.Contains(msg, strconv.FormatUint(uint64(tc.size), 10)) {
			t.Errorf("ValidateTableSize(%d) = %q, want it to mention %q and the value", tc.size, msg, tc.wantErr)
		}
	}
}

func TestMaxTableSizeIsLargestPrimeBelow2To20(t *testing.T) {
	for n := uint32(MaxTableSize + 1); n < 1<<20; n++ {
		if IsPrime(n) {
			t.Fatalf("%d is a prime between MaxTableSize and 1<<20", n)
		}
	}
}

func TestBuildErrors(t *testing.T) {
	keys := backendKeys(0, 3)
	for _, tc := range []struct {
		name    string
		size    uint32
		keys    []string
		out     []int32
		wantIs  error  // checked with errors.Is if set
		wantMsg string // substring if set
	}{
		{name: "non-prime size", size: 16383, keys: keys, wantMsg: "16383"},
		{name: "size too small", size: 5, keys: keys, wantMsg: "5"},
		{name: "size too big", size: 1048583, keys: keys, wantMsg: "1048583"},
		{name: "nil keys", size: 7, keys: nil, wantIs: ErrNoBackends},
		{name: "empty keys", size: 7, keys: []string{}, wantIs: ErrNoBackends},
		{name: "duplicate", size: 7, keys: []string{"a", "b", "a"}, wantIs: ErrDuplicateKey, wantMsg: `"a"`},
		{name: "duplicate empty", size: 7, keys: []string{"", ""}, wantIs: ErrDuplicateKey},
		{name: "more backends than slots", size: 7, keys: backendKeys(0, 8), wantIs: ErrTooManyBackends, wantMsg: "8 backends"},
		{name: "short out", size: 7, keys: keys, out: make([]int32, 6), wantMsg: "6 entries"},
		{name: "long out", size: 7, keys: keys, out: make([]int32, 8), wantMsg: "8 entries"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for i := range tc.out {
				tc.out[i] = 42
			}
			got, err := NewBuilder(tc.size).Build(tc.keys, tc.out)
			if err == nil {
				t.Fatalf("Build succeeded, want error")
			}
			if got != nil {
				t.Errorf("Build returned a table with error %v", err)
			}
			if tc.wantIs != nil && !errors.Is(err, tc.wantIs) {
				t.Errorf("error %v is not %v", err, tc.wantIs)
			}
			if tc.wantMsg != "" && !strings.Contains(err.Error(), tc.wantMsg) {
				t.Errorf("error %q does not mention %q", err, tc.wantMsg)
			}
			for i, v := range tc.out {
				if v != 42 {
					t.Fatalf("out[%d] modified on error", i)
				}
			}
		})
	}
}

// TestEverySlotFilled checks the basic contract over a spread of sizes and
// backend counts, including a single backend and as many backends as slots.
func TestEverySlotFilled(t *testing.T) {
	for _, tc := range []struct {
		size uint32
		n    int
	}{
		{7, 1}, {7, 3}, {7, 7},
		{61, 2}, {61, 60}, {61, 61},
		{DefaultTableSize, 1}, {DefaultTableSize, 10}, {DefaultTableSize, 1000}, {DefaultTableSize, DefaultTableSize},
		{65537, 100},
	} {
		t.Run(fmt.Sprintf("M=%d/N=%d", tc.size, tc.n), func(t *testing.T) {
			tab := mustBuild(t, NewBuilder(tc.size), ipKeys(tc.n))
			if len(tab) != int(tc.size) {
				t.Fatalf("len = %d, want %d", len(tab), tc.size)
			}
			for s, i := range tab {
				if i < 0 || int(i) >= tc.n {
					t.Fatalf("slot %d = %d, want an index in [0,%d)", s, i, tc.n)
				}
			}
			// Every backend gets one slot per round, so shares differ by
			// at most one slot and nobody is left out.
			c := counts(tab, tc.n)
			if lo, hi := slices.Min(c), slices.Max(c); lo < int(tc.size)/tc.n || hi-lo > 1 {
				t.Errorf("per-backend slots in [%d,%d], want floor/ceil of %d/%d", lo, hi, tc.size, tc.n)
			}
		})
	}
}

// TestSpread: each backend's share is within a few percent of M/N. The
// round-robin population makes the bound exact: counts are floor(M/N) or
// ceil(M/N), so the relative deviation is below N/M. For N=100 that is
// 0.61%; the paper (§3.4) recommends M > 100·N precisely so that it stays
// under 1%, and 16381 > 100·100.
func TestSpread(t *testing.T) {
	const m = DefaultTableSize
	for _, tc := range []struct {
		n      int
		maxDev float64 // max |count - M/N| / (M/N)
	}{
		{3, 0.02},
		{10, 0.02},
		{100, 0.01},
	} {
		t.Run(fmt.Sprintf("N=%d", tc.n), func(t *testing.T) {
			for name, keys := range map[string][]string{"ports": backendKeys(7, tc.n), "ips": ipKeys(tc.n)} {
				c := counts(mustBuild(t, NewBuilder(m), keys), tc.n)
				ideal := float64(m) / float64(tc.n)
				for i, got := range c {
					if dev := abs(float64(got)-ideal) / ideal; dev > tc.maxDev {
						t.Errorf("%s: backend %d owns %d slots, %.2f%% off %.1f", name, i, got, 100*dev, ideal)
					}
				}
				if lo, hi := slices.Min(c), slices.Max(c); hi-lo > 1 {
					t.Errorf("%s: max/min = %d/%d, want within one slot", name, hi, lo)
				}
			}
		})
	}
}

func abs(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}

// TestDisruption removes each backend in turn and counts slots whose
// backend changed. The removed backend's ~M/N slots must move; Maglev also
// moves some slots between survivors (it trades a little disruption for
// exact balance, §3.4), which grows with N/M. Measured with these keys and
// M=16381 the survivor churn averages ~0.06% of M for N=3, ~0.5% for N=10,
// ~1.3% for N=100 (worst single removal ~1.5%); the bounds leave headroom
// while still failing if, say, the round order or permutations stopped
// being stable (that moves ~(N-1)/N of the slots).
func TestDisruption(t *testing.T) {
	const m = DefaultTableSize
	for _, tc := range []struct {
		n int
		// Survivor slots that may change owner, as a fraction of M: for
		// any single removal, and averaged over all removals.
		worst, mean float64
	}{
		{3, 0.005, 0.002},
		{10, 0.015, 0.008},
		{100, 0.02, 0.016},
	} {
		t.Run(fmt.Sprintf("N=%d", tc.n), func(t *testing.T) {
			keys := ipKeys(tc.n)
			b := NewBuilder(m)
			before := mustBuild(t, b, keys)
			after := make([]int32, m)
			sumChurn := 0
			for r := range tc.n {
				rest := slices.Delete(slices.Clone(keys), r, r+1)
				if _, err := b.Build(rest, after); err != nil {
					t.Fatal(err)
				}
				moved, survivorSlots, survivorMoved := 0, 0, 0
				for s := range before {
					old, cur := keys[before[s]], rest[after[s]]
					if int(before[s]) != r {
						survivorSlots++
					}
					if old != cur {
						moved++
						if int(before[s]) != r {
							survivorMoved++
						}
					}
					if cur == keys[r] {
						t.Fatalf("slot %d still maps to removed backend", s)
					}
				}
				sumChurn += survivorMoved
				if frac, limit := float64(moved)/m, 1/float64(tc.n)+1.0/m+tc.worst; frac > limit {
					t.Errorf("removing %s moved %d slots (%.4f of M), want <= %.4f", keys[r], moved, frac, limit)
				}
				if kept := survivorSlots - survivorMoved; float64(kept) < (1-tc.worst)*float64(survivorSlots) {
					t.Errorf("removing %s: survivors kept %d of their %d slots", keys[r], kept, survivorSlots)
				}
			}
			if mean := float64(sumChurn) / float64(tc.n) / m; mean > tc.mean {
				t.Errorf("mean survivor churn %.4f of M, want <= %.4f", mean, tc.mean)
			}
		})
	}
}

// TestOrderIndependence: any permutation of the same keys yields the same
// slot -> key mapping.
func TestOrderIndependence(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{2, 3, 10, 100, 1000} {
		t.Run(fmt.Sprintf("N=%d", n), func(t *testing.T) {
			keys := backendKeys(3, n)
			b := NewBuilder(DefaultTableSize)
			want := mustBuild(t, b, keys)
			orders := [][]string{slices.Clone(keys)}
			slices.Reverse(orders[0])
			for range 5 {
				o := slices.Clone(keys)
				rng.Shuffle(len(o), func(i, j int) { o[i], o[j] = o[j], o[i] })
				orders = append(orders, o)
			}
			for _, o := range orders {
				got := mustBuild(t, b, o)
				for s := range got {
					if o[got[s]] != keys[want[s]] {
						t.Fatalf("slot %d: %s, want %s", s, o[got[s]], keys[want[s]])
					}
				}
			}
		})
	}
}

// TestDeterminism: rebuilding gives identical tables whether the Builder
// is fresh or reused after other sizes of key sets (no state leaks through
// the reused buffers), and whether out is supplied or allocated.
func TestDeterminism(t *testing.T) {
	keys := backendKeys(42, 10)
	want := mustBuild(t, NewBuilder(DefaultTableSize), keys)

	b := NewBuilder(DefaultTableSize)
	out := make([]int32, DefaultTableSize)
	for _, other := range [][]string{backendKeys(1, 1000), backendKeys(2, 1), keys, backendKeys(3, 50)} {
		mustBuild(t, b, other)
		got, err := b.Build(keys, out)
		if err != nil {
			t.Fatal(err)
		}
		if &got[0] != &out[0] {
			t.Fatal("Build did not fill the supplied out")
		}
		if !slices.Equal(got, want) {
			t.Fatalf("rebuild after %d-key table differs", len(other))
		}
	}
}

// TestGolden pins the hash and the table for a fixed input. Tables must
// be identical across processes, restarts, versions and architectures; if
// this fails the on-node format changed and every flow that relies on
// Maglev (rather than conntrack) would be reshuffled on upgrade.
func TestGolden(t *testing.T) {
	h1, h2 := keyHashes("198.18.1.2:8080")
	if h1 != 0x0cc658a869377922 || h2 != 0xfa84f395bb99a378 {
		t.Errorf("keyHashes = %#x, %#x", h1, h2)
	}

	keys := []string{"198.18.1.2:8080", "198.18.1.3:8080", "198.18.1.4:8080", "[2001:db8::1]:443", "backend-e"}
	tab := mustBuild(t, NewBuilder(DefaultTableSize), keys)
	for _, g := range []struct {
		slot int
		want int32
	}{{0, 4}, {1, 2}, {2, 1}, {100, 2}, {4096, 0}, {8190, 4}, {16380, 4}} {
		if tab[g.slot] != g.want {
			t.Errorf("slot %d = %d, want %d", g.slot, tab[g.slot], g.want)
		}
	}
	if got, want := tableDigest(keys, tab), uint64(goldenDigest); got != want {
		t.Errorf("table digest = %#x, want %#x", got, want)
	}

	small := mustBuild(t, NewBuilder(7), keys[:3])
	if want := []int32{0, 2, 1, 1, 2, 0, 0}; !slices.Equal(small, want) {
		t.Errorf("M=7 table = %v, want %v", small, want)
	}
}

const goldenDigest = 0x63571ad4f6fd8e03

// tableDigest hashes the slot -> key mapping.
func tableDigest(keys []string, tab []int32) uint64 {
	h := fnv.New64a()
	for _, i := range tab {
		h.Write([]byte(keys[i]))
		h.Write([]byte{0})
	}
	return h.Sum64()
}

// TestPaperExample reproduces Table 1 of the paper: M=7, three backends
// with the given (offset, skip), before and after B1 is removed.
func TestPaperExample(t *testing.T) {
	type be struct{ offset, skip uint32 }
	run := func(bes []be) []int32 {
		b := NewBuilder(7)
		b.order = b.order[:0]
		b.perms = b.perms[:0]
		for i, x := range bes {
			b.order = append(b.order, int32(i))
			w := walker{next: x.offset}
			for k := range w.skip {
				w.skip[k] = uint32(k+1) * x.skip % 7
			}
			b.perms = append(b.perms, w)
		}
		out := make([]int32, 7)
		b.populate(out)
		return out
	}
	b0, b1, b2 := be{3, 4}, be{0, 2}, be{3, 1}
	if got, want := run([]be{b0, b1, b2}), []int32{1, 0, 1, 0, 2, 2, 0}; !slices.Equal(got, want) {
		t.Errorf("before: %v, want %v", got, want)
	}
	// After removing B1 the remaining backends are B0 (index 0) and B2
	// (index 1 here; 2 in the paper).
	if got, want := run([]be{b0, b2}), []int32{0, 0, 0, 0, 1, 1, 1}; !slices.Equal(got, want) {
		t.Errorf("after: %v, want %v", got, want)
	}
}

// TestMatchesReference compares Build with the plain pseudocode over many
// sizes and key counts.
func TestMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	var primes []uint32
	for p := uint32(MinTableSize); p < 4000; p++ {
		if IsPrime(p) {
			primes = append(primes, p)
		}
	}
	cases := []struct {
		m uint32
		n int
	}{{7, 3}, {7, 7}, {DefaultTableSize, 3}, {DefaultTableSize, 10}, {DefaultTableSize, 100}}
	for range 60 {
		m := primes[rng.IntN(len(primes))]
		cases = append(cases, struct {
			m uint32
			n int
		}{m, 1 + rng.IntN(int(m))})
	}
	b := map[uint32]*Builder{}
	for _, tc := range cases {
		if b[tc.m] == nil {
			b[tc.m] = NewBuilder(tc.m)
		}
		keys := backendKeys(int(tc.m), tc.n)
		got := mustBuild(t, b[tc.m], keys)
		if want := referenceTable(tc.m, keys); !slices.Equal(got, want) {
			t.Errorf("M=%d N=%d: table differs from reference", tc.m, tc.n)
		}
	}
}

func TestBuildDoesNotAllocate(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation counting")
	}
	b := NewBuilder(DefaultTableSize)
	keys := backendKeys(0, 100)
	out := make([]int32, DefaultTableSize)
	mustBuild(t, b, keys) // size the scratch buffers
	if allocs := testing.AllocsPerRun(20, func() {
		if _, err := b.Build(keys, out); err != nil {
			t.Fatal(err)
		}
	}); allocs != 0 {
		t.Errorf("Build allocates %.1f times per call with a reused out", allocs)
	}
}

// FuzzBuild checks the contract for arbitrary key sets: every slot valid,
// balanced, and independent of key order.
func FuzzBuild(f *testing.F) {
	f.Add("a\nb\nc", uint8(0))
	f.Add("198.18.1.2:8080\n198.18.1.3:8080\n[::1]:80\n\n", uint8(3))
	f.Add("x", uint8(1))
	sizes := []uint32{7, 61, 1021, DefaultTableSize}
	f.Fuzz(func(t *testing.T, joined string, sz uint8) {
		m := sizes[int(sz)%len(sizes)]
		keys := slices.Compact(slices.Sorted(slices.Values(strings.Split(joined, "\n"))))
		if len(keys) > int(m) {
			keys = keys[:m]
		}
		b := NewBuilder(m)
		tab := mustBuild(t, b, keys)
		c := counts(tab, len(keys))
		if hi, lo := slices.Max(c), slices.Min(c); hi-lo > 1 || lo == 0 {
			t.Fatalf("counts in [%d,%d]", lo, hi)
		}
		rev := slices.Clone(keys)
		slices.Reverse(rev)
		tab2 := mustBuild(t, b, rev)
		for s := range tab {
			if keys[tab[s]] != rev[tab2[s]] {
				t.Fatalf("slot %d depends on key order", s)
			}
		}
	})
}
