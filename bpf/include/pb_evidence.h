/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* What counts as a backend's answer and what a client may end: the
 * sequence rules for RSTs and the reply's side of the node.
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_EVIDENCE_H
#define PB_EVIDENCE_H

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
 * is looked up once per flow, not per packet; not for a reply that came
 * through a tunnel (outer_saddr, its outer source): the uplink it arrived
 * on carries every node's, so it is looked up each time. */
static __always_inline int reply_side_ok(struct xdp_md *ctx, __u32 ifindex, __u32 family, __u32 outer_saddr,
					 struct ct_value *rv)
{
	if (!outer_saddr && rv->reply_ifindex == ifindex)
		return 1;
	struct config *cfg = config();
	if (cfg && (cfg->flags & PB_CFG_RPF) && !pb_reverse_path_ok(ctx, family, outer_saddr))
		return 0;
	if (!outer_saddr)
		rv->reply_ifindex = ifindex;
	return 1;
}

#endif /* PB_EVIDENCE_H */
