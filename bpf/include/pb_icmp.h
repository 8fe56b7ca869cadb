/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* ICMP and ICMPv6 errors about a NATed flow: translated for their
 * receiver, and a UDP backend's port unreachable as its refusal.
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_ICMP_H
#define PB_ICMP_H

/* udp_refused makes a UDP endpoint's port unreachable its flow's verdict
 * (once: a refusal, if nothing answered before) and ends the flow, as a
 * refused TCP connection ends: the client's next datagram on the same
 * ports is a new flow, picked afresh, not sent to the closed port until
 * the entry idles out. rv and rk are the flow's reverse entry and key
 * (whose destination is the client). */
static __always_inline void udp_refused(struct ct_value *rv, const struct ct_key *rk, struct global_stats *gs)
{
	__u32 old = __sync_fetch_and_or(&rv->flags, PB_CT_CLOSED);
	if (old & PB_CT_CLOSED)
		return;
	if (!(old & PB_CT_ESTABLISHED)) {
		__u8 evf = (old & PB_CT_PROBE) ? PB_EVF_PROBE : 0;
		if (!(old & PB_CT_PROBE))
			evf |= kernel_trip(rv->svc_id, rv->backend_id, PB_TRIP_REFUSED, rv->created_ns);
		emit(PB_EV_REFUSED, evf, rv->svc_id, rv->backend_id, &rk->dst, rk->family, rk->dport, gs);
	}
	struct ct_key fk;
	fwd_key(&fk, rk, rv);
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
	/* The message ends where the IP header says: a header that claims
	 * less than the quote, or more than the frame, is malformed (the
	 * kernel drops it), and passes untouched. */
	void *msg_end = (void *)ip + be16_len(ip->tot_len);
	if (msg_end > data_end)
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
	if ((void *)(ports + 4) > data_end || (void *)(ports + 4) > msg_end) /* the 8 bytes RFC 792 promises */
		return -1;
	q->ip = ip;
	q->icmp = icmp;
	q->in = in;
	q->ports = ports;
	q->l4csum = quoted_l4csum(in->protocol, ports, data_end, msg_end);
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
		if (!reply_side_ok(ctx, ifindex, PB_AF_INET, 0, rv)) {
			if (gs)
				gs->reply_wrong_side++;
			return XDP_PASS;
		}
		void *data = (void *)(long)ctx->data;
		int sum = pb_csum(ctx, (void *)q.icmp - data, be16_len(q.ip->tot_len) - q.ip->ihl * 4);
		if (sum == 0xffff) {
			udp_refused(rv, &rk, gs);
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
	/* As for IPv4: the payload length must hold the quote and fit the
	 * frame. */
	void *msg_end = (void *)(ip6 + 1) + be16_len(ip6->payload_len);
	if ((void *)(ports + 4) > data_end || (void *)(ports + 4) > msg_end || msg_end > data_end)
		return -1;
	q->ip6 = ip6;
	q->icmp = icmp;
	q->in = in;
	q->ports = ports;
	q->l4csum = quoted_l4csum(in->nexthdr, ports, data_end, msg_end);
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
		if (!reply_side_ok(ctx, ifindex, PB_AF_INET6, 0, rv)) {
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
			udp_refused(rv, &k, gs);
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

#endif /* PB_ICMP_H */
