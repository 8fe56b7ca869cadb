/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The two array reads that decide for most traffic that it is not ours:
 * a port no service uses, an address no VIP hashes to.
 *
 * Part of pb_xdp: included by lb.c, in its order, after the headers
 * before it (not self-contained). */
#ifndef PB_PREFILTER_H
#define PB_PREFILTER_H

static __always_inline __u8 port_role(__be16 port)
{
	__u32 k = bpf_ntohs(port);
	__u8 *role = bpf_map_lookup_elem(&pb_ports, &k);
	return role ? *role : 0;
}

static __always_inline int vip_slot_marked(const union addr *a, __u8 family)
{
	__u32 k = (bpf_ntohl(addr_fold(a, family)) * PB_VIP_SLOT_MUL) >> (32 - PB_VIP_SLOT_BITS);
	__u8 *marked = bpf_map_lookup_elem(&pb_vip_slots, &k);
	return marked && *marked;
}

#endif /* PB_PREFILTER_H */
