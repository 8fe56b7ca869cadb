/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Handing new flows to kube-proxy (dead-man's switch, uninstall, a service
 * handed back) and clearing the kernel's conntrack where the two paths
 * meet.
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_HANDOVER_H
#define PB_HANDOVER_H

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
	       (__s64)(coarse_now() - cfg->heartbeat_ns) > (__s64)cfg->dead_man_ns;
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

#endif /* PB_HANDOVER_H */
