/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The SYN guard: sources proven by a backend's payload, and the per-CPU
 * budget for the rest while a flood lasts.
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_SYNGUARD_H
#define PB_SYNGUARD_H

/* trust_source records that addr's flow carried payload from a backend:
 * proof that the address is real and answers (see pb_src_trust). Refreshed
 * at most once a second, in place: an LRU update allocates. */
static __always_inline void trust_source(const union addr *addr, __u8 family)
{
	struct src_key k = {};
	k.addr = *addr;
	k.family = family;
	__u64 now = coarse_now();
	__u64 *seen = bpf_map_lookup_elem(&pb_src_trust, &k);
	if (seen) {
		if (now - *seen > 1000000000ULL)
			*seen = now;
		return;
	}
	bpf_map_update_elem(&pb_src_trust, &k, &now, BPF_NOEXIST);
}

/* syn_guard_drops says whether the SYN for flow fk is to be dropped (it
 * runs before conntrack is read: a dropped SYN costs no bucket walk):
 * the guard is on (a flood: the agent's lease, or this CPU armed it), its
 * source has no recent proof of a real connection, and this CPU's budget
 * for such SYNs is spent. The budget is a GCRA: one SYN per interval_ns,
 * up to burst_ns ahead. */
static __always_inline int syn_guard_drops(const struct ct_key *fk)
{
	__u32 zero = 0;
	struct syn_guard *g = bpf_map_lookup_elem(&pb_syn_guard, &zero);
	if (!g || !g->interval_ns)
		return 0;
	struct syn_guard_cpu *c = bpf_map_lookup_elem(&pb_syn_guard_cpu, &zero);
	if (!c)
		return 0;
	__u64 now = coarse_now();
	/* Arming: every SYN to a service counts, dropped ones too, so the
	 * guard stays armed while the flood lasts. Past arm_syns in a window
	 * the CPU is busy, and only then is each SYN's source looked up with
	 * the guard off: it arms once a quarter of arm_syns more come from
	 * untrusted sources, so a busy node's known clients do not arm it, and
	 * a quiet one pays no lookup. */
	if (now - c->window_ns >= PB_SYN_WINDOW_NS) {
		c->window_ns = now;
		c->window_syns = 0;
		c->window_untrusted = 0;
	}
	c->window_syns++;
	int on = now < g->until_ns || now < c->armed_until_ns;
	int busy = g->arm_syns && c->window_syns > g->arm_syns;
	if (!on && !busy)
		return 0;
	struct src_key k = {};
	k.addr = fk->src;
	k.family = fk->family;
	__u64 *seen = bpf_map_lookup_elem(&pb_src_trust, &k);
	int trusted = seen && now - *seen < g->trust_ns;
	if (busy && !trusted && ++c->window_untrusted > g->arm_syns / 4) {
		if (now >= c->armed_until_ns)
			c->armed++;
		c->armed_until_ns = now + PB_SYN_ARM_HOLD_NS;
		on = 1;
	}
	if (!on)
		return 0;
	if (trusted) {
		c->trusted++;
		return 0;
	}
	__u64 tat = c->tat_ns;
	if (tat < now)
		tat = now;
	if (tat - now > g->burst_ns) {
		c->dropped++;
		return 1;
	}
	c->tat_ns = tat + g->interval_ns;
	c->admitted++;
	return 0;
}

#endif /* PB_SYNGUARD_H */
