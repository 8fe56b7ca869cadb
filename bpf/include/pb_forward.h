/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The client's side of a flow: its control packets (SYN again, FIN, RST),
 * the breaker's RST, packets of established flows.
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_FORWARD_H
#define PB_FORWARD_H

/* client_control handles SYN, FIN and RST from the client on a known flow.
 * Returns 0 to forward with *fv, or new_flow's refusal. */
static __always_inline int client_control(struct xdp_md *ctx, struct pkt *p, struct svc_value *svc,
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
			if (!(old & (PB_CT_FIN_FWD | PB_CT_CLOSED)))
				fin_seen(p, old, PB_CT_FIN_FWD, PB_CT_FIN_REV, fk, rv, seq,
					 bpf_ntohl(tcp->ack_seq),
					 (old & PB_CT_FIN_REV) && l4_csum_ok(ctx, p) == 1);
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
	struct svc_stats *ss = svc_counters(svc_id);
	if (ss) {
		ss->packets++;
		ss->bytes += p->len;
	}
	struct be_stats *bs = be_counters(backend_id);
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
	/* The client's ACK of the backend's FIN, which closed the flow after
	 * the client's own: the flow is over, and its entries go (fin_seen).
	 * Only with a right checksum: the backend would drop it otherwise. */
	int last = 0;
	if (unlikely(ct->flags & PB_CT_LAST_ACK)) {
		struct tcphdr *tcp = (void *)p->ports;
		if ((void *)(tcp + 1) <= p->end && (p->tcp_flags & TCP_ACK) &&
		    bpf_ntohl(tcp->ack_seq) == ct->backend_isn && l4_csum_ok(ctx, p) == 1)
			last = 1;
	}
	__u64 now = coarse_now();
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
				rv->backend_isn = 0; /* the forward entry's holds a FIN's end */
				rv->sweep_mark = 0; /* the sweep's, of the other half */
				bpf_map_update_elem(&pb_ct_v2, &sc->rk, rv, BPF_NOEXIST);
			}
		}
	}
	int rc = to_backend(ctx, p, &ct->nat_addr, ct->nat_port, ct->svc_id, ct->backend_id, gs);
	if (unlikely(last)) {
		/* The reverse half goes if it is this flow's (a Linux client
		 * may use the port towards two VIPs with a backend in common). */
		struct scratch *sc = scratch();
		if (sc) {
			rev_key(&sc->rk, fk, ct);
			struct ct_value *rv = bpf_map_lookup_elem(&pb_ct_v2, &sc->rk);
			if (rv && rv->created_ns == ct->created_ns)
				bpf_map_delete_elem(&pb_ct_v2, &sc->rk);
		}
		bpf_map_delete_elem(&pb_ct_v2, fk);
	}
	return rc;
}

#endif /* PB_FORWARD_H */
