//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Baselines for the per-packet benchmark (bench/packet.go), measured in the
 * same run as the datapath:
 *
 *   xdp_pass   returns XDP_PASS: the cost of BPF_PROG_TEST_RUN itself.
 *   min_dnat   the least an L4 DNAT can do: parse Ethernet/IPv4/TCP or UDP,
 *              one hash lookup on (daddr, dport, proto), rewrite daddr and
 *              dport with incremental IPv4 and L4 checksum updates, XDP_PASS.
 *              No conntrack, no counters, no events. A packet that matches
 *              no entry leaves with XDP_PASS after the failed lookup (the
 *              floor for pass-through traffic).
 *   lb_new     the conntracking floor, new flow: the least any load
 *              balancer that keeps flows does for a flow's first packet.
 *              Parse as min_dnat, one VIP hash lookup, one hash of the
 *              5-tuple, one Maglev read (a flat ARRAY of backend ids, see
 *              below), one backend ARRAY read, one LRU_HASH insert of the
 *              flow (5-tuple -> backend), the DNAT rewrite, XDP_PASS (the
 *              verdict pb_xdp returns in the benchmark: no redirect set).
 *              No lookup of the flow first (a SYN is taken as new, as
 *              Katran does), no clock, no counter, no event.
 *   lb_known   its known-flow twin: parse, one LRU_HASH lookup of the
 *              5-tuple, the rewrite, XDP_PASS; a miss passes untouched.
 *   lb_new_wide, lb_known_wide
 *              the same with the flow keyed as pb_ct_v2 keys it (40 bytes:
 *              16-byte addresses of either family, ports, protocol,
 *              direction, family) in a table of its own: a diagnostic of
 *              what the key's size costs, not the floor.
 *   emit_event reserves, fills and submits one 40-byte outcome event on
 *              the ring buffer exactly as the datapath's emit() does, and
 *              nothing else: loaded with the datapath's pb_events in place
 *              of its own events map, it drives the ring buffer and the
 *              agent's reader far faster than whole new flows can.
 *
 * Compiled with the datapath's flags (-O2 -mcpu=v3), see gen.go.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct dnat_key {
	__be32 addr;
	__be16 port;
	__u8 proto;
	__u8 pad;
};

struct dnat_value {
	__be32 addr;
	__be16 port;
	__u16 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct dnat_key);
	__type(value, struct dnat_value);
	__uint(max_entries, 65536);
} dnat SEC(".maps");

/* The datapath's struct event (bpf/include/pb_structs.h), 40 bytes. */
struct event {
	__u64 ts_ns;
	__u32 svc_id;
	__u32 backend_id;
	__u8 client[16];
	__be16 client_port;
	__u8 type;
	__u8 flags;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22);
} events SEC(".maps");

/* Events that found the ring full. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} emit_lost SEC(".maps");

static __u32 seq;

/*
 * The conntracking floor's maps. Each is the cheapest layout a real
 * IPv4 load balancer could ship:
 *
 * lb_vips     (VIP, port, proto) -> the service's Maglev table: where it
 *             starts in lb_maglev and its size. A hash (a VIP is any
 *             address), preallocated.
 * lb_maglev   every service's Maglev table in one flat ARRAY, service s's
 *             slot i at base(s) + i: one array read, which the verifier
 *             inlines (no helper call), where an array of maps needs a
 *             helper call for the inner lookup after the outer one. The
 *             price is a fixed size (services x table size, 4 B a slot:
 *             64 MiB for 1,024 services of 16,381 slots) and a table
 *             replaced by rewriting slots in place (or by flipping
 *             between two halves in the service's value).
 * lb_backends backend id -> address and port: an ARRAY (inlined read).
 * lb_flows    the flow table: an LRU_HASH keyed by the IPv4 5-tuple (16
 *             bytes: jhash is linear in key length, and an IPv6 table
 *             would be a map of its own, as Cilium keeps CT4 and CT6), the
 *             value the backend's address and port (the known flow needs
 *             no second read). One entry per flow. The common LRU (no
 *             BPF_F_NO_COMMON_LRU), as pb_ct_v2. Its size is set at load
 *             (the bench uses pb_ct_v2's).
 */
struct lb_vip_key {
	__be32 addr;
	__be16 port;
	__u8 proto;
	__u8 pad;
};

struct lb_vip {
	__u32 base; /* the table's first slot in lb_maglev */
	__u32 size; /* slots (a prime) */
};

struct lb_flow_key {
	__be32 src;
	__be32 dst;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 pad[3];
};

struct lb_backend {
	__be32 addr;
	__be16 port;
	__u16 pad;
};

/* pb_ct_v2's key layout (bpf/include/pb_structs.h struct ct_key). */
struct lb_wide_key {
	__u32 src[4];
	__u32 dst[4];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 dir;
	__u8 family;
	__u8 pad;
};

#define LB_MAGLEV_SLOTS (4 * 16381)

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb_vip_key);
	__type(value, struct lb_vip);
	__uint(max_entries, 1024);
} lb_vips SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, LB_MAGLEV_SLOTS);
} lb_maglev SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct lb_backend);
	__uint(max_entries, 4096);
} lb_backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct lb_flow_key);
	__type(value, struct lb_backend);
	__uint(max_entries, 262144);
} lb_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct lb_wide_key);
	__type(value, struct lb_backend);
	__uint(max_entries, 262144);
} lb_flows_wide SEC(".maps");

/* The wide key of a flow key, as pb_xdp fills it (dir 0: forward, family
 * 1: IPv4). */
static __always_inline void wide_key(struct lb_wide_key *w, const struct lb_flow_key *k)
{
	w->src[0] = k->src;
	w->dst[0] = k->dst;
	w->sport = k->sport;
	w->dport = k->dport;
	w->proto = k->proto;
	w->family = 1;
}

static __always_inline __u16 fold(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* RFC 1624, eqn. 3. */
static __always_inline void csum_replace4(__sum16 *sum, __be32 from, __be32 to)
{
	__u32 s = (__u16)~*sum;
	s += (~from & 0xffff) + (~from >> 16);
	s += (to & 0xffff) + (to >> 16);
	*sum = ~fold(s);
}

static __always_inline void csum_replace2(__sum16 *sum, __be16 from, __be16 to)
{
	__u32 s = (__u16)~*sum;
	s += (__u16)~from;
	s += to;
	*sum = ~fold(s);
}

/* A 32-bit finaliser (xor-shift-multiply) over the 5-tuple's words: three
 * multiplies per word, enough to spread client ports over a table's
 * slots. */
static __always_inline __u32 mix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x7feb352dU;
	h ^= h >> 15;
	h *= 0x846ca68bU;
	h ^= h >> 16;
	return h;
}

static __always_inline __u32 flow_hash(const struct lb_flow_key *k)
{
	__u32 h = mix32(k->src ^ 0x9e3779b9U);
	h = mix32(h ^ k->dst);
	return mix32(h ^ ((__u32)k->sport << 16 | k->dport) ^ k->proto);
}

/* lb_parse is min_dnat's parse, filling the flow key; the L4 checksum
 * field and the ports in *l4csum and *ports. 0 for an IPv4 TCP/UDP
 * packet. */
static __always_inline int lb_parse(struct xdp_md *ctx, struct iphdr **ipp, __be16 **portsp,
				    __sum16 **l4csum, struct lb_flow_key *k)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return -1;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->ihl != 5)
		return -1;
	__be16 *ports = (void *)(ip + 1);
	if (ip->protocol == IPPROTO_TCP) {
		struct tcphdr *tcp = (void *)ports;
		if ((void *)(tcp + 1) > data_end)
			return -1;
		*l4csum = &tcp->check;
	} else if (ip->protocol == IPPROTO_UDP) {
		struct udphdr *udp = (void *)ports;
		if ((void *)(udp + 1) > data_end)
			return -1;
		*l4csum = &udp->check;
	} else {
		return -1;
	}
	k->src = ip->saddr;
	k->dst = ip->daddr;
	k->sport = ports[0];
	k->dport = ports[1];
	k->proto = ip->protocol;
	*ipp = ip;
	*portsp = ports;
	return 0;
}

/* lb_rewrite is min_dnat's rewrite: destination to be, checksums updated
 * incrementally. */
static __always_inline void lb_rewrite(struct iphdr *ip, __be16 *ports, __sum16 *l4csum,
				       const struct lb_backend *be)
{
	csum_replace4(l4csum, ip->daddr, be->addr);
	csum_replace2(l4csum, ports[1], be->port);
	csum_replace4(&ip->check, ip->daddr, be->addr);
	ip->daddr = be->addr;
	ports[1] = be->port;
}

/* lb_pick is lb_new up to the backend: the VIP lookup and the Maglev
 * read. */
static __always_inline struct lb_backend *lb_pick(const struct lb_flow_key *k)
{
	struct lb_vip_key vk = {.addr = k->dst, .port = k->dport, .proto = k->proto};
	struct lb_vip *vip = bpf_map_lookup_elem(&lb_vips, &vk);
	if (!vip || !vip->size)
		return 0;
	__u32 slot = vip->base + flow_hash(k) % vip->size;
	__u32 *id = bpf_map_lookup_elem(&lb_maglev, &slot);
	if (!id)
		return 0;
	struct lb_backend *be = bpf_map_lookup_elem(&lb_backends, id);
	if (!be || !be->addr)
		return 0;
	return be;
}

SEC("xdp")
int lb_new(struct xdp_md *ctx)
{
	struct iphdr *ip;
	__be16 *ports;
	__sum16 *l4csum;
	struct lb_flow_key k = {};
	if (lb_parse(ctx, &ip, &ports, &l4csum, &k))
		return XDP_PASS;
	struct lb_backend *be = lb_pick(&k);
	if (!be)
		return XDP_PASS;
	bpf_map_update_elem(&lb_flows, &k, be, BPF_ANY);
	lb_rewrite(ip, ports, l4csum, be);
	return XDP_PASS;
}

SEC("xdp")
int lb_known(struct xdp_md *ctx)
{
	struct iphdr *ip;
	__be16 *ports;
	__sum16 *l4csum;
	struct lb_flow_key k = {};
	if (lb_parse(ctx, &ip, &ports, &l4csum, &k))
		return XDP_PASS;
	struct lb_backend *be = bpf_map_lookup_elem(&lb_flows, &k);
	if (!be)
		return XDP_PASS;
	lb_rewrite(ip, ports, l4csum, be);
	return XDP_PASS;
}

SEC("xdp")
int lb_new_wide(struct xdp_md *ctx)
{
	struct iphdr *ip;
	__be16 *ports;
	__sum16 *l4csum;
	struct lb_flow_key k = {};
	if (lb_parse(ctx, &ip, &ports, &l4csum, &k))
		return XDP_PASS;
	struct lb_backend *be = lb_pick(&k);
	if (!be)
		return XDP_PASS;
	struct lb_wide_key w = {};
	wide_key(&w, &k);
	bpf_map_update_elem(&lb_flows_wide, &w, be, BPF_ANY);
	lb_rewrite(ip, ports, l4csum, be);
	return XDP_PASS;
}

SEC("xdp")
int lb_known_wide(struct xdp_md *ctx)
{
	struct iphdr *ip;
	__be16 *ports;
	__sum16 *l4csum;
	struct lb_flow_key k = {};
	if (lb_parse(ctx, &ip, &ports, &l4csum, &k))
		return XDP_PASS;
	struct lb_wide_key w = {};
	wide_key(&w, &k);
	struct lb_backend *be = bpf_map_lookup_elem(&lb_flows_wide, &w);
	if (!be)
		return XDP_PASS;
	lb_rewrite(ip, ports, l4csum, be);
	return XDP_PASS;
}

SEC("xdp")
int xdp_pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

SEC("xdp")
int min_dnat(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->ihl != 5)
		return XDP_PASS;

	__be16 *ports = (void *)(ip + 1);
	__sum16 *l4csum;
	if (ip->protocol == IPPROTO_TCP) {
		struct tcphdr *tcp = (void *)ports;
		if ((void *)(tcp + 1) > data_end)
			return XDP_PASS;
		l4csum = &tcp->check;
	} else if (ip->protocol == IPPROTO_UDP) {
		struct udphdr *udp = (void *)ports;
		if ((void *)(udp + 1) > data_end)
			return XDP_PASS;
		l4csum = &udp->check;
	} else {
		return XDP_PASS;
	}

	struct dnat_key k = {.addr = ip->daddr, .port = ports[1], .proto = ip->protocol};
	struct dnat_value *v = bpf_map_lookup_elem(&dnat, &k);
	if (!v)
		return XDP_PASS;

	csum_replace4(l4csum, ip->daddr, v->addr);
	csum_replace2(l4csum, ports[1], v->port);
	csum_replace4(&ip->check, ip->daddr, v->addr);
	ip->daddr = v->addr;
	ports[1] = v->port;
	return XDP_PASS;
}

SEC("xdp")
int emit_event(struct xdp_md *ctx)
{
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__u32 k = 0;
		__u64 *lost = bpf_map_lookup_elem(&emit_lost, &k);
		if (lost)
			(*lost)++;
		return XDP_PASS;
	}
	__builtin_memset(e, 0, sizeof(*e));
	__u32 n = __sync_fetch_and_add(&seq, 1);
	e->ts_ns = bpf_ktime_get_ns();
	e->svc_id = 1;
	e->backend_id = 1;
	e->client[0] = 198;
	e->client[1] = 18;
	e->client[2] = 128 | (n >> 24);
	e->client[3] = n >> 16;
	e->client_port = (__be16)n;
	e->type = 1; /* PB_EV_NEW_FLOW */
	bpf_ringbuf_submit(e, 0);
	return XDP_PASS;
}
