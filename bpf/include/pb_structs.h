/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Map keys and values. The agent reads these layouts from BTF through
 * bpf2go; bpftool prints them with field names. Changing a layout means a
 * new map name (pb_x_v2), never a silent reinterpretation of a pinned map. */
#ifndef PB_STRUCTS_H
#define PB_STRUCTS_H

#include <linux/types.h>

/* 16 bytes so IPv6 fits without a new layout; IPv4 uses v4 and zeroes the
 * rest. bytes comes first so bpftool prints an address readably:
 * "bytes": [198,18,100,1,0,...]. */
union addr {
	__u8 bytes[16];
	__be32 v4;
	__be32 v6[4];
};

/* pb_services key: one L4 service (VIP, port, protocol). */
struct svc_key {
	union addr vip;
	__be16 port;
	__u8 proto;  /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 family; /* PB_AF_INET or PB_AF_INET6 */
};

struct svc_value {
	__u32 id;                       /* index into pb_svc_inflight, ... (pb_svc_stats_v2: id / 16) */
	__u32 table;                    /* which of the service's two tables is live (0, 1) */
	__u32 table_size;               /* slots in the live table; 0: no table, new flows dropped */
	__u32 max_inflight;             /* 0: no limit */
	__u32 max_inflight_per_backend; /* 0: no limit */
	__u32 backend_count;            /* active backends listed in pb_svc_backends */
	__u32 flags;                    /* PB_SVC_F_* */
	/* sessionAffinity ClientIP: a client's new flows go to the backend of
	 * its last one for this long after it (pb_affinity); 0: off. Was
	 * padding, always written 0: an older agent's values mean off. */
	__u32 affinity_timeout_s;
};

/* pb_svc_backends key: the idx-th active backend of a service. */
struct svc_backend_key {
	__u32 svc_id;
	__u32 idx;
};

/* pb_backends value, indexed by backend id. A backend id belongs to one
 * (service, endpoint) pair, so its state is that pair's state. */
struct backend {
	union addr addr;
	__be16 port;
	__u8 family;
	__u8 state;         /* enum pb_backend_state */
	__u32 svc_id;
	__s32 probe_grants; /* PROBATION: new flows still admitted (atomic) */
	__u32 pad;
};

struct ct_key {
	union addr src;
	union addr dst;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 dir; /* PB_DIR_FWD or PB_DIR_REV */
	__u8 family;
	__u8 pad;
};

/* pb_ct_v2 value. The sequence numbers are what the evidence rules check a
 * packet against before it counts (see handle_reply): host order. */
struct ct_value {
	union addr nat_addr; /* FWD: backend address; REV: VIP */
	__be16 nat_port;        /* FWD: backend port;    REV: VIP port */
	__u16 sweep_mark;       /* the kernel sweep that judged the flow at its other half (pb_ct_sweep_run) */
	__u32 flags;            /* PB_CT_*; canonical in the REV entry */
	__u32 svc_id;
	__u32 backend_id;
	__u64 created_ns;       /* bpf_ktime_get_ns at flow start */
	__u64 last_seen_ns;     /* coarse clock, refreshed at most once a second */
	__u32 client_isn;       /* the client's SYN's sequence number (a flow a SYN opened) */
	/* REV: the backend's SYN-ACK's sequence number. FWD (no SYN-ACK's):
	 * once a FIN was seen, the acknowledgment that FIN asks for (its
	 * sequence number + its payload + 1); once the second FIN acknowledged
	 * the first, the second's (PB_CT_LAST_ACK). */
	__u32 backend_isn;
	__u32 backend_ack;      /* REV: the highest acknowledgment the backend sent (PB_CT_ACK_SEEN) */
	__u32 reply_ifindex;    /* REV: the interface the backend's replies passed the reverse-path check on */
};

/* pb_ct_expire entry: one flow the agent's sweep found idle past its
 * timeout in its snapshot of pb_ct_v2, for pb_ct_expire_run to delete. An
 * entry goes only if it still is the flow the snapshot saw (created_ns):
 * a tuple reused meanwhile is a new flow's. The reverse entry goes first,
 * and the forward one only once it went; a key of family 0 is not asked
 * about (a forward entry without its reverse half has rev.family 0). */
struct ct_expire {
	struct ct_key rev;
	struct ct_key fwd;
	__u64 created_ns;
	__u8 rev_result; /* enum pb_ct_expire_result, written by the program */
	__u8 fwd_result;
	__u8 pad[6];
};

/* pb_ct_expire_run's context: how many pb_ct_expire entries to act on. */
struct ct_expire_args {
	__u32 n;
	__u32 deleted; /* out: conntrack entries deleted */
};

/* pb_ct_sweep_run's context: the agent's clocks and timeouts in, what
 * the sweep did out. Times are nanoseconds; last_seen_ns is on the coarse
 * clock, created_ns on the monotonic one. */
struct ct_sweep_args {
	__u64 now_coarse;
	__u64 now_mono;
	__u64 tcp_established; /* timeouts by state, as the agent's Timeouts */
	__u64 tcp_opening;
	__u64 tcp_closed;
	__u64 udp;
	__u64 orphan; /* a pb_flows entry without its flow is released once this old */
	__u32 entries;  /* out: pb_ct_v2 entries seen */
	__u32 expired;  /* out: flows expired */
	__u32 released; /* out: pb_flows entries released (their slots given back) */
	__u32 counted;  /* out: pb_flows entries kept */
	__u32 failed;   /* out: PB_SWEEP_FAIL_*: the in-use sets are not whole */
	__u16 mark;     /* in: this sweep's sweep_mark, never 0 (a new entry's) nor PB_SWEEP_MARK_GONE */
	__u8 walk;      /* in: the walk this run makes, 0 to 3 (1 starts a sweep; 0, before it, clears every mark) */
	__u8 pad;
};

/* pb_ct_inuse[0]: the service and backend ids live conntrack entries and
 * counted flows refer to, one bit each, as pb_ct_sweep_run last found
 * them. */
struct ct_inuse {
	__u64 svc[PB_MAX_SERVICES / 64];
	__u64 be[PB_MAX_BACKENDS / 64];
};

/* pb_ct_inuse_vips key: a VIP and port live flows are addressed to. */
struct vip_use_key {
	union addr addr;
	__be16 port;
	__u8 family;
	__u8 pad;
};

/* pb_affinity key: a client of a service with session affinity. */
struct affinity_key {
	union addr client;
	__u32 svc_id;
	__u8 family; /* PB_AF_INET or PB_AF_INET6 */
	__u8 pad[3];
};

/* pb_affinity value: the backend of the client's last new flow, and when
 * (bpf_ktime_get_ns). */
struct affinity_value {
	__u32 backend_id;
	__u32 pad;
	__u64 last_ns;
};

/* scan walks a service's list of active backends (pb_svc_backends) from
 * a hashed start for one that is active, is neither skip nor avoid, and,
 * when take is set, has room under limit (a slot is then taken on it). */
struct scan {
	__u32 svc_id;
	__u32 start;
	__u32 n;
	__u32 limit;
	__u32 skip;
	__u32 avoid;
	__u32 take;
	__u32 found;
};

/* pb_pick_backend's request (hash, seed, avoid, may_probe) and answer
 * (id, probe): more than a function's five argument registers hold. */
struct pick_req {
	__u32 hash;
	__u32 seed;
	__u32 avoid;
	__u32 may_probe;
	__u32 id;
	__u32 probe;
};

/* pb_scratch value: temporaries of one program run (see scratch()). */
struct scratch {
	struct ct_key rk;   /* new_flow, established, handle_reply: a reverse entry's key */
	struct ct_value rv; /* new_flow, established: a reverse entry */
	struct ct_value fv; /* handle_forward: the flow's forward entry */
	struct ct_key fk;   /* handle_reply: the flow's forward key */
	struct svc_value svc; /* handle_forward: the service, as it was when the packet came */
	struct affinity_key ak;   /* new_flow: the client's pb_affinity key */
	struct affinity_value av; /* new_flow: its new pb_affinity value */
	struct pick_req pq;       /* new_flow: pb_pick_backend's request and answer */
	struct scan scan;         /* pb_pick_backend, backend_slot: a walk of a service's backends */
	/* forward, pb_reverse_path_ok: a struct bpf_fib_lookup (as words: its
	 * anonymous unions have no Go twin in bpf2go's bindings) */
	__u64 fib[8];
	__u8 buf[PB_CSUM_MAX + 4]; /* pb_csum, pb_tcp_opts_signed: bytes copied out of the packet */
	/* nf_forget: a struct bpf_sock_tuple and a struct bpf_ct_opts (as
	 * words, for the same reason as fib) */
	__u32 nf_tuple[10];
	__u32 nf_opts[3];
};

/* One L4 outcome, sent to the agent on pb_events. */
struct event {
	__u64 ts_ns; /* bpf_ktime_get_ns (CLOCK_MONOTONIC) */
	__u32 svc_id;
	__u32 backend_id;
	union addr client;
	__be16 client_port;
	__u8 type;   /* enum pb_event_type */
	__u8 flags;  /* PB_EVF_* */
	__u8 family; /* the client's: PB_AF_INET or PB_AF_INET6 (0 from datapaths before IPv6: IPv4) */
	__u8 pad[3];
};

/* pb_flows value: one live flow counted against a circuit breaker. Whoever
 * deletes the entry (datapath on FIN/RST, agent on expiry) releases the
 * count, so it is released exactly once. */
struct flow_value {
	__u32 svc_id;
	__u32 backend_id;
	__u64 created_ns;
};

/* pb_syns[slot]: a copy of the last SYN seen of a flow to a service with
 * retryRefused, as the client sent it, so that the agent can replay it at
 * once when the backend refuses (the datapath keeps that RST from the
 * client). Written by the datapath; read by the agent. A slot holds one
 * flow (the tag says which): a newer SYN hashing there replaces it. */
struct syn_copy {
	union addr client;  /* tag: client address and port, VIP and port */
	union addr vip;
	__be16 client_port;
	__be16 vip_port;
	__u32 ifindex;      /* the interface it came in on */
	__u8 eth[12];       /* its destination and source MAC */
	__be32 seq;         /* the client's initial sequence number */
	__be16 window;
	__u8 ttl;           /* IPv4 TTL, IPv6 hop limit */
	__u8 opt_len;       /* bytes of TCP options in opts (0..40) */
	__u8 family;        /* PB_AF_INET or PB_AF_INET6 */
	__u8 pad[3];
	__u8 opts[PB_SYN_MAX_OPTS];
};

/* The metadata of every SYN the agent replays: backend_id is the backend
 * to move the flow off (its SYN left unanswered past the service's replay
 * deadline), or 0 (a refused SYN, retried where the table sends it). */
struct replay_meta {
	__u32 magic; /* PB_REPLAY_MAGIC */
	__u32 backend_id;
};

/* pb_svc_trip[svc_id]: when the datapath ejects a backend of the service
 * itself (a kernel trip), without waiting for the agent. */
struct svc_trip {
	__u32 max_failures; /* consecutive counted failures that trip; 0: never (agent) */
	__u32 kinds;        /* enum pb_trip_kind bits counted (agent) */
	__u64 settle_ns;    /* a reset counts only this soon after the flow's SYN: later the agent has judged it (agent) */
	__s64 budget;       /* trips still allowed by maxEjectionPercent (agent writes, datapath takes, atomic) */
	__u64 trips;        /* trips done (datapath, atomic) */
	__u64 suppressed;   /* trips the budget held back (datapath, atomic) */
};

/* pb_be_trip[backend_id]: the datapath's own streak of a backend. */
struct be_trip {
	__u32 failures;   /* consecutive counted failures (datapath, atomic; the agent zeroes it) */
	__u32 pad;
	__u64 tripped_ns; /* bpf_ktime_get_ns of its last trip */
};

/* pb_svc_inflight[svc_id], pb_be_inflight[backend_id]: live counted flows.
 * Memory-mapped by the agent, which releases expired flows with atomic
 * adds on the same words the datapath uses. */
struct inflight {
	__s64 count;
};

/* pb_config_v2[0]: runtime settings written by the agent. */
struct config {
	__u32 flags;              /* PB_CFG_* */
	__u32 hash_seed;          /* the flow hash's secret seed, shared by the cluster's nodes */
	__u64 syn_retrans_min_ns; /* a SYN seen again this soon after the first is a duplicate, not the
				   * client's retransmission (0: PB_SYN_RETRANS_MIN_NS) */
	__u64 heartbeat_ns;       /* CLOCK_MONOTONIC of the agent's last heartbeat (every second) */
	__u64 dead_man_ns;        /* a heartbeat older than this hands new flows to kube-proxy (0: never) */
};

/* pb_ifaces value: what the datapath knows of an interface it is attached
 * to, by ifindex. Written by the agent. */
struct iface {
	__u32 flags;  /* PB_IF_* */
	__u32 master; /* its master's ifindex (a bridge port's bridge), 0: none. The node routes
		       * to a bridged pod through the bridge: a reply arriving on the port
		       * passes the reverse-path check when the route names the bridge */
};

/* pb_syn_guard[0]: the SYN guard, written by the agent. While it is on,
 * a SYN opening a flow from a source without a recent proof of a real
 * connection (pb_src_trust) takes a token of a per-CPU budget, and is
 * dropped when none is left: a flood of spoofed SYNs is stopped at the
 * first XDP pass instead of costing the backends, the veths and the
 * agent a handshake each. It is on while the agent's lease lasts (flood
 * mode), and on a CPU that has armed it itself: more than arm_syns SYNs
 * opening flows in one PB_SYN_WINDOW_NS, then a quarter of that again from
 * untrusted sources, which a flood reaches within milliseconds, before the
 * agent can tell. Times are
 * bpf_ktime_get_coarse_ns. interval_ns 0: no guard at all. */
struct syn_guard {
	__u64 until_ns;    /* the agent's lease: on while now < until_ns */
	__u64 interval_ns; /* 1e9 / untrusted SYNs admitted per second per CPU */
	__u64 burst_ns;    /* how far ahead of now the budget may be spent */
	__u64 trust_ns;    /* a source stays trusted this long after its proof */
	__u64 arm_syns;    /* SYNs per CPU and window that arm it (0: never) */
};

/* pb_syn_guard_cpu[0], per CPU: the guard's budget and its verdicts. */
struct syn_guard_cpu {
	__u64 tat_ns;         /* when this CPU's budget is next free (GCRA) */
	__u64 trusted;        /* SYNs admitted while on: trusted source */
	__u64 admitted;       /* ... untrusted, within the budget */
	__u64 dropped;        /* ... untrusted, over the budget: dropped */
	__u64 window_ns;      /* start of this CPU's current window */
	__u64 window_syns;    /* SYNs opening flows in it */
	__u64 window_untrusted; /* ... from untrusted sources, past arm_syns */
	__u64 armed_until_ns; /* armed by this CPU until then */
	__u64 armed;          /* times this CPU armed it (from disarmed) */
};

/* pb_src_trust key: a client address. */
struct src_key {
	union addr addr;
	__u8 family; /* PB_AF_INET or PB_AF_INET6 */
	__u8 pad[3];
};

/* pb_stats[0], per CPU: datapath-wide counters. */
struct global_stats {
	__u64 events_lost;         /* ring buffer full: outcome not delivered */
	__u64 redirected;          /* forwarded with bpf_redirect_map */
	__u64 passed_after_nat;    /* rewritten, then left to the kernel stack */
	__u64 no_backend;          /* new flow to a service with no usable backend */
	__u64 probe_admitted;      /* probation grant consumed */
	__u64 steered;             /* new flow moved off a non-active backend */
	__u64 steer_failed;        /* ... and no active one was found: sent anyway */
	__u64 repicked;            /* unanswered SYN moved off a dead backend */
	__u64 ct_create_failed;    /* conntrack insert failed */
	__u64 malformed;           /* VIP-bound packet too short or bad lengths */
	__u64 inflight_rejected;   /* new flow refused by a circuit breaker */
	__u64 inflight_untracked;  /* pb_flows full: admitted without counting */
	__u64 reject_rst_tx;       /* rejection RST sent back out the ingress (redirect) */
	__u64 reject_rst_pass;     /* ... or handed to the stack to route back */
	__u64 probe_rescued;       /* refused probe's RST kept from its client */
	__u64 refused_rescued;     /* other refused flows' RST kept (retryRefused) */
	__u64 retried;             /* rescued non-probe flows re-picked on their retransmitted SYN */
	__u64 icmp_translated;     /* ICMP errors about a NATed flow, translated */
	/* Evidence no client can forge: what was not counted, and why. */
	__u64 syn_doomed;          /* SYNs the backend could not accept (bad checksum, SYN|FIN, TTL <= 1,
				    * TCP-MD5/AO option): passed unchanged, no flow */
	__u64 syn_duplicate;       /* a pending flow's SYN again, too soon or with another ISN: no timeout */
	__u64 reply_wrong_side;    /* a backend's reply from where the node does not route it: passed unchanged */
	__u64 reply_bad_checksum;  /* a RST, SYN-ACK or ICMP error with a bad checksum: not counted */
	__u64 reply_unacked;       /* a RST or SYN-ACK not acknowledging what the client sent: not counted */
	__u64 client_rst_ignored;  /* a client's RST out of the backend's sequence: the flow and its slot kept */
	__u64 handed_over;         /* new flows left to kube-proxy: the agent away (dead-man's switch) or uninstalling */
	__u64 kube_proxy_midstream; /* mid-stream packets of a service just taken over, left to kube-proxy's flow */
};

/* One service's counters, per CPU: pb_svc_stats_v2[svc_id / PB_STATS_BLOCK]
 * .s[svc_id % PB_STATS_BLOCK]. */
struct svc_stats {
	__u64 packets;   /* client -> VIP packets forwarded */
	__u64 bytes;
	__u64 flows;      /* new flows admitted */
	__u64 no_backend; /* new flows dropped: no usable backend */
	__u64 over_limit; /* new flows refused by the circuit breaker */
};

/* One backend's counters, per CPU: pb_be_stats_v2[backend_id /
 * PB_STATS_BLOCK].b[backend_id % PB_STATS_BLOCK]. */
struct be_stats {
	__u64 packets;       /* client -> backend packets */
	__u64 bytes;
	__u64 flows;         /* new flows sent to this backend */
	__u64 reply_packets; /* backend -> client packets reverse-NATed */
	__u64 reply_bytes;
};

/* pb_svc_stats_v2 and pb_be_stats_v2 values: PB_STATS_BLOCK services' or
 * backends' counters, by consecutive ids. */
struct svc_stats_block {
	struct svc_stats s[PB_STATS_BLOCK];
};

struct be_stats_block {
	struct be_stats b[PB_STATS_BLOCK];
};

/* pb_stats_reset entry: a service's or backend's id whose counters
 * pb_stats_reset_run zeroes on every CPU. */
struct stats_reset {
	__u32 id;
	__u32 backend; /* 1: a backend id, 0: a service id */
};

/* pb_stats_reset_run's context. */
struct stats_reset_args {
	__u32 n;      /* pb_stats_reset entries to act on */
	__u32 ncpu;   /* the possible CPUs: a per-CPU map's copies */
	__u32 missed; /* out: ids past the end of their map, nothing zeroed */
	__u32 pad;
};

/* pb_health value: one endpoint's failure-accrual state, so a restarted
 * agent keeps penalties running. Written by the agent on every state change;
 * the datapath never reads it. Times are Unix nanoseconds. */
struct endpoint_health {
	__u32 svc_id;
	__u8 state;             /* 0 ready, 1 ejected, 2 probation */
	__u8 penalty_level;     /* failed probes since the first ejection */
	__u8 last_failure_kind; /* 1 refused, 2 timeout, 3 reset, 4 reset-after-data */
	__u8 pad;
	__u32 consecutive_failures;
	__u32 pad2;
	__u64 ejections;
	__u64 penalty_ns;
	__s64 ejected_at_ns;
	__s64 probation_at_ns;
	__s64 last_failure_ns;
};

#endif
