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
const enum pb_ct_expire_result *unused_ct_expire_result __attribute__((unused));

/* The parts, in the order each needs the ones before. */
#include "pb_pkt.h"
#include "pb_parse.h"
#include "pb_nat.h"
#include "pb_events.h"
#include "pb_pick.h"
#include "pb_prefilter.h"
#include "pb_trips.h"
#include "pb_synguard.h"
#include "pb_handover.h"
#include "pb_evidence.h"
#include "pb_replay.h"
#include "pb_forward.h"
#include "pb_icmp.h"

/* service looks a VIP's service up. The agent rewrites a service's entry
 * at every change of its endpoints, and the hash map replaces an entry by
 * linking the new one at its bucket's head and then unlinking the old: a
 * lookup already past the head, on an entry ahead of the old one, finds
 * neither and misses a service that exists (TestServiceRewriteNeverMissed
 * makes it happen). A second walk starts at the head, where the new entry
 * is by then. Only a packet to a VIP port and a marked address pays it on
 * a real miss. */
static __always_inline struct svc_value *service(const struct svc_key *sk)
{
	struct svc_value *v = bpf_map_lookup_elem(&pb_services, sk);
	if (!v)
		v = bpf_map_lookup_elem(&pb_services, sk);
	return v;
}

/* svc_owner says whose value a copy with this id is: 1 key sk's
 * (pb_svc_keys[id] is sk), 0 another key's or none's (all zero: written
 * by an agent older than pb_svc_keys, as in a rollback until its own
 * program is attached: a fallback to a second look for that case cost the
 * verifier a sixth more instructions, and the agent fills the map at
 * every start). */
_Static_assert(sizeof(struct svc_key) == 5 * sizeof(__u32), "svc_key is five words");
static __always_inline int svc_owner(const struct svc_key *sk, __u32 id)
{
	const struct svc_key *k = bpf_map_lookup_elem(&pb_svc_keys, &id);
	if (!k)
		return 0;
	const __u32 *x = (const void *)sk, *y = (const void *)k;
	int same = 1;
#pragma unroll
	for (int i = 0; i < 5; i++)
		same &= x[i] == y[i];
	return same;
}

/* svc_same: two service values are the same, word by word. */
_Static_assert(sizeof(struct svc_value) == 8 * sizeof(__u32), "svc_value is eight words");
static __always_inline int svc_same(const struct svc_value *a, const struct svc_value *b)
{
	const __u32 *x = (const void *)a, *y = (const void *)b;
	int same = 1;
#pragma unroll
	for (int i = 0; i < 8; i++)
		same &= x[i] == y[i];
	return same;
}

/* svc_copy_ok says whether svc, a copy of the value at svcp that key sk's
 * lookup returned, is sk's service's: its id names sk (pb_svc_keys), and
 * the entry still reads as copied, so that a copy torn by the entry's
 * reuse for another value midway is not taken either. */
static __always_inline int svc_copy_ok(const struct svc_key *sk, const struct svc_value *svc,
				       const struct svc_value *svcp)
{
	return svc_owner(sk, svc->id) && svc_same(svc, svcp);
}

/* service_copy copies svcp, the value key sk's lookup returned, into the
 * scratch: the agent flips tables by rewriting the value. An entry the
 * agent replaced is reused by the map at once, for any key: read through
 * svcp after that, it is another service's value
 * (TestServiceRewriteNeverMissed sent new flows to another service's
 * backend so). A copy svc_copy_ok refuses is made again from a fresh
 * lookup, once. NULL: the service is gone, its entry was reused under
 * both copies, or its id names another key or none. */
static __always_inline struct svc_value *service_copy(const struct svc_key *sk, const struct svc_value *svcp)
{
	struct scratch *sc = scratch();
	if (!sc)
		return 0;
	struct svc_value *svc = &sc->svc;
	*svc = *svcp;
	if (svc_copy_ok(sk, svc, svcp))
		return svc;
	svcp = service(sk);
	if (!svcp)
		return 0;
	*svc = *svcp;
	return svc_copy_ok(sk, svc, svcp) ? svc : 0;
}

/* handle_forward handles a client packet to a service that is not the
 * plain established case: a new flow, or SYN, FIN or RST on a known one
 * (ct, when not NULL). svc is the service's copy (service_copy). */
static __always_inline int handle_forward(struct xdp_md *ctx, struct pkt *p, struct svc_value *svc,
				     struct ct_key *fk, struct ct_value *ct)
{
	struct global_stats *gs = gstats();
	__u32 move_off = replay_move_off(ctx);
	struct scratch *sc = scratch();
	if (!sc)
		return XDP_PASS;
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
		rc = client_control(ctx, p, svc, fk, fv, move_off, gs);
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
		/* A FIN on no flow is most likely a flow's that ended here: a
		 * client's FIN sent again after the backend's last ACK took the
		 * entries (fin_seen) and was lost on its way. Picked up closed,
		 * so it stays the closed timeout, not an opening's or an
		 * established flow's. */
		__u32 ct_flags = 0;
		if (!syn && (p->tcp_flags & TCP_FIN))
			ct_flags = PB_CT_FIN_FWD | PB_CT_CLOSED;
		rc = new_flow(p, svc, fk, !syn, 0, 0, 0, 0, ct_flags, fv, gs);
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
	if (!reply_side_ok(ctx, p->ifindex, p->family, p->outer ? p->outer->saddr : 0, rv)) {
		if (gs)
			gs->reply_wrong_side++;
		return -1;
	}

	int last = 0; /* the final ACK of the flow's close: its entries go */
	if (p->proto == IPPROTO_TCP) {
		__u8 f = p->tcp_flags;
		struct tcphdr *tcp = (void *)p->ports;
		if ((void *)(tcp + 1) > p->end)
			return -1;
		__u32 seq = bpf_ntohl(tcp->seq), ack = bpf_ntohl(tcp->ack_seq);
		int synack = (f & (TCP_SYN | TCP_ACK)) == (TCP_SYN | TCP_ACK);
		/* Summed once, for every packet the checksum matters to: a RST or
		 * SYN-ACK decides only with a right one, the second FIN arms its
		 * flow's last ACK (fin_seen) and that ACK deletes the flow only
		 * so. A segment too long to sum (over PB_CSUM_MAX) is not right:
		 * its flow stays for the sweep. */
		__u32 was = rv->flags;
		int sum_ok = 0;
		if ((f & TCP_RST) || synack || ((f & TCP_FIN) && (was & PB_CT_FIN_FWD)) ||
		    (was & PB_CT_LAST_ACK))
			sum_ok = l4_csum_ok(ctx, p) == 1;
		if (((f & TCP_RST) || synack) && !sum_ok) {
			if (gs)
				gs->reply_bad_checksum++;
			goto nat;
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
		/* The forward key, as the client sent it: built only for a
		 * packet that can end, settle or judge the flow (a SYN, FIN or
		 * RST, or the backend's first data; an armed flow's last ACK
		 * builds it below), not for the replies of an established flow,
		 * most of them. first_data is read once: the
		 * LRU may reuse rv's element for another flow meanwhile, and a
		 * second read could find the bit clear with no key built. */
		int first_data = p->payload && !(rv->flags & PB_CT_BACKEND_DATA);
		struct ct_key *fkp = &sc->fk;
		if ((f & (TCP_SYN | TCP_FIN | TCP_RST)) || first_data)
			fwd_key(fkp, rk, rv);

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
			if (first_data) {
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
				fin_seen(p, old, PB_CT_FIN_REV, PB_CT_FIN_FWD, fkp, rv, seq, ack, sum_ok);
			} else if (unlikely(rv->flags & PB_CT_LAST_ACK) && !synack && (f & TCP_ACK)) {
				/* The backend's ACK of the client's FIN, which closed
				 * the flow after its own: its entries go (fin_seen),
				 * if its checksum is right (the client drops it else)
				 * and the forward entry is this flow's. */
				fwd_key(fkp, rk, rv);
				struct ct_value *fv = bpf_map_lookup_elem(&pb_ct_v2, fkp);
				last = sum_ok && fv && fv->created_ns == rv->created_ns && ack == fv->backend_isn;
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
	__u64 now = coarse_now();
	if (now - rv->last_seen_ns > 1000000000ULL)
		rv->last_seen_ns = now;

	__u32 bid = rv->backend_id;
	rewrite_src(p, &rv->nat_addr, rv->nat_port);

	struct be_stats *bs = be_counters(bid);
	if (bs) {
		bs->reply_packets++;
		bs->reply_bytes += p->len;
	}
	if (unlikely(last)) {
		bpf_map_delete_elem(&pb_ct_v2, &sc->fk);
		bpf_map_delete_elem(&pb_ct_v2, rk);
	}
	return forward(ctx, p, gs);
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
		if (p.outer)
			return XDP_PASS; /* inside a tunnel: not counted */
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
	/* From a tunnel only replies are ours: the client side of a flow is
	 * always on this node. */
	if (!p.outer && (port_role(p.ports[1]) & PB_PORT_VIP)) {
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
		int syn = p.proto == IPPROTO_TCP && (p.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST)) == TCP_SYN;
		if (syn) {
			/* A SYN to a service is the SYN guard's to judge before
			 * conntrack is read: a flood's SYN costs the service lookup
			 * and the guard, not a cold conntrack bucket. The agent's
			 * replays are its own, not the guard's. */
			svcp = service(&sk);
			if (svcp && !replay_meta(ctx) && syn_guard_drops(&fk))
				return XDP_DROP;
		}
		struct ct_value *ct = bpf_map_lookup_elem(&pb_ct_v2, &fk);
		int control = p.proto == IPPROTO_TCP && (p.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST));
		if (ct && !control)
			return established(ctx, &p, &fk, ct, gstats());

		if (!syn) /* a SYN's service was looked up above */
			svcp = service(&sk);
		if (svcp)
			svcp = service_copy(&sk, svcp);
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

/* The agent's conntrack sweep, in the kernel: the agent finds the idle
 * flows in a snapshot of pb_ct_v2 and runs this program (BPF_PROG_RUN)
 * over a batch of them in pb_ct_expire, where a lookup and a delete per
 * entry, each its own system call, made expiring a flow four (most of the
 * agent's cost of a closed connection). An entry goes only if it still
 * is the flow the snapshot saw: its tuple may have been reused since. */
static __always_inline __u8 ct_expire_key(const struct ct_key *k, __u64 created_ns, __u16 mark, __u32 *deleted)
{
	struct ct_value *v = bpf_map_lookup_elem(&pb_ct_v2, k);
	if (!v)
		return PB_CT_EXPIRE_ABSENT;
	if (v->created_ns != created_ns)
		return PB_CT_EXPIRE_OTHER;
	/* mark, when not 0, is left on it for a walk that may yet come to it
	 * (sweep_expire). */
	if (mark)
		v->sweep_mark = mark;
	/* Gone meanwhile (the LRU, or a concurrent delete) is gone too. */
	if (bpf_map_delete_elem(&pb_ct_v2, k) == 0)
		(*deleted)++;
	return PB_CT_EXPIRE_DELETED;
}

struct ct_expire_loop {
	__u32 deleted;
};

static long ct_expire_one(__u32 i, void *data)
{
	struct ct_expire_loop *l = data;
	struct ct_expire *x = bpf_map_lookup_elem(&pb_ct_expire, &i);
	if (!x)
		return 1;
	x->rev_result = PB_CT_EXPIRE_UNASKED;
	x->fwd_result = PB_CT_EXPIRE_UNASKED;
	if (x->rev.family) {
		x->rev_result = ct_expire_key(&x->rev, x->created_ns, 0, &l->deleted);
		if (x->rev_result != PB_CT_EXPIRE_DELETED)
			return 0;
	}
	if (x->fwd.family)
		x->fwd_result = ct_expire_key(&x->fwd, x->created_ns, 0, &l->deleted);
	return 0;
}

SEC("syscall")
int pb_ct_expire_run(struct ct_expire_args *a)
{
	struct ct_expire_loop l = {};
	__u32 n = a->n;
	if (n > PB_CT_EXPIRE_BATCH)
		n = PB_CT_EXPIRE_BATCH;
	bpf_loop(n, ct_expire_one, &l, 0);
	a->deleted = l.deleted;
	return 0;
}

/* The agent's reset of a reused id's counters. pb_svc_stats_v2 and
 * pb_be_stats_v2 hold PB_STATS_BLOCK ids to an element, and the agent
 * cannot write one slot from user space: a lookup and an update of the
 * whole element would put back the counts its neighbours gained in
 * between, which Prometheus reads as a counter reset. This zeroes the one
 * slot on every CPU, in place. A reused id has no live flow, so nothing
 * counts into the slot meanwhile. */
struct stats_reset_loop {
	__u32 key;
	__u32 slot;
	__u32 backend;
	__u32 zeroed; /* CPUs whose copy was zeroed */
};

static long stats_reset_cpu(__u32 cpu, void *data)
{
	struct stats_reset_loop *l = data;
	__u32 slot = l->slot % PB_STATS_BLOCK;
	if (l->backend) {
		struct be_stats_block *b = bpf_map_lookup_percpu_elem(&pb_be_stats_v2, &l->key, cpu);
		if (!b)
			return 1; /* past the last CPU, or past the map's end */
		__builtin_memset(&b->b[slot], 0, sizeof(b->b[slot]));
	} else {
		struct svc_stats_block *b = bpf_map_lookup_percpu_elem(&pb_svc_stats_v2, &l->key, cpu);
		if (!b)
			return 1;
		__builtin_memset(&b->s[slot], 0, sizeof(b->s[slot]));
	}
	l->zeroed++;
	return 0;
}

static long stats_reset_one(__u32 i, void *data)
{
	struct stats_reset_args *a = data;
	struct stats_reset *r = bpf_map_lookup_elem(&pb_stats_reset, &i);
	if (!r)
		return 1;
	struct stats_reset_loop l = {
		.key = r->id / PB_STATS_BLOCK,
		.slot = r->id % PB_STATS_BLOCK,
		.backend = r->backend,
	};
	bpf_loop(a->ncpu, stats_reset_cpu, &l, 0);
	/* Not even CPU 0's copy: the id is past the map's end. */
	if (!l.zeroed)
		a->missed++;
	return 0;
}

SEC("syscall")
int pb_stats_reset_run(struct stats_reset_args *a)
{
	struct stats_reset_args args = *a;
	if (args.n > PB_STATS_RESET_BATCH)
		args.n = PB_STATS_RESET_BATCH;
	args.missed = 0;
	long done = bpf_loop(args.n, stats_reset_one, &args, 0);
	a->missed = args.missed;
	/* bpf_loop refuses a count past its limit (1 << 23) outright. */
	return done == args.n ? 0 : 1;
}

/* The agent's whole conntrack sweep, in the kernel: what the agent's
 * reaper (pkg/conntrack) does with a copy of pb_ct_v2, done here with
 * lookups in the table itself. A flow reset, or closed otherwise than
 * by a FIN each way with the second acknowledging the first (those go at
 * their last ACK: fin_seen), keeps its two entries for the closed
 * timeout (10 s); before the datapath deleted closed flows itself, the
 * copy was of some 200,000 entries at 10,000 connections a second, most
 * of the agent's sweep. The walks:
 *   1. every entry of pb_ct_v2, once. The first half of a flow the walk
 *      comes to judges the flow for both: idle past its state's timeout
 *      (last seen by either half), both halves go; otherwise its ids are
 *      in use. It marks the other half (sweep_mark), which the walk then
 *      passes by. A forward entry without its reverse half is put aside
 *      (pb_ct_sweep_lone);
 *   2. those forward entries: one idle past the closed timeout goes,
 *      unless a live reverse entry of another flow names its key (walk 1
 *      put that key in pb_ct_sweep_apart); otherwise its ids are in use;
 *   3. pb_flows: an entry whose flow is gone, and older than the orphan
 *      age, is released and its breaker slots given back.
 * A walk of the table costs a visit of every entry (about 190 ns each on
 * a 2.8 GHz guest, the entries scattered over a table bigger than the
 * cache): one walk instead of one per direction spares half of them.
 * Each walk is its own run (ct_sweep_args.walk, the state kept in
 * pb_ct_sweep_state): on a kernel without full preemption a run keeps its
 * CPU until it returns (the two walks it replaced took 63-84 ms and 18-29
 * ms at 240,000 entries, none of them due, on a 2.8 GHz guest).
 * An entry found due is deleted only when the walk has moved past it (at
 * a later callback, or after the walk): the walk reads an entry's
 * successor after its callback (before 6.15), and a deleted LRU entry can
 * be handed to a new flow at once, which would take the walk into another
 * bucket. So
 * a due flow's other half, if the walk comes to it next, waits for the
 * callback after. The datapath's own deletes and evictions can move the
 * walk all the same, and a live flow's reverse entry can go unseen: so
 * walk 2 deletes a forward entry only if its reverse half is not there.
 *
 * A mark from an earlier sweep is not this one's: the agent counts them
 * up, and a new entry's is 0. The walk clears any other mark from the
 * entries it judges, so that after a sweep every entry carries its mark
 * or none. An agent's first sweep clears them all first (walk 0): the
 * marks its predecessor left may equal its own. What is left: an entry
 * the walk missed keeps its mark, and a second agent sweeping the same
 * maps may mark with this one's mark, 1 in 65,534 each. A lookup counts
 * as a use for the LRU: after a sweep, every live flow's forward half
 * looks recently used (see sweep_flow). */
struct bpf_map;

struct ct_sweep_walk {
	struct ct_sweep_args a;
	struct ct_expire pend; /* a due flow, deleted once the walk is past it */
	__u32 pend_svc, pend_be; /* its ids, in use if its forward half stays */
	struct ct_key pend_flow; /* a pb_flows entry to release at the next step */
	struct flow_value pend_fv;
	__u8 has_pend;
	__u8 has_pend_flow;
	__u8 pend_rev_seen; /* the walk came to pend.rev: counted in entries */
	__u8 pend_fwd_seen; /* the walk came to pend.fwd: counted in entries */
};

/* pb_ct_sweep_state[0]: one sweep's walks. In a map, not on the stack:
 * the verifier then sees its fields as unknown values, where on the stack
 * it tracked every value a counter or flag took through the callbacks and
 * never finished. Not per-CPU: the agent's thread may move to another CPU
 * between its walks. Not pinned. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct ct_sweep_walk);
	__uint(max_entries, 1);
} pb_ct_sweep_state SEC(".maps");

static __always_inline struct ct_sweep_walk *sweep_state(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&pb_ct_sweep_state, &zero);
}

static __always_inline __u64 sweep_timeout(const struct ct_sweep_args *a, __u8 proto, __u32 flags)
{
	if (proto != IPPROTO_TCP)
		return a->udp;
	if (flags & PB_CT_CLOSED)
		return a->tcp_closed;
	if (flags & PB_CT_ESTABLISHED)
		return a->tcp_established;
	return a->tcp_opening;
}

/* sweep_use marks a flow's ids, and the VIP its forward key is addressed
 * to, in use. */
static __always_inline void sweep_use(struct ct_sweep_walk *w, const struct ct_key *fk, __u32 svc, __u32 be)
{
	__u32 zero = 0;
	struct ct_inuse *u = bpf_map_lookup_elem(&pb_ct_inuse, &zero);
	if (!u) {
		w->a.failed |= PB_SWEEP_FAIL_INUSE;
		return;
	}
	if (svc < PB_MAX_SERVICES && be < PB_MAX_BACKENDS) {
		u->svc[svc / 64] |= 1ULL << (svc % 64);
		u->be[be / 64] |= 1ULL << (be % 64);
	} else {
		w->a.failed |= PB_SWEEP_FAIL_ID;
	}
	struct vip_use_key vk = {};
	vk.addr = fk->dst;
	vk.port = fk->dport;
	vk.family = fk->family;
	/* Most live flows' VIPs are there already; an update of a map without
	 * preallocation allocates even to replace. */
	if (bpf_map_lookup_elem(&pb_ct_inuse_vips, &vk))
		return;
	__u8 one = 1;
	if (bpf_map_update_elem(&pb_ct_inuse_vips, &vk, &one, BPF_ANY))
		w->a.failed |= PB_SWEEP_FAIL_VIPS;
}

static __always_inline int ct_key_eq(const struct ct_key *a, const struct ct_key *b)
{
	const __u32 *x = (const void *)a, *y = (const void *)b;
	for (int i = 0; i < (int)(sizeof(*a) / 4); i++)
		if (x[i] != y[i])
			return 0;
	return 1;
}

/* sweep_expire deletes entry k if it still is the flow that started at
 * created (ct_expire_key). One the walk has yet to come to is counted in
 * entries here, and marked gone first: the walk may come to it all the
 * same, as kernels since 6.15 (and stable backports, 6.12.y's among
 * them) read an entry's successor before its callback, and it must
 * neither count nor judge it then. */
static __always_inline __u8 sweep_expire(struct ct_sweep_walk *w, const struct ct_key *k, __u64 created, __u8 seen)
{
	__u32 deleted = 0;
	__u8 r = ct_expire_key(k, created, seen ? 0 : PB_SWEEP_MARK_GONE, &deleted);
	if (!seen)
		w->a.entries += deleted;
	return r;
}

/* sweep_settle deletes the due flow walk 1 found, now that the walk has
 * moved past it (cur: the entry the walk is on; NULL after the walk). The
 * walk may be on the flow's other half: the flow waits for the next
 * step. Each entry goes only if it is still the flow's (its start): the
 * datapath may have reused the tuple meanwhile. An entry deleted before
 * the walk came to it is counted in entries here. */
static __always_inline void sweep_settle(struct ct_sweep_walk *w, const struct ct_key *cur)
{
	if (w->has_pend) {
		struct ct_expire *x = &w->pend;
		int on_rev = cur && ct_key_eq(&x->rev, cur);
		int on_fwd = cur && x->fwd.family && ct_key_eq(&x->fwd, cur);
		if (on_rev)
			w->pend_rev_seen = 1;
		if (on_fwd)
			w->pend_fwd_seen = 1;
		if (!on_rev && !on_fwd) {
			__u8 r = sweep_expire(w, &x->rev, x->created_ns, w->pend_rev_seen);
			if (r == PB_CT_EXPIRE_DELETED) {
				w->a.expired++;
				if (x->fwd.family)
					sweep_expire(w, &x->fwd, x->created_ns, w->pend_fwd_seen);
			} else if (x->fwd.family) {
				/* The reverse key is another flow's by now: the
				 * forward half stays (marked: the walk passes it by
				 * if it has yet to come to it), and keeps its ids
				 * until the next sweep. */
				sweep_use(w, &x->fwd, w->pend_svc, w->pend_be);
			}
			w->has_pend = 0;
			w->pend_rev_seen = 0;
			w->pend_fwd_seen = 0;
		}
	}
	if (w->has_pend_flow) {
		w->has_pend_flow = 0;
		/* Only if it is still the flow's: the datapath may have
		 * released it (a FIN or RST) and counted a new flow there. */
		if (release_flow(&w->pend_flow, w->pend_fv.created_ns, 1))
			w->a.released++;
	}
}

/* sweep_flow judges the flow of reverse entry rv (key rk), whose forward
 * half is f (key fk; NULL: gone, or another flow's), at the first of its
 * halves walk 1 came to: rv if rev_first, else f. */
static __always_inline void sweep_flow(struct ct_sweep_walk *w, const struct ct_key *rk, struct ct_value *rv,
				       const struct ct_key *fk, struct ct_value *f, int rev_first)
{
	__u64 last = rv->last_seen_ns;
	__u32 flags = rv->flags;
	if (f && f->last_seen_ns > last)
		last = f->last_seen_ns;
	if (!f || !(f->flags & PB_CT_CLIENT_ACKED))
		flags &= ~PB_CT_ESTABLISHED; /* handshake never completed by the client */
	/* The walk passes the other half by, due or not: a due one is
	 * deleted with this one. One that carries this sweep's mark already
	 * (a walk's miss, or another agent's sweep) was passed by and
	 * counted. */
	struct ct_value *other = rev_first ? f : rv;
	__u8 other_seen = 0;
	if (other) {
		other_seen = other->sweep_mark == w->a.mark;
		other->sweep_mark = w->a.mark;
	}
	if ((__s64)(w->a.now_coarse - last) > (__s64)sweep_timeout(&w->a, rk->proto, flags)) {
		__builtin_memset(&w->pend, 0, sizeof(w->pend));
		w->pend.rev = *rk;
		if (f)
			w->pend.fwd = *fk;
		w->pend.created_ns = rv->created_ns;
		w->pend_svc = rv->svc_id;
		w->pend_be = rv->backend_id;
		w->pend_rev_seen = rev_first ? 1 : other_seen;
		w->pend_fwd_seen = rev_first ? other_seen : 1;
		w->has_pend = 1;
		return;
	}
	if (!f) {
		/* Its forward key stays the live flow's: walk 2 keeps the entry
		 * there (the moved flow's), walk 3 the flow's pb_flows entry. */
		__u8 one = 1;
		if (bpf_map_update_elem(&pb_ct_sweep_apart, fk, &one, BPF_ANY))
			w->a.failed |= PB_SWEEP_FAIL_APART;
	} else if (!rev_first) {
		/* A lookup is a use for the LRU. The datapath rebuilds a lost
		 * reverse half from the forward one, not the other way round:
		 * each sweep keeps every live flow's forward half recently
		 * used, as a lookup of it does when the reverse half comes
		 * first. */
		bpf_map_lookup_elem(&pb_ct_v2, fk);
	}
	sweep_use(w, fk, rv->svc_id, rv->backend_id);
}

static long ct_sweep_entry(struct bpf_map *map, const struct ct_key *k, struct ct_value *v, void *ctx)
{
	struct ct_sweep_walk *w = sweep_state();
	if (!w)
		return 1;
	sweep_settle(w, k);
	if (v->sweep_mark == PB_SWEEP_MARK_GONE) {
		/* Deleted, and counted, before the walk came to it; unless it is
		 * still there after all (its delete failed): judged then. */
		struct ct_value *c = bpf_map_lookup_elem(&pb_ct_v2, k);
		if (!c || c->created_ns != v->created_ns || c->sweep_mark != PB_SWEEP_MARK_GONE)
			return 0;
		c->sweep_mark = 0;
	}
	w->a.entries++;
	/* Judged at its other half (walk 0 cleared an earlier agent's
	 * marks). */
	if (v->sweep_mark == w->a.mark)
		return 0;
	if (v->sweep_mark)
		v->sweep_mark = 0;
	/* The two halves of a flow share its start. A forward entry with
	 * another start is another flow's: the one a replay moved off the
	 * reverse entry's backend, which has its own reverse entry. */
	if (k->dir == PB_DIR_REV) {
		struct ct_key fk;
		fwd_key(&fk, k, v);
		struct ct_value *f = bpf_map_lookup_elem(&pb_ct_v2, &fk);
		if (f && f->created_ns != v->created_ns)
			f = NULL;
		sweep_flow(w, k, v, &fk, f, 1);
		return 0;
	}
	if (k->dir != PB_DIR_FWD)
		return 0;
	struct ct_key rk;
	rev_key(&rk, k, v);
	struct ct_value *r = bpf_map_lookup_elem(&pb_ct_v2, &rk);
	if (r && r->created_ns == v->created_ns) {
		sweep_flow(w, &rk, r, k, v, 0);
		return 0;
	}
	/* Without its reverse half (the LRU took it, or a replay moved the
	 * flow and the new backend has not answered): judged by walk 2. */
	if (bpf_map_update_elem(&pb_ct_sweep_lone, k, &v->created_ns, BPF_ANY))
		w->a.failed |= PB_SWEEP_FAIL_LONE;
	return 0;
}

/* ct_sweep_lone judges a forward entry walk 1 found without its reverse
 * half, if it is still there. */
static long ct_sweep_lone(struct bpf_map *map, const struct ct_key *k, __u64 *created, void *ctx)
{
	struct ct_sweep_walk *w = sweep_state();
	if (!w)
		return 1;
	struct ct_value *v = bpf_map_lookup_elem(&pb_ct_v2, k);
	if (!v)
		return 0;
	if (v->created_ns != *created) {
		/* A new flow on the tuple since walk 1: young, in use. */
		sweep_use(w, k, v->svc_id, v->backend_id);
		return 0;
	}
	if (bpf_map_lookup_elem(&pb_ct_sweep_apart, k))
		return 0;
	/* Whether a live reverse entry names it is not known: left to the
	 * agent's own sweep (ErrSweepIncomplete). */
	if (w->a.failed & PB_SWEEP_FAIL_APART)
		return 0;
	/* Without its reverse half: the closed timeout; until then it keeps
	 * its ids. */
	if ((__s64)(w->a.now_coarse - v->last_seen_ns) > (__s64)w->a.tcp_closed) {
		/* Unless its reverse half is there after all: walk 1 did not see
		 * it (the datapath's churn moved the walk past it, or made it
		 * since). The flow is judged at the next sweep; meanwhile it
		 * lives. */
		struct ct_key rk;
		rev_key(&rk, k, v);
		struct ct_value *r = bpf_map_lookup_elem(&pb_ct_v2, &rk);
		if (r && r->created_ns == v->created_ns) {
			sweep_use(w, k, v->svc_id, v->backend_id);
			return 0;
		}
		/* Not the table this walk is on: deleted at once. */
		bpf_map_delete_elem(&pb_ct_v2, k);
		w->a.expired++;
		return 0;
	}
	sweep_use(w, k, v->svc_id, v->backend_id);
	return 0;
}

static long ct_sweep_flow(struct bpf_map *map, const struct ct_key *k, struct flow_value *fv, void *ctx)
{
	struct ct_sweep_walk *w = sweep_state();
	if (!w)
		return 1;
	sweep_settle(w, NULL);
	/* Its flow lives if its forward entry does, or a live reverse entry
	 * still names its key; a young entry may be a flow being created (its
	 * pb_flows entry is written before its conntrack entries). */
	if (bpf_map_lookup_elem(&pb_ct_v2, k) || bpf_map_lookup_elem(&pb_ct_sweep_apart, k) ||
	    (__s64)(w->a.now_mono - fv->created_ns) < (__s64)w->a.orphan) {
		w->a.counted++;
		sweep_use(w, k, fv->svc_id, fv->backend_id);
		return 0;
	}
	if (w->a.failed & PB_SWEEP_FAIL_APART)
		return 0; /* as in walk 2 */
	w->pend_flow = *k;
	w->pend_fv = *fv;
	w->has_pend_flow = 1;
	return 0;
}

/* sweep_clear empties the map it walks: pb_ct_sweep_apart,
 * pb_ct_sweep_lone and pb_ct_inuse_vips alike. */
static long sweep_clear(struct bpf_map *map, const void *k, void *v, void *ctx)
{
	bpf_map_delete_elem(map, k);
	return 0;
}

static long sweep_clear_mark(struct bpf_map *map, const struct ct_key *k, struct ct_value *v, void *ctx)
{
	if (v->sweep_mark)
		v->sweep_mark = 0;
	return 0;
}

static long sweep_clear_word(__u32 i, void *ctx)
{
	__u32 zero = 0;
	struct ct_inuse *u = bpf_map_lookup_elem(&pb_ct_inuse, &zero);
	if (!u)
		return 1;
	if (i < PB_MAX_SERVICES / 64)
		u->svc[i] = 0;
	if (i < PB_MAX_BACKENDS / 64)
		u->be[i] = 0;
	return 0;
}

SEC("syscall")
int pb_ct_sweep_run(struct ct_sweep_args *a)
{
	if (a->walk == 0) {
		bpf_for_each_map_elem(&pb_ct_v2, sweep_clear_mark, NULL, 0);
		return 0;
	}
	struct ct_sweep_walk *w = sweep_state();
	if (!w)
		return 1;
	switch (a->walk) {
	case 1:
		__builtin_memset(w, 0, sizeof(*w));
		w->a = *a;
		w->a.entries = w->a.expired = w->a.released = w->a.counted = w->a.failed = 0;
		bpf_for_each_map_elem(&pb_ct_sweep_apart, sweep_clear, NULL, 0);
		bpf_for_each_map_elem(&pb_ct_sweep_lone, sweep_clear, NULL, 0);
		bpf_for_each_map_elem(&pb_ct_inuse_vips, sweep_clear, NULL, 0);
		bpf_loop(PB_MAX_BACKENDS / 64, sweep_clear_word, NULL, 0);
		/* entries: the table's size when the sweep began (on a table
		 * the datapath changes meanwhile, about): every entry the walk
		 * came to, and those it deleted before it came to them. */
		bpf_for_each_map_elem(&pb_ct_v2, ct_sweep_entry, NULL, 0);
		sweep_settle(w, NULL);
		break;
	case 2:
		bpf_for_each_map_elem(&pb_ct_sweep_lone, ct_sweep_lone, NULL, 0);
		break;
	case 3:
		bpf_for_each_map_elem(&pb_flows, ct_sweep_flow, NULL, 0);
		sweep_settle(w, NULL);
		break;
	default:
		return 1;
	}
	a->entries = w->a.entries;
	a->expired = w->a.expired;
	a->released = w->a.released;
	a->counted = w->a.counted;
	a->failed = w->a.failed;
	return 0;
}
