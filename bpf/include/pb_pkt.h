/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The packet as parsed (struct pkt) and the per-run accessors of the maps
 * every part uses (stats, scratch, config, interfaces).
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_PKT_H
#define PB_PKT_H

#define TCP_FIN 0x01
#define TCP_SYN 0x02
#define TCP_RST 0x04
#define TCP_ACK 0x10

#define IP_MF 0x2000
#define IP_OFFSET 0x1fff

#ifndef AF_INET
#define AF_INET 2
#endif

/* The IPv6 header (linux/ipv6.h would pull libc's headers in), with its
 * addresses as the maps' union addr. */
struct pb_ipv6hdr {
	__u8 vtc;       /* version, traffic class */
	__u8 flow[3];
	__be16 payload_len;
	__u8 nexthdr;
	__u8 hop_limit;
	union addr saddr;
	union addr daddr;
};

#define ETH_P_IPV6_BE bpf_htons(0x86DD)
#ifndef AF_INET6
#define AF_INET6 10
#endif

/* A parsed IPv4 or IPv6 TCP/UDP packet. Pointers are into the packet and
 * were bounds-checked by parse(); ip is set for IPv4, ip6 for IPv6. */
struct pkt {
	struct ethhdr *eth;
	struct iphdr *ip;
	/* The outer header of an IPIP packet whose inner one is ip (a reply
	 * that came through a pod network's tunnel); 0 for anything else. */
	struct iphdr *outer;
	struct pb_ipv6hdr *ip6;
	__be16 *ports;    /* [0] source, [1] destination */
	void *end;        /* the packet's end, for reads beyond what every path checked */
	__sum16 *l4csum;  /* TCP or UDP checksum field */
	__u32 payload;    /* L4 payload bytes */
	__u32 len;        /* IP total length (IPv6: header + payload) */
	__u32 l4len;      /* L4 header and payload */
	/* The family (PB_AF_INET or PB_AF_INET6) and protocol each in a word
	 * of its own: the verifier tracks a whole-word store exactly, so where
	 * they are read back from the stack it knows, path by path, which of
	 * ip and ip6 is set and how much of the L4 header parse checked (a
	 * byte stored beside others it would not). */
	__u64 family;
	__u64 proto;
	__u8 tcp_flags;
	__u8 partial;     /* L4 checksum left to the device (see l4csum_replace) */
	__u32 ifindex;    /* ingress interface */
};

/* The packet's source and destination as map addresses, into a zeroed
 * src and dst (an IPv4 address fills only their first word). */
static __always_inline void pkt_addrs(const struct pkt *p, union addr *src, union addr *dst)
{
	if (p->family == PB_AF_INET6) {
		*src = p->ip6->saddr;
		*dst = p->ip6->daddr;
		return;
	}
	src->v4 = p->ip->saddr;
	dst->v4 = p->ip->daddr;
}

static __always_inline struct global_stats *gstats(void)
{
	__u32 k = 0;
	return bpf_map_lookup_elem(&pb_stats_v2, &k);
}

/* svc_counters and be_counters are a service's and a backend's counters on this
 * CPU: one slot of a block (see PB_STATS_BLOCK). */
static __always_inline struct svc_stats *svc_counters(__u32 id)
{
	__u32 k = id / PB_STATS_BLOCK;
	struct svc_stats_block *b = bpf_map_lookup_elem(&pb_svc_stats_v2, &k);
	return b ? &b->s[id % PB_STATS_BLOCK] : 0;
}

static __always_inline struct be_stats *be_counters(__u32 id)
{
	__u32 k = id / PB_STATS_BLOCK;
	struct be_stats_block *b = bpf_map_lookup_elem(&pb_be_stats_v2, &k);
	return b ? &b->b[id % PB_STATS_BLOCK] : 0;
}

/* scratch is this CPU's room for the largest temporaries. XDP runs to the
 * end on its CPU without another XDP program interleaving (softirq, or
 * BPF_PROG_RUN's live frames with bottom halves off), so one per CPU is
 * enough. */
_Static_assert(sizeof(((struct scratch *)0)->fib) == sizeof(struct bpf_fib_lookup), "scratch fib");

static __always_inline struct scratch *scratch(void)
{
	__u32 k = 0;
	return bpf_map_lookup_elem(&pb_scratch, &k);
}

static __always_inline struct config *config(void)
{
	__u32 k = 0;
	return bpf_map_lookup_elem(&pb_config_v2, &k);
}

/* The coarse clock (bpf_ktime_get_coarse_ns), read at most once a jiffy.
 * bpf_jiffies64 is a single load once JITed (the verifier inlines it),
 * while the clock is a helper call: a sixth of an established packet's
 * cost. The coarse clock moves only with the tick that moves jiffies, so
 * what this returns is as fresh as the clock itself (a tick late at most,
 * when jiffies moved before the clock did). One copy for all CPUs: it is
 * written once a jiffy, read by every packet. Racing writers store the
 * same value; a reader seeing a new jiffies with the old time is a tick
 * late, which no user of this clock minds (refreshes once a second, the
 * SYN guard's windows, the dead-man's bound). */
struct pb_clock {
	__u64 jiffies;
	__u64 ns;
};
struct pb_clock pb_clock;

static __always_inline __u64 coarse_now(void)
{
	__u64 j = bpf_jiffies64();
	if (j == pb_clock.jiffies)
		return pb_clock.ns;
	__u64 ns = bpf_ktime_get_coarse_ns();
	pb_clock.ns = ns;
	pb_clock.jiffies = j;
	return ns;
}

/* partial_iface says whether a local sender on ifindex may leave its L4
 * checksum to the device (PB_IF_PARTIAL). */
static __always_inline int partial_iface(__u32 ifindex)
{
	struct iface *i = bpf_map_lookup_elem(&pb_ifaces, &ifindex);
	return i && (i->flags & PB_IF_PARTIAL);
}

/* decap_iface says whether IPIP packets arriving on ifindex are a pod
 * network's tunnel traffic, to be parsed inside (a node's uplink; never a
 * pod's veth, where a pod could wrap what it likes). */
static __always_inline int decap_iface(__u32 ifindex)
{
	struct iface *i = bpf_map_lookup_elem(&pb_ifaces, &ifindex);
	return i && (i->flags & PB_IF_DECAP);
}

#endif /* PB_PKT_H */
