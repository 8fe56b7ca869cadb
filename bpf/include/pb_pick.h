/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Choosing a backend for a new flow: the Maglev slot, probes, steering off
 * backends not admitted, the circuit breaker, session affinity; a new
 * flow's conntrack entries and NEW_FLOW event.
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_PICK_H
#define PB_PICK_H

struct pick {
	__u32 id;
	struct backend *be;
	__u8 probe;
};

/* table_key is the pb_maglev key of a service's live table. */
static __always_inline __u32 table_key(const struct svc_value *svc)
{
	return svc->id * 2 + (svc->table & 1);
}

/* table_lookup reads slot of the table at key in outer and returns its
 * backend, if that backend is a live one of service svc_id: a stale table
 * (a fallback, a table being replaced) can hold a cleared id or one since
 * given to another service. */
static __always_inline struct backend *table_lookup(void *outer, __u32 key, __u32 slot, __u32 *id,
						    __u32 svc_id)
{
	void *tbl = bpf_map_lookup_elem(outer, &key);
	if (!tbl)
		return 0;
	__u32 *idp = bpf_map_lookup_elem(tbl, &slot);
	if (!idp || *idp == 0)
		return 0;
	*id = *idp;
	struct backend *be = bpf_map_lookup_elem(&pb_backends, id);
	if (!be || !be->family || be->svc_id != svc_id)
		return 0;
	return be;
}

/* take_slot counts one more flow in c unless it is at limit (0: none). */
static __always_inline int take_slot(struct inflight *c, __u32 limit)
{
	if (!c)
		return 0;
	__s64 old = __sync_fetch_and_add(&c->count, 1);
	if (limit && old >= limit) {
		__sync_fetch_and_add(&c->count, -1);
		return -1;
	}
	return 0;
}

/* scan_entry reads entry k of a service's list: the backend, when it is
 * one of the service's. */
static __always_inline struct backend *scan_entry(const struct scan *sc, const struct svc_backend_key *k,
						  __u32 *id)
{
	__u32 *idp = bpf_map_lookup_elem(&pb_svc_backends, k);
	if (!idp)
		return 0;
	*id = *idp;
	struct backend *be = bpf_map_lookup_elem(&pb_backends, id);
	if (!be || !be->family || be->svc_id != sc->svc_id)
		return 0;
	return be;
}

/* scan_ref is bpf_loop's context for scan_backend: a loop's context must
 * be on the stack, and the walk's state is in the per-CPU scratch (the
 * stack has no room for it beside its callers'). */
struct scan_ref {
	struct scan *sc;
};

static long scan_backend(__u32 i, struct scan_ref *ref)
{
	struct scan *sc = ref->sc;
	if (!sc || !sc->n)
		return 1;
	struct svc_backend_key k = {.svc_id = sc->svc_id, .idx = (sc->start + i) % sc->n};
	__u32 id = 0;
	/* While the agent rewrites the entry, a lookup can miss it (see
	 * service() in lb.c), and one that found it can read the element
	 * after the map recycled it for another key: once more. */
	struct backend *be = scan_entry(sc, &k, &id);
	if (!be)
		be = scan_entry(sc, &k, &id);
	if (!be || id == sc->skip || id == sc->avoid || be->state != PB_BE_ACTIVE)
		return 0;
	if (sc->take && take_slot(bpf_map_lookup_elem(&pb_be_inflight, &id), sc->limit))
		return 0;
	sc->found = id;
	return 1;
}

static __always_inline __u32 scan_count(struct svc_value *svc)
{
	__u32 n = svc->backend_count;
	return n > PB_MAX_SCAN ? PB_MAX_SCAN : n;
}

/* scan_run walks sc's list: 1 when it found a backend (sc->found). */
static __always_inline int scan_run(struct scan *sc)
{
	struct scan_ref ref = {.sc = sc};
	return sc->n && bpf_loop(sc->n, scan_backend, &ref, 0) > 0 && sc->found;
}

#define PB_STEER_TRIES 3

/* pb_pick_backend chooses the backend for a new flow of service svc: the
 * Maglev slot's backend if it is active, or if it is in probation and a
 * grant is left (the flow becomes the probe). Otherwise the flow is
 * steered: first to the same slot of the service's table without
 * probation backends, then to a few rehashed slots, then to the first
 * active backend of the service's list. rq->avoid (0: none) is never
 * picked while another active backend exists: the backend a retried flow
 * leaves. Only when nothing else is found is the flow sent to the slot's
 * backend anyway. The answer is in rq->id and rq->probe; -1: no backend.
 *
 * A global function: the verifier walks it once, with its arguments
 * unknown, instead of once in every path of the program that reaches a
 * new flow (its branches and rehashes were most of the instructions it
 * walked, and of the time it took to load the program). Its frame counts
 * against the 512 bytes of stack with pb_xdp's and scan_backend's (each
 * rounded up to 32 bytes on 6.1): the walk's state is in the scratch,
 * and the total is at the limit, so a new local here or in pb_xdp is
 * likely to be refused at load ("combined stack size"). */
__noinline int pb_pick_backend(struct svc_value *svc, struct pick_req *rq)
{
	if (!svc || !rq)
		return -1;
	__u32 size = svc->table_size;
	if (size == 0)
		return -1;
	__u32 slot = rq->hash % size;
	__u32 id = 0;
	struct backend *be = table_lookup(&pb_maglev, table_key(svc), slot, &id, svc->id);
	if (!be)
		return -1;

	rq->id = id;
	rq->probe = 0;
	if (likely(be->state == PB_BE_ACTIVE && id != rq->avoid))
		return 0;
	/* Steering counts moves off backends that are not active; a retry
	 * leaving an active one is counted as a retry. */
	int off = be->state != PB_BE_ACTIVE;

	if (be->state == PB_BE_PROBATION && rq->may_probe && id != rq->avoid && be->probe_grants > 0 &&
	    __sync_fetch_and_add(&be->probe_grants, -1) > 0) {
		rq->probe = 1;
		struct global_stats *gs = gstats();
		if (gs)
			gs->probe_admitted++;
		return 0;
	}

	__u32 alt_id = 0;
	struct backend *alt = table_lookup(&pb_maglev_fb, svc->id, slot, &alt_id, svc->id);
	if (alt && alt->state == PB_BE_ACTIVE && alt_id != rq->avoid)
		goto steered;

#pragma unroll
	for (__u32 i = 1; i <= PB_STEER_TRIES; i++) {
		alt = table_lookup(&pb_maglev, table_key(svc), jhash_3words(rq->hash, i, 0, rq->seed) % size,
				   &alt_id, svc->id);
		if (alt && alt->state == PB_BE_ACTIVE && alt_id != rq->avoid)
			goto steered;
	}
	struct scratch *scr = scratch();
	if (scr) {
		struct scan *sc = &scr->scan;
		__builtin_memset(sc, 0, sizeof(*sc));
		sc->svc_id = svc->id;
		sc->start = rq->hash;
		sc->n = scan_count(svc);
		sc->avoid = rq->avoid;
		if (scan_run(sc)) {
			alt_id = sc->found;
			goto steered;
		}
	}
	/* Nothing else is active: a retry goes back to the backend it left
	 * rather than to a slot's backend that is not active (in probation
	 * with its grant spent, or ejected). */
	if (rq->avoid && off) {
		alt_id = rq->avoid;
		alt = bpf_map_lookup_elem(&pb_backends, &alt_id);
		if (alt && alt->family && alt->svc_id == svc->id && alt->state == PB_BE_ACTIVE)
			goto steered;
	}
	if (off) {
		struct global_stats *gs = gstats();
		if (gs)
			gs->steer_failed++;
	}
	return 0;
steered:
	rq->id = alt_id;
	if (off) {
		struct global_stats *gs = gstats();
		if (gs)
			gs->steered++;
	}
	return 0;
}

/* pick_backend is pb_pick_backend's answer for a new flow, its backend
 * looked up again (a global function cannot hand back a pointer into a
 * map; pb_backends is an array, the lookup a load). */
static __always_inline int pick_backend(struct scratch *sc, struct svc_value *svc, __u32 hash, __u32 seed,
					int may_probe, __u32 avoid, struct pick *out)
{
	struct pick_req *rq = &sc->pq;
	rq->hash = hash;
	rq->seed = seed;
	rq->avoid = avoid;
	rq->may_probe = may_probe;
	rq->id = 0;
	rq->probe = 0;
	if (pb_pick_backend(svc, rq) < 0)
		return -1;
	__u32 id = rq->id;
	struct backend *be = bpf_map_lookup_elem(&pb_backends, &id);
	if (!be)
		return -1;
	out->id = id;
	out->be = be;
	out->probe = rq->probe;
	return 0;
}

/* addr_eq compares two map addresses (all 16 bytes: an IPv4 one's rest is
 * zero in both). */
static __always_inline int addr_eq(const union addr *a, const union addr *b)
{
	return a->v6[0] == b->v6[0] && a->v6[1] == b->v6[1] && a->v6[2] == b->v6[2] && a->v6[3] == b->v6[3];
}

/* addr_fold is an address in one word: IPv4's own, IPv6's four XORed. */
static __always_inline __u32 addr_fold(const union addr *a, __u8 family)
{
	if (family == PB_AF_INET6)
		return a->v6[0] ^ a->v6[1] ^ a->v6[2] ^ a->v6[3];
	return a->v4;
}

/* fwd_key is rev_key's inverse: the forward (client -> VIP) key of the
 * flow whose reverse entry, keyed rk, holds rv. */
static __always_inline void fwd_key(struct ct_key *fk, const struct ct_key *rk,
				    const struct ct_value *rv)
{
	fk->src = rk->dst;
	fk->dst = rv->nat_addr;
	fk->sport = rk->dport;
	fk->dport = rv->nat_port;
	fk->proto = rk->proto;
	fk->dir = PB_DIR_FWD;
	fk->family = rk->family;
	fk->pad = 0;
}

static __always_inline void rev_key(struct ct_key *rk, const struct ct_key *fk,
				    const struct ct_value *fv)
{
	rk->src = fv->nat_addr;
	rk->dst = fk->src;
	rk->sport = fv->nat_port;
	rk->dport = fk->sport;
	rk->proto = fk->proto;
	rk->dir = PB_DIR_REV;
	rk->family = fk->family;
	rk->pad = 0;
}

static __always_inline void inflight_add(void *map, __u32 id, __s64 d)
{
	struct inflight *c = bpf_map_lookup_elem(map, &id);
	if (c)
		__sync_fetch_and_add(&c->count, d);
}

/* release_flow gives back a counted flow's circuit-breaker slot and
 * says whether it did. Whoever deletes the pb_flows entry releases it (the
 * datapath on FIN or RST, the sweep on expiry), so it happens exactly
 * once. With check_start, only an entry with that start (created_ns):
 * the sweep's, which judged the entry a while before. */
static __always_inline int release_flow(const struct ct_key *fk, __u64 created_ns, int check_start)
{
	/* Programs have no lookup-and-delete for hashes. Between the lookup
	 * and the delete, another releaser of the same flow would have to
	 * delete it and a new flow on the same tuple be counted for this to
	 * release the wrong ids: nanoseconds apart, on one tuple. */
	struct flow_value *fl = bpf_map_lookup_elem(&pb_flows, fk);
	if (!fl || (check_start && fl->created_ns != created_ns))
		return 0;
	__u32 svc = fl->svc_id, be = fl->backend_id;
	if (bpf_map_delete_elem(&pb_flows, fk))
		return 0;
	inflight_add(&pb_svc_inflight, svc, -1);
	inflight_add(&pb_be_inflight, be, -1);
	return 1;
}

static __always_inline void release(const struct ct_key *fk)
{
	release_flow(fk, 0, 0);
}

/* backend_slot takes a slot on the picked backend or, when it is at its
 * per-endpoint limit, on the first active backend of the service with
 * room (a scan of the service's backend list from a hashed start, so the
 * overflow spreads). Returns -1 when every backend is full. */
static __always_inline int backend_slot(struct scratch *scr, struct svc_value *svc, __u32 hash,
					__u32 avoid, struct pick *pk)
{
	__u32 limit = svc->max_inflight_per_backend;
	if (!take_slot(bpf_map_lookup_elem(&pb_be_inflight, &pk->id), limit))
		return 0;
	if (pk->probe) {
		/* The probe cannot go to its backend: the grant is not spent. */
		__sync_fetch_and_add(&pk->be->probe_grants, 1);
		pk->probe = 0;
	}
	struct scan *sc = &scr->scan;
	__builtin_memset(sc, 0, sizeof(*sc));
	sc->svc_id = svc->id;
	sc->start = hash;
	sc->n = scan_count(svc);
	sc->limit = limit;
	sc->skip = pk->id;
	sc->avoid = avoid;
	sc->take = 1;
	if (!scan_run(sc))
		return -1;
	__u32 id = sc->found;
	struct backend *be = bpf_map_lookup_elem(&pb_backends, &id);
	if (!be) {
		inflight_add(&pb_be_inflight, id, -1);
		return -1;
	}
	pk->id = id;
	pk->be = be;
	pk->probe = 0;
	return 0;
}

#define PB_NO_BACKEND -1
#define PB_OVER_LIMIT -2

/* affinity_pick: for a service with sessionAffinity ClientIP, the backend
 * of the client's last new flow, when that was less than the service's
 * timeout ago and the backend is still an active one of the service (not
 * avoid). Accrual wins over affinity: an ejected or probation backend is
 * not returned, the flow gets a fresh pick, and the client is pinned to
 * that one (affinity_set). The key is left in the scratch's ak, the
 * client's pin, if it has one, in *pin. */
static __always_inline int affinity_pick(struct scratch *sc, struct svc_value *svc, const struct ct_key *fk,
					 __u32 avoid, __u64 now, struct pick *out, struct affinity_value **pin)
{
	struct affinity_key *k = &sc->ak;
	__builtin_memset(k, 0, sizeof(*k));
	k->client = fk->src;
	k->svc_id = svc->id;
	k->family = fk->family;
	struct affinity_value *v = bpf_map_lookup_elem(&pb_affinity, k);
	*pin = v;
	if (!v)
		return -1;
	/* Signed: another CPU may have stamped it a moment after now. */
	if ((__s64)(now - v->last_ns) >= (__s64)svc->affinity_timeout_s * 1000000000LL)
		return -1;
	__u32 id = v->backend_id;
	if (!id || id == avoid)
		return -1;
	struct backend *be = bpf_map_lookup_elem(&pb_backends, &id);
	if (!be || !be->family || be->svc_id != svc->id || be->state != PB_BE_ACTIVE)
		return -1;
	out->id = id;
	out->be = be;
	out->probe = 0;
	return 0;
}

/* affinity_set pins the client of key sc->ak to backend id from now on.
 * A pin the client has (pin) is written in place: an update of an LRU
 * map takes a free element and frees the old one, each under a lock, for
 * two words. What that gives up, rarely:
 * - a reader between the two stores may see one of them only: at worst
 *   it follows the pin's old backend while that is still active, as two
 *   racing flows of the client could before;
 * - an LRU reuses a freed element at once. If the pin was freed since
 *   the lookup (the agent forgetting the service's pins, or a full map's
 *   eviction for another CPU's insert) and reused, this writes another
 *   pin: affinity_pick follows it only to an active backend of its own
 *   service, so at worst another client of this service is pinned to
 *   this flow's backend; and this client's next flow picks afresh. */
static __always_inline void affinity_set(struct scratch *sc, struct affinity_value *pin, __u32 id, __u64 now)
{
	if (pin) {
		if (pin->backend_id != id)
			pin->backend_id = id;
		pin->last_ns = now;
		return;
	}
	sc->av.backend_id = id;
	sc->av.pad = 0;
	sc->av.last_ns = now;
	bpf_map_update_elem(&pb_affinity, &sc->ak, &sc->av, BPF_ANY);
}

static __always_inline void count_refused(struct svc_value *svc, int over_limit)
{
	struct svc_stats *ss = svc_counters(svc->id);
	if (!ss)
		return;
	if (over_limit)
		ss->over_limit++;
	else
		ss->no_backend++;
}

/* new_flow picks a backend and writes both conntrack entries. A SYN or a
 * first UDP packet is a real new flow (event, counters, circuit breaker,
 * may be a probe); a mid-stream TCP packet without state (conntrack entry
 * lost) only gets a backend. old_rev, when set, is the reverse entry of
 * the backend the flow leaves, avoid a backend not to pick again, ct_flags
 * flags the flow starts with. Returns 0, PB_NO_BACKEND or PB_OVER_LIMIT. */
static __always_inline int new_flow(struct pkt *p, struct svc_value *svc, struct ct_key *fk,
				    int midstream, __u8 ev_flags, struct ct_key *old_rev, int keep_old,
				    __u32 avoid, __u32 ct_flags, struct ct_value *fv,
				    struct global_stats *gs)
{
	/* A flow moving off its backend gives its slot back first. */
	if (old_rev)
		release(fk);

	/* Circuit breaker: one more flow, unless the service is full. Services
	 * without limits pay nothing here. */
	int limited = !midstream && (svc->max_inflight || svc->max_inflight_per_backend);
	if (limited && take_slot(bpf_map_lookup_elem(&pb_svc_inflight, &svc->id), svc->max_inflight)) {
		if (gs)
			gs->inflight_rejected++;
		count_refused(svc, 1);
		return PB_OVER_LIMIT;
	}

	/* The hash's seed is the cluster's secret (pb_config_v2): a client
	 * that knows the tables cannot pick its backend by its source port. */
	struct config *cfg = config();
	__u32 seed = PB_HASH_SEED ^ (cfg ? cfg->hash_seed : 0);
	__u32 hash = jhash_3words(addr_fold(&fk->src, fk->family), addr_fold(&fk->dst, fk->family),
				  ((__u32)fk->sport << 16) | fk->dport, seed ^ fk->proto);
	struct pick pk = {};
	/* A retried client has been refused once: it is not our experiment. */
	int may_probe = !midstream && !(ct_flags & PB_CT_RETRY);
	/* The reverse entry, the affinity key and the pick's request are
	 * built in the per-CPU scratch: the stack (512 bytes for pb_xdp's
	 * inlined frame, pb_pick_backend's and scan_backend's together) has
	 * no room for them. */
	struct scratch *sc = scratch();
	if (!sc) {
		if (limited)
			inflight_add(&pb_svc_inflight, svc->id, -1);
		return PB_NO_BACKEND;
	}
	__u64 now = bpf_ktime_get_ns();
	int sticky = svc->affinity_timeout_s != 0;
	struct affinity_value *pin = NULL;
	if ((!sticky || affinity_pick(sc, svc, fk, avoid, now, &pk, &pin) < 0) &&
	    pick_backend(sc, svc, hash, seed, may_probe, avoid, &pk) < 0) {
		if (limited)
			inflight_add(&pb_svc_inflight, svc->id, -1);
		if (gs)
			gs->no_backend++;
		count_refused(svc, 0);
		return PB_NO_BACKEND;
	}

	__u32 flags = ct_flags;
	if (limited) {
		if (backend_slot(sc, svc, hash, avoid, &pk)) {
			inflight_add(&pb_svc_inflight, svc->id, -1);
			if (gs)
				gs->inflight_rejected++;
			count_refused(svc, 1);
			return PB_OVER_LIMIT;
		}
		struct flow_value fl = {.svc_id = svc->id, .backend_id = pk.id, .created_ns = now};
		if (bpf_map_update_elem(&pb_flows, fk, &fl, BPF_NOEXIST) == 0) {
			flags |= PB_CT_COUNTED;
		} else {
			/* No room to remember it: admit it uncounted, and say so. */
			inflight_add(&pb_svc_inflight, svc->id, -1);
			inflight_add(&pb_be_inflight, pk.id, -1);
			if (gs)
				gs->inflight_untracked++;
		}
	}

	/* Where the flow goes now, past the breaker's moves, is where the
	 * client's next flows go. */
	if (sticky)
		affinity_set(sc, pin, pk.id, now);
	if (pk.probe)
		flags |= PB_CT_PROBE;
	if (svc->flags & PB_SVC_F_RETRY_REFUSED)
		flags |= PB_CT_RETRYABLE;
	if (svc->flags & PB_SVC_F_QUIET_DATA)
		flags |= PB_CT_QUIET_DATA;
	if (svc->flags & PB_SVC_F_QUIET_END)
		flags |= PB_CT_QUIET_END;
	if (midstream)
		flags |= PB_CT_MIDSTREAM | PB_CT_ESTABLISHED;

	__builtin_memset(fv, 0, sizeof(*fv));
	fv->nat_addr = pk.be->addr;
	fv->nat_port = pk.be->port;
	fv->flags = flags;
	fv->svc_id = svc->id;
	fv->backend_id = pk.id;
	fv->created_ns = now;
	fv->last_seen_ns = coarse_now();
	/* The ISN the backend's answers must acknowledge (see handle_reply). */
	struct tcphdr *syn = (void *)p->ports;
	if (p->proto == IPPROTO_TCP && !midstream && (void *)(syn + 1) <= p->end)
		fv->client_isn = bpf_ntohl(syn->seq);

	struct ct_key *rk = &sc->rk;
	struct ct_value *rv = &sc->rv;
	rev_key(rk, fk, fv);
	*rv = *fv;
	rv->nat_addr = fk->dst;
	rv->nat_port = fk->dport;

	if (old_rev && keep_old) {
		/* The backend left it unanswered, may still answer: its entry
		 * stays, marked, so a late SYN-ACK is reported (it answered, late:
		 * no timeout) and kept from the client. The slot went with the
		 * flow. */
		struct ct_value *o = bpf_map_lookup_elem(&pb_ct_v2, old_rev);
		if (o) {
			__sync_fetch_and_and(&o->flags, ~PB_CT_COUNTED);
			__sync_fetch_and_or(&o->flags, PB_CT_MOVED);
		}
	} else if (old_rev) {
		bpf_map_delete_elem(&pb_ct_v2, old_rev);
	}
	if (bpf_map_update_elem(&pb_ct_v2, fk, fv, BPF_ANY) ||
	    bpf_map_update_elem(&pb_ct_v2, rk, rv, BPF_ANY)) {
		if (gs)
			gs->ct_create_failed++;
	}

	if (!midstream) {
		if (pk.probe)
			ev_flags |= PB_EVF_PROBE;
		/* Stamped with the flow's start: the time the agent times the
		 * handshake from is the one conntrack holds. */
		emit_at(PB_EV_NEW_FLOW, ev_flags, svc->id, pk.id, &fk->src, fk->family, fk->sport, gs, now);
		struct svc_stats *ss = svc_counters(svc->id);
		if (ss)
			ss->flows++;
		struct be_stats *bs = be_counters(pk.id);
		if (bs)
			bs->flows++;
	}
	return 0;
}

#endif /* PB_PICK_H */
