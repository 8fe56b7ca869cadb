//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* A test-only tc egress program that holds a backend's SYN-ACKs, IPv4 and
 * IPv6: each one is copied to a ring buffer and dropped, and userspace
 * sends the copy again after a delay, marked so that it passes here. It
 * gives a test a backend whose handshakes are slow, on kernels without
 * sch_netem. */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* FRAME_MAX bounds the copy: a SYN-ACK with every TCP option fits. */
#define FRAME_MAX 128

struct frame {
	__u32 len;
	__u8 data[FRAME_MAX];
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} held SEC(".maps");

/* resend_mark is the mark userspace puts on the copies it sends. */
volatile const __u32 resend_mark = 0x5ac4;

SEC("tc")
int hold_synack(struct __sk_buff *skb)
{
	if (skb->mark == resend_mark)
		return TC_ACT_OK;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_OK;
	struct tcphdr *th;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_TCP || ip->ihl != 5)
			return TC_ACT_OK;
		th = (void *)(ip + 1);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		/* The stack puts no extension header on a SYN-ACK. */
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end || ip6->nexthdr != IPPROTO_TCP)
			return TC_ACT_OK;
		th = (void *)(ip6 + 1);
	} else {
		return TC_ACT_OK;
	}
	if ((void *)(th + 1) > end || !th->syn || !th->ack)
		return TC_ACT_OK;
	__u32 len = skb->len;
	if (len > FRAME_MAX)
		return TC_ACT_OK; /* never for a SYN-ACK; pass rather than lose it */
	/* Two checks on the register the helper gets: clang would otherwise
	 * merge them into one on a copy, which only some verifiers follow. */
	asm volatile("" : "+r"(len));
	if (len < sizeof(*eth) + sizeof(struct iphdr) + sizeof(*th))
		return TC_ACT_OK;
	struct frame *f = bpf_ringbuf_reserve(&held, sizeof(*f), 0);
	if (!f)
		return TC_ACT_OK;
	__builtin_memset(f->data, 0, sizeof(f->data));
	f->len = len;
	if (bpf_skb_load_bytes(skb, 0, f->data, len)) {
		bpf_ringbuf_discard(f, 0);
		return TC_ACT_OK;
	}
	bpf_ringbuf_submit(f, 0);
	return TC_ACT_SHOT;
}
