/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Every map the datapath uses. All are pinned by name under the agent's
 * bpffs root (default /sys/fs/bpf/penaltybox/); README.md documents each. */
#ifndef PB_MAPS_H
#define PB_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "pb_consts.h"
#include "pb_structs.h"

/* VIP:port:proto -> service. Written by the agent. The map reuses a
 * replaced entry at once, for any key (not after a grace period), and a
 * lookup racing a replacement can miss the key: service() in lb.c looks
 * twice, and service_copy checks its copy of the value against
 * pb_svc_keys. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct svc_key);
	__type(value, struct svc_value);
	__uint(max_entries, PB_MAX_SERVICES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_services SEC(".maps");

/* service id -> the pb_services key its service is written under (all
 * zero: no service has the id). Written by the agent before the service's
 * value, through a memory map. A value read through a pointer pb_services
 * returned can be another service's, the entry reused meanwhile: its id
 * names the key it belongs to, so service_copy tells. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct svc_key);
	__uint(max_entries, PB_MAX_SERVICES);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_svc_keys SEC(".maps");

/* The inner map template of pb_maglev and pb_maglev_fb: slot -> backend id.
 * BPF_F_INNER_MAP lets each service's table have its own size;
 * BPF_F_MMAPABLE lets the agent fill a new table with one memory copy
 * instead of a batch update per slot (the ejection's critical path). */
struct pb_maglev_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, PB_MAGLEV_DEFAULT_SIZE);
	__uint(map_flags, BPF_F_INNER_MAP | BPF_F_MMAPABLE);
};

/* 2 * service id + n -> the service's Maglev table n (0 or 1). A service
 * has two tables: the agent fills the one not in use, then flips the
 * service's `table` field, so a reader sees the old table or the new one,
 * never a mix, and a flip costs no RCU grace period (replacing an inner
 * map does). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__type(key, __u32);
	__uint(max_entries, 2 * PB_MAX_SERVICES);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct pb_maglev_inner);
} pb_maglev SEC(".maps");

/* service id -> the table without probation backends, for the service's
 * live table size. Consulted only for a new flow that lands on a probation
 * backend whose grant is used up: it takes this table's pick for the same
 * slot. Installed (empty) at a service's first ejection, filled at its
 * first probation: the install costs an RCU grace period, off the agent's
 * loop (pkg/maps SetFallback). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__type(key, __u32);
	__uint(max_entries, PB_MAX_SERVICES);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct pb_maglev_inner);
} pb_maglev_fb SEC(".maps");

/* backend id -> address, port and admission state. Written by the agent;
 * the datapath only decrements probe_grants. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct backend);
	__uint(max_entries, PB_MAX_BACKENDS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_backends SEC(".maps");

/* Connection tracking, two entries per flow (FWD and REV). Written by the
 * datapath; the agent reaps idle entries. _v2: the flow's sequence numbers
 * (the agent copies a pb_ct it finds into it). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct ct_key);
	__type(value, struct ct_value);
	__uint(max_entries, PB_CT_SIZE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_ct_v2 SEC(".maps");

/* L4 outcomes for the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, PB_EVENTS_BYTES);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_events SEC(".maps");

/* Port -> PB_PORT_* bits. A cheap first filter so traffic that cannot be
 * ours costs two array reads, not two hash lookups. Written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u8);
	__uint(max_entries, 65536);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_ports SEC(".maps");

/* Address slot (see PB_VIP_SLOT_*) -> 1 when some VIP, or the VIP of a
 * removed service that conntrack still holds flows of, hashes there. A
 * packet to a VIP port at an address whose slot is 0 is no VIP's: it
 * passes without a conntrack or service lookup. Other addresses may share
 * a VIP's slot; they only pay those lookups. Written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u8);
	__uint(max_entries, PB_VIP_SLOTS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_vip_slots SEC(".maps");

/* Egress interfaces that XDP_REDIRECT can deliver to. Written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_redirect SEC(".maps");

/* ifindex -> struct iface: the interfaces the program is attached to that
 * need telling apart. PB_IF_PARTIAL: a local sender may hand us a
 * CHECKSUM_PARTIAL packet there (veths of local pods); elsewhere a complete
 * checksum is never mistaken for a partial one. master: the reverse-path
 * check's other acceptable interface. Written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct iface);
	__uint(max_entries, 4096);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_ifaces SEC(".maps");

/* Runtime settings (struct config). Written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct config);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_config_v2 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct global_stats);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_stats_v2 SEC(".maps");

/* pb_nf_stats[PB_NF_*], per CPU: entries of the kernel's conntrack the
 * datapath expired, by why (nf_forget). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, PB_NF_WHYS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_nf_stats SEC(".maps");

/* pb_scratch[0], per CPU: the datapath's room for temporaries too large
 * for its stack. Not pinned: nothing outside one program run reads it. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct scratch);
	__uint(max_entries, 1);
} pb_scratch SEC(".maps");

/* pb_ct_expire[i]: the flows the agent's conntrack sweep hands
 * pb_ct_expire_run to delete, and what it did (struct ct_expire). Written
 * and read by the agent through a memory map, one batch at a time. Not
 * pinned: nothing outside one sweep reads it. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct ct_expire);
	__uint(max_entries, PB_CT_EXPIRE_BATCH);
	__uint(map_flags, BPF_F_MMAPABLE);
} pb_ct_expire SEC(".maps");

/* pb_ct_sweep_run's working set: the forward keys of live reverse
 * entries whose forward entry is gone (the LRU) or another flow's (the
 * one a replay moved off the backend). Such a key keeps its forward entry
 * and its pb_flows entry alive, as the flow it was written for lives.
 * Emptied and filled by walk 1 of each sweep. Not pinned. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct ct_key);
	__type(value, __u8);
	__uint(max_entries, PB_CT_SIZE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} pb_ct_sweep_apart SEC(".maps");

/* pb_ct_sweep_run's other working set: the forward entries its first walk
 * found without their reverse half (value: the entry's created_ns). Only
 * once that walk is over is it known whether a live reverse entry of
 * another start names one (pb_ct_sweep_apart): the second walk judges
 * them then. Emptied and filled by walk 1 of each sweep. Not pinned. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct ct_key);
	__type(value, __u64);
	__uint(max_entries, PB_CT_SIZE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} pb_ct_sweep_lone SEC(".maps");

/* pb_ct_inuse[0]: the ids live flows use (struct ct_inuse), and
 * pb_ct_inuse_vips: the VIPs and ports they are addressed to. Emptied by
 * walk 1 of each sweep of pb_ct_sweep_run and filled by its walks, read
 * by the agent after the last. Not pinned. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct ct_inuse);
	__uint(max_entries, 1);
} pb_ct_inuse SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct vip_use_key);
	__type(value, __u8);
	__uint(max_entries, PB_MAX_SERVICES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} pb_ct_inuse_vips SEC(".maps");

/* Traffic counters, PB_STATS_BLOCK services or backends to an element
 * (see PB_STATS_BLOCK). Written by the datapath; zeroed for a reused id
 * by pb_stats_reset_run. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct svc_stats_block);
	__uint(max_entries, PB_MAX_SERVICES / PB_STATS_BLOCK);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_svc_stats_v2 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct be_stats_block);
	__uint(max_entries, PB_MAX_BACKENDS / PB_STATS_BLOCK);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_be_stats_v2 SEC(".maps");

/* pb_stats_reset[i]: the ids whose counters the agent has
 * pb_stats_reset_run zero (a reused id starts clean). Not pinned. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct stats_reset);
	__uint(max_entries, PB_STATS_RESET_BATCH);
} pb_stats_reset SEC(".maps");

/* Forward conntrack key -> the flow's circuit-breaker accounting. Only
 * flows of services with a limit are here. A plain hash, not LRU: an
 * entry must never vanish without its count being released. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct ct_key);
	__type(value, struct flow_value);
	__uint(max_entries, PB_CT_SIZE / 2);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_flows SEC(".maps");

/* (service id, index) -> backend id: each service's active backends, so a
 * new flow whose backend is at its per-endpoint limit finds one with room
 * by a bounded scan. Written by the agent with the Maglev table. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct svc_backend_key);
	__type(value, __u32);
	__uint(max_entries, PB_MAX_BACKENDS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_svc_backends SEC(".maps");

/* service id -> live counted flows (atomic; agent maps it). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct inflight);
	__uint(max_entries, PB_MAX_SERVICES);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_svc_inflight SEC(".maps");

/* backend id -> live counted flows (atomic; agent maps it). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct inflight);
	__uint(max_entries, PB_MAX_BACKENDS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_be_inflight SEC(".maps");

/* service id -> kernel-trip settings and budget. Written by the agent
 * (settings, budget) and the datapath (budget taken, counters). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct svc_trip);
	__uint(max_entries, PB_MAX_SERVICES);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_svc_trip SEC(".maps");

/* backend id -> the datapath's streak of failures. Written by the
 * datapath; the agent zeroes an entry when its backend starts afresh. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct be_trip);
	__uint(max_entries, PB_MAX_BACKENDS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_be_trip SEC(".maps");

/* SYN slot (see PB_SYN_SLOT_BITS) -> the flow's SYN, for the agent's
 * replay of a refused one. Written by the datapath, read by the agent.
 * _v2: 16-byte addresses and a family (IPv6 SYNs too). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct syn_copy);
	__uint(max_entries, PB_SYN_SLOTS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_syns_v2 SEC(".maps");

/* The SYN guard (struct syn_guard): written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct syn_guard);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_syn_guard SEC(".maps");

/* The SYN guard's per-CPU budget and counters: written by the datapath. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct syn_guard_cpu);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_syn_guard_cpu SEC(".maps");

/* client address -> bpf_ktime_get_coarse_ns of its last proof of a real
 * connection: a backend sent payload on one of its flows, which a backend
 * does only after a handshake whose ACK acknowledged its SYN-ACK (a
 * spoofed source never sees that). Written by the datapath; the SYN guard
 * reads it. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct src_key);
	__type(value, __u64);
	__uint(max_entries, PB_TRUST_SIZE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_src_trust SEC(".maps");

/* (service, client address) -> the backend of the client's last new flow
 * to a service with sessionAffinity ClientIP, and when. Written by the
 * datapath on each new flow of such a service; the agent deletes a
 * service's entries when it turns affinity off or removes the service.
 * LRU: the least recently seen clients go first when it is full. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct affinity_key);
	__type(value, struct affinity_value);
	__uint(max_entries, PB_AFFINITY_SIZE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_affinity SEC(".maps");

/* backend id -> failure-accrual state. Written by the agent only. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct endpoint_health);
	__uint(max_entries, PB_MAX_BACKENDS);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pb_health SEC(".maps");

#endif
