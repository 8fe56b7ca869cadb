/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Refused SYNs kept for the agent to replay elsewhere, and the metadata
 * of its replays.
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_REPLAY_H
#define PB_REPLAY_H

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

#endif /* PB_REPLAY_H */
