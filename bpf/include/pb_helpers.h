/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Small inline helpers: checksums, hashing. */
#ifndef PB_HELPERS_H
#define PB_HELPERS_H

#include <linux/types.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#ifndef likely
#define likely(x) __builtin_expect(!!(x), 1)
#endif
#ifndef unlikely
#define unlikely(x) __builtin_expect(!!(x), 0)
#endif
/* One load, not cached in a register across a loop: for words another CPU
 * or the agent changes under us. */
#ifndef READ_ONCE
#define READ_ONCE(x) (*(volatile __typeof__(x) *)&(x))
#endif

/* be16_len reads a big-endian 16-bit length or offset as a bounded
 * host-order number. The verifiers of 6.1 and 6.12 forget a register's
 * bounds across a byte swap, so a bpf_ntohs result added to a packet
 * pointer is refused there ("unbounded min value", "out of bounds"); the
 * mask puts the bounds back, and the barrier keeps the compiler from
 * folding the mask away as redundant. */
static __always_inline __u32 be16_len(__be16 v)
{
	__u32 n = bpf_ntohs(v);
	barrier_var(n);
	return n & 0xffff;
}

/* ext_len is the extension headers' length pb_ipv6_l4 returned (at most
 * PB_IPV6_MAX_EXT_BYTES, checked by the caller) in a register whose bounds
 * every verifier keeps: 6.1's loses a bound checked on a 32-bit copy of
 * the value by the time the 64-bit one is added to a packet pointer. */
static __always_inline __u32 ext_len(__u32 ext)
{
	barrier_var(ext);
	return ext & 0x3ff; /* PB_IPV6_MAX_EXT_BYTES < 1024 */
}

static __always_inline __u16 csum_fold32(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* RFC 1624, eqn. 3: HC' = ~(~HC + ~m + m'). Ones' complement sums do not
 * care about byte order as long as old and new use the same one. */
static __always_inline void csum_replace2(__sum16 *sum, __be16 from, __be16 to)
{
	__u32 s = (__u16)~*sum;
	s += (__u16)~from;
	s += to;
	*sum = ~csum_fold32(s);
}

/* csum_delta4 is what replacing the 32-bit word from by to adds to a
 * checksum's inverse (~m + m' of eqn. 3, unfolded: at most 4 x 0xffff,
 * so a 32-bit sum holds thousands of them before its one fold). */
static __always_inline __u32 csum_delta4(__be32 from, __be32 to)
{
	return (~from & 0xffff) + (~from >> 16) + (to & 0xffff) + (to >> 16);
}

static __always_inline void csum_replace4(__sum16 *sum, __be32 from, __be32 to)
{
	__u32 s = (__u16)~*sum;
	s += csum_delta4(from, to);
	*sum = ~csum_fold32(s);
}

/* Bob Jenkins' lookup3 final mix, as in the kernel's jhash.h. */
static __always_inline __u32 rol32(__u32 w, unsigned int s)
{
	return (w << s) | (w >> ((-s) & 31));
}

#define __jhash_final(a, b, c)        \
	{                             \
		c ^= b;               \
		c -= rol32(b, 14);    \
		a ^= c;               \
		a -= rol32(c, 11);    \
		b ^= a;               \
		b -= rol32(a, 25);    \
		c ^= b;               \
		c -= rol32(b, 16);    \
		a ^= c;               \
		a -= rol32(c, 4);     \
		b ^= a;               \
		b -= rol32(a, 14);    \
		c ^= b;               \
		c -= rol32(b, 24);    \
	}

static __always_inline __u32 jhash_3words(__u32 a, __u32 b, __u32 c, __u32 initval)
{
	a += 0xdeadbeef + (3 << 2) + initval;
	b += 0xdeadbeef + (3 << 2) + initval;
	c += 0xdeadbeef + (3 << 2) + initval;
	__jhash_final(a, b, c);
	return c;
}

#endif
