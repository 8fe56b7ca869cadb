//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * penaltybox XDP datapath.
 *
 * The program reads as the packet's path:
 *   parse -> port prefilter -> service lookup (client -> VIP)
 *            -> conntrack or Maglev pick -> DNAT -> forward
 *         -> reverse conntrack (backend -> client) -> outcome events
 *            -> reverse NAT -> forward
 * Anything else returns XDP_PASS untouched.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "pb_consts.h"
#include "pb_structs.h"
#include "pb_maps.h"
#include "pb_helpers.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Ring buffer records are typed only by size, and the enums below are never
 * the type of a map value or global; keep them in BTF so bpf2go generates
 * their Go twins (the agent's decoders and constants come from those). */
const struct event *unused_event __attribute__((unused));
const enum pb_backend_state *unused_backend_state __attribute__((unused));
const enum pb_event_type *unused_event_type __attribute__((unused));
const enum pb_event_flag *unused_event_flag __attribute__((unused));
const enum pb_svc_flag *unused_svc_flag __attribute__((unused));
const enum pb_trip_kind *unused_trip_kind __attribute__((unused));
const enum pb_nf_why *unused_nf_why __attribute__((unused));

#define TCP_FIN 0x01
#define TCP_SYN 0x02
#define TCP_RST 0x04
#define TCP_ACK 0x10

#define IP_MF 0x2000
#define IP_OFFSET 0x1fff

#ifndef AF_INET
#define AF_INET 2
#endif

/* The IPv6 header (linux/ipv6.h would pull libc's headers in), with its
 * addresses as the maps' union addr. */
struct pb_ipv6hdr {
	__u8 vtc;       /* version, traffic class */
	__u8 flow[3];
	__be16 payload_len;
	__u8 nexthdr;
	__u8 hop_limit;
	union addr saddr;
	union addr daddr;
};

#define ETH_P_IPV6_BE bpf_htons(0x86DD)
#ifndef AF_INET6
#define AF_INET6 10
#endif

/* A parsed IPv4 or IPv6 TCP/UDP packet. Pointers are into the packet and
 * were bounds-checked by parse(); ip is set for IPv4, ip6 for IPv6. */
struct pkt {
	struct ethhdr *eth;
	struct iphdr *ip;
	struct pb_ipv6hdr *ip6;
	__be16 *ports;    /* [0] source, [1] destination */
	void *end;        /* the packet's end, for reads beyond what every path checked */
	__sum16 *l4csum;  /* TCP or UDP checksum field */
	__u32 payload;    /* L4 payload bytes */
	__u32 len;        /* IP total length (IPv6: header + payload) */
	__u32 l4len;      /* L4 header and payload */
	/* The family (PB_AF_INET or PB_AF_INET6) and protocol each in a word
	 * of its own: the verifier tracks a whole-word store exactly, so where
	 * they are read back from the stack it knows, path by path, which of
	 * ip and ip6 is set and how much of the L4 header parse checked (a
	 * byte stored beside others it would not). */
	__u64 family;
	__u64 proto;
	__u8 tcp_flags;
	__u8 partial;     /* L4 checksum left to the device (see l4csum_replace) */
	__u32 ifindex;    /* ingress interface */
};

/* The packet's source and destination as map addresses, into a zeroed
 * src and dst (an IPv4 address fills only their first word). */
static __always_inline void pkt_addrs(const struct pkt *p, union addr *src, union addr *dst)
{
	if (p->family == PB_AF_INET6) {
		*src = p->ip6->saddr;
		*dst = p->ip6->daddr;
		return;
	}
	src->v4 = p->ip->saddr;
	dst->v4 = p->ip->daddr;
}

static __always_inline struct global_stats *gstats(void)
{
	__u32 k = 0;
	return bpf_map_lookup_elem(&pb_stats_v2, &k);
}

/* scratch is this CPU's room for the largest temporaries. XDP runs to the
 * end on its CPU without another XDP program interleaving (softirq, or
 * BPF_PROG_RUN's live frames with bottom halves off), so one per CPU is
 * enough. */
_Static_assert(sizeof(((struct scratch *)0)->fib) == sizeof(struct bpf_fib_lookup), "scratch fib");

static __always_inline struct scratch *scratch(void)
{
	__u32 k = 0;
	return bpf_map_lookup_elem(&pb_scratch, &k);
}

static __always_inline struct config *config(void)
{
	__u32 k = 0;
	return bpf_map_lookup_elem(&pb_config_v2, &k);
}

/* partial_iface says whether a local sender on ifindex may leave its L4
 * checksum to the device (PB_IF_PARTIAL). */
static __always_inline int partial_iface(__u32 ifindex)
{
	struct iface *i = bpf_map_lookup_elem(&pb_ifaces, &ifindex);
	return i && (i->flags & PB_IF_PARTIAL);
}

/* pb_csum is the ones' complement sum, folded to 16 bits but not
 * inverted, of len bytes of the packet at off; -1 when len is 0 or over
 * PB_CSUM_MAX or the bytes are not all in the packet. A global function:
 * the verifier checks it once, not at each caller. */
__noinline int pb_csum(struct xdp_md *ctx, __u32 off, __u32 len)
{
	struct scratch *sc = scratch();
	if (!sc)
		return -1;
	/* Signed, behind a barrier: see keep_syn. */
	__s32 n = len;
	barrier_var(n);
	if (n <= 0 || n > PB_CSUM_MAX)
		return -1;
	if (bpf_xdp_load_bytes(ctx, off, sc->buf, n))
		return -1;
	/* bpf_csum_diff sums whole 32-bit words, at most 512 bytes a call:
	 * the bytes up to the next word are zeros (RFC 1071's padding). */
	sc->buf[n] = 0;
	sc->buf[n + 1] = 0;
	sc->buf[n + 2] = 0;
	__u32 words = ((__u32)n + 3) & ~3u;
	__s64 sum;
	if (words <= 512) {
		sum = bpf_csum_diff(0, 0, (__be32 *)sc->buf, words, 0);
	} else {
		sum = bpf_csum_diff(0, 0, (__be32 *)sc->buf, 512, 0);
		if (sum < 0)
			return -1;
		words -= 512;
		if (words > 512)
			return -1;
		sum = bpf_csum_diff(0, 0, (__be32 *)(sc->buf + 512), words, (__u32)sum);
	}
	if (sum < 0)
		return -1;
	return csum_fold32((__u32)sum);
}

#define TCPOPT_MD5SIG 19
#define TCPOPT_AO 29

/* pb_tcp_opts_rejected says whether the TCP options at off, len bytes,
 * hold a signature option (TCP-MD5, TCP-AO): a listener without the key
 * drops such a SYN without an answer. */
__noinline int pb_tcp_opts_rejected(struct xdp_md *ctx, __u32 off, __u32 len)
{
	struct scratch *sc = scratch();
	if (!sc)
		return 0;
	__s32 n = len;
	barrier_var(n);
	if (n <= 0 || n > PB_SYN_MAX_OPTS)
		return 0;
	if (bpf_xdp_load_bytes(ctx, off, sc->buf, n))
		return 0;
	__u32 pos = 0;
	for (int i = 0; i < PB_SYN_MAX_OPTS; i++) {
		if (pos >= (__u32)n)
			break;
		__u8 kind = sc->buf[pos & 63];
		if (kind == 0) /* end of options */
			break;
		if (kind == 1) { /* no-op */
			pos++;
			continue;
		}
		if (kind == TCPOPT_MD5SIG || kind == TCPOPT_AO)
			return 1;
		__u8 l = sc->buf[(pos + 1) & 63];
		if (l < 2)
			break;
		pos += l;
	}
	return 0;
}

/* pb_reverse_path_ok applies the strict reverse-path rule (rp_filter=1)
 * to the packet in ctx, an IPv4 (family PB_AF_INET) or IPv6 one: the node's
 * route back to its source leaves by the interface it arrived on, or by
 * that interface's master (a bridged pod is routed through the bridge). A
 * pod cannot pass it with another's address unless the two share a
 * segment. Where the lookup fails (no route, forwarding off) it fails. */
__noinline int pb_reverse_path_ok(struct xdp_md *ctx, __u32 family)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 ifindex = ctx->ingress_ifindex;
	struct scratch *sc = scratch();
	if (!sc)
		return 0;
	struct bpf_fib_lookup *fib = (void *)sc->fib;
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->ifindex = ifindex;
	if (family == PB_AF_INET6) {
		struct pb_ipv6hdr *ip6 = data + sizeof(struct ethhdr);
		if ((void *)(ip6 + 1) > data_end)
			return 0;
		fib->family = AF_INET6;
		__builtin_memcpy(fib->ipv6_src, &ip6->daddr, 16);
		__builtin_memcpy(fib->ipv6_dst, &ip6->saddr, 16);
	} else {
		struct iphdr *ip = data + sizeof(struct ethhdr);
		if ((void *)(ip + 1) > data_end)
			return 0;
		fib->family = AF_INET;
		fib->ipv4_src = ip->daddr;
		fib->ipv4_dst = ip->saddr;
	}
	long rc = bpf_fib_lookup(ctx, fib, sizeof(*fib), 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return 0;
	if (fib->ifindex == ifindex)
		return 1;
	struct iface *i = bpf_map_lookup_elem(&pb_ifaces, &ifindex);
	return i && i->master && i->master == fib->ifindex;
}

/* seq_after: a is later than b in sequence space (RFC 793's modular
 * compare). */
static __always_inline int seq_after(__u32 a, __u32 b)
{
	return (__s32)(a - b) > 0;
}

/* parse_l4 checks the TCP or UDP header at l4, whose segment is l4len
 * bytes long, and fills p's L4 fields. */
static __always_inline int parse_l4(struct pkt *p, void *l4, __u32 l4len, void *data_end)
{
	p->l4len = l4len;
	p->end = data_end;
	/* Constants stored on each branch: the protocol read back later is
	 * exact on every path (see struct pkt). */
	if (p->proto == IPPROTO_TCP) {
		p->proto = IPPROTO_TCP;
		struct tcphdr *tcp = l4;
		if ((void *)(tcp + 1) > data_end)
			return -1;
		__u32 doff = tcp->doff * 4;
		if (doff < sizeof(*tcp) || doff > l4len)
			return -1;
		p->ports = (__be16 *)tcp;
		p->l4csum = &tcp->check;
		p->payload = l4len - doff;
		p->tcp_flags = ((__u8 *)tcp)[13];
	} else {
		p->proto = IPPROTO_UDP;
		struct udphdr *udp = l4;
		if ((void *)(udp + 1) > data_end)
			return -1;
		__u32 ulen = be16_len(udp->len);
		if (ulen < sizeof(*udp) || ulen > l4len)
			return -1;
		p->ports = (__be16 *)udp;
		p->l4csum = &udp->check;
		p->payload = ulen - sizeof(*udp);
	}
	return 0;
}

/* IPv6 extension headers skipped on the way to TCP or UDP (RFC 8200 4.1
 * order); a fragment (44) passes, as IPv4 fragments do, and so does
 * anything else (ESP, AH, mobility, no next header). */
#define IPV6_HOPOPTS 0
#define IPV6_ROUTING 43
#define IPV6_FRAGMENT 44
#define IPV6_DSTOPTS 60
#ifndef IPPROTO_ICMPV6
#define IPPROTO_ICMPV6 58
#endif
#define PB_IPV6_MAX_EXT 4
#define PB_IPV6_MAX_EXT_BYTES 512 /* the headers skipped, in all */

/* pb_ipv6_l4 walks an IPv6 packet's extension headers (at most
 * PB_IPV6_MAX_EXT) and returns the L4 protocol and offset from the end of
 * the IPv6 header as (proto << 16 | offset), or -1 for a packet that is not
 * ours (a fragment, more headers than we skip, not TCP, UDP or ICMPv6). A global
 * function, so the verifier checks it once on its own and its callers see
 * one unknown offset: inlined, every number of headers skipped would be a
 * path of its own through the whole program after it. */
__noinline int pb_ipv6_l4(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct pb_ipv6hdr *ip6 = data + sizeof(struct ethhdr);
	if ((void *)(ip6 + 1) > data_end)
		return -1;
	__u8 nh = ip6->nexthdr;
	__u32 off = 0;
#pragma unroll
	for (int i = 0; i < PB_IPV6_MAX_EXT; i++) {
		if (nh != IPV6_HOPOPTS && nh != IPV6_ROUTING && nh != IPV6_DSTOPTS)
			break;
		__u8 *h = (void *)(ip6 + 1) + off;
		if ((void *)(h + 4) > data_end)
			return -1;
		/* A routing header with segments left: the destination is not
		 * the final one, and the L4 checksum is over that (RFC 8200
		 * 8.1): not ours to rewrite. */
		if (nh == IPV6_ROUTING && h[3] != 0)
			return -1;
		nh = h[0];
		off += ((__u32)h[1] + 1) * 8;
		if (off > PB_IPV6_MAX_EXT_BYTES)
			return -1;
	}
	if (nh != IPPROTO_TCP && nh != IPPROTO_UDP && nh != IPPROTO_ICMPV6)
		return -1;
	return (int)((__u32)nh << 16 | off);
}

/* parse6 is parse for IPv6: 0 for a well-formed TCP/UDP packet, 1 for
 * traffic that is not ours, -1 for one too short or inconsistent to
 * touch. */
static __always_inline int parse6(struct xdp_md *ctx, struct pkt *p, struct ethhdr *eth, void *data_end)
{
	struct pb_ipv6hdr *ip6 = (void *)(eth + 1);
	if ((void *)(ip6 + 1) > data_end)
		return 1;
	if ((ip6->vtc >> 4) != 6)
		return 1;
	int r = pb_ipv6_l4(ctx);
	if (r < 0)
		return 1;
	__u32 ext = r & 0xffff;
	if (ext > PB_IPV6_MAX_EXT_BYTES)
		return 1;
	ext = ext_len(ext);
	if ((r >> 16) == IPPROTO_ICMPV6)
		return 2; /* see icmp6_error */
	__u32 plen = be16_len(ip6->payload_len);
	p->family = PB_AF_INET6;
	/* A jumbogram (payload length 0) or a length past the frame: not ours
	 * to touch. */
	if (plen <= ext || (void *)(ip6 + 1) + plen > data_end)
		return -1;
	p->eth = eth;
	p->ip6 = ip6;
	p->len = sizeof(*ip6) + plen;
	p->proto = r >> 16;
	return parse_l4(p, (void *)(ip6 + 1) + ext, plen - ext, data_end);
}

/* parse validates everything the rest of the program relies on. Returns 0
 * for a well-formed IPv4 TCP/UDP packet, 2 for an IPv4 ICMP packet (see
 * icmp_error), 1 for other traffic that is simply not ours, -1 for a packet
 * too short or inconsistent to touch. */
static __always_inline int parse(struct xdp_md *ctx, struct pkt *p, const __u64 family)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end)
		return 1;
	if (family == PB_AF_INET6)
		return parse6(ctx, p, eth, data_end);
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return 1;

	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return 1;
	if (ip->version != 4 || ip->ihl < 5)
		return 1;
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP)
		return ip->protocol == IPPROTO_ICMP ? 2 : 1;
	/* Fragments carry no ports (or only the first does): not ours. */
	if (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET))
		return 1;

	__u32 ihl = ip->ihl * 4;
	__u32 len = be16_len(ip->tot_len);
	p->family = PB_AF_INET;
	if (len < ihl || (void *)ip + len > data_end)
		return -1;

	p->eth = eth;
	p->ip = ip;
	p->len = len;
	p->proto = ip->protocol;
	return parse_l4(p, (void *)ip + ihl, len - ihl, data_end);
}


/* The pseudo-header sum, folded but not inverted: what a sender that
 * leaves the checksum to the device (CHECKSUM_PARTIAL, the default for
 * local sockets on a veth) puts in the L4 checksum field. */
static __always_inline __u16 pseudo_sum(__be32 saddr, __be32 daddr, __u8 proto, __u32 l4len)
{
	__u32 s = (saddr & 0xffff) + (saddr >> 16) + (daddr & 0xffff) + (daddr >> 16);
	s += bpf_htons(proto) + bpf_htons((__u16)l4len);
	return csum_fold32(s);
}

/* pseudo_sum6 is pseudo_sum for IPv6 (RFC 8200 8.1). */
static __always_inline __u16 pseudo_sum6(const union addr *saddr, const union addr *daddr, __u8 proto,
					 __u32 l4len)
{
	__u32 s = 0;
#pragma unroll
	for (int i = 0; i < 4; i++) {
		s += (saddr->v6[i] & 0xffff) + (saddr->v6[i] >> 16);
		s += (daddr->v6[i] & 0xffff) + (daddr->v6[i] >> 16);
	}
	s += bpf_htons((__u16)l4len) + bpf_htons(proto);
	return csum_fold32(s);
}

/* The pseudo-header sum of p with its source (dst 0) or destination
 * replaced by addr, or as it is when addr is NULL. */
static __always_inline __u16 pkt_pseudo(const struct pkt *p, int dst, const union addr *addr)
{
	if (p->family == PB_AF_INET6) {
		const union addr *sa = &p->ip6->saddr, *da = &p->ip6->daddr;
		if (addr) {
			if (dst)
				da = addr;
			else
				sa = addr;
		}
		return pseudo_sum6(sa, da, p->proto, p->l4len);
	}
	__be32 sa = p->ip->saddr, da = p->ip->daddr;
	if (addr) {
		if (dst)
			da = addr->v4;
		else
			sa = addr->v4;
	}
	return pseudo_sum(sa, da, p->proto, p->l4len);
}

/* l4_csum_ok checks p's TCP or UDP checksum: 1 right, 0 wrong, -1 not
 * checked (a segment over PB_CSUM_MAX bytes). On an interface where local
 * senders leave the checksum to the device, the bare pseudo-header sum such
 * a partial checksum holds is taken as right: XDP cannot tell it from a
 * complete one that happens to hold the same value, but neither can the
 * receiver, which finishes or trusts it likewise. */
static __always_inline int l4_csum_ok(struct xdp_md *ctx, struct pkt *p)
{
	__u16 ps = pkt_pseudo(p, 0, 0);
	if (*p->l4csum == ps && partial_iface(p->ifindex))
		return 1;
	if (p->proto == IPPROTO_UDP && *p->l4csum == 0 && p->family == PB_AF_INET)
		return 1; /* no checksum */
	int sum = pb_csum(ctx, (void *)p->ports - (void *)(long)ctx->data, p->l4len);
	if (sum < 0)
		return p->l4len > PB_CSUM_MAX ? -1 : 0;
	return csum_fold32((__u32)sum + ps) == 0xffff;
}

/* syn_doomed says whether a client's SYN can never open a connection,
 * whatever its backend's health: the stack or the backend drops it without
 * an answer, and a timeout judged on it would be the client's doing, not
 * the backend's. A SYN|FIN (Linux drops it); a TTL or hop limit that
 * forwarding uses up; a bad IPv4 header or TCP checksum; a TCP-MD5 or
 * TCP-AO option (a listener without the key drops the SYN). A SYN too long
 * to check its checksum (data over PB_CSUM_MAX bytes) is not judged. */
static __always_inline int syn_doomed(struct xdp_md *ctx, struct pkt *p)
{
	if (p->tcp_flags & TCP_FIN)
		return 1;
	void *data = (void *)(long)ctx->data;
	if (p->family == PB_AF_INET6) {
		if (p->ip6->hop_limit <= 1)
			return 1;
	} else {
		if (p->ip->ttl <= 1)
			return 1;
		if (pb_csum(ctx, sizeof(struct ethhdr), p->ip->ihl * 4) != 0xffff)
			return 1;
	}
	if (l4_csum_ok(ctx, p) == 0)
		return 1;
	struct tcphdr *tcp = (void *)p->ports;
	__u32 opts = tcp->doff * 4 - sizeof(*tcp); /* parse: doff >= 5 */
	return opts && pb_tcp_opts_rejected(ctx, (void *)(tcp + 1) - data, opts);
}

/* l4csum_replace updates the TCP/UDP checksum for a new source (dst 0) or
 * destination address and port.
 * A packet from a local sender on a veth usually carries only the
 * pseudo-header sum (the checksum is finished by the device later); XDP
 * cannot see skb->ip_summed, so such a field is recognised by its value and
 * replaced by the new pseudo-header sum (ports are not in it: the device
 * sums them when it finishes). A complete checksum matches that value by
 * chance once in 65536 packets and is then corrupted; TCP's retransmission
 * differs (timestamps, ack) and gets through. */
static __always_inline void l4csum_replace(struct pkt *p, int dst, const union addr *new_addr,
					   __be16 old_port, __be16 new_port)
{
	/* A zero UDP checksum means "none" (IPv4); keep it that way. */
	if (p->proto == IPPROTO_UDP && *p->l4csum == 0)
		return;
	if (*p->l4csum == pkt_pseudo(p, dst, 0) && partial_iface(p->ifindex)) {
		p->partial = 1;
		*p->l4csum = pkt_pseudo(p, dst, new_addr);
		return;
	}
	if (p->family == PB_AF_INET6) {
		const union addr *old = dst ? &p->ip6->daddr : &p->ip6->saddr;
#pragma unroll
		for (int i = 0; i < 4; i++)
			csum_replace4(p->l4csum, old->v6[i], new_addr->v6[i]);
	} else {
		csum_replace4(p->l4csum, dst ? p->ip->daddr : p->ip->saddr, new_addr->v4);
	}
	csum_replace2(p->l4csum, old_port, new_port);
	if (p->proto == IPPROTO_UDP && *p->l4csum == 0)
		*p->l4csum = 0xffff;
}

/* rewrite sets the source (dst 0) or destination address and port. */
static __always_inline void rewrite(struct pkt *p, int dst, const union addr *addr, __be16 port)
{
	l4csum_replace(p, dst, addr, p->ports[dst ? 1 : 0], port);
	if (p->family == PB_AF_INET6) {
		if (dst)
			p->ip6->daddr = *addr;
		else
			p->ip6->saddr = *addr;
	} else {
		struct iphdr *ip = p->ip;
		__be32 *a = dst ? &ip->daddr : &ip->saddr;
		csum_replace4(&ip->check, *a, addr->v4);
		*a = addr->v4;
	}
	p->ports[dst ? 1 : 0] = port;
}

/* DNAT: destination becomes the backend. */
static __always_inline void rewrite_dst(struct pkt *p, const union addr *addr, __be16 port)
{
	rewrite(p, 1, addr, port);
}

/* Reverse NAT: the reply's source becomes the VIP again. */
static __always_inline void rewrite_src(struct pkt *p, const union addr *addr, __be16 port)
{
	rewrite(p, 0, addr, port);
}

/* forward sends a rewritten packet on. With redirect enabled and a FIB
 * route out of an interface the agent marked as able to receive
 * redirected frames, it leaves through bpf_redirect_map; otherwise the
 * kernel stack routes it (XDP_PASS), which always works. */
static __always_inline int forward(struct xdp_md *ctx, struct pkt *p, struct global_stats *gs)
{
	__u32 k = 0;
	struct config *cfg = bpf_map_lookup_elem(&pb_config_v2, &k);
	if (!cfg || !(cfg->flags & PB_CFG_REDIRECT))
		goto pass;

	/* The lookup's parameters in the scratch: the stack has no room. */
	struct scratch *sc = scratch();
	if (!sc)
		goto pass;
	struct bpf_fib_lookup *fib = (void *)sc->fib;
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->l4_protocol = p->proto;
	fib->tot_len = p->len;
	fib->ifindex = p->ifindex;
	if (p->family == PB_AF_INET6) {
		fib->family = AF_INET6;
		__builtin_memcpy(fib->ipv6_src, &p->ip6->saddr, 16);
		__builtin_memcpy(fib->ipv6_dst, &p->ip6->daddr, 16);
	} else {
		fib->family = AF_INET;
		fib->tos = p->ip->tos;
		fib->ipv4_src = p->ip->saddr;
		fib->ipv4_dst = p->ip->daddr;
	}

	if (bpf_fib_lookup(ctx, fib, sizeof(*fib), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		goto pass;
	if (!bpf_map_lookup_elem(&pb_redirect, &fib->ifindex))
		goto pass;
	/* A redirected frame loses the skb's note that its checksum is still to
	 * be finished; only the stack can carry a partial checksum on. */
	if (p->partial)
		goto pass;
	if (p->family == PB_AF_INET6) {
		if (p->ip6->hop_limit <= 1)
			goto pass; /* the stack sends the ICMPv6 time exceeded */
		p->ip6->hop_limit--;
	} else {
		struct iphdr *ip = p->ip;
		if (ip->ttl <= 1)
			goto pass; /* the stack sends the ICMP time-exceeded */
		__be16 old = *(__be16 *)&ip->ttl;
		ip->ttl--;
		csum_replace2(&ip->check, old, *(__be16 *)&ip->ttl);
	}
	__builtin_memcpy(p->eth->h_dest, fib->dmac, ETH_ALEN);
	__builtin_memcpy(p->eth->h_source, fib->smac, ETH_ALEN);
	if (gs)
		gs->redirected++;
	return bpf_redirect_map(&pb_redirect, fib->ifindex, XDP_PASS);
pass:
	if (gs)
		gs->passed_after_nat++;
	return XDP_PASS;
}

/* emit_at reports an outcome stamped at, a bpf_ktime_get_ns reading the
 * caller already has (a clock read is a few percent of a new flow), or,
 * with at 0, stamped once its record is reserved: the reader's caught-up
 * mark relies on a verdict being in the ring (reserved) by the time its
 * stamp has passed (see outcomes.Reader). */
static __always_inline void emit_at(__u8 type, __u8 flags, __u32 svc_id, __u32 backend_id,
				    const union addr *client, __u8 family, __be16 client_port,
				    struct global_stats *gs, __u64 at)
{
	struct event *e = bpf_ringbuf_reserve(&pb_events, sizeof(*e), 0);
	if (!e) {
		if (gs)
			gs->events_lost++;
		return;
	}
	/* Ring buffer memory is not zeroed: write every byte. */
	__builtin_memset(e, 0, sizeof(*e));
	e->ts_ns = at ? at : bpf_ktime_get_ns();
	e->svc_id = svc_id;
	e->backend_id = backend_id;
	e->client = *client;
	e->family = family;
	e->client_port = client_port;
	e->type = type;
	e->flags = flags;
	/* Waking the reader costs a self-interrupt per event (the bulk of a
	 * new flow's cost in a VM). Only failures, which may eject an endpoint
	 * and so must be seen at once, wake it, and they must force it: the
	 * kernel's default wakes the reader only when it has read everything
	 * before, which the unannounced events make false. The rest wait for
	 * the next failure or the reader's periodic poll (milliseconds). */
	__u64 wake = (type == PB_EV_REFUSED || type == PB_EV_RESET || type == PB_EV_SYN_RETRANS)
			     ? BPF_RB_FORCE_WAKEUP
			     : BPF_RB_NO_WAKEUP;
	bpf_ringbuf_submit(e, wake);
}

static __always_inline void emit(__u8 type, __u8 flags, __u32 svc_id, __u32 backend_id,
				 const union addr *client, __u8 family, __be16 client_port,
				 struct global_stats *gs)
{
	emit_at(type, flags, svc_id, backend_id, client, family, client_port, gs, 0);
}

struct pick {
	__u32 id;
	struct backend *be;
	__u8 probe;
};

/* table_key is the pb_maglev key of a service's live table. */
static __always_inline __u32 table_key(const struct svc_value *svc)
{
	return svc->id * 2 + (svc->table & 1);
}

/* table_lookup reads slot of the table at key in outer and returns its
 * backend, if that backend is a live one of service svc_id: a stale table
 * (a fallback, a table being replaced) can hold a cleared id or one since
 * given to another service. */
static __always_inline struct backend *table_lookup(void *outer, __u32 key, __u32 slot, __u32 *id,
						    __u32 svc_id)
{
	void *tbl = bpf_map_lookup_elem(outer, &key);
	if (!tbl)
		return 0;
	__u32 *idp = bpf_map_lookup_elem(tbl, &slot);
	if (!idp || *idp == 0)
		return 0;
	*id = *idp;
	struct backend *be = bpf_map_lookup_elem(&pb_backends, id);
	if (!be || !be->family || be->svc_id != svc_id)
		return 0;
	return be;
}

/* take_slot counts one more flow in c unless it is at limit (0: none). */
static __always_inline int take_slot(struct inflight *c, __u32 limit)
{
	if (!c)
		return 0;
	__s64 old = __sync_fetch_and_add(&c->count, 1);
	if (limit && old >= limit) {
		__sync_fetch_and_add(&c->count, -1);
		return -1;
	}
	return 0;
}

/* scan walks a service's list of active backends (pb_svc_backends) from
 * a hashed start for one that is active, is neither skip nor avoid, and,
 * when take is set, has room under limit (a slot is then taken on it). */
struct scan {
	__u32 svc_id;
	__u32 start;
	__u32 n;
	__u32 limit;
	__u32 skip;
	__u32 avoid;
	__u32 take;
	__u32 found;
};

static long scan_backend(__u32 i, struct scan *sc)
{
	if (!sc->n)
		return 1;
	struct svc_backend_key k = {.svc_id = sc->svc_id, .idx = (sc->start + i) % sc->n};
	__u32 *idp = bpf_map_lookup_elem(&pb_svc_backends, &k);
	if (!idp || *idp == sc->skip || *idp == sc->avoid)
		return 0;
	__u32 id = *idp;
	struct backend *be = bpf_map_lookup_elem(&pb_backends, &id);
	if (!be || !be->family || be->svc_id != sc->svc_id || be->state != PB_BE_ACTIVE)
		return 0;
	if (sc->take && take_slot(bpf_map_lookup_elem(&pb_be_inflight, &id), sc->limit))
		return 0;
	sc->found = id;
	return 1;
}

static __always_inline __u32 scan_count(struct svc_value *svc)
{
	__u32 n = svc->backend_count;
	return n > PB_MAX_SCAN ? PB_MAX_SCAN : n;
}

#define PB_STEER_TRIES 3

/* pick_backend chooses the backend for a new flow: the Maglev slot's
 * backend if it is active, or if it is in probation and a grant is left
 * (the flow becomes the probe). Otherwise the flow is steered: first to the
 * same slot of the service's table without probation backends, then to a
 * few rehashed slots, then to the first active backend of the service's
 * list. avoid (0: none) is never picked while another active backend
 * exists: the backend a retried flow leaves. Only when nothing else is
 * found is the flow sent to the slot's backend anyway. */
static __always_inline int pick_backend(struct svc_value *svc, __u32 hash, __u32 seed, int may_probe,
					__u32 avoid, struct pick *out, struct global_stats *gs)
{
	__u32 size = svc->table_size;
	if (size == 0)
		return -1;
	__u32 slot = hash % size;
	__u32 id = 0;
	struct backend *be = table_lookup(&pb_maglev, table_key(svc), slot, &id, svc->id);
	if (!be)
		return -1;

	out->id = id;
	out->be = be;
	out->probe = 0;
	if (likely(be->state == PB_BE_ACTIVE && id != avoid))
		return 0;
	/* Steering counts moves off backends that are not active; a retry
	 * leaving an active one is counted as a retry. */
	int off = be->state != PB_BE_ACTIVE;

	if (be->state == PB_BE_PROBATION && may_probe && id != avoid && be->probe_grants > 0 &&
	    __sync_fetch_and_add(&be->probe_grants, -1) > 0) {
		out->probe = 1;
		if (gs)
			gs->probe_admitted++;
		return 0;
	}

	__u32 alt_id = 0;
	struct backend *alt = table_lookup(&pb_maglev_fb, svc->id, slot, &alt_id, svc->id);
	if (alt && alt->state == PB_BE_ACTIVE && alt_id != avoid)
		goto steered;

#pragma unroll
	for (__u32 i = 1; i <= PB_STEER_TRIES; i++) {
		alt = table_lookup(&pb_maglev, table_key(svc), jhash_3words(hash, i, 0, seed) % size,
				   &alt_id, svc->id);
		if (alt && alt->state == PB_BE_ACTIVE && alt_id != avoid)
			goto steered;
	}
	__u32 n = scan_count(svc);
	struct scan sc = {.svc_id = svc->id, .start = hash, .n = n, .avoid = avoid};
	if (n && bpf_loop(n, scan_backend, &sc, 0) > 0 && sc.found) {
		alt_id = sc.found;
		alt = bpf_map_lookup_elem(&pb_backends, &alt_id);
		if (alt)
			goto steered;
	}
	/* Nothing else is active: a retry goes back to the backend it left
	 * rather than to a slot's backend that is not active (in probation
	 * with its grant spent, or ejected). */
	if (avoid && off) {
		alt_id = avoid;
		alt = bpf_map_lookup_elem(&pb_backends, &alt_id);
		if (alt && alt->family && alt->svc_id == svc->id && alt->state == PB_BE_ACTIVE)
			goto steered;
	}
	if (gs && off)
		gs->steer_failed++;
	return 0;
steered:
	out->id = alt_id;
	out->be = alt;
	if (gs && off)
		gs->steered++;
	return 0;
}

/* addr_eq compares two map addresses (all 16 bytes: an IPv4 one's rest is
 * zero in both). */
static __always_inline int addr_eq(const union addr *a, const union addr *b)
{
	return a->v6[0] == b->v6[0] && a->v6[1] == b->v6[1] && a->v6[2] == b->v6[2] && a->v6[3] == b->v6[3];
}

/* addr_fold is an address in one word: IPv4's own, IPv6's four XORed. */
static __always_inline __u32 addr_fold(const union addr *a, __u8 family)
{
	if (family == PB_AF_INET6)
		return a->v6[0] ^ a->v6[1] ^ a->v6[2] ^ a->v6[3];
	return a->v4;
}

static __always_inline void rev_key(struct ct_key *rk, const struct ct_key *fk,
				    const struct ct_value *fv)
{
	rk->src = fv->nat_addr;
	rk->dst = fk->src;
	rk->sport = fv->nat_port;
	rk->dport = fk->sport;
	rk->proto = fk->proto;
	rk->dir = PB_DIR_REV;
	rk->family = fk->family;
	rk->pad = 0;
}

static __always_inline void inflight_add(void *map, __u32 id, __s64 d)
{
	struct inflight *c = bpf_map_lookup_elem(map, &id);
	if (c)
		__sync_fetch_and_add(&c->count, d);
}

/* release gives back a counted flow's circuit-breaker slot. Whoever
 * deletes the pb_flows entry releases it (the datapath on FIN or RST, the
 * agent on expiry), so it happens exactly once. */
static __always_inline void release(const struct ct_key *fk)
{
	/* Programs have no lookup-and-delete for hashes. Between the lookup
	 * and the delete, another releaser of the same flow would have to
	 * delete it and a new flow on the same tuple be counted for this to
	 * release the wrong ids: nanoseconds apart, on one tuple. */
	struct flow_value *fl = bpf_map_lookup_elem(&pb_flows, fk);
	if (!fl)
		return;
	__u32 svc = fl->svc_id, be = fl->backend_id;
	if (bpf_map_delete_elem(&pb_flows, fk))
		return;
	inflight_add(&pb_svc_inflight, svc, -1);
	inflight_add(&pb_be_inflight, be, -1);
}

/* backend_slot takes a slot on the picked backend or, when it is at its
 * per-endpoint limit, on the first active backend of the service with
 * room (a scan of the service's backend list from a hashed start, so the
 * overflow spreads). Returns -1 when every backend is full. */
static __always_inline int backend_slot(struct svc_value *svc, __u32 hash, __u32 avoid,
					struct pick *pk)
{
	__u32 limit = svc->max_inflight_per_backend;
	if (!take_slot(bpf_map_lookup_elem(&pb_be_inflight, &pk->id), limit))
		return 0;
	if (pk->probe) {
		/* The probe cannot go to its backend: the grant is not spent. */
		__sync_fetch_and_add(&pk->be->probe_grants, 1);
		pk->probe = 0;
	}
	__u32 n = scan_count(svc);
	struct scan sc = {.svc_id = svc->id, .start = hash, .n = n, .limit = limit, .skip = pk->id,
			  .avoid = avoid, .take = 1};
	if (!n || bpf_loop(n, scan_backend, &sc, 0) <= 0 || !sc.found)
		return -1;
	__u32 id = sc.found;
	struct backend *be = bpf_map_lookup_elem(&pb_backends, &id);
	if (!be) {
		inflight_add(&pb_be_inflight, id, -1);
		return -1;
	}
	pk->id = id;
	pk->be = be;
	pk->probe = 0;
	return 0;
}

#define PB_NO_BACKEND -1
#define PB_OVER_LIMIT -2

static __always_inline void count_refused(struct svc_value *svc, int over_limit)
{
	struct svc_stats *ss = bpf_map_lookup_elem(&pb_svc_stats, &svc->id);
	if (!ss)
		return;
	if (over_limit)
		ss->over_limit++;
	else
		ss->no_backend++;
}

/* new_flow picks a backend and writes both conntrack entries. A SYN or a
 * first UDP packet is a real new flow (event, counters, circuit breaker,
 * may be a probe); a mid-stream TCP packet without state (conntrack entry
 * lost) only gets a backend. old_rev, when set, is the reverse entry of
 * the backend the flow leaves, avoid a backend not to pick again, ct_flags
 * flags the flow starts with. Returns 0, PB_NO_BACKEND or PB_OVER_LIMIT. */
static __always_inline int new_flow(struct pkt *p, struct svc_value *svc, struct ct_key *fk,
				    int midstream, __u8 ev_flags, struct ct_key *old_rev, int keep_old,
				    __u32 avoid, __u32 ct_flags, struct ct_value *fv,
				    struct global_stats *gs)
{
	/* A flow moving off its backend gives its slot back first. */
	if (old_rev)
		release(fk);

	/* Circuit breaker: one more flow, unless the service is full. Services
	 * without limits pay nothing here. */
	int limited = !midstream && (svc->max_inflight || svc->max_inflight_per_backend);
	if (limited && take_slot(bpf_map_lookup_elem(&pb_svc_inflight, &svc->id), svc->max_inflight)) {
		if (gs)
			gs->inflight_rejected++;
		count_refused(svc, 1);
		return PB_OVER_LIMIT;
	}

	/* The hash's seed is the cluster's secret (pb_config_v2): a client
	 * that knows the tables cannot pick its backend by its source port. */
	struct config *cfg = config();
	__u32 seed = PB_HASH_SEED ^ (cfg ? cfg->hash_seed : 0);
	__u32 hash = jhash_3words(addr_fold(&fk->src, fk->family), addr_fold(&fk->dst, fk->family),
				  ((__u32)fk->sport << 16) | fk->dport, seed ^ fk->proto);
	struct pick pk = {};
	/* A retried client has been refused once: it is not our experiment. */
	int may_probe = !midstream && !(ct_flags & PB_CT_RETRY);
	if (pick_backend(svc, hash, seed, may_probe, avoid, &pk, gs) < 0) {
		if (limited)
			inflight_add(&pb_svc_inflight, svc->id, -1);
		if (gs)
			gs->no_backend++;
		count_refused(svc, 0);
		return PB_NO_BACKEND;
	}

	__u64 now = bpf_ktime_get_ns();
	__u32 flags = ct_flags;
	if (limited) {
		if (backend_slot(svc, hash, avoid, &pk)) {
			inflight_add(&pb_svc_inflight, svc->id, -1);
			if (gs)
				gs->inflight_rejected++;
			count_refused(svc, 1);
			return PB_OVER_LIMIT;
		}
		struct flow_value fl = {.svc_id = svc->id, .backend_id = pk.id, .created_ns = now};
		if (bpf_map_update_elem(&pb_flows, fk, &fl, BPF_NOEXIST) == 0) {
			flags |= PB_CT_COUNTED;
		} else {
			/* No room to remember it: admit it uncounted, and say so. */
			inflight_add(&pb_svc_inflight, svc->id, -1);
			inflight_add(&pb_be_inflight, pk.id, -1);
			if (gs)
				gs->inflight_untracked++;
		}
	}

	if (pk.probe)
		flags |= PB_CT_PROBE;
	if (svc->flags & PB_SVC_F_RETRY_REFUSED)
		flags |= PB_CT_RETRYABLE;
	if (svc->flags & PB_SVC_F_QUIET_DATA)
		flags |= PB_CT_QUIET_DATA;
	if (svc->flags & PB_SVC_F_QUIET_END)
		flags |= PB_CT_QUIET_END;
	if (midstream)
		flags |= PB_CT_MIDSTREAM | PB_CT_ESTABLISHED;

	__builtin_memset(fv, 0, sizeof(*fv));
	fv->nat_addr = pk.be->addr;
	fv->nat_port = pk.be->port;
	fv->flags = flags;
	fv->svc_id = svc->id;
	fv->backend_id = pk.id;
	fv->created_ns = now;
	fv->last_seen_ns = bpf_ktime_get_coarse_ns();
	/* The ISN the backend's answers must acknowledge (see handle_reply). */
	struct tcphdr *syn = (void *)p->ports;
	if (p->proto == IPPROTO_TCP && !midstream && (void *)(syn + 1) <= p->end)
		fv->client_isn = bpf_ntohl(syn->seq);

	/* The reverse entry is built in the per-CPU scratch: the stack
	 * (512 bytes for the whole inlined program) has no room for it. */
	struct scratch *sc = scratch();
	if (!sc)
		return PB_NO_BACKEND;
	struct ct_key *rk = &sc->rk;
	struct ct_value *rv = &sc->rv;
	rev_key(rk, fk, fv);
	*rv = *fv;
	rv->nat_addr = fk->dst;
	rv->nat_port = fk->dport;

	if (old_rev && keep_old) {
		/* The backend left it unanswered, may still answer: its entry
		 * stays, marked, so a late SYN-ACK is reported (it answered, late:
		 * no timeout) and kept from the client. The slot went with the
		 * flow. */
		struct ct_value *o = bpf_map_lookup_elem(&pb_ct_v2, old_rev);
		if (o) {
			__sync_fetch_and_and(&o->flags, ~PB_CT_COUNTED);
			__sync_fetch_and_or(&o->flags, PB_CT_MOVED);
		}
	} else if (old_rev) {
		bpf_map_delete_elem(&pb_ct_v2, old_rev);
	}
	if (bpf_map_update_elem(&pb_ct_v2, fk, fv, BPF_ANY) ||
	    bpf_map_update_elem(&pb_ct_v2, rk, rv, BPF_ANY)) {
		if (gs)
			gs->ct_create_failed++;
	}

	if (!midstream) {
		if (pk.probe)
			ev_flags |= PB_EVF_PROBE;
		/* Stamped with the flow's start: the time the agent times the
		 * handshake from is the one conntrack holds. */
		emit_at(PB_EV_NEW_FLOW, ev_flags, svc->id, pk.id, &fk->src, fk->family, fk->sport, gs, now);
		struct svc_stats *ss = bpf_map_lookup_elem(&pb_svc_stats, &svc->id);
		if (ss)
			ss->flows++;
		struct be_stats *bs = bpf_map_lookup_elem(&pb_be_stats, &pk.id);
		if (bs)
			bs->flows++;
	}
	return 0;
}

/* A kernel trip: the datapath ejects a backend itself at its service's
 * max_failures-th consecutive counted failure, so the next new flow that
 * would pick it is steered elsewhere without waiting for the agent. The
 * agent adopts the trip (penalty, probation, metrics) or undoes it. Only
 * an active backend trips (a probe's failure is the agent's to judge),
 * and only while the budget the agent leaves under maxEjectionPercent
 * lasts. Returns PB_EVF_TRIPPED when this failure tripped. */
static __always_inline int take_budget(struct svc_trip *st)
{
	/* Never below zero, even for a moment: a unit is taken only while one
	 * is there (the agent's stores of the budget race with this). */
#pragma unroll
	for (int i = 0; i < 4; i++) {
		__s64 b = READ_ONCE(st->budget);
		if (b <= 0)
			return -1;
		if (__sync_val_compare_and_swap(&st->budget, b, b - 1) == b)
			return 0;
	}
	return -1;
}

static __always_inline __u8 kernel_trip(__u32 svc_id, __u32 bid, __u32 kind, __u64 created_ns)
{
	struct svc_trip *st = bpf_map_lookup_elem(&pb_svc_trip, &svc_id);
	if (!st || !st->max_failures || !(st->kinds & kind))
		return 0;
	/* A reset of a flow the agent has judged a success already (it
	 * outlived the connect timeout) is no failure to it: nor to us. */
	if (kind != PB_TRIP_REFUSED && bpf_ktime_get_ns() - created_ns > st->settle_ns)
		return 0;
	struct be_trip *bt = bpf_map_lookup_elem(&pb_be_trip, &bid);
	if (!bt)
		return 0;
	__u32 n = __sync_fetch_and_add(&bt->failures, 1) + 1;
	if (n < st->max_failures)
		return 0;
	struct backend *be = bpf_map_lookup_elem(&pb_backends, &bid);
	if (!be || be->state != PB_BE_ACTIVE)
		return 0;
	if (take_budget(st)) {
		__sync_fetch_and_add(&st->suppressed, 1);
		return 0;
	}
	/* Two failures racing on two CPUs may both get here: the state write
	 * is idempotent, both count as trips (the agent adopts one). */
	be->state = PB_BE_EJECTED;
	bt->tripped_ns = bpf_ktime_get_ns();
	__sync_fetch_and_add(&st->trips, 1);
	return PB_EVF_TRIPPED;
}

/* streak_over ends a backend's streak of failures at a success, as the
 * agent's tracker decides one. */
static __always_inline void streak_over(__u32 bid)
{
	struct be_trip *bt = bpf_map_lookup_elem(&pb_be_trip, &bid);
	if (bt && bt->failures)
		bt->failures = 0;
}

/* close_flow marks the flow closed once, gives back its circuit-breaker
 * slot and reports its end. fk is the flow's full forward key. */
static __always_inline void close_flow(struct ct_value *rv, __u8 ev_flags,
				       const struct ct_key *fk, struct global_stats *gs)
{
	__u32 old = __sync_fetch_and_or(&rv->flags, PB_CT_CLOSED);
	if (old & PB_CT_CLOSED)
		return;
	if (old & PB_CT_COUNTED)
		release(fk);
	/* A void end (PB_EVF_VOID) is no verdict, and the agent must hear of
	 * it, or its deadline would judge the flow. */
	if (ev_flags & PB_EVF_VOID)
		goto report;
	/* A clean end of an established flow is a success for every settle
	 * rule (a client's RST is the client's doing, not the backend's). */
	if ((old & PB_CT_ESTABLISHED) && !(old & PB_CT_MIDSTREAM))
		streak_over(rv->backend_id);
	/* A flow the agent has judged already needs no end: success came with
	 * the SYN-ACK, or with the first data when the service waits for it. */
	if ((old & PB_CT_QUIET_END) && (old & PB_CT_ESTABLISHED) &&
	    (old & (PB_CT_QUIET_DATA | PB_CT_BACKEND_DATA)))
		return;
report:
	emit(PB_EV_FLOW_END, ev_flags, rv->svc_id, rv->backend_id, &fk->src, fk->family, fk->sport, gs);
}

/* trust_source records that addr's flow carried payload from a backend:
 * proof that the address is real and answers (see pb_src_trust). Refreshed
 * at most once a second, in place: an LRU update allocates. */
static __always_inline void trust_source(const union addr *addr, __u8 family)
{
	struct src_key k = {};
	k.addr = *addr;
	k.family = family;
	__u64 now = bpf_ktime_get_coarse_ns();
	__u64 *seen = bpf_map_lookup_elem(&pb_src_trust, &k);
	if (seen) {
		if (now - *seen > 1000000000ULL)
			*seen = now;
		return;
	}
	bpf_map_update_elem(&pb_src_trust, &k, &now, BPF_NOEXIST);
}

/* syn_guard_drops says whether the SYN for flow fk is to be dropped (it
 * runs before conntrack is read: a dropped SYN costs no bucket walk):
 * the guard is on (a flood: the agent's lease, or this CPU armed it), its
 * source has no recent proof of a real connection, and this CPU's budget
 * for such SYNs is spent. The budget is a GCRA: one SYN per interval_ns,
 * up to burst_ns ahead. */
static __always_inline int syn_guard_drops(const struct ct_key *fk)
{
	__u32 zero = 0;
	struct syn_guard *g = bpf_map_lookup_elem(&pb_syn_guard, &zero);
	if (!g || !g->interval_ns)
		return 0;
	struct syn_guard_cpu *c = bpf_map_lookup_elem(&pb_syn_guard_cpu, &zero);
	if (!c)
		return 0;
	__u64 now = bpf_ktime_get_coarse_ns();
	/* Arming: every SYN to a service counts, dropped ones too, so the
	 * guard stays armed while the flood lasts. Past arm_syns in a window
	 * the CPU is busy, and only then is each SYN's source looked up with
	 * the guard off: it arms once a quarter of arm_syns more come from
	 * untrusted sources, so a busy node's known clients do not arm it, and
	 * a quiet one pays no lookup. */
	if (now - c->window_ns >= PB_SYN_WINDOW_NS) {
		c->window_ns = now;
		c->window_syns = 0;
		c->window_untrusted = 0;
	}
	c->window_syns++;
	int on = now < g->until_ns || now < c->armed_until_ns;
	int busy = g->arm_syns && c->window_syns > g->arm_syns;
	if (!on && !busy)
		return 0;
	struct src_key k = {};
	k.addr = fk->src;
	k.family = fk->family;
	__u64 *seen = bpf_map_lookup_elem(&pb_src_trust, &k);
	int trusted = seen && now - *seen < g->trust_ns;
	if (busy && !trusted && ++c->window_untrusted > g->arm_syns / 4) {
		if (now >= c->armed_until_ns)
			c->armed++;
		c->armed_until_ns = now + PB_SYN_ARM_HOLD_NS;
		on = 1;
	}
	if (!on)
		return 0;
	if (trusted) {
		c->trusted++;
		return 0;
	}
	__u64 tat = c->tat_ns;
	if (tat < now)
		tat = now;
	if (tat - now > g->burst_ns) {
		c->dropped++;
		return 1;
	}
	c->tat_ns = tat + g->interval_ns;
	c->admitted++;
	return 0;
}

/* handed_over says whether new flows go to kube-proxy instead: the agent
 * is uninstalling (PB_CFG_DRAIN), or its heartbeat is older than the
 * dead-man's bound (it crashed, hangs or was removed without a clean-up):
 * the maps it last wrote no longer follow the endpoints. Flows already
 * here finish where they are. */
static __always_inline int handed_over(void)
{
	struct config *cfg = config();
	if (!cfg)
		return 0;
	if (cfg->flags & PB_CFG_DRAIN)
		return 1;
	/* Signed: the coarse clock lags the agent's reading by up to a tick,
	 * so a fresh heartbeat can be a little ahead of it. */
	return cfg->dead_man_ns && cfg->heartbeat_ns &&
	       (__s64)(bpf_ktime_get_coarse_ns() - cfg->heartbeat_ns) > (__s64)cfg->dead_man_ns;
}

/* The kernel's conntrack (nf_conntrack) through its kfuncs (Linux 6.0),
 * weak: a kernel without them (no nf_conntrack, no BTF) loads the program
 * all the same, and nf_forget does nothing there. Only the fields the
 * kfuncs check are declared: nf_conn is never read.
 *
 * pb_nf_kfuncs is set by the loader (pkg/datapath) when the kernel has
 * them. A constant, so where it is 0 the verifier never reaches the calls
 * (a missing weak kfunc's call is invalid); testing the kfunc's address
 * instead (bpf_ksym_exists) is refused before Linux 6.3. */
const volatile __u32 pb_nf_kfuncs = 0;

struct nf_conn {};
struct bpf_ct_opts {
	__s32 netns_id;
	__s32 error;
	__u8 l4proto;
	__u8 dir;
	__u8 reserved[2];
};
extern struct nf_conn *bpf_xdp_ct_lookup(struct xdp_md *xdp_ctx, struct bpf_sock_tuple *bpf_tuple, __u32 tuple__sz,
					  struct bpf_ct_opts *opts, __u32 opts__sz) __ksym __weak;
extern void bpf_ct_release(struct nf_conn *nfct) __ksym __weak;
extern int bpf_ct_change_timeout(struct nf_conn *nfct, __u32 timeout) __ksym __weak;

/* nf_forget expires the kernel's conntrack entry holding the tuple in
 * the scratch's nf_tuple (tuple_len bytes of it), in either of the entry's
 * directions, so that a new connection on it starts clean. The kernel sees
 * both paths a service's flows can take, in the forms it sees them:
 * kube-proxy's as client -> VIP (DNATed by its rules), the datapath's as
 * client -> backend (the DNAT done here) and, for the replies rewritten
 * here, VIP -> client. When a client's port comes back within the minutes
 * such an entry lingers (TIME_WAIT, or unacknowledged) and the new
 * connection takes the other path, the old entry claims its packets: the
 * reply tuple of a datapath flow is kube-proxy's finished flow's, so the
 * kernel moves the flow's source port and its replies pass here
 * unrecognised; a kube-proxy SYN matches the replies of a datapath flow
 * and escapes kube-proxy's DNAT. Either way the connection fails. The
 * datapath calls this only where the two paths meet (a service lately
 * kube-proxy's, new flows handed to kube-proxy), for a flow's first packet
 * (a TCP SYN, whose tuple no live connection of the client can hold; a UDP
 * datagram with no flow here). */
static __always_inline void nf_forget(struct xdp_md *ctx, struct scratch *sc, __u32 tuple_len, __u8 proto, __u32 why)
{
	struct bpf_ct_opts *o = (void *)sc->nf_opts;
	__builtin_memset(o, 0, sizeof(*o));
	o->netns_id = -1; /* the interface's namespace */
	o->l4proto = proto;
	struct nf_conn *ct = bpf_xdp_ct_lookup(ctx, (void *)sc->nf_tuple, tuple_len, o, sizeof(*o));
	if (!ct)
		return;
	/* Expired now: the kernel drops it as soon as a lookup meets it. */
	int err = bpf_ct_change_timeout(ct, 0);
	bpf_ct_release(ct);
	__u64 *n = bpf_map_lookup_elem(&pb_nf_stats, &why);
	if (!err && n)
		(*n)++;
}

/* nf_can_forget: p opens a flow (a TCP SYN; for UDP, the datapath calls
 * this only for a datagram with no flow here) and the kernel has the
 * conntrack kfuncs. */
static __always_inline int nf_can_forget(const struct pkt *p)
{
	return pb_nf_kfuncs && (p->proto == IPPROTO_UDP ||
				(p->proto == IPPROTO_TCP && (p->tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST)) == TCP_SYN));
}

/* nf_forget_pkt: nf_forget for SYN p's own tuple, client -> VIP. Going
 * to kube-proxy (handed over), a reply of a finished flow of ours, VIP ->
 * client, holds it as its reply tuple. Coming to us (taken over),
 * kube-proxy's finished flow from the same client port holds it as its
 * original tuple, whichever backend kube-proxy picked: the replies of the
 * new flow, rewritten to come from the VIP, would be that tuple's replies
 * and the kernel would move their source port. One lookup finds either
 * entry: the kernel keeps a tuple in one entry only. */
static __always_inline void nf_forget_pkt(struct xdp_md *ctx, struct pkt *p, __u32 why)
{
	struct scratch *sc = scratch();
	if (!sc || !nf_can_forget(p))
		return;
	struct bpf_sock_tuple *t = (void *)sc->nf_tuple;
	if (p->family == PB_AF_INET6) {
		__builtin_memcpy(t->ipv6.saddr, &p->ip6->saddr, 16);
		__builtin_memcpy(t->ipv6.daddr, &p->ip6->daddr, 16);
		t->ipv6.sport = p->ports[0];
		t->ipv6.dport = p->ports[1];
		nf_forget(ctx, sc, sizeof(t->ipv6), p->proto, why);
		return;
	}
	t->ipv4.saddr = p->ip->saddr;
	t->ipv4.daddr = p->ip->daddr;
	t->ipv4.sport = p->ports[0];
	t->ipv4.dport = p->ports[1];
	nf_forget(ctx, sc, sizeof(t->ipv4), p->proto, why);
}

/* client_rst_ok says whether a client's RST resets the backend's end of
 * flow rv, so the flow may end and give its breaker slot back: RFC 5961 3.2
 * resets only on the sequence number the backend expects next, its last
 * acknowledgment (before it answered, the client's ISN plus one); any
 * other RST in the window earns a challenge ACK, which a client whose
 * socket is gone answers with the exact RST, and one outside is dropped. A
 * flow picked up midstream before the backend acknowledged anything is
 * taken at its word, as before: nothing is known of its sequence. */
static __always_inline int client_rst_ok(const struct ct_value *rv, __u32 seq)
{
	__u32 cur = rv->flags;
	if (cur & PB_CT_ACK_SEEN)
		return seq == rv->backend_ack;
	if (cur & PB_CT_MIDSTREAM)
		return 1;
	return seq == rv->client_isn + 1;
}

/* client_control handles SYN, FIN and RST from the client on a known flow.
 * Returns 0 to forward with *fv, or new_flow's refusal. */
static __always_inline int client_control(struct pkt *p, struct svc_value *svc,
					  struct ct_key *fk, struct ct_value *fv, __u32 move_off,
					  struct global_stats *gs)
{
	struct ct_key rk = {};
	rev_key(&rk, fk, fv);
	struct ct_value *rv = bpf_map_lookup_elem(&pb_ct_v2, &rk);
	__u8 f = p->tcp_flags;
	struct tcphdr *tcp = (void *)p->ports;
	if ((void *)(tcp + 1) > p->end)
		return 0;
	__u32 seq = bpf_ntohl(tcp->seq);

	if (f & TCP_RST) {
		if (rv) {
			if (!client_rst_ok(rv, seq)) {
				/* Forwarded: the backend decides, and the flow
				 * keeps its slot while it lives. */
				if (gs)
					gs->client_rst_ignored++;
				return 0;
			}
			close_flow(rv, PB_EVF_CLIENT, fk, gs);
		} else if (fv->flags & PB_CT_COUNTED) {
			release(fk); /* reverse half evicted: nobody else will */
		}
		return 0;
	}
	if (f & TCP_FIN) {
		if (rv) {
			__u32 old = __sync_fetch_and_or(&rv->flags, PB_CT_FIN_FWD);
			if ((old & PB_CT_FIN_REV) && !(old & PB_CT_CLOSED))
				close_flow(rv, PB_EVF_CLIENT, fk, gs);
		}
		return 0;
	}
	if ((f & (TCP_SYN | TCP_ACK)) != TCP_SYN)
		return 0;

	/* A SYN on a known tuple. One new_flow call below serves every case
	 * that starts the flow again (each inlined copy costs the verifier
	 * and the program size). */
	__u8 evf = 0;
	__u32 avoid = 0, ct_flags = 0;
	int retry = 0, moved = 0;
	/* A new flow on the tuple (its reverse entry lost, or the flow over)
	 * is kube-proxy's while the datapath hands new flows over, or the
	 * service is kube-proxy's again. */
	if ((!rv || (rv->flags & PB_CT_CLOSED)) && (handed_over() || (svc->flags & PB_SVC_F_HANDED_BACK))) {
		if (gs)
			gs->handed_over++;
		/* The old flow's entries go: the replies of kube-proxy's flow on
		 * the tuple must not be rewritten as the old flow's. */
		if (!rv && (fv->flags & PB_CT_COUNTED))
			release(fk);
		bpf_map_delete_elem(&pb_ct_v2, &rk);
		bpf_map_delete_elem(&pb_ct_v2, fk);
		return PB_HANDED_OVER;
	}
	if (!rv)
		goto again; /* reverse entry lost: a new flow */
	__u32 cur = rv->flags;
	if (cur & PB_CT_CLOSED) {
		/* A reused tuple after the flow ended is a new flow. If its
		 * backend refused it and the refusal was kept from the client,
		 * this is the client's retransmission: one more try, elsewhere. */
		if ((cur & (PB_CT_RESCUED | PB_CT_RETRY)) == PB_CT_RESCUED) {
			evf = PB_EVF_REPICK;
			avoid = fv->backend_id;
			ct_flags = PB_CT_RETRY;
			retry = !(cur & PB_CT_PROBE);
		}
		goto again;
	}
	if (cur & PB_CT_ESTABLISHED)
		return 0;

	/* The agent's replay of a SYN its backend has left unanswered past
	 * the service's replay deadline: move the flow now (once), without
	 * waiting for the client's retransmission. Not a retransmission seen
	 * by the kernel, so no SYN_RETRANS: the agent's connect deadline
	 * judges the silent backend (a late SYN-ACK from it still counts as
	 * its answer: see PB_CT_MOVED). Only where another backend can take
	 * it; otherwise the replay is dropped and the flow waits on. */
	if (move_off) {
		if (move_off != fv->backend_id || (cur & PB_CT_RETRY) || svc->backend_count < 2 ||
		    svc->max_inflight || svc->max_inflight_per_backend)
			return PB_REPLAY_STAYS;
		if (gs)
			gs->repicked++;
		evf = PB_EVF_REPICK;
		avoid = move_off;
		ct_flags = PB_CT_RETRY;
		moved = 1;
		goto again;
	}

	/* ...otherwise the client sends its SYN again. Its retransmission (the
	 * same ISN, at least syn_retrans_min_ns after the first) says the
	 * backend has not answered within the client's retransmission timeout.
	 * An earlier copy is a duplicate (the network's or a client's own), and
	 * a SYN with another ISN another attempt on the tuple, which the
	 * backend answers with a challenge ACK: both go on to the backend and
	 * decide nothing. */
	struct config *cfg = config();
	__u64 min_age = cfg && cfg->syn_retrans_min_ns ? cfg->syn_retrans_min_ns : PB_SYN_RETRANS_MIN_NS;
	if (seq != fv->client_isn || bpf_ktime_get_ns() - fv->created_ns < min_age) {
		if (gs)
			gs->syn_duplicate++;
		return 0;
	}
	/* The backend has not answered: report it once. */
	__u32 old = __sync_fetch_and_or(&rv->flags, PB_CT_TIMEOUT_SEEN);
	if (!(old & PB_CT_TIMEOUT_SEEN))
		emit(PB_EV_SYN_RETRANS, (old & PB_CT_PROBE) ? PB_EVF_PROBE : 0, fv->svc_id,
		     fv->backend_id, &fk->src, fk->family, fk->sport, gs);

	/* The backend never answered, so moving the flow is safe. Do it when the
	 * agent has taken the backend out: the client's retry then succeeds
	 * instead of timing out. A flow that is already a retry stays one. */
	__u32 bid = fv->backend_id;
	struct backend *be = bpf_map_lookup_elem(&pb_backends, &bid);
	if (!be || (be->state != PB_BE_EJECTED && be->state != PB_BE_REMOVED))
		return 0;
	if (gs)
		gs->repicked++;
	evf = PB_EVF_REPICK;
	avoid = bid;
	ct_flags = cur & PB_CT_RETRY;
again:;
	int rc = new_flow(p, svc, fk, 0, evf, rv ? &rk : 0, moved, avoid, ct_flags, fv, gs);
	if (rc == 0 && retry && gs)
		gs->retried++;
	if (moved && (rc < 0 || fv->backend_id == move_off))
		return PB_REPLAY_STAYS; /* nowhere else after all: the replay goes nowhere */
	return rc;
}

static __always_inline __u16 sum16(const __u16 *w, int n, __u32 s)
{
#pragma unroll
	for (int i = 0; i < n; i++)
		s += w[i];
	return csum_fold32(s);
}

/* reject answers a new TCP flow the circuit breaker turned away with a RST
 * from the VIP, so the client fails at once instead of timing out; UDP is
 * dropped. The SYN becomes the RST in place: addresses and ports swapped,
 * seq 0, ack = its seq + 1 + payload (RFC 9293 3.10.7.1), no options. It
 * goes back out the ingress interface when that interface can take
 * redirected frames (it is in pb_redirect), else the stack routes it back
 * (XDP_PASS). */
static __always_inline int reject(struct xdp_md *ctx, struct pkt *p, struct global_stats *gs)
{
	if (p->proto != IPPROTO_TCP || !(p->tcp_flags & TCP_SYN))
		return XDP_DROP;
	int v6 = p->family == PB_AF_INET6;
	/* Rebuilt in place only without IP options or extension headers. */
	if (v6 ? (void *)p->ports != (void *)(p->ip6 + 1) : p->ip->ihl != 5)
		return XDP_DROP;
	struct tcphdr *tcp = (void *)p->ports;
	/* Opaque to the compiler: knowing it equals ip6 + 1 (above), it would
	 * read through that pointer, whose range the check below never sets. */
	barrier_var(tcp);
	if ((void *)(tcp + 1) > p->end)
		return XDP_DROP;
	/* SEG.SEQ + SEG.LEN: the SYN and the payload (a SYN|FIN never gets
	 * here: syn_doomed passes it on). */
	__u32 ack = bpf_ntohl(tcp->seq) + 1 + p->payload;

	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	int want = sizeof(struct ethhdr) + (v6 ? sizeof(struct pb_ipv6hdr) : sizeof(struct iphdr)) +
		   sizeof(struct tcphdr);
	int delta = want - (int)(data_end - data);
	if (delta < 0 && bpf_xdp_adjust_tail(ctx, delta))
		return XDP_DROP;

	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	__u32 ps;
	if (v6) {
		struct pb_ipv6hdr *ip6 = (void *)(eth + 1);
		tcp = (void *)(ip6 + 1);
		if ((void *)(tcp + 1) > data_end)
			return XDP_DROP;
		ps = bpf_htons(IPPROTO_TCP) + bpf_htons(sizeof(*tcp));
#pragma unroll
		for (int i = 0; i < 4; i++) {
			__be32 w = ip6->saddr.v6[i];
			ip6->saddr.v6[i] = ip6->daddr.v6[i];
			ip6->daddr.v6[i] = w;
			ps += (w & 0xffff) + (w >> 16) + (ip6->saddr.v6[i] & 0xffff) + (ip6->saddr.v6[i] >> 16);
		}
		ip6->vtc = 0x60;
		ip6->flow[0] = ip6->flow[1] = ip6->flow[2] = 0;
		ip6->payload_len = bpf_htons(sizeof(struct tcphdr));
		ip6->nexthdr = IPPROTO_TCP;
		ip6->hop_limit = 64;
	} else {
		struct iphdr *ip = (void *)(eth + 1);
		tcp = (void *)(ip + 1);
		if ((void *)(tcp + 1) > data_end)
			return XDP_DROP;
		__be32 a = ip->saddr;
		ip->saddr = ip->daddr;
		ip->daddr = a;
		ip->tot_len = bpf_htons(sizeof(struct iphdr) + sizeof(struct tcphdr));
		ip->id = 0;
		ip->frag_off = 0;
		ip->ttl = 64;
		ip->tos = 0;
		ip->check = 0;
		ip->check = ~sum16((__u16 *)ip, sizeof(*ip) / 2, 0);
		ps = (ip->saddr & 0xffff) + (ip->saddr >> 16) + (ip->daddr & 0xffff) + (ip->daddr >> 16) +
		     bpf_htons(IPPROTO_TCP) + bpf_htons(sizeof(*tcp));
	}

	__be16 port = tcp->source;
	tcp->source = tcp->dest;
	tcp->dest = port;
	tcp->seq = 0;
	tcp->ack_seq = bpf_htonl(ack);
	((__u8 *)tcp)[12] = 5 << 4;            /* data offset: no options */
	((__u8 *)tcp)[13] = TCP_RST | TCP_ACK;
	tcp->window = 0;
	tcp->urg_ptr = 0;
	tcp->check = 0;
	tcp->check = ~sum16((__u16 *)tcp, sizeof(*tcp) / 2, ps);

	__u32 ifindex = p->ifindex;
	if (bpf_map_lookup_elem(&pb_redirect, &ifindex)) {
		unsigned char mac[ETH_ALEN];
		__builtin_memcpy(mac, eth->h_source, ETH_ALEN);
		__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
		__builtin_memcpy(eth->h_dest, mac, ETH_ALEN);
		if (gs)
			gs->reject_rst_tx++;
		/* Back out the way it came, like XDP_TX, but through the devmap:
		 * a veth kicks its peer's NAPI for redirected frames, while an
		 * XDP_TX frame to a peer without an XDP program (GRO only) waits
		 * in the ring until other traffic arrives. */
		return bpf_redirect_map(&pb_redirect, ifindex, XDP_DROP);
	}
	/* The frame still looks addressed to this host: the stack forwards
	 * the RST back out to the client. */
	if (gs)
		gs->reject_rst_pass++;
	return XDP_PASS;
}

/* to_backend DNATs a client packet to its flow's backend, counts it and
 * sends it on. */
static __always_inline int to_backend(struct xdp_md *ctx, struct pkt *p, const union addr *addr,
				      __be16 port, __u32 svc_id, __u32 backend_id, struct global_stats *gs)
{
	rewrite_dst(p, addr, port);
	struct svc_stats *ss = bpf_map_lookup_elem(&pb_svc_stats, &svc_id);
	if (ss) {
		ss->packets++;
		ss->bytes += p->len;
	}
	struct be_stats *bs = bpf_map_lookup_elem(&pb_be_stats, &backend_id);
	if (bs) {
		bs->packets++;
		bs->bytes += p->len;
	}
	return forward(ctx, p, gs);
}

/* established handles the common case: a packet of a known flow that
 * carries no SYN, FIN or RST. One conntrack lookup, no service lookup. */
static __always_inline int established(struct xdp_md *ctx, struct pkt *p, struct ct_key *fk,
				       struct ct_value *ct, struct global_stats *gs)
{
	/* The client completed the handshake: an established flow for the
	 * reaper's timeouts (a SYN-ACK alone does not make one). */
	if (unlikely(!(ct->flags & PB_CT_CLIENT_ACKED)))
		__sync_fetch_and_or(&ct->flags, PB_CT_CLIENT_ACKED);
	__u64 now = bpf_ktime_get_coarse_ns();
	/* Refresh at most once a second: keeps the line clean. Then also make
	 * sure the reverse half is there: the LRU may have evicted it, and
	 * without it replies are not reverse-NATed and the flow's end is
	 * never seen. Built in the scratch: the stack has no room for it. */
	if (now - ct->last_seen_ns > 1000000000ULL) {
		ct->last_seen_ns = now;
		struct scratch *sc = scratch();
		if (sc) {
			rev_key(&sc->rk, fk, ct);
			if (!bpf_map_lookup_elem(&pb_ct_v2, &sc->rk)) {
				struct ct_value *rv = &sc->rv;
				*rv = *ct;
				rv->nat_addr = fk->dst;
				rv->nat_port = fk->dport;
				rv->flags = (ct->flags & (PB_CT_COUNTED | PB_CT_PROBE)) | PB_CT_ESTABLISHED |
					    PB_CT_MIDSTREAM;
				rv->last_seen_ns = now;
				rv->reply_ifindex = 0;
				bpf_map_update_elem(&pb_ct_v2, &sc->rk, rv, BPF_NOEXIST);
			}
		}
	}
	return to_backend(ctx, p, &ct->nat_addr, ct->nat_port, ct->svc_id, ct->backend_id, gs);
}

static __always_inline __u32 syn_slot(const union addr *client, __u8 family, __be16 port)
{
	return ((bpf_ntohl(addr_fold(client, family)) * PB_VIP_SLOT_MUL) ^
		((__u32)bpf_ntohs(port) * PB_SYN_PORT_MUL)) >>
	       (32 - PB_SYN_SLOT_BITS);
}

/* keep_syn copies a client's SYN into pb_syns_v2, untouched (before NAT), so
 * that the agent can replay it to another backend the moment this one
 * refuses it: the client's connect then succeeds in one more round trip
 * instead of waiting for its own retransmission. */
static __always_inline void keep_syn(struct xdp_md *ctx, struct pkt *p)
{
	struct tcphdr *tcp = (void *)p->ports;
	void *data_end = (void *)(long)ctx->data_end;
	if ((void *)(tcp + 1) > data_end)
		return;
	union addr client = {}, vip = {};
	pkt_addrs(p, &client, &vip);
	__u32 k = syn_slot(&client, p->family, p->ports[0]);
	struct syn_copy *c = bpf_map_lookup_elem(&pb_syns_v2, &k);
	if (!c)
		return;
	__u32 opt_len = tcp->doff * 4 - sizeof(*tcp); /* parse: doff >= 5 */
	if (opt_len > PB_SYN_MAX_OPTS)
		return;
	__u32 off = (void *)(tcp + 1) - (void *)(long)ctx->data;
	if (opt_len) {
		/* Bounded on both sides in the register the helper gets, with
		 * signed compares: older verifiers learn nothing from "!= 0",
		 * clang turns an unsigned "n < 1" into "n == 0", which 6.1's
		 * verifier does not take as a lower bound, and a zero size is
		 * refused there. */
		__s32 n = opt_len;
		barrier_var(n);
		if (n <= 0 || n > PB_SYN_MAX_OPTS)
			return;
		if (bpf_xdp_load_bytes(ctx, off, c->opts, n))
			return;
	}
	c->client = client;
	c->vip = vip;
	c->family = p->family;
	c->client_port = p->ports[0];
	c->vip_port = p->ports[1];
	c->ifindex = p->ifindex;
	__builtin_memcpy(c->eth, p->eth, sizeof(c->eth));
	c->seq = tcp->seq;
	c->window = tcp->window;
	c->ttl = p->family == PB_AF_INET6 ? p->ip6->hop_limit : p->ip->ttl;
	c->opt_len = opt_len;
}

/* syn_kept says whether pb_syns_v2 holds the very SYN that the RST in p
 * answers (its flow's, with the sequence number the RST acknowledges):
 * only then may the agent replay it. */
static __always_inline int syn_kept(struct pkt *p, const struct ct_key *fk)
{
	struct tcphdr *tcp = (void *)p->ports;
	if (!(p->tcp_flags & TCP_ACK) || (void *)(tcp + 1) > p->end)
		return 0;
	__u32 k = syn_slot(&fk->src, fk->family, fk->sport);
	struct syn_copy *c = bpf_map_lookup_elem(&pb_syns_v2, &k);
	return c && c->family == fk->family && addr_eq(&c->client, &fk->src) && c->client_port == fk->sport &&
	       addr_eq(&c->vip, &fk->dst) && c->vip_port == fk->dport &&
	       bpf_ntohl(c->seq) + 1 == bpf_ntohl(tcp->ack_seq);
}

/* replay_meta is the agent's replay metadata (struct replay_meta), or
 * NULL for a frame that arrived on an interface (no metadata). */
static __always_inline struct replay_meta *replay_meta(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	struct replay_meta *m = (void *)(long)ctx->data_meta;
	if ((void *)(m + 1) > data || m->magic != PB_REPLAY_MAGIC)
		return 0;
	return m;
}

/* replay_move_off is the backend an agent's replay moves the flow off,
 * or 0. */
static __always_inline __u32 replay_move_off(struct xdp_md *ctx)
{
	struct replay_meta *m = replay_meta(ctx);
	return m ? m->backend_id : 0;
}

/* handle_forward handles a client packet to a service that is not the
 * plain established case: a new flow, or SYN, FIN or RST on a known one
 * (ct, when not NULL). */
static __always_inline int handle_forward(struct xdp_md *ctx, struct pkt *p, struct svc_value *svcp,
				     struct ct_key *fk, struct ct_value *ct)
{
	struct global_stats *gs = gstats();
	__u32 move_off = replay_move_off(ctx);
	struct scratch *sc = scratch();
	if (!sc)
		return XDP_PASS;
	/* A copy: the agent flips tables by rewriting this value. */
	struct svc_value *svc = &sc->svc;
	*svc = *svcp;
	struct ct_value *fv = &sc->fv;
	int rc;
	/* A SYN the backend could not accept is not its to answer: it passes
	 * as it came (the stack or the backend drops it), and no flow or
	 * verdict starts on it. The agent's replays are rebuilt whole. */
	if (p->proto == IPPROTO_TCP && (p->tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST)) == TCP_SYN &&
	    !replay_meta(ctx) && syn_doomed(ctx, p)) {
		if (gs)
			gs->syn_doomed++;
		return XDP_PASS;
	}
	if (ct) {
		*fv = *ct;
		rc = client_control(p, svc, fk, fv, move_off, gs);
	} else if (handed_over() || (svc->flags & PB_SVC_F_HANDED_BACK)) {
		/* The agent is away (or the install is going), or the service
		 * is kube-proxy's again: a datapath that cannot be told of
		 * endpoint changes takes no new flow. */
		if (gs)
			gs->handed_over++;
		nf_forget_pkt(ctx, p, PB_NF_HANDED_OVER);
		return XDP_PASS;
	} else if ((svc->flags & PB_SVC_F_TAKEN_OVER) && p->proto == IPPROTO_TCP &&
		   !(p->tcp_flags & TCP_SYN)) {
		/* A flow kube-proxy began before the service was ours. */
		if (gs)
			gs->kube_proxy_midstream++;
		return XDP_PASS;
	} else {
		int syn = p->proto == IPPROTO_UDP ||
			  (p->tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST)) == TCP_SYN;
		if (p->proto == IPPROTO_TCP && (p->tcp_flags & TCP_RST))
			return XDP_PASS; /* RST for a flow we never saw: nothing to reset */
		rc = new_flow(p, svc, fk, !syn, 0, 0, 0, 0, 0, fv, gs);
	}
	if (rc == PB_REPLAY_STAYS)
		return XDP_DROP;
	if (rc == PB_HANDED_OVER) {
		nf_forget_pkt(ctx, p, PB_NF_HANDED_OVER);
		return XDP_PASS;
	}
	if (rc == PB_OVER_LIMIT)
		return reject(ctx, p, gs);
	if (rc < 0)
		return XDP_DROP; /* no backend: a VIP has nowhere else to go */
	/* Kept only once it goes to a backend: a SYN dropped (the guard's,
	 * or with nowhere to go) must not take another flow's slot. */
	if ((svc->flags & PB_SVC_F_RETRY_REFUSED) && p->proto == IPPROTO_TCP &&
	    (p->tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN)) == TCP_SYN)
		keep_syn(ctx, p);
	/* Lately kube-proxy's: the kernel may still hold one of its finished
	 * flows from this client port (see nf_forget). */
	if ((svc->flags & PB_SVC_F_TAKEN_OVER) && (!ct || p->proto == IPPROTO_TCP))
		nf_forget_pkt(ctx, p, PB_NF_TAKEN_OVER);
	return to_backend(ctx, p, &fv->nat_addr, fv->nat_port, fv->svc_id, fv->backend_id, gs);
}

/* rst_is_backends says whether a backend's RST on a flow (flags cur, the
 * RST's flags f, sequence and acknowledgment numbers) is the backend's own
 * failure rather than its answer to a client's mistake:
 * - before the SYN-ACK, a refusal acknowledges the client's SYN (ACK of
 *   ISN+1), as the client's stack requires of it;
 * - after it, a reset of a connection the client completed right: either
 *   RST|ACK (a socket's abort: the application's reset, or its close with
 *   data unread), or the listener's bare RST of the client's right
 *   handshake ACK, whose sequence is the ACK's, the backend's ISN+1 (a
 *   full accept queue with tcp_abort_on_overflow). A wrong handshake ACK
 *   earns a bare RST with the wrong number (RFC 9293 3.10.7.3), which
 *   decides nothing about the backend. */
static __always_inline int rst_is_backends(__u32 cur, __u8 f, __u32 seq, __u32 ack, const struct ct_value *rv)
{
	if (!(cur & PB_CT_ESTABLISHED))
		return (f & TCP_ACK) && ack == rv->client_isn + 1;
	return (f & TCP_ACK) || (!(cur & PB_CT_BACKEND_DATA) && seq == rv->backend_isn + 1);
}

/* reply_side_ok says whether a reply of flow rv arrived where the node
 * routes its backend (pb_reverse_path_ok), unless the check is off: what
 * arrives from elsewhere carries another sender's claim, not the
 * backend's. The interface that passed is kept in the flow, so the route
 * is looked up once per flow, not per packet. */
static __always_inline int reply_side_ok(struct xdp_md *ctx, __u32 ifindex, __u32 family, struct ct_value *rv)
{
	if (rv->reply_ifindex == ifindex)
		return 1;
	struct config *cfg = config();
	if (cfg && (cfg->flags & PB_CFG_RPF) && !pb_reverse_path_ok(ctx, family))
		return 0;
	rv->reply_ifindex = ifindex;
	return 1;
}

/* handle_reply reverse-NATs a backend's reply and turns its TCP flags into
 * outcome events. Returns -1 when the packet belongs to no flow of ours, or
 * comes from where no reply of the flow can (it passes unchanged).
 *
 * Evidence no client can forge: a reply decides something only if the
 * backend alone could have sent it, about a connection the client conducted
 * right. It must arrive on the backend's side of the node (reply_side_ok);
 * a RST or SYN-ACK must carry a right checksum (a receiver drops it
 * otherwise); a SYN-ACK and a refusal must acknowledge the client's SYN
 * (ISN + 1), and a reset after the SYN-ACK counts only if it is not the
 * backend's answer to a client's wrong handshake ACK (rst_is_backends).
 * What fails is forwarded as it is, and decides nothing. */
static __always_inline int handle_reply(struct xdp_md *ctx, struct pkt *p,
					struct global_stats *gs)
{
	/* Keys in the scratch: the stack has no room for them. */
	struct scratch *sc = scratch();
	if (!sc)
		return -1;
	struct ct_key *rk = &sc->rk;
	__builtin_memset(rk, 0, sizeof(*rk));
	pkt_addrs(p, &rk->src, &rk->dst);
	rk->sport = p->ports[0];
	rk->dport = p->ports[1];
	rk->proto = p->proto;
	rk->dir = PB_DIR_REV;
	rk->family = p->family;

	struct ct_value *rv = bpf_map_lookup_elem(&pb_ct_v2, rk);
	if (!rv)
		return -1;
	if (!reply_side_ok(ctx, p->ifindex, p->family, rv)) {
		if (gs)
			gs->reply_wrong_side++;
		return -1;
	}

	if (p->proto == IPPROTO_TCP) {
		__u8 f = p->tcp_flags;
		struct tcphdr *tcp = (void *)p->ports;
		if ((void *)(tcp + 1) > p->end)
			return -1;
		__u32 seq = bpf_ntohl(tcp->seq), ack = bpf_ntohl(tcp->ack_seq);
		int synack = (f & (TCP_SYN | TCP_ACK)) == (TCP_SYN | TCP_ACK);
		if ((f & TCP_RST) || synack) {
			if (l4_csum_ok(ctx, p) != 1) {
				if (gs)
					gs->reply_bad_checksum++;
				goto nat;
			}
		}
		/* The backend's acknowledgment: what a client's RST must carry
		 * (client_rst_ok). */
		if ((f & TCP_ACK) && (!(rv->flags & PB_CT_ACK_SEEN) || seq_after(ack, rv->backend_ack))) {
			rv->backend_ack = ack;
			if (!(rv->flags & PB_CT_ACK_SEEN))
				__sync_fetch_and_or(&rv->flags, PB_CT_ACK_SEEN);
		}
		/* A SYN-ACK that does not acknowledge the client's SYN is not
		 * its answer: the client's stack refuses it too. */
		if (synack && !(rv->flags & PB_CT_ESTABLISHED) && !(rv->flags & PB_CT_MIDSTREAM) &&
		    ack != rv->client_isn + 1) {
			if (gs)
				gs->reply_unacked++;
			goto nat;
		}
		if (rv->flags & PB_CT_MOVED) {
			/* The backend the flow was moved off answers after all:
			 * that is its answer to the agent (late, not a timeout); the
			 * client has its connection with another backend, so nothing
			 * goes on. */
			if (synack) {
				__u32 old = __sync_fetch_and_or(&rv->flags, PB_CT_ESTABLISHED);
				if (!(old & PB_CT_ESTABLISHED))
					emit(PB_EV_ESTABLISHED, 0, rv->svc_id, rv->backend_id, &rk->dst, rk->family, rk->dport, gs);
			}
			return XDP_DROP;
		}
		/* The forward key, as the client sent it. */
		struct ct_key *fkp = &sc->fk;
		__builtin_memset(fkp, 0, sizeof(*fkp));
		fkp->src = rk->dst;
		fkp->dst = rv->nat_addr;
		fkp->sport = rk->dport;
		fkp->dport = rv->nat_port;
		fkp->proto = rk->proto;
		fkp->dir = PB_DIR_FWD;
		fkp->family = rk->family;

		if (f & TCP_RST) {
			__u32 cur = rv->flags;
			if (!(cur & PB_CT_MIDSTREAM) && !rst_is_backends(cur, f, seq, ack, rv)) {
				if (gs)
					gs->reply_unacked++;
				/* After the SYN-ACK, the backend answered the client's
				 * wrong ACK: the flow ends without a verdict. Before it,
				 * the RST is not about the client's SYN, which the
				 * backend still holds. */
				if (cur & PB_CT_ESTABLISHED)
					close_flow(rv, PB_EVF_VOID, fkp, gs);
				goto nat;
			}
			/* A refused probe is our experiment on a real client: it
			 * failed, the client need not. With retryRefused any
			 * refused flow gets the same. The RST is kept from the
			 * client, whose SYN retransmission (~1s) is sent to
			 * another backend (client_control); once per flow. The
			 * bits this decides on never change after the flow began
			 * (ESTABLISHED is checked again below), so the decision
			 * goes in with CLOSED, in one atomic update. */
			__u32 set = PB_CT_CLOSED;
			if ((cur & (PB_CT_PROBE | PB_CT_RETRYABLE)) &&
			    !(cur & (PB_CT_ESTABLISHED | PB_CT_MIDSTREAM | PB_CT_RETRY)))
				set |= PB_CT_RESCUED;
			__u32 old = __sync_fetch_and_or(&rv->flags, set);
			if (old & PB_CT_CLOSED) {
				/* A second RST of a rescued flow (answering a
				 * retransmitted SYN) is kept from the client too. */
				if (old & PB_CT_RESCUED)
					return XDP_DROP;
				/* Closed by someone else (the client's RST): this
				 * RST rescues nothing, and the mark it just added
				 * would make the tuple's next SYN a retry. */
				if (set & PB_CT_RESCUED)
					__sync_fetch_and_and(&rv->flags, ~PB_CT_RESCUED);
			} else {
				int rescue = 0;
				if (old & PB_CT_COUNTED)
					release(fkp);
				__u8 evf = (old & PB_CT_PROBE) ? PB_EVF_PROBE : 0;
				if (old & PB_CT_MIDSTREAM) {
					/* picked up without its handshake: not an outcome */
				} else if (!(old & PB_CT_ESTABLISHED)) {
					evf |= kernel_trip(rv->svc_id, rv->backend_id, PB_TRIP_REFUSED,
							   rv->created_ns);
					if (set & PB_CT_RESCUED) {
						rescue = (old & PB_CT_PROBE) ? 1 : 2;
						if (syn_kept(p, fkp))
							evf |= PB_EVF_RESCUED;
					}
					emit(PB_EV_REFUSED, evf, rv->svc_id, rv->backend_id,
					     &fkp->src, fkp->family, fkp->sport, gs);
				} else {
					if (old & PB_CT_BACKEND_DATA)
						evf |= PB_EVF_BACKEND_DATA;
					evf |= kernel_trip(rv->svc_id, rv->backend_id,
							   (old & PB_CT_BACKEND_DATA) ? PB_TRIP_RESET_AFTER_DATA
										      : PB_TRIP_RESET,
							   rv->created_ns);
					emit(PB_EV_RESET, evf, rv->svc_id, rv->backend_id,
					     &fkp->src, fkp->family, fkp->sport, gs);
				}
				/* No FLOW_END: the REFUSED or RESET just sent is the
				 * verdict, and a flow picked up midstream has none. */
				/* Established meanwhile: a reset, nothing to rescue. */
				if ((set & PB_CT_RESCUED) && !rescue)
					__sync_fetch_and_and(&rv->flags, ~PB_CT_RESCUED);
				if (rescue) {
					if (gs) {
						if (rescue == 1)
							gs->probe_rescued++;
						else
							gs->refused_rescued++;
					}
					return XDP_DROP;
				}
			}
		} else {
			if (synack && !(rv->flags & PB_CT_ESTABLISHED)) {
				/* Kept before ESTABLISHED is set: a bare RST after it is
				 * judged against it (rst_is_backends). */
				rv->backend_isn = seq;
				__u32 old = __sync_fetch_and_or(&rv->flags, PB_CT_ESTABLISHED);
				if (!(old & (PB_CT_ESTABLISHED | PB_CT_CLOSED))) {
					/* QUIET_DATA: the SYN-ACK is the success. */
					if (old & PB_CT_QUIET_DATA)
						streak_over(rv->backend_id);
					emit(PB_EV_ESTABLISHED,
					     (old & PB_CT_PROBE) ? PB_EVF_PROBE : 0, rv->svc_id,
					     rv->backend_id, &fkp->src, fkp->family, fkp->sport, gs);
				}
			}
			/* The first payload byte settles a connection as working: a reset
			 * after it is no longer a failure to connect. */
			if (p->payload && !(rv->flags & PB_CT_BACKEND_DATA)) {
				__u32 old = __sync_fetch_and_or(&rv->flags, PB_CT_BACKEND_DATA);
				/* Any flow's, midstream too: a backend sends payload
				 * only on a connection it accepted. */
				if (!(old & (PB_CT_BACKEND_DATA | PB_CT_CLOSED)))
					trust_source(&fkp->src, fkp->family);
				if (!(old & (PB_CT_BACKEND_DATA | PB_CT_CLOSED | PB_CT_MIDSTREAM | PB_CT_QUIET_DATA))) {
					/* QUIET_END without QUIET_DATA: the first data is
					 * the success (a reset before it is a failure). */
					if (old & PB_CT_QUIET_END)
						streak_over(rv->backend_id);
					emit(PB_EV_FIRST_DATA, (old & PB_CT_PROBE) ? PB_EVF_PROBE : 0,
					     rv->svc_id, rv->backend_id, &fkp->src, fkp->family, fkp->sport, gs);
				}
			}
			if (f & TCP_FIN) {
				__u32 old = __sync_fetch_and_or(&rv->flags, PB_CT_FIN_REV);
				if ((old & PB_CT_FIN_FWD) && !(old & PB_CT_CLOSED))
					close_flow(rv, 0, fkp, gs);
			}
		}
	} else if (rv->flags & PB_CT_MOVED) {
		return XDP_DROP;
	}

	if (p->proto == IPPROTO_UDP && !(rv->flags & PB_CT_ESTABLISHED)) {
		/* A UDP flow's first reply is its success: UDP's only answer. */
		__u32 old = __sync_fetch_and_or(&rv->flags, PB_CT_ESTABLISHED);
		if (!(old & (PB_CT_ESTABLISHED | PB_CT_CLOSED))) {
			streak_over(rv->backend_id);
			emit(PB_EV_ESTABLISHED, (old & PB_CT_PROBE) ? PB_EVF_PROBE : 0, rv->svc_id,
			     rv->backend_id, &rk->dst, rk->family, rk->dport, gs);
		}
	}

nat:;
	__u64 now = bpf_ktime_get_coarse_ns();
	if (now - rv->last_seen_ns > 1000000000ULL)
		rv->last_seen_ns = now;

	__u32 bid = rv->backend_id;
	rewrite_src(p, &rv->nat_addr, rv->nat_port);

	struct be_stats *bs = bpf_map_lookup_elem(&pb_be_stats, &bid);
	if (bs) {
		bs->reply_packets++;
		bs->reply_bytes += p->len;
	}
	return forward(ctx, p, gs);
}

static __always_inline __u8 port_role(__be16 port)
{
	__u32 k = bpf_ntohs(port);
	__u8 *role = bpf_map_lookup_elem(&pb_ports, &k);
	return role ? *role : 0;
}

static __always_inline int vip_slot_marked(const union addr *a, __u8 family)
{
	__u32 k = (bpf_ntohl(addr_fold(a, family)) * PB_VIP_SLOT_MUL) >> (32 - PB_VIP_SLOT_BITS);
	__u8 *marked = bpf_map_lookup_elem(&pb_vip_slots, &k);
	return marked && *marked;
}


/* udp_refused makes a UDP endpoint's port unreachable its flow's verdict
 * (once: a refusal, if nothing answered before) and ends the flow, as a
 * refused TCP connection ends: the client's next datagram on the same
 * ports is a new flow, picked afresh, not sent to the closed port until
 * the entry idles out. rv and rk are the flow's reverse entry and key,
 * client its address (of rk's family), cport its port. */
static __always_inline void udp_refused(struct ct_value *rv, const struct ct_key *rk, const union addr *client,
					__be16 cport, struct global_stats *gs)
{
	__u32 old = __sync_fetch_and_or(&rv->flags, PB_CT_CLOSED);
	if (old & PB_CT_CLOSED)
		return;
	if (!(old & PB_CT_ESTABLISHED)) {
		__u8 evf = (old & PB_CT_PROBE) ? PB_EVF_PROBE : 0;
		if (!(old & PB_CT_PROBE))
			evf |= kernel_trip(rv->svc_id, rv->backend_id, PB_TRIP_REFUSED, rv->created_ns);
		emit(PB_EV_REFUSED, evf, rv->svc_id, rv->backend_id, client, rk->family, cport, gs);
	}
	struct ct_key fk = {};
	fk.src = *client;
	fk.dst = rv->nat_addr;
	fk.sport = cport;
	fk.dport = rv->nat_port;
	fk.proto = IPPROTO_UDP;
	fk.dir = PB_DIR_FWD;
	fk.family = rk->family;
	/* The forward entry only if it is still this flow's: the LRU may have
	 * evicted it, and the tuple's next datagram made another flow's. */
	struct ct_value *fv = bpf_map_lookup_elem(&pb_ct_v2, &fk);
	if (fv && fv->backend_id == rv->backend_id && fv->created_ns == rv->created_ns) {
		if (old & PB_CT_COUNTED)
			release(&fk);
		bpf_map_delete_elem(&pb_ct_v2, &fk);
	}
	bpf_map_delete_elem(&pb_ct_v2, rk);
}

/* An ICMP error (destination unreachable, time exceeded) quotes the packet
 * it is about: its IP header and at least 8 bytes of its L4 header. For a
 * NATed flow that packet carries the backend's address, which the client
 * never used (or the VIP, which the backend never saw), so untranslated the
 * error is dropped by the receiver's stack: path MTU discovery through the
 * NAT black-holes, and a UDP backend's port unreachable is lost. Both
 * directions are translated, the quoted header and every checksum with it:
 * - from the backend's side, quoting client -> backend: the quote becomes
 *   client -> VIP, and the outer source the VIP when the backend itself
 *   sent it; on to the client;
 * - from the client's side, quoting VIP -> client (a reply): the quote
 *   becomes backend -> client and the outer destination the backend.
 * A UDP port unreachable from the backend itself is its flow's refusal
 * (once per flow), as a RST is for TCP. */
/* The ICMP header (linux/icmp.h would pull libc's socket headers in). */
struct pb_icmphdr {
	__u8 type;
	__u8 code;
	__sum16 checksum;
	__be32 rest; /* unused, or the next-hop MTU */
};

#define PB_ICMP_DEST_UNREACH 3
#define PB_ICMP_PORT_UNREACH 3 /* code */
#define PB_ICMP_TIME_EXCEEDED 11

struct icmp_quote {
	struct iphdr *ip;   /* outer */
	struct pb_icmphdr *icmp;
	struct iphdr *in;   /* the quoted IP header */
	__be16 *ports;      /* the quoted L4 ports */
	__sum16 *l4csum;    /* the quoted L4 checksum, 0 when not quoted */
};

/* quoted_l4csum is the quoted segment's checksum field: UDP's is in the
 * 8 bytes every error quotes, TCP's only when more is quoted (0: not). */
static __always_inline __sum16 *quoted_l4csum(__u8 proto, __be16 *ports, void *data_end, void *msg_end)
{
	if (proto == IPPROTO_UDP)
		return (__sum16 *)(ports + 3);
	struct tcphdr *tcp = (void *)ports;
	/* Within the frame and within the ICMP message (not a trailer). */
	void *f = (void *)&tcp->check + sizeof(tcp->check);
	if (f <= data_end && f <= msg_end)
		return &tcp->check;
	return 0;
}

static __always_inline int parse_icmp(struct xdp_md *ctx, struct icmp_quote *q)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct iphdr *ip = data + sizeof(struct ethhdr);
	if ((void *)(ip + 1) > data_end || (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET)))
		return -1;
	struct pb_icmphdr *icmp = (void *)ip + ip->ihl * 4;
	if ((void *)(icmp + 1) > data_end)
		return -1;
	if (icmp->type != PB_ICMP_DEST_UNREACH && icmp->type != PB_ICMP_TIME_EXCEEDED)
		return -1;
	struct iphdr *in = (void *)(icmp + 1);
	if ((void *)(in + 1) > data_end || in->version != 4 || in->ihl < 5)
		return -1;
	if (in->protocol != IPPROTO_TCP && in->protocol != IPPROTO_UDP)
		return -1;
	if (in->frag_off & bpf_htons(IP_OFFSET))
		return -1; /* a later fragment quotes no ports */
	__u32 ihl = in->ihl * 4;
	if (ihl > 60)
		return -1;
	__be16 *ports = (void *)in + ihl;
	if ((void *)(ports + 4) > data_end) /* the 8 bytes RFC 792 promises */
		return -1;
	q->ip = ip;
	q->icmp = icmp;
	q->in = in;
	q->ports = ports;
	q->l4csum = quoted_l4csum(in->protocol, ports, data_end, (void *)ip + be16_len(ip->tot_len));
	return 0;
}

/* quote_rewrite changes the quoted packet's source (dst 0) or destination
 * address and port to addr:port, keeping the quoted IP checksum, the quoted
 * L4 checksum (when quoted and, for UDP, in use) and the ICMP checksum
 * right. Every changed word is 16-bit aligned within the ICMP message. */
static __always_inline void quote_rewrite(struct icmp_quote *q, int dst, __be32 addr, __be16 port)
{
	struct iphdr *in = q->in;
	__sum16 *ic = &q->icmp->checksum;
	__be32 *a = dst ? &in->daddr : &in->saddr;
	__be16 *pp = dst ? &q->ports[1] : &q->ports[0];
	__be32 old_a = *a;
	__be16 old_p = *pp;

	__sum16 old_ipc = in->check;
	csum_replace4(&in->check, old_a, addr);
	csum_replace2(ic, old_ipc, in->check);
	if (q->l4csum && !(in->protocol == IPPROTO_UDP && *q->l4csum == 0)) {
		__sum16 old_l4c = *q->l4csum;
		csum_replace4(q->l4csum, old_a, addr);
		csum_replace2(q->l4csum, old_p, port);
		if (in->protocol == IPPROTO_UDP && *q->l4csum == 0)
			*q->l4csum = 0xffff;
		csum_replace2(ic, old_l4c, *q->l4csum);
	}
	csum_replace4(ic, old_a, addr);
	csum_replace2(ic, old_p, port);
	*a = addr;
	*pp = port;
}

static __always_inline void outer_rewrite(struct iphdr *ip, int dst, __be32 addr)
{
	__be32 *a = dst ? &ip->daddr : &ip->saddr;
	csum_replace4(&ip->check, *a, addr);
	*a = addr;
}

static __always_inline int icmp_error(struct xdp_md *ctx, __u32 ifindex, struct global_stats *gs)
{
	struct icmp_quote q;
	if (parse_icmp(ctx, &q))
		return XDP_PASS;
	struct iphdr *in = q.in;

	/* From the client's side: the quote is a reply we sent as the VIP. */
	union addr qsrc = {};
	qsrc.v4 = in->saddr;
	if ((port_role(q.ports[0]) & PB_PORT_VIP) && vip_slot_marked(&qsrc, PB_AF_INET) && q.ip->daddr == in->saddr) {
		struct ct_key fk = {};
		fk.src.v4 = in->daddr;
		fk.dst.v4 = in->saddr;
		fk.sport = q.ports[1];
		fk.dport = q.ports[0];
		fk.proto = in->protocol;
		fk.dir = PB_DIR_FWD;
		fk.family = PB_AF_INET;
		struct ct_value *ct = bpf_map_lookup_elem(&pb_ct_v2, &fk);
		if (ct) {
			__be32 be = ct->nat_addr.v4;
			quote_rewrite(&q, 0, be, ct->nat_port);
			outer_rewrite(q.ip, 1, be);
			if (gs)
				gs->icmp_translated++;
			return XDP_PASS;
		}
	}

	/* From the backend's side: the quote is a packet we sent it. */
	if (!(port_role(q.ports[1]) & PB_PORT_BACKEND))
		return XDP_PASS;
	struct ct_key rk = {};
	rk.src.v4 = in->daddr;
	rk.dst.v4 = in->saddr;
	rk.sport = q.ports[1];
	rk.dport = q.ports[0];
	rk.proto = in->protocol;
	rk.dir = PB_DIR_REV;
	rk.family = PB_AF_INET;
	struct ct_value *rv = bpf_map_lookup_elem(&pb_ct_v2, &rk);
	if (!rv || (rv->flags & PB_CT_MOVED))
		return XDP_PASS;
	__be32 vip = rv->nat_addr.v4;
	__be16 vport = rv->nat_port;
	int from_backend = q.ip->saddr == in->daddr;
	if (from_backend && in->protocol == IPPROTO_UDP && q.icmp->type == PB_ICMP_DEST_UNREACH &&
	    q.icmp->code == PB_ICMP_PORT_UNREACH) {
		/* A refusal only from the backend's side, and whole. */
		if (!reply_side_ok(ctx, ifindex, PB_AF_INET, rv)) {
			if (gs)
				gs->reply_wrong_side++;
			return XDP_PASS;
		}
		void *data = (void *)(long)ctx->data;
		int sum = pb_csum(ctx, (void *)q.icmp - data, be16_len(q.ip->tot_len) - q.ip->ihl * 4);
		if (sum == 0xffff) {
			union addr c = {}; /* all 16 bytes: it goes into a key */
			c.v4 = in->saddr;
			udp_refused(rv, &rk, &c, q.ports[0], gs);
		} else if (gs) {
			gs->reply_bad_checksum++;
		}
	}
	quote_rewrite(&q, 1, vip, vport);
	if (from_backend)
		outer_rewrite(q.ip, 0, vip);
	if (gs)
		gs->icmp_translated++;
	return XDP_PASS;
}

/* ICMPv6 errors (RFC 4443: destination unreachable, packet too big, time
 * exceeded) about a balanced flow, translated as icmp_error translates
 * ICMPv4: from the backend's side the quote becomes client -> VIP (and the
 * outer source the VIP when the backend itself sent it), from the client's
 * side backend -> client, the outer destination the backend. The ICMPv6
 * checksum covers a pseudo-header with the outer addresses, so it follows
 * those too. A quote with extension headers passes untranslated. A UDP
 * port unreachable from the backend itself is its flow's refusal. */
#define PB_ICMP6_DEST_UNREACH 1
#define PB_ICMP6_PORT_UNREACH 4 /* code */
#define PB_ICMP6_PKT_TOOBIG 2
#define PB_ICMP6_TIME_EXCEED 3

struct icmp6_quote {
	struct pb_ipv6hdr *ip6; /* outer */
	struct pb_icmphdr *icmp;
	struct pb_ipv6hdr *in;  /* the quoted IPv6 header */
	__be16 *ports;
	__sum16 *l4csum;        /* the quoted L4 checksum, 0 when not quoted */
};

static __always_inline int parse_icmp6(struct xdp_md *ctx, struct icmp6_quote *q)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct pb_ipv6hdr *ip6 = data + sizeof(struct ethhdr);
	if ((void *)(ip6 + 1) > data_end)
		return -1;
	int r = pb_ipv6_l4(ctx);
	if (r < 0 || (r >> 16) != IPPROTO_ICMPV6)
		return -1;
	__u32 off = r & 0xffff;
	if (off > PB_IPV6_MAX_EXT_BYTES)
		return -1;
	off = ext_len(off);
	struct pb_icmphdr *icmp = (void *)(ip6 + 1) + off;
	if ((void *)(icmp + 1) > data_end)
		return -1;
	if (icmp->type != PB_ICMP6_DEST_UNREACH && icmp->type != PB_ICMP6_PKT_TOOBIG &&
	    icmp->type != PB_ICMP6_TIME_EXCEED)
		return -1;
	struct pb_ipv6hdr *in = (void *)(icmp + 1);
	if ((void *)(in + 1) > data_end || (in->vtc >> 4) != 6)
		return -1;
	if (in->nexthdr != IPPROTO_TCP && in->nexthdr != IPPROTO_UDP)
		return -1;
	__be16 *ports = (void *)(in + 1);
	if ((void *)(ports + 4) > data_end)
		return -1;
	q->ip6 = ip6;
	q->icmp = icmp;
	q->in = in;
	q->ports = ports;
	q->l4csum = quoted_l4csum(in->nexthdr, ports, data_end, (void *)(ip6 + 1) + be16_len(ip6->payload_len));
	return 0;
}

/* quote6_rewrite is quote_rewrite for a quoted IPv6 packet (no header
 * checksum to keep). */
static __always_inline void quote6_rewrite(struct icmp6_quote *q, int dst, const union addr *addr, __be16 port)
{
	struct pb_ipv6hdr *in = q->in;
	__sum16 *ic = &q->icmp->checksum;
	union addr *a = dst ? &in->daddr : &in->saddr;
	__be16 *pp = dst ? &q->ports[1] : &q->ports[0];
	__be16 old_p = *pp;
	int l4 = q->l4csum && !(in->nexthdr == IPPROTO_UDP && *q->l4csum == 0);
	__sum16 old_l4c = l4 ? *q->l4csum : 0;
#pragma unroll
	for (int i = 0; i < 4; i++) {
		__be32 w = a->v6[i];
		if (l4)
			csum_replace4(q->l4csum, w, addr->v6[i]);
		csum_replace4(ic, w, addr->v6[i]);
		a->v6[i] = addr->v6[i];
	}
	if (l4) {
		csum_replace2(q->l4csum, old_p, port);
		if (in->nexthdr == IPPROTO_UDP && *q->l4csum == 0)
			*q->l4csum = 0xffff;
		csum_replace2(ic, old_l4c, *q->l4csum);
	}
	csum_replace2(ic, old_p, port);
	*pp = port;
}

/* outer6_rewrite changes the outer source (dst 0) or destination, and the
 * ICMPv6 checksum whose pseudo-header holds it. */
static __always_inline void outer6_rewrite(struct icmp6_quote *q, int dst, const union addr *addr)
{
	union addr *a = dst ? &q->ip6->daddr : &q->ip6->saddr;
#pragma unroll
	for (int i = 0; i < 4; i++) {
		csum_replace4(&q->icmp->checksum, a->v6[i], addr->v6[i]);
		a->v6[i] = addr->v6[i];
	}
}

static __always_inline int icmp6_error(struct xdp_md *ctx, __u32 ifindex, struct global_stats *gs)
{
	struct icmp6_quote q;
	if (parse_icmp6(ctx, &q))
		return XDP_PASS;
	struct pb_ipv6hdr *in = q.in;
	struct ct_key k = {};
	k.proto = in->nexthdr;
	k.family = PB_AF_INET6;

	/* From the client's side: the quote is a reply we sent as the VIP. */
	if ((port_role(q.ports[0]) & PB_PORT_VIP) && vip_slot_marked(&in->saddr, PB_AF_INET6)) {
		k.src = in->daddr;
		k.dst = in->saddr;
		k.sport = q.ports[1];
		k.dport = q.ports[0];
		k.dir = PB_DIR_FWD;
		struct ct_value *ct = bpf_map_lookup_elem(&pb_ct_v2, &k);
		if (ct && addr_eq(&q.ip6->daddr, &in->saddr)) {
			quote6_rewrite(&q, 0, &ct->nat_addr, ct->nat_port);
			outer6_rewrite(&q, 1, &ct->nat_addr);
			if (gs)
				gs->icmp_translated++;
			return XDP_PASS;
		}
	}

	/* From the backend's side: the quote is a packet we sent it. */
	if (!(port_role(q.ports[1]) & PB_PORT_BACKEND))
		return XDP_PASS;
	k.src = in->daddr;
	k.dst = in->saddr;
	k.sport = q.ports[1];
	k.dport = q.ports[0];
	k.dir = PB_DIR_REV;
	struct ct_value *rv = bpf_map_lookup_elem(&pb_ct_v2, &k);
	if (!rv || (rv->flags & PB_CT_MOVED))
		return XDP_PASS;
	int from_backend = addr_eq(&q.ip6->saddr, &in->daddr);
	if (from_backend && in->nexthdr == IPPROTO_UDP && q.icmp->type == PB_ICMP6_DEST_UNREACH &&
	    q.icmp->code == PB_ICMP6_PORT_UNREACH) {
		/* A refusal only from the backend's side, and whole (the
		 * ICMPv6 checksum covers the outer addresses too). */
		if (!reply_side_ok(ctx, ifindex, PB_AF_INET6, rv)) {
			if (gs)
				gs->reply_wrong_side++;
			return XDP_PASS;
		}
		void *data = (void *)(long)ctx->data;
		__u32 mlen = be16_len(q.ip6->payload_len) - ((void *)q.icmp - (void *)(q.ip6 + 1));
		int sum = pb_csum(ctx, (void *)q.icmp - data, mlen);
		/* The translation reads the VIP from the entry udp_refused
		 * deletes: a copy first. */
		union addr vip6 = rv->nat_addr;
		__be16 vport6 = rv->nat_port;
		if (sum >= 0 && csum_fold32((__u32)sum + pseudo_sum6(&q.ip6->saddr, &q.ip6->daddr, IPPROTO_ICMPV6, mlen)) == 0xffff)
			udp_refused(rv, &k, &in->saddr, q.ports[0], gs);
		else if (gs)
			gs->reply_bad_checksum++;
		quote6_rewrite(&q, 1, &vip6, vport6);
		outer6_rewrite(&q, 0, &vip6);
		if (gs)
			gs->icmp_translated++;
		return XDP_PASS;
	}
	quote6_rewrite(&q, 1, &rv->nat_addr, rv->nat_port);
	if (from_backend)
		outer6_rewrite(&q, 0, &rv->nat_addr);
	if (gs)
		gs->icmp_translated++;
	return XDP_PASS;
}

/* pb_run is the whole program for one address family. family is a
 * constant in each of pb_xdp's two calls, so the compiler specialises each
 * copy and the verifier walks an IPv4 and an IPv6 program, each with no
 * branch on the family left (one copy with the family branches everywhere
 * cost the verifier several times both). */
static __always_inline int pb_run(struct xdp_md *ctx, __u32 ifindex, const __u64 family)
{
	struct pkt p = {};
	/* p stays in memory: promoted to registers, its fields became values
	 * that every early return of parse carried along, a dozen
	 * instructions at each check of the path most packets take. */
	asm volatile("" : : "r"(&p) : "memory");
	p.ifindex = ifindex;
	p.family = family;
	int rc = parse(ctx, &p, family);
	if (rc == 2)
		return family == PB_AF_INET6 ? icmp6_error(ctx, ifindex, gstats()) : icmp_error(ctx, ifindex, gstats());
	if (rc > 0)
		return XDP_PASS;

	/* A malformed packet still has readable ports if parse got that far;
	 * count it only when it looked like ours, and never touch it. */
	if (rc < 0) {
		void *data_end = (void *)(long)ctx->data_end;
		void *ip = (void *)(long)ctx->data + sizeof(struct ethhdr);
		__be16 *ports = ip + (p.family == PB_AF_INET6 ? sizeof(struct pb_ipv6hdr) : sizeof(struct iphdr));
		if ((void *)(ports + 2) <= data_end && (port_role(ports[1]) & PB_PORT_VIP)) {
			struct global_stats *gs = gstats();
			if (gs)
				gs->malformed++;
		}
		return XDP_PASS;
	}

	/* Two array reads decide for most traffic that is not ours: a
	 * destination port no service uses, or an address no VIP hashes to. */
	if (port_role(p.ports[1]) & PB_PORT_VIP) {
		/* The key is zeroed here, not for every packet: most traffic is
		 * not to a VIP port. */
		struct ct_key fk = {};
		pkt_addrs(&p, &fk.src, &fk.dst);
		if (!vip_slot_marked(&fk.dst, p.family))
			goto reply;
		/* Conntrack first: most packets to a VIP belong to a known flow,
		 * which needs no service lookup (and keeps working after its
		 * service is gone). */
		fk.sport = p.ports[0];
		fk.dport = p.ports[1];
		fk.proto = p.proto;
		fk.dir = PB_DIR_FWD;
		fk.family = p.family;
		struct svc_key sk = {};
		sk.vip = fk.dst;
		sk.port = p.ports[1];
		sk.proto = p.proto;
		sk.family = p.family;
		struct svc_value *svcp = 0;
		if (p.proto == IPPROTO_TCP && (p.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST)) == TCP_SYN) {
			/* A SYN to a service is the SYN guard's to judge before
			 * conntrack is read: a flood's SYN costs the service lookup
			 * and the guard, not a cold conntrack bucket. The agent's
			 * replays are its own, not the guard's. */
			svcp = bpf_map_lookup_elem(&pb_services, &sk);
			if (svcp && !replay_meta(ctx) && syn_guard_drops(&fk))
				return XDP_DROP;
		}
		struct ct_value *ct = bpf_map_lookup_elem(&pb_ct_v2, &fk);
		int control = p.proto == IPPROTO_TCP && (p.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST));
		if (ct && !control)
			return established(ctx, &p, &fk, ct, gstats());

		if (!svcp)
			svcp = bpf_map_lookup_elem(&pb_services, &sk);
		if (svcp)
			return handle_forward(ctx, &p, svcp, &fk, ct);
		if (ct)
			return established(ctx, &p, &fk, ct, gstats()); /* service gone, flow lives on */
	}
reply:
	if (port_role(p.ports[0]) & PB_PORT_BACKEND) {
		rc = handle_reply(ctx, &p, gstats());
		if (rc >= 0)
			return rc;
	}
	return XDP_PASS;
}

SEC("xdp")
int pb_xdp(struct xdp_md *ctx)
{
	/* Context fields read here once: each specialised copy using the
	 * context itself makes the compiler offset the context pointer, which
	 * the verifier refuses. */
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 ifindex = ctx->ingress_ifindex;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) <= data_end && eth->h_proto == ETH_P_IPV6_BE)
		return pb_run(ctx, ifindex, PB_AF_INET6);
	return pb_run(ctx, ifindex, PB_AF_INET);
}
