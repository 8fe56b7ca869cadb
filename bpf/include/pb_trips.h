/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Kernel trips (an endpoint ejected at its maxFailures-th failure, within
 * the service's budget) and a flow's end.
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_TRIPS_H
#define PB_TRIPS_H

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
	/* An entry with no family is no endpoint of the agent's (cleared, or
	 * never written: an id a flow kept from before its map was recreated),
	 * though its zeroed state reads PB_BE_ACTIVE. */
	struct backend *be = bpf_map_lookup_elem(&pb_backends, &bid);
	if (!be || !be->family || be->state != PB_BE_ACTIVE)
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

/* fin_seen keeps what a FIN asks to be acknowledged, so that the flow's
 * entries go at the ACK that completes its close (PB_CT_LAST_ACK) instead
 * of waiting a closed flow's timeout for the sweep: at ten thousand
 * connections a second those are most of the table, and most of the
 * sweep's work. old: the flow's flags before this FIN's bit (mine) was
 * set; other: the other side's FIN bit; fk: the forward key; rv: the
 * reverse entry; sum_ok: the FIN's checksum is right (asked of the
 * second FIN only). The first FIN of the flow keeps its end in the
 * forward entry. The second arms the other side's ACK (the client's, when the
 * second FIN is the backend's) only if it acknowledges exactly that end
 * and its checksum is right: a FIN again, one that does not acknowledge
 * the other's (a simultaneous close), one a client forged with a guessed
 * sequence number or a wrong checksum arms nothing, and the entries stay
 * for the sweep, as before. So do a flow reset first, and halves of two
 * flows (another flow's forward entry under the key). */
static __always_inline void fin_seen(const struct pkt *p, __u32 old, __u32 mine, __u32 other,
				     const struct ct_key *fk, struct ct_value *rv, __u32 seq, __u32 ack,
				     int sum_ok)
{
	if (old & (mine | PB_CT_CLOSED))
		return;
	int first = !(old & other);
	if (!first && !(p->tcp_flags & TCP_ACK))
		return;
	struct ct_value *fv = bpf_map_lookup_elem(&pb_ct_v2, fk);
	if (!fv || fv->created_ns != rv->created_ns)
		return;
	__u32 end = seq + p->payload + 1;
	if (first) {
		fv->backend_isn = end;
		return;
	}
	if (ack != fv->backend_isn || !sum_ok)
		return;
	fv->backend_isn = end;
	__sync_fetch_and_or(mine == PB_CT_FIN_REV ? &fv->flags : &rv->flags, PB_CT_LAST_ACK);
}

#endif /* PB_TRIPS_H */
