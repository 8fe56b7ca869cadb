/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Outcome events to the agent (pb_events).
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_EVENTS_H
#define PB_EVENTS_H

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
	 * the next failure or the reader's periodic poll (tens of
	 * milliseconds). A probe's events wake it too: its verdict takes an
	 * endpoint out of probation, and probes are few. */
	__u64 wake = (type == PB_EV_REFUSED || type == PB_EV_RESET || type == PB_EV_SYN_RETRANS ||
		      (flags & PB_EVF_PROBE))
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

#endif /* PB_EVENTS_H */
