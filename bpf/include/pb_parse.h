/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Parsing: Ethernet, IPv4 (and IPIP from a node's uplink), IPv6 and its
 * extension headers, TCP and UDP; the checksum and option reads over the
 * packet; the strict reverse-path rule.
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_PARSE_H
#define PB_PARSE_H

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

/* pb_reverse_path_ok applies the strict reverse-path rule (rp_filter=1)
 * to the packet in ctx, an IPv4 (family PB_AF_INET) or IPv6 one: the node's
 * route back to its source leaves by the interface it arrived on, or by
 * that interface's master (a bridged pod is routed through the bridge). A
 * pod cannot pass it with another's address unless the two share a
 * segment. Where the lookup fails (no route, forwarding off) it fails. */
__noinline int pb_reverse_path_ok(struct xdp_md *ctx, __u32 family, __u32 outer_saddr)
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
		/* Inside an IPIP packet (see parse): its outer header has no
		 * options. */
		struct iphdr *ip = data + sizeof(struct ethhdr) + (outer_saddr ? sizeof(struct iphdr) : 0);
		if ((void *)(ip + 1) > data_end)
			return 0;
		fib->family = AF_INET;
		fib->ipv4_src = ip->daddr;
		fib->ipv4_dst = ip->saddr;
	}
	long rc = bpf_fib_lookup(ctx, fib, sizeof(*fib), 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return 0;
	if (outer_saddr) {
		/* Tunnelled: the node routes the backend through an IPIP
		 * tunnel to the node the packet came from (the lookup leaves
		 * the route's gateway in ipv4_dst). */
		struct iface *t = bpf_map_lookup_elem(&pb_ifaces, &fib->ifindex);
		return t && (t->flags & PB_IF_IPIP) && fib->ipv4_dst == outer_saddr;
	}
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
	if (ip->protocol == IPPROTO_IPIP) {
		/* A pod network's IPIP tunnel (Calico's tunl0): a backend's
		 * reply from another node. Its inner packet is rewritten in
		 * place; the stack decapsulates it as before. Only on an
		 * uplink, and only unfragmented, with no outer options (what
		 * the kernel's tunnels send). ICMP inside is left alone. */
		if (ip->ihl != 5 || (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET)) || !decap_iface(p->ifindex))
			return 1;
		struct iphdr *in = (void *)(ip + 1);
		if ((void *)(in + 1) > data_end)
			return 1;
		if (in->version != 4 || in->ihl < 5)
			return 1;
		p->outer = ip;
		ip = in;
	}
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP)
		return ip->protocol == IPPROTO_ICMP && !p->outer ? 2 : 1;
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

#endif /* PB_PARSE_H */
