package main

import (
	"fmt"
	"io"
	"strings"
)

// The closing note: for every missed target, by how much (from this run)
// and why, with the profile that shows it. The profiles were taken on this
// machine with the commands given; rerun them after changing the datapath
// or the agent.
var explanations = []struct {
	match string // substring of Target.What
	text  string
}{
	{"established path|reply path", `**Established and reply paths against the minimal DNAT** (%s ns established). Conntrack is looked up first and pb_services only for SYN, FIN and RST or a conntrack miss, and last_seen is refreshed once a second from bpf_ktime_get_coarse_ns. On top of the floor's DNAT the program still reads the pb_ports prefilter, hashes a 40-byte conntrack key where the floor hashes 8 bytes (jhash is linear in key length), copies the conntrack value, tests for partial checksums and updates two per-CPU counters. Profile it with ` + "`perf record -a -g -- go run ./bench --spin established`" + `. What is left to try (bpf/): hash only the used 16 bytes of an IPv4 conntrack key.`},
	{"new-flow path|new flow under Katran|full conntrack", `**New flow against 3× the minimal DNAT and Katran's 399 ns.** The success-side events are already submitted with BPF_RB_NO_WAKEUP (only failures wake the agent), which took the self-IPI of the ring buffer's wake-up out of this path (1,814 ns before, same machine), and the NEW_FLOW event reuses the flow's start time (one clock read less). Profile (` + "`perf record -a -g -- go run ./bench --spin newflow`" + `, leaf functions of samples whose stack holds pb_xdp): about half is htab_lru_map_update_elem, the two conntrack inserts (half of that bpf_lru_pop_free, the LRU free-list lock; on this paravirtualised guest every irqrestore after a lock is a hypercall), 16% lookup_nulls_elem_raw (bucket walks in a table of a million buckets, cold for a new tuple), 16% the program's own instructions, 7% clock reads, 5% the ring buffer. **What a conntrack layout can win, measured** (2026-12-01, this program rebuilt with inserts removed, ` + "`go run ./bench --only packet --rounds 5`" + ` back to back with the unmodified build): without the reverse entry's insert, the saving one entry per flow would bring, a new flow costs 730 ns (7.98× the floor; unmodified 1,125 ns, 14.06×) and into a full conntrack 886 ns (9.53×; unmodified 1,324 ns, 16.55×); with no conntrack insert at all, 557 ns (6.24×). So no conntrack layout reaches 3× (or 4× into a full table) on this guest: even a datapath that remembers nothing costs 6× a DNAT that does nothing but rewrite, for the cold service and conntrack buckets, the Maglev pick through two array-of-maps lookups, the ring buffer record and the counters. One entry per flow would be worth its price (a second key layout for replies, which would find the flow through a backend → VIP lookup on every reply packet) only with that lookup an array read. Tried and dropped: BPF_F_NO_COMMON_LRU on pb_ct (per-CPU LRU lists) was slower here. The tail of single calls into a full conntrack (the p99 row) is the LRU's batch eviction: when a CPU's local free list runs dry, one insert refills it with 128 nodes from the global list, evicting them under its lock, so about one insert in 128 pays for 128 evictions. Measured (2026-12-03, ` + "`go run ./bench --only packet --rounds 5`" + ` twice, alternating with a build that only adds BPF_F_NO_COMMON_LRU to pb_ct, whose per-CPU lists evict 4 at a time): the p99 fell from 47.6–47.9 µs to 4.6–4.8 µs, but the median new flow rose from 1,302–1,352 ns to 2,183–2,514 ns and into a full conntrack from 1,682–1,703 ns to 3,225–3,375 ns (that hour ran about twice as slow as this run's). Trading every flow's cost for the tail is the wrong way round, so the common LRU stays; one entry per flow would halve the evictions and with them the tail's frequency.`},
	{"VIP port, non-VIP address ≤", `**Pass-through to a VIP port at an address that is no VIP** (%s ns, against %s ns for a port no service uses). Two array reads decide it: pb_ports (the destination port is some service's) and pb_vip_slots (a hash of the destination address; the agent marks every VIP's slot). An address that shares a slot with a VIP pays a conntrack and a service lookup (two hash misses) before it passes: the benchmark's address is checked to share none, so a miss here is the machine, or a change in those two reads (bpf/lb.c, pb_xdp).`},
	{"reaction p99", `**Reaction time** (median over rounds: p50 %s µs, p99 %s µs). The path is already short: a failure event is submitted with BPF_RB_FORCE_WAKEUP, the ring-buffer reader classifies it and runs accrual on its own goroutine (no channel hop), and an ejection writes the endpoint's state EJECTED into pb_backends (from that write on new flows are steered away), fills the service's idle Maglev table through a memory map and flips pb_services to it (no map-in-map update, so no RCU grace period: the diagnostic rows show what one would cost under this load, p50 %s µs, p99 %s µs). ` + "`perf trace -s -p <agent>`" + ` shows the agent's bpf() calls at 20–50 µs each, so the work per ejection is well under a millisecond. The floor under it, measured at the same time: an otherwise idle process waiting in the same reader for one event every 10 ms on a ring buffer of its own sees the event p50 %s µs, p99 %s µs after the kernel stamped it (the baseline rows), so on this paravirtualised 2-core guest the wake-up alone (irq_work, waking a sleeping thread, the Go netpoller) takes %s%% of the 1 ms budget at p99; the agent's p99 is %s× that floor. The rest of the tail is the agent waiting for a CPU while the load generator, the servers and its own event handling (400 connections/s of new-flow, established and flow-end events) share the 2 cores. On a node: give the agent CPU priority over its node's workloads (deploy/ sets a CPU request; a priority class or a higher nice value goes further).`},
	{"programmed in < 5 s", `**10,000 × 10 start-up is bound by the number of bpf() syscalls.** Backend entries, their counters and pb_svc_backends are written with batch updates and adoption reads with batch lookups; what remains is one map per Maglev table (two per service) and its memory map. Profile the agent from exec to ready with ` + "`perf record -g -p <agent pid>`" + ` and count syscalls with ` + "`perf trace -s`" + `.`},
	{"agent RSS", `**Agent RSS.** The agent sets a soft memory limit (GOMEMLIMIT 96 MiB unless the environment says otherwise) so the GC collects before the heap doubles; RssFile adds about 40 MB (the binary and the memory-mapped Maglev tables). Check with /proc/PID/status and GODEBUG=gctrace=1.`},
	{"above HAProxy|failures ≥ 99.9%", `**Refusing backend against HAProxy's passive checks.** Median failed connections per run: penaltybox %s, HAProxy %s (the last of them %s s and %s s after the start); penaltybox with retryRefused %s, HAProxy with option redispatch %s. Both detectors act after maxFailures = error-limit = 5 consecutive refusals, so without a retry five client-visible failures is the floor of either: a tie at five is not a shortfall of accrual (penaltybox's fifth comes sooner: HAProxy retries each refused connect on the same server first). Beating it takes hiding the refusals themselves, which is what retryRefused does (the refused SYN's RST is kept from the client and the agent replays the SYN at once to another backend); HAProxy's equivalent is option redispatch, and with both on, both lose nothing, and the difference is latency: HAProxy redispatches after its 300 ms turn-around, penaltybox one round trip after the refusal (the "slower than" and "slowest" rows). retryRefused is on by default; the plain penaltybox rows set it off to show accrual alone.`},
	{"ring buffer", `**Ring buffer.** The ring (4 MiB, the agent's default) holds about 87,000 events; the agent's reader drains about 1.6–1.9 million events per second when the producer is unpaced (the saturation rows). A loss at a paced rate below that is a reader that was off the CPU for longer than the ring lasts at that rate (about 160 ms at 550,000/s, 87 ms at 1,000,000/s) on this shared 2-core machine; a larger ring (` + "`--events-bytes`" + `) scales the margin linearly.`},
	{"connections/s ≥ nftables|machine CPU per connection ≤|agent CPU per healthy", `**End to end against nftables.** Machine CPU per connection: penaltybox %s µs (XDP_PASS mode) against nftables' %s µs, of which the agent process accounts for %s µs (the "of which" rows): it reads, decodes and runs through accrual the events a healthy connection's verdict needs (NEW_FLOW and ESTABLISHED, and FIRST_DATA where resets before data count, the default; FLOW_END only for a flow not yet decided). Part of the agent's CPU is paid per second, not per connection (the reader's 5 ms poll, its timers, the Go runtime's sysmon), so its share per connection falls as the rate rises: the same build measured 6.6 µs at 7,300 connections/s and 2.7–3.1 µs at 12,000 within an hour on this VM. A profile of the agent under this load (perf record -g -p) put 7%% of it in sorting handshake times for the replay deadline, now a one-pass selection; the rest is spread over the tracker's map, the reader and the scheduler. Its share was 27 µs until the reader stopped blocking in epoll_wait(2) (perf stat on the agent: the Go runtime's sysmon woke ~3,000 times a second to retake the blocked reader's P; now ~130), and about 19 µs until the agent's loop stopped waking for the connect deadlines of connections already decided (perf record -g on the agent: 65%% of its CPU was the Go scheduler parking and waking threads, 7%% the event handling). The rest is the kernel's: a new flow costs the datapath 0.7–1.1 µs per SYN (section 1, over this VM's runs), and with native XDP (the "native XDP on the veths" rows) a veth hands every packet to NAPI (veth_xdp_rcv) instead of straight to the peer's backlog; generic XDP, which ` + "`--xdp-mode auto`" + ` attaches to veths, keeps the backlog path and runs the program in it. The closed loop is latency-bound, not CPU-bound: a system-wide perf record over 2 s of each variant found the CPUs halted 27%% of the time in both (pvm_safe_halt_hc), so connections per second follow per-connection latency and swing ±10%% from round to round. What is left to try (bpf/ and agent): fewer records per healthy connection (a connect deadline could read conntrack's ESTABLISHED bit instead of waiting for the event), and XDP only on the interfaces traffic to VIPs enters by (here cl0), leaving the backends' veths on their fast path when replies need no XDP (reverse NAT could move to tc).`},
	{"p99 latency < 100 ms", "**Dropping SYNs: the p99 is the replay deadline.** A connection whose SYN the dropping backend swallowed completes one replay deadline plus a round trip after its SYN; the deadline is four times the service's recent handshake p99 (the second largest of its last 128 handshakes), rounded up to a power of two milliseconds (pkg/agent/replays.go). So the p99 of a round is bimodal: about 23 ms when the deadline is 16 ms, about 152 ms when two handshakes among the last 128 took 16–32 ms and it became 128 ms. Measured (2026-12-03, `go run ./bench --only failing --rounds 2`, the agent of 219e2a7 and of 6e029e6 back to back): 23.0 / 151.5 ms and 24.5 / 153.3 ms, the same in both builds; in that hour an idle process's ring-buffer wake-up had a p99 of 1.4 ms (the reaction part's floor rows), against 59 µs in quieter hours, and handshakes stalled with it. What is left to try (agent): a deadline that one scheduling stall of a 2-core VM does not multiply by eight: no rounding up past the next 8 ms step, and a tail taken over a longer window of handshakes."},
	{"ok during the flood", "**SYN flood: what legit connections still lose** (%s: penaltybox %s%% ok, with native XDP on the veths %s%%, the same build without the SYN guard %s%%). The guard drops the flood's SYNs at their first XDP pass, judged right after the service lookup and before conntrack is read (the packet part's \"flood SYN the SYN guard drops\" row). What legit connections lose they lose before XDP runs: the client's veth dropped %s packets during the flood (native XDP on the veths: %s; nftables DNAT: %s), legit SYNs among them, and with the 1 s connect timeout a dropped SYN is a failed connection (Linux retransmits a SYN after 1 s). With generic XDP (`--xdp-mode auto` attaches it to veths) and with nftables a SYN is processed in the receive path of the sender's own softirq, behind the per-CPU backlog, so the sender slows down instead of overflowing anything (nftables DNAT: %s SYNs/s sent); with native XDP a veth queues its sender's packets in a 256-entry ring that its NAPI drains on the CPU that scheduled it, and the ring overflows while that CPU, shared by the sender, the clients, the servers and the agent on this 2-core VM, runs something else. What is left to try: less work per flood SYN in the program (the service lookup, the guard's per-CPU state and the trust lookup remain), and the same flood on a NIC with native XDP, whose rings are 4–16 times a veth's and spread over RSS queues, which this machine does not have."},
}

// closingNote writes the explanations of the missed targets.
func (r *Results) closingNote(w io.Writer) {
	var missed []Target
	for _, t := range r.Targets {
		if !t.Met {
			missed = append(missed, t)
		}
	}
	if len(missed) == 0 {
		return
	}
	fmt.Fprintf(w, "## Closing note: missed targets, by how much and why\n\n")
	for _, t := range missed {
		fmt.Fprintf(w, "- %s: %s — %s.\n", t.What, t.Measured, t.Missing)
	}
	fmt.Fprintln(w)
	done := map[int]bool{}
	for _, t := range missed {
		for i, e := range explanations {
			hit := false
			for _, m := range strings.Split(e.match, "|") {
				hit = hit || strings.Contains(t.What, m)
			}
			if done[i] || !hit {
				continue
			}
			done[i] = true
			text := e.text
			switch e.match {
			case "established path|reply path":
				text = fmt.Sprintf(text, fmtNum(r.median("packet", "established flow"), 1))
			case "connections/s ≥ nftables|machine CPU per connection ≤|agent CPU per healthy":
				text = fmt.Sprintf(text,
					fmtNum(r.median("e2e", "penaltybox, XDP_PASS after NAT: machine CPU per connection"), 0),
					fmtNum(r.median("e2e", "nftables DNAT (kube-proxy nftables mode): machine CPU per connection"), 0),
					fmtNum(r.median("e2e", "penaltybox, XDP_PASS after NAT: "+ownRow), 0))
			case "above HAProxy|failures ≥ 99.9%":
				sc := strings.SplitN(t.What, ":", 2)[0]
				text = fmt.Sprintf(text,
					fmtNum(r.median("failing", sc+": penaltybox: failed connections"), -1),
					fmtNum(r.median("failing", sc+": HAProxy, passive L4 checks: failed connections"), -1),
					fmtNum(r.median("failing", sc+": penaltybox: time until the last failure"), 2),
					fmtNum(r.median("failing", sc+": HAProxy, passive L4 checks: time until the last failure"), 2),
					fmtNum(r.median("failing", sc+": penaltybox, retryRefused: failed connections"), -1),
					fmtNum(r.median("failing", sc+": HAProxy, passive L4 checks + option redispatch: failed connections"), -1))
			case "ok during the flood":
				sc := strings.SplitN(t.What, ":", 2)[0] + ": "
				text = fmt.Sprintf(text, strings.TrimSuffix(sc, ": "),
					fmtNum(r.median("flood", sc+"penaltybox: legit connections ok during the flood"), 2),
					fmtNum(r.median("flood", sc+"penaltybox, native XDP on the veths: legit connections ok during the flood"), 2),
					fmtNum(r.median("flood", sc+"penaltybox, no SYN guard: legit connections ok during the flood"), 2),
					fmtNum(r.median("flood", sc+"penaltybox: client veth drops during the flood"), 0),
					fmtNum(r.median("flood", sc+"penaltybox, native XDP on the veths: client veth drops during the flood"), 0),
					fmtNum(r.median("flood", sc+"nftables DNAT: client veth drops during the flood"), 0),
					fmtNum(r.median("flood", sc+"nftables DNAT: SYNs sent per second"), 0))
			case "VIP port, non-VIP address ≤":
				text = fmt.Sprintf(text,
					fmtNum(r.median("packet", "pass-through, VIP port, non-VIP address"), 0),
					fmtNum(r.median("packet", "pass-through, non-VIP port"), 0))
			case "reaction p99":
				text = fmt.Sprintf(text,
					fmtNum(r.median("reaction", "reaction time p50"), 0),
					fmtNum(r.median("reaction", "reaction time p99"), 0),
					fmtNum(r.median("reaction", "diagnostic: one Maglev-table swap (map-in-map update) under the same load, p50"), 0),
					fmtNum(r.median("reaction", "diagnostic: one Maglev-table swap (map-in-map update) under the same load, p99"), 0),
					fmtNum(r.median("reaction", floorName+"p50"), 0),
					fmtNum(r.median("reaction", floorName+"p99"), 0),
					fmtNum(r.median("reaction", floorName+"p99")/10, 0),
					fmtNum(r.ratio("reaction", "reaction time p99"), 2))
			}
			fmt.Fprintf(w, "%s\n\n", text)
		}
	}
}
