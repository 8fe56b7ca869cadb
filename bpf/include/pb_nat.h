/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Checksums of rewritten packets, the DNAT and reverse-NAT rewrite, the
 * doomed-SYN checks, and forwarding (redirect or the stack).
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_NAT_H
#define PB_NAT_H

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

/* sum_words adds n (at most max) 32-bit words of the packet at w to s,
 * read in place, and folds the sum to 16 bits (not inverted); -1 when a
 * word lies past end. Summed as 32-bit words, the ones' complement sum is
 * the one of the 16-bit words (RFC 1071: byte order and word size do not
 * change it once folded). */
#define sum_words(w, n, max, end, s0)                                          \
	({                                                                     \
		__u64 __s = (s0);                                              \
		int __ok = 1;                                                  \
		_Pragma("unroll") for (int __i = 0; __i < (max); __i++) {      \
			if (__i < (n) && __ok) {                               \
				if ((void *)((w) + __i + 1) > (end))           \
					__ok = 0;                              \
				else                                           \
					__s += (w)[__i];                       \
			}                                                      \
		}                                                              \
		__s = (__s & 0xffffffff) + (__s >> 32);                        \
		__s = (__s & 0xffffffff) + (__s >> 32);                        \
		__ok ? (int)csum_fold32((__u32)__s) : -1;                      \
	})

/* pb_tcp_opts_signed says whether the TCP options at off, len bytes, hold
 * a signature option (TCP-MD5, TCP-AO): a listener without the key drops
 * such a SYN without an answer. The options are copied out first: walked
 * in the packet, each step's bounds check is a branch that Linux 6.1's
 * verifier cannot prune across the loop's 40 steps (it gives up at a
 * million instructions). A global function: the verifier walks the loop
 * once, not in every path of the program. */
__noinline int pb_tcp_opts_signed(struct xdp_md *ctx, __u32 off, __u32 len)
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

/* pb_syn_sums_ok checks the checksums of the usual TCP SYN, whose header
 * is at l4off (l4len bytes of segment) in an IPv4 (family PB_AF_INET) or
 * IPv6 packet that arrived on ifindex: 1 right, 0 wrong, -1 not the usual
 * SYN (IPv4 options, a payload): the caller copies those out (pb_csum).
 * The usual one is summed in place, its headers read as words: copying
 * them out cost every SYN about as much as its conntrack insert. A global
 * function: its branches are walked once by the verifier, not in every
 * path of the program that would inline them. */
__noinline int pb_syn_sums_ok(struct xdp_md *ctx, __u32 l4off, __u32 l4len, __u32 ifindex, __u32 family)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u32 ps;
	if (family == PB_AF_INET6) {
		struct pb_ipv6hdr *ip6 = data + sizeof(struct ethhdr);
		if ((void *)(ip6 + 1) > end)
			return -1;
		ps = pseudo_sum6(&ip6->saddr, &ip6->daddr, IPPROTO_TCP, l4len);
	} else {
		struct iphdr *ip = data + sizeof(struct ethhdr);
		if ((void *)(ip + 1) > end || ip->ihl != 5)
			return -1;
		if (sum_words((__u32 *)ip, 5, 5, end, 0) != 0xffff)
			return 0;
		ps = pseudo_sum(ip->saddr, ip->daddr, IPPROTO_TCP, l4len);
	}
	if (l4off > 512)
		return -1;
	struct tcphdr *tcp = data + l4off;
	if ((void *)(tcp + 1) > end || l4len != tcp->doff * 4)
		return -1;
	if (tcp->check == ps && partial_iface(ifindex))
		return 1; /* left to the device: see l4_csum_ok */
	int sum = sum_words((__u32 *)tcp, tcp->doff, 15, end, ps);
	if (sum < 0)
		return -1;
	return sum == 0xffff;
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
	} else if (p->ip->ttl <= 1) {
		return 1;
	}
	__u32 l4off = (void *)p->ports - data;
	int ok = pb_syn_sums_ok(ctx, l4off, p->l4len, p->ifindex, p->family);
	if (ok < 0) {
		if (p->family == PB_AF_INET && pb_csum(ctx, sizeof(struct ethhdr), p->ip->ihl * 4) != 0xffff)
			return 1;
		ok = l4_csum_ok(ctx, p);
	}
	if (ok == 0)
		return 1;
	struct tcphdr *tcp = (void *)p->ports;
	__u32 opts = tcp->doff * 4 - sizeof(*tcp); /* parse: doff >= 5 */
	return opts && pb_tcp_opts_signed(ctx, l4off + sizeof(*tcp), opts);
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
	/* RFC 1624 eqn. 3 over every word that changes at once: one fold and
	 * one write to the packet's field, not one per word. */
	__u32 s = (__u16)~*p->l4csum;
	if (p->family == PB_AF_INET6) {
		const union addr *old = dst ? &p->ip6->daddr : &p->ip6->saddr;
#pragma unroll
		for (int i = 0; i < 4; i++)
			s += csum_delta4(old->v6[i], new_addr->v6[i]);
	} else {
		s += csum_delta4(dst ? p->ip->daddr : p->ip->saddr, new_addr->v4);
	}
	s += (__u16)~old_port + (__u16)new_port;
	__sum16 c = ~csum_fold32(s);
	if (p->proto == IPPROTO_UDP && c == 0)
		c = 0xffff;
	*p->l4csum = c;
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
	/* A tunnelled reply goes on encapsulated, for the stack to unwrap. */
	if (!cfg || !(cfg->flags & PB_CFG_REDIRECT) || p->outer)
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

#endif /* PB_NAT_H */
