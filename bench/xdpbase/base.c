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
