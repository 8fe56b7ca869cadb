/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Constants shared by the datapath and (through BTF) the agent. */
#ifndef PB_CONSTS_H
#define PB_CONSTS_H

/* Default map sizes. The agent overrides max_entries at load time from its
 * flags; these only make the object loadable on its own (tests, bpftool). */
#define PB_MAX_SERVICES 65536
#define PB_MAX_BACKENDS 262144
#define PB_CT_SIZE 262144
#define PB_TRUST_SIZE 65536 /* pb_src_trust: client addresses remembered */
#define PB_AFFINITY_SIZE 65536 /* pb_affinity: (service, client) pairs remembered; the loader may resize it */
#define PB_SYN_WINDOW_NS 100000000ULL /* the SYN guard's arming window: 100 ms */
#define PB_SYN_ARM_HOLD_NS 1000000000ULL /* armed for 1 s past the last window over */
#define PB_EVENTS_BYTES (1 << 20)
#define PB_MAGLEV_DEFAULT_SIZE 16381

/* Address families as stored in keys; IPv6 uses all 16 bytes of pb_addr. */
#define PB_AF_INET 4
#define PB_AF_INET6 6

/* pb_ports value bits: which roles a port plays. */
#define PB_PORT_VIP 0x1     /* some service listens on this destination port */
#define PB_PORT_BACKEND 0x2 /* some backend sends replies from this source port */

/* pb_vip_slots: a second prefilter, on the destination address. Slot =
 * the top PB_VIP_SLOT_BITS bits of (host-order address * PB_VIP_SLOT_MUL),
 * a multiplicative hash (pkg/maps.VIPSlot computes the same). */
#define PB_VIP_SLOT_BITS 16
#define PB_VIP_SLOTS (1 << PB_VIP_SLOT_BITS)
#define PB_VIP_SLOT_MUL 0x9e3779b1u

/* pb_ct key direction. */
#define PB_DIR_FWD 0 /* client -> VIP, as seen on the wire */
#define PB_DIR_REV 1 /* backend -> client, as seen on the wire */

/* Flow state bits. Canonical copy lives in the reverse entry's flags
 * (the reply path touches it on every packet anyway); the forward path reads
 * and updates it only on SYN, FIN and RST. Atomic OR makes each
 * "first time" transition (and its event) happen exactly once. */
#define PB_CT_ESTABLISHED 0x0001   /* SYN-ACK seen from the backend */
#define PB_CT_BACKEND_DATA 0x0002  /* backend sent at least one payload byte */
#define PB_CT_FIN_FWD 0x0004       /* client sent FIN */
#define PB_CT_FIN_REV 0x0008       /* backend sent FIN */
#define PB_CT_CLOSED 0x0010        /* RST seen, or FIN both ways */
#define PB_CT_TIMEOUT_SEEN 0x0020  /* retransmitted SYN already reported */
#define PB_CT_PROBE 0x0040         /* this flow is a probation probe */
#define PB_CT_MIDSTREAM 0x0080     /* picked up without a SYN (CT lost) */
#define PB_CT_CLIENT_ACKED 0x0100  /* FWD entry: the client sent a non-SYN packet (handshake completed) */
#define PB_CT_COUNTED 0x0200       /* counted in the inflight gauges (has a pb_flows entry) */
#define PB_CT_RESCUED 0x0400       /* the backend refused it; the RST was kept from the client */
#define PB_CT_RETRY 0x0800         /* a rescued flow's second try: not rescued again */
#define PB_CT_RETRYABLE 0x1000     /* its service had retryRefused when the flow began */
#define PB_CT_QUIET_DATA 0x2000    /* its service had PB_SVC_F_QUIET_DATA when the flow began */
#define PB_CT_QUIET_END 0x4000     /* its service had PB_SVC_F_QUIET_END when the flow began */
#define PB_CT_MOVED 0x8000         /* REV entry of the backend an unanswered flow was moved off: its late answer is reported, then dropped */
#define PB_CT_ACK_SEEN 0x20000     /* backend_ack holds an acknowledgment the backend sent */
/* The flow closed with a FIN each way, the second acknowledging the first:
 * the ACK of the second FIN from this entry's side (a FWD entry's: the
 * client's; a REV entry's: the backend's) ends it, and its entries go at
 * once instead of at the sweep (each if it has the flow's start). The
 * ACK's number is in the FWD entry's backend_isn (see fin_seen). */
#define PB_CT_LAST_ACK 0x40000

/* client_control: the agent's replay could not be moved; drop it, the
 * flow stays as it was. */
#define PB_REPLAY_STAYS -3
/* client_control: a new flow on the tuple while new flows go to
 * kube-proxy (handed_over): the packet passes as it came. */
#define PB_HANDED_OVER -4

/* Backend admission state, written by the agent. */
enum pb_backend_state {
	PB_BE_ACTIVE = 0,    /* in the Maglev table, takes new flows */
	PB_BE_PROBATION = 1, /* in the table, admits probe_grants new flows */
	PB_BE_EJECTED = 2,   /* out of the table: penalty running */
	PB_BE_REMOVED = 3,   /* gone from the desired state; kept for live flows */
};

/* Outcome events on pb_events. */
enum pb_event_type {
	PB_EV_NEW_FLOW = 1,    /* first packet of a flow sent to a backend */
	PB_EV_ESTABLISHED = 2, /* SYN-ACK from the backend */
	PB_EV_REFUSED = 3,     /* RST from the backend before SYN-ACK */
	PB_EV_RESET = 4,       /* RST from the backend after SYN-ACK */
	PB_EV_SYN_RETRANS = 5, /* client retransmitted SYN, no SYN-ACK yet */
	PB_EV_FLOW_END = 6,    /* FIN both ways or a client's RST, unless the flow's verdict is known (PB_SVC_F_QUIET_END) */
	/* 7 is reserved: circuit-breaker rejections are counted, not reported
	 * one by one (they come in floods, exactly when the ring is busiest). */
	PB_EV_FIRST_DATA = 8,  /* first payload byte from the backend */
};

/* What pb_ct_expire_run did with one key of a pb_ct_expire entry. */
enum pb_ct_expire_result {
	PB_CT_EXPIRE_UNASKED = 0, /* family 0, or the reverse entry stayed */
	PB_CT_EXPIRE_DELETED = 1, /* it was the flow's, and is gone */
	PB_CT_EXPIRE_ABSENT = 2,  /* no entry under the key */
	PB_CT_EXPIRE_OTHER = 3,   /* another flow's (another created_ns): kept */
};

/* pb_ct_sweep_run's failures (ct_sweep_args.failed): a set it could not
 * write, so the agent sweeps without it. */
#define PB_SWEEP_FAIL_APART 0x1 /* pb_ct_sweep_apart full, or no memory */
#define PB_SWEEP_FAIL_VIPS 0x2  /* pb_ct_inuse_vips full, or no memory */
#define PB_SWEEP_FAIL_ID 0x4    /* an id past PB_MAX_SERVICES or PB_MAX_BACKENDS */
#define PB_SWEEP_FAIL_INUSE 0x8 /* pb_ct_inuse unreadable */
#define PB_SWEEP_FAIL_LONE 0x10 /* pb_ct_sweep_lone full, or no memory */
/* sweep_mark of an entry pb_ct_sweep_run deleted before its walk came to
 * it; never a sweep's mark. */
#define PB_SWEEP_MARK_GONE 0xffff

/* pb_ct_expire's size: the flows one run of pb_ct_expire_run expires. */
#define PB_CT_EXPIRE_BATCH 1024
/* Counters per element of pb_svc_stats_v2 and pb_be_stats_v2: a per-CPU
 * array allocates each element on its own, and 262,144 allocations made
 * creating pb_be_stats a third of a second of the agent's start. */
#define PB_STATS_BLOCK 16
/* Ids pb_stats_reset_run zeroes per run. */
#define PB_STATS_RESET_BATCH 4096

/* pb_services flags. An enum so bpf2go generates them for the agent. The
 * QUIET flags say which events the agent's verdict on a flow of the
 * service does not need: each one costs it a ring buffer record to read. */
enum pb_svc_flag {
	PB_SVC_F_RETRY_REFUSED = 0x1, /* a refused new flow gets one more try elsewhere */
	PB_SVC_F_QUIET_DATA = 0x2,    /* no FIRST_DATA: a success is not decided by data */
	PB_SVC_F_QUIET_END = 0x4,     /* no FLOW_END once the flow is decided (SYN-ACK seen, and
				       * first data too unless QUIET_DATA) */
	PB_SVC_F_TAKEN_OVER = 0x8,    /* just taken from kube-proxy: a mid-stream packet without a flow
				       * here is one of kube-proxy's flows, left to it */
	PB_SVC_F_HANDED_BACK = 0x10,  /* no longer served: new flows go to kube-proxy, the flows here
				       * finish (kept until the kernel's conntrack forgot them) */
};

/* pb_nf_stats indexes: why the datapath expired an entry of the kernel's
 * conntrack (see nf_forget in lb.c). */
enum pb_nf_why {
	PB_NF_TAKEN_OVER = 0,  /* kube-proxy's finished flow on a new flow's tuple */
	PB_NF_HANDED_OVER = 1, /* a finished flow of ours on the tuple of a new flow for kube-proxy */
	PB_NF_WHYS = 2,
};

/* struct event.flags bits. An enum, not #defines, so bpf2go generates them
 * for the agent (the constants compile the same). */
enum pb_event_flag {
	PB_EVF_PROBE = 0x01,        /* the flow is a probation probe */
	PB_EVF_BACKEND_DATA = 0x02, /* RESET: the backend had sent payload */
	PB_EVF_REPICK = 0x04,       /* NEW_FLOW: moved on a retransmitted SYN (ejected or refusing backend) */
	PB_EVF_CLIENT = 0x08,       /* FLOW_END: the client ended it */
	PB_EVF_TRIPPED = 0x10,      /* REFUSED, RESET: this failure made the datapath eject the backend (pb_be_trip) */
	PB_EVF_RESCUED = 0x20,      /* REFUSED: the RST was kept from the client and pb_syns holds the SYN it answered: replay it */
	PB_EVF_VOID = 0x40,         /* FLOW_END: the backend reset a flow the client had not conducted right: no verdict */
};

/* pb_svc_trip.kinds: the failures the datapath counts towards a trip. */
enum pb_trip_kind {
	PB_TRIP_REFUSED = 0x1,          /* RST before the SYN-ACK */
	PB_TRIP_RESET = 0x2,            /* RST after the SYN-ACK, before backend data */
	PB_TRIP_RESET_AFTER_DATA = 0x4, /* RST after backend data */
};

/* Circuit breaker: how many of a service's backends a new flow scans for
 * room when its own is at the per-endpoint limit. */
#define PB_MAX_SCAN 4096

/* pb_syns: slot = the top PB_SYN_SLOT_BITS bits of (host-order client
 * address * PB_VIP_SLOT_MUL) ^ (host-order client port * PB_SYN_PORT_MUL)
 * (pkg/maps.SynSlot computes the same). */
#define PB_SYN_SLOT_BITS 16
#define PB_SYN_SLOTS (1 << PB_SYN_SLOT_BITS)
#define PB_SYN_PORT_MUL 0x85ebca6bu
#define PB_SYN_MAX_OPTS 40

/* XDP metadata the agent puts before a SYN it replays (BPF_PROG_RUN live
 * frames; no packet from a wire carries metadata). */
#define PB_REPLAY_MAGIC 0x70627270u /* "pbrp" */

/* pb_config_v2.flags */
#define PB_CFG_REDIRECT 0x1 /* try bpf_fib_lookup + redirect after NAT */
#define PB_CFG_RPF 0x2      /* evidence only from where the node routes its sender (strict reverse path) */
#define PB_CFG_DRAIN 0x4    /* uninstalling: new flows go to kube-proxy, established ones finish */

/* A pending flow's SYN seen again this soon is a duplicate, not the
 * client's retransmission (unless pb_config_v2 says otherwise): Linux's
 * smallest retransmission timeout. */
#define PB_SYN_RETRANS_MIN_NS 200000000ULL

/* pb_ifaces flags */
#define PB_IF_PARTIAL 0x1 /* local senders may leave the L4 checksum to the device (a pod's veth) */
#define PB_IF_DECAP 0x2   /* a node's uplink: an IPIP packet arriving here is a pod network's, a backend's reply inside is parsed */
#define PB_IF_IPIP 0x4    /* an IPIP tunnel device (Calico's tunl0): routes through it name the remote node as gateway */

/* The longest segment or ICMP message whose checksum the datapath checks. */
#define PB_CSUM_MAX 1024

#define PB_HASH_SEED 0x9e3779b9u

#endif
