// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"io"
	"math"
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
	{"30% refused at random: penaltybox failure-rate success rate after", "**An endpoint refusing 30%% at random, failure-rate alone** (this run: %s after the first second, single rounds %s to %s; %s failed connections of about 1,500 a run). What a readmission costs is chance: a probe brings the endpoint back, the window judges it again once it holds its minimum of calls, and a 30%% refuser can sit near the 20%% threshold for a while before the window ejects it again, so one readmission in a run can cost a few connections and none in the next (test/e2e's TestPartlyRefusingEndpoint measured 99.575-99.975%% over six runs on 2026-12-03 and keeps a 99%% margin). The accrual decides as designed; the rule that loses nothing is the default, retryRefused, whose replays took every refused connection elsewhere in every round (100%% beside it). Lowering the threshold or raising minCalls trades this against ejecting healthy endpoints on noise."},
	{"established path|reply path", `**Established path against the conntracking floor's known flow** (this run: %s ns, the floor's known flow %s ns, %s×; XDP_PASS %s ns, %s×). The floor (lb_known) parses, looks the 16-byte IPv4 5-tuple up in one LRU hash and rewrites. Where pb_xdp's extra time goes, measured (` + "`" + profileCmd + "`" + `, 5 rounds, medians of the per-round differences to the unmodified build, two runs): the coarse clock read on every packet (bpf_ktime_get_coarse_ns, only to refresh last_seen once a second; a helper call, and the spills around it) ` + estClock + `, since 316eac9 read once a jiffy (coarse_now: a copy kept beside the bpf_jiffies64 it was read at, which the verifier inlines to one load): beside the program before it (variant main, section 1d of bench/RESULTS-floor.md, two runs at 11:10 and 11:16 UTC) the established path went from 90; 91 to 76; 78 ns, 1.30× and 1.47× the floor's known flow, whose own median moved between 59 and 51 ns from one run to the other; the 40-byte conntrack key ` + estKey + ` (the floor with pb_ct_v2's key against its own, section 1a's diagnostic rows; ` + "`perf record -g -- go run ./bench --spin established`" + ` puts 13%% of the samples in htab_map_hash, jhash over 40 bytes, and 6%% in the bucket walk and its memcmp); the pb_vip_slots read, per-service and per-backend counters and forward()'s pb_config_v2 read ` + estSmall + `; all of these but the key together (variant lean-est) ` + estLean + `. Keeping pb_run's parsed packet in memory (the empty asm) is worth ` + estPktMem + `: keep it. The rest is the fuller parse (IP version, fragments, total length, the IPv6 dispatch), the 64-byte conntrack value and the flag test. **History** (each revision's own bench built and run on this machine in the same hour, alternating, ` + "`go run ./bench --only packet --rounds 3`" + ` twice each; established and pass-through against XDP_PASS, medians): ` + histText + ` The established path has cost 3.9–4.3× XDP_PASS here since 30 November, and pass-through 1.3–1.5×; the one addition that moved both was the first form of the evidence rules (901a150: 6.3× and 1.9×, the issue's figures), which a2d938e took off the forward path. Ratios to XDP_PASS from older RESULTS files do not compare: that program cost 4–6 ns there and 22 ns on this machine's kernel, whose BPF_PROG_TEST_RUN loop costs more per run. **What to change (bpf/lb.c), by saving:** (1) no clock read per established packet: done (316eac9; not the agent's heartbeat, which stops with the agent and would leave last_seen, and the reaper that reads it, on the agent's clock); (2) an IPv4 conntrack keyed by 16 bytes (a map of its own, or only the used bytes hashed) (` + estKey + `); (3) the counters, the slot read and the config read (` + estSmall + `). (1)–(3) bring the established path to about the floor's 1.3×. **Where the rest goes, line by line** (2026-12-07: ` + "`perf record -a -F 4999`" + ` of ` + "`go run ./bench --spin established`" + `, each sample's offset in pb_xdp mapped to its source line through the loaded program's jited line info): of the path's samples, htab_map_hash (jhash over the 40-byte key) 30%%, the bucket walk and compare 14%%, pb_xdp's own instructions 47%%, BPF_PROG_TEST_RUN's loop the rest; of pb_xdp's own, the prefilter's two array reads 19%% (pb_ports 15%%, pb_vip_slots 4%%), the per-service and per-backend counters 15%% (two per-CPU lookups, four adds), the checksum updates and rewrite 16%%, the parse 13%% (the zeroed packet record 2%%), building the conntrack and service keys 6%%, the global counters' and pb_config_v2's reads 3%%. No line stands out: the gap to the floor is the prefilter and the counters, which it has not, and the longer key's hash, spread over a few nanoseconds each.`},
	{"new flow ≤ 1.3×|new flow under Katran|full conntrack", `**New flow against the conntracking floor** (this run: %s ns, the floor's new flow %s ns, %s×; into a full table %s ns against %s ns, %s×; Katran's 399 ns is the issue's figure, not measured here; the floor does what Katran does for a SYN). The floor parses, looks the VIP up, hashes the 5-tuple, reads one slot of a flat Maglev ARRAY and the backend's entry, inserts one LRU entry and rewrites: %s ns more than the minimal DNAT measured the same way (repeat=1), nearly all of it the one LRU insert (a free node popped under the LRU's lock: on this paravirtualised guest every irqrestore after a lock is a hypercall). What pb_xdp's new flow spends beyond it, measured (` + "`" + profileCmd + "`" + `, section 1d of bench/RESULTS-floor.md; two runs of 5 rounds, medians of the per-round differences to the unmodified build, into the empty table; first run; second run): ` + newText + ` **What to change (bpf/lb.c), ranked by saving:** ` + newRecs + ` Connect-time translation for pods on the node (cgroup connect4/6) would take the per-packet cost of their established flows to zero, but not the new flow's cost for traffic from outside the node, and only with every guarantee kept; the packet path above reaches about 1.3× the floor without it. **The tail into a full table** (the p99 row) is the LRU's refill of a CPU's free list: when it runs dry, one insert takes 128 nodes from the global list and evicts them under its lock. The floor runs the same code and its p99 into a full table is %s µs where pb_xdp's is %s µs: with one entry per flow a refill falls on one flow in 128, under the 1%% the p99 looks at; with two, on one in 64. So one entry per flow should meet the ≤ 2 µs p99 target by halving the refills' frequency, not their cost (section 1a's p99.9 and "over 10 µs" rows show both). BPF_F_NO_COMMON_LRU (per-CPU lists, 4 evictions at a time) cut the p99 tenfold but doubled the median (2026-12-03): not worth it.`},
	{"VIP port, non-VIP address ≤", `**Pass-through to a VIP port at an address that is no VIP** (%s ns, against %s ns for a port no service uses). Two array reads decide it: pb_ports (the destination port is some service's) and pb_vip_slots (a hash of the destination address; the agent marks every VIP's slot). An address that shares a slot with a VIP pays a conntrack and a service lookup (two hash misses) before it passes: the benchmark's address is checked to share none, so a miss here is the machine, or a change in those two reads (bpf/lb.c, pb_xdp).`},
	{"single TCP stream through a VIP ≥ 0.95× the same stream direct", `**Bulk throughput** (one 256 MiB TCP stream, part 7; this run, best mode: download %s×, upload %s× the stream with no program attached). Through the VIP the stream keeps download %s×, upload %s× of the same stream to the backend's own address with the same agent attached, and download %s×, upload %s× of the same stream with only an XDP program that returns XDP_PASS attached the same way (the floor row; the extra rows under the table give each mode round by round): the NAT and the conntrack lookup per packet cost a bulk stream nothing measurable. What it loses against the node with no program attached is the attachment itself, which the floor loses as well (download %s×, upload %s× of no program). That is the kernel's, not the program's: on the generic XDP path (netif_receive_generic_xdp) a cloned or non-linear skb, which every GRO aggregate forwarded between veths is, is copied before any program runs (skb_linearize, or into page-pool pages for a program declared xdp.frags: a copy either way); native XDP on a veth clears the peer's TSO (veth_xdp_set), so the sender segments every 64 KiB into MTU-sized packets and each is copied into an xdp_buff. A frags-aware program was measured and kept out for that reason (` + "`bench/variants/xdpfrags.sh 9`" + `: an XDP_PASS program loaded as xdp.frags beside one loaded as xdp, both generic on a forwarding netns's two veths, one 2 GB nc stream each, 9 rounds in rotating order on 2026-12-04 while the machine was shared): plain 2.5–3.7, frags 2.6–3.7, none 2.9–3.8 Gbit/s, frags no better than plain within the noise. The ways out are outside the program: native XDP on a NIC driver (the program runs before any skb exists), or tc on the veths, where the skb stays as it is.`},
	{"reaction p99", `**Reaction time** (median over rounds: p50 %s µs, p99 %s µs). The path is already short: a failure event is submitted with BPF_RB_FORCE_WAKEUP, the ring-buffer reader classifies it and runs accrual on its own goroutine (no channel hop), and an ejection writes the endpoint's state EJECTED into pb_backends (from that write on new flows are steered away), fills the service's idle Maglev table through a memory map and flips pb_services to it (no map-in-map update, so no RCU grace period: the diagnostic rows show what one would cost under this load, p50 %s µs, p99 %s µs). The floor under it, measured at the same time: an otherwise idle process waiting in the same reader for one event every 10 ms on a ring buffer of its own sees the event p50 %s µs, p99 %s µs after the kernel stamped it (the baseline rows), so on this paravirtualised 2-core guest the wake-up alone (irq_work, waking a sleeping thread, the Go netpoller) takes %s%% of the 1 ms budget at p99; the agent's p99 is %s× that floor. The agent's own part (its log line's split: the reader handing over the batch → the maps written; the lock, the events before the deciding one, accrual, the Maglev rebuild, two map writes) is p50 %s µs, p99 %s µs: the rest is the wake-up. Split at accrual's decision (the line's reaction_decided_us), judging (the lock, the batch's events before the deciding one, accrual) is p50 %s µs, p99 %s µs, and programming (the Maglev rebuild, the table's fill, the map writes) p50 %s µs, p99 %s µs. The first system call of a wake-up may cost more than the next on a host that traces bpf() calls: the floor's process times the first bpf() call its handler makes after each wake-up (a map lookup) at p50 %s µs, p99 %s µs, and the same call at once after it at p50 %s µs (the bpf() diagnostic rows; its other thread's BPF_PROG_TEST_RUN submitted the event microseconds before, so the handler's call is its thread's first since the wake-up, not the process's). On the bench's VM on 2026-12-06, a test program calling bpf() after 5 ms sleeps (BPF_MAP_UPDATE_ELEM on an array) paid 13-30 µs for the first call and 1-3 µs for the next, while getpid() cost 2-3 µs either way; ` + "`perf record -F 20000 -g`" + ` of it put the first call's time in a BPF program attached at __sys_bpf's entry (the frames of its helpers and its hash lookups), one of the host's that ` + "`bpftool prog show`" + ` does not list. Where that holds, an ejection's first map write pays it before any of its own work. Two stalls are gone from it (issue 35): the first probation of each service installed its fallback table on the agent's loop (an RCU grace period, 15–36 ms here, which every ejection arriving meanwhile waited for: the first round's p99 was milliseconds), now installed in the background at the service's first ejection; and a batch's ejections waited for each other's log lines and pb_health writes, now written after the batch. Map writes no longer go through encoding/binary's reflection (a quarter of the programming's CPU samples). The rest of the tail is the agent waiting for a CPU while the load generator, the servers and its own event handling (400 connections/s of new-flow, established and flow-end events) share the 2 cores. On a node: give the agent CPU priority over its node's workloads (deploy/ sets a CPU request; a priority class or a higher nice value goes further).`},
	{"connections/s (worst mode)", "**Agent CPU per healthy connection at a paced rate** (the agentcpu part). Where it goes, how far the agent's side went (the reader's poll, a pointer-free tracker key, reused batches and sweep snapshots, the sweep's deletes in the kernel) and the kernel-side design the 1 µs target needs (successes counted per CPU in the datapath and read in batches, failures ordered by a per-backend sequence, and a conntrack sweep whose work does not grow with closed flows): bench/AGENTCPU.md. Since 2026-12-06 the part's clients come from 16 addresses and it warms up 11 s, so its window holds what a node with many clients pays: until 280ce5a (2026-12-07), the sweep deleting each closed flow's two entries 10 s after its close. Before, one client address reused its tuples every 6.4 s (each new flow took its tuple's closed entry over) and the window's sweep found nothing due: the figures before that date (about 3 µs) leave that out. Measured that way, the agent before the deletes moved into the kernel (f809948) took 16.2 / 15.4 / 16.0 µs a connection (medians of 3 rounds, consecutive / failure-rate / unified) and after them (5828798) 7.8 / 7.5 / 7.3 µs, runs one after the other (2026-12-06 02:55-03:02 UTC): the deletes were four system calls a flow, 13.6-16.2 µs a flow in `BenchmarkSweepExpire`, now one per 1,024 flows, 3.1-3.7 µs a flow the scan included. Then (0c2817a) the sweep's snapshot grows by doubling: the window holds a fresh agent's second sweep, whose snapshot append grew a quarter at a time from the first's, allocating, faulting in and copying it several times over (a CPU profile of one such agent, start to end: a quarter of its CPU in growing the snapshot). Alternating runs of the agents before and after (2 rounds each, twice, 06:02-06:12 UTC): 6.43 -> 5.15 µs a connection, medians of 12 samples. The agent's CPU over 10 s held under the same load past its first sweeps (steady state, --agentcpu-hold) was 430-460 ms before, so the window is now near what a long-running agent pays: the sweep's read of the table, the pairing of its entries and the program's deletes about 40% of it, the tracker's map about 15%, the Go runtime's sleeps and wake-ups most of the rest. Then (82306fa) the whole sweep moved into the kernel: `pb_ct_sweep_run`, a BPF_PROG_TYPE_SYSCALL program, walks the table itself (three walks, `bpf_for_each_map_elem`) where the agent copied it and paired its entries, with the same decisions as the copy's (a test over random tables of every shape compares both); `BenchmarkSweep` 1,162-1,332 -> 689-867 ns a flow with none due, 2,389-2,612 -> 958-1,237 with all due. Alternating runs of the agents before and after (3 rounds each, twice, 21:21-21:35 UTC, on an Intel Xeon guest where the runs above had an AMD EPYC): 5.33 -> 4.61 µs a connection, medians of 18 samples (4.28-7.45 -> 4.10-5.39). Then (280ce5a, 1f56f98) the datapath deletes a flow closed by a FIN each way, the second acknowledging the first, at its last ACK, so the sweep no longer walks 10 s of closed flows, most of the table at this rate: the agents before and after alternating (one round each, three pairs, 2026-12-07 21:21-21:28 UTC, an AMD EPYC), 3.40 / 3.87 / 4.03 -> 1.90 / 2.27 / 3.22 µs a connection (min / median / max over all modes). Held under the load after it (perf record, 15 s): the events' handling 52% and the reader's reads 8% (three records a healthy connection, the tracker's map and deadlines), the sweep 19% (its walk over the empty buckets of the 524,288-entry table the part then sized for closed flows that stayed 10 s), the scheduler 12%. The part's agents now run on the default table (262,144 entries, 4,000-8,000 used at this rate), as the new sizing advice has it: 1.60 / 1.93 / 3.38 µs a connection against 1.95 / 2.37 / 3.52 µs on 524,288 (the same agent, one round of each, alternating, five pairs; min / median / max of 15 samples). The 1 µs target now rests on the events, which the kernel-counted successes of bench/AGENTCPU.md would take away."},
	{"programmed in < 5 s", `**10,000 × 10 start-up is bound by the number of bpf() syscalls.** Backend entries, their counters and pb_svc_backends are written with batch updates and adoption reads with batch lookups; what remains is one map per Maglev table (two per service) and its memory map. Profile the agent from exec to ready with ` + "`perf record -g -p <agent pid>`" + ` and count syscalls with ` + "`perf trace -s`" + `.`},
	{"agent RSS <", `**Agent RSS.** The agent sets a soft memory limit (GOMEMLIMIT 96 MiB unless the environment says otherwise) so the GC collects before the heap doubles; RssFile adds about 40 MB (the binary and the memory-mapped Maglev tables). Check with /proc/PID/status and GODEBUG=gctrace=1.`},
	{"endpoints programmed from cold", apiColdText},
	{"endpoints: agent RSS ≤", apiRSSText},
	{"EndpointSlice changes/s: agent <", apiCPUText},
	{"above HAProxy|failures ≥ 99.9%", `**Refusing backend against HAProxy's passive checks.** Median failed connections per run: penaltybox %s, HAProxy %s (the last of them %s s and %s s after the start); penaltybox with retryRefused %s, HAProxy with option redispatch %s. Both detectors act after maxFailures = error-limit = 5 consecutive refusals, so without a retry five client-visible failures is the floor of either: a tie at five is not a shortfall of accrual (penaltybox's fifth comes sooner: HAProxy retries each refused connect on the same server first). Beating it takes hiding the refusals themselves, which is what retryRefused does (the refused SYN's RST is kept from the client and the agent replays the SYN at once to another backend); HAProxy's equivalent is option redispatch, and with both on, both lose nothing, and the difference is latency: HAProxy redispatches after its 300 ms turn-around, penaltybox one round trip after the refusal (the "slower than" and "slowest" rows). retryRefused is on by default; the plain penaltybox rows set it off to show accrual alone.`},
	{"ring buffer", `**Ring buffer.** The ring (4 MiB, the agent's default) holds about 87,000 events; the agent's reader drains about 1.6–1.9 million events per second when the producer is unpaced (the saturation rows). A loss at a paced rate below that is a reader that was off the CPU for longer than the ring lasts at that rate (about 160 ms at 550,000/s, 87 ms at 1,000,000/s) on this shared 2-core machine; a larger ring (` + "`--events-bytes`" + `) scales the margin linearly.`},
	{"connections/s ≥ nftables|machine CPU per connection ≤|agent CPU per healthy connection ≤ 3", `**End to end against nftables.** Machine CPU per connection: penaltybox %s µs (XDP_PASS mode) against nftables' %s µs, of which the agent process accounts for %s µs (the "of which" rows): it reads, decodes and runs through accrual the events a healthy connection's verdict needs (NEW_FLOW and ESTABLISHED, and FIRST_DATA where resets before data count, the default; FLOW_END only for a flow not yet decided). Part of the agent's CPU is paid per second, not per connection (the reader's poll, every 5 ms until the agentcpu part's work and every 5-50 ms since, its timers, the Go runtime's sysmon), so its share per connection falls as the rate rises: the same build measured 6.6 µs at 7,300 connections/s and 2.7–3.1 µs at 12,000 within an hour on this VM. A profile of the agent under this load (perf record -g -p) put 7%% of it in sorting handshake times for the replay deadline, now a one-pass selection; the rest is spread over the tracker's map, the reader and the scheduler. Its share was 27 µs until the reader stopped blocking in epoll_wait(2) (perf stat on the agent: the Go runtime's sysmon woke ~3,000 times a second to retake the blocked reader's P; now ~130), and about 19 µs until the agent's loop stopped waking for the connect deadlines of connections already decided (perf record -g on the agent: 65%% of its CPU was the Go scheduler parking and waking threads, 7%% the event handling). The rest is the kernel's: a new flow costs the datapath 0.7–1.1 µs per SYN (section 1, over this VM's runs), and with native XDP (the "native XDP on the veths" rows) a veth hands every packet to NAPI (veth_xdp_rcv) instead of straight to the peer's backlog; generic XDP, which ` + "`--xdp-mode auto`" + ` attaches to veths, keeps the backlog path and runs the program in it. The closed loop is latency-bound, not CPU-bound: a system-wide perf record over 2 s of each variant found the CPUs halted 27%% of the time in both (pvm_safe_halt_hc), so connections per second follow per-connection latency and swing ±10%% from round to round. What is left to try (bpf/ and agent): fewer records per healthy connection (a connect deadline could read conntrack's ESTABLISHED bit instead of waiting for the event), and XDP only on the interfaces traffic to VIPs enters by (here cl0), leaving the backends' veths on their fast path when replies need no XDP (reverse NAT could move to tc).`},
	{"p99 latency < 100 ms", "**Dropping SYNs: the p99 is the replay deadline.** A connection whose SYN the dropping backend swallowed completes one replay deadline plus a round trip after its SYN; the deadline is four times the service's recent handshake p99 (the second largest of its last 128 handshakes), rounded up to a power of two milliseconds (pkg/agent/replays.go). So the p99 of a round is bimodal: about 23 ms when the deadline is 16 ms, about 152 ms when two handshakes among the last 128 took 16–32 ms and it became 128 ms. Measured (2026-12-03, `go run ./bench --only failing --rounds 2`, the agent of 219e2a7 and of 6e029e6 back to back): 23.0 / 151.5 ms and 24.5 / 153.3 ms, the same in both builds; in that hour an idle process's ring-buffer wake-up had a p99 of 1.4 ms (the reaction part's floor rows), against 59 µs in quieter hours, and handshakes stalled with it. What is left to try (agent): a deadline that one scheduling stall of a 2-core VM does not multiply by eight: no rounding up past the next 8 ms step, and a tail taken over a longer window of handshakes."},
	{"ok during the flood", "**SYN flood: what legit connections still lose** (%s: penaltybox %s%% ok, with native XDP on the veths %s%%, the same build without the SYN guard %s%%). The guard drops the flood's SYNs at their first XDP pass, judged right after the service lookup and before conntrack is read (the packet part's \"flood SYN the SYN guard drops\" row). What legit connections lose they lose before XDP runs: the client's veth dropped %s packets during the flood (native XDP on the veths: %s; nftables DNAT: %s), legit SYNs among them, and with the 1 s connect timeout a dropped SYN is a failed connection (Linux retransmits a SYN after 1 s). With generic XDP (`--xdp-mode auto` attaches it to veths) and with nftables a SYN is processed in the receive path of the sender's own softirq, behind the per-CPU backlog, so the sender slows down instead of overflowing anything (nftables DNAT: %s SYNs/s sent); with native XDP a veth queues its sender's packets in a 256-entry ring that its NAPI drains on the CPU that scheduled it, and the ring overflows while that CPU, shared by the sender, the clients, the servers and the agent on this 2-core VM, runs something else. What is left to try: less work per flood SYN in the program (the service lookup, the guard's per-CPU state and the trust lookup remain), and the same flood on a NIC with native XDP, whose rings are 4–16 times a veth's and spread over RSS queues, which this machine does not have."},
}

// liveFramesRefusedNote begins the failing part's note where the agent
// could send no replays (the kernel refuses the live-frame mode and no raw
// socket opened): the closing note then explains the replayed rows'
// figures by the clients' own retransmissions. (Worded as the runs
// before the raw-socket fallback wrote it, so their JSON renders alike.)
const liveFramesRefusedNote = "This machine's kernel refuses BPF_PROG_RUN's live-frame mode, which SYN replays need"

// replaysOffFixes rewrite the closing note's sentences that say what the
// replays did, for a run whose kernel refused them (liveFramesRefusedNote):
// its clients waited for their own retransmissions instead.
var replaysOffFixes = []struct{ was, off string }{
	{"retryRefused, whose replays took every refused connection elsewhere in every round (100% beside it)",
		"retryRefused, which took every refused connection elsewhere in every round (100% beside it; in this run, whose kernel refuses replays, on the clients' own SYN retransmissions)"},
	{"penaltybox one round trip after the refusal (the \"slower than\" and \"slowest\" rows)",
		"penaltybox one round trip after the refusal where the kernel allows replays, and in this run, whose kernel refuses them, on the client's own retransmission a second later (the \"slower than\" and \"slowest\" rows)"},
}

// noted says whether a note of part begins with prefix.
func (r *Results) noted(part, prefix string) bool {
	for _, n := range r.Notes[part] {
		if strings.HasPrefix(n, prefix) {
			return true
		}
	}
	return false
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
	replaysOff := r.noted("failing", liveFramesRefusedNote)
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
				text = fmt.Sprintf(text, fmtNum(r.median("packet", "established flow"), 1),
					fmtNum(r.median("floor", flKnown), 1), fmtNum(r.ratio("floor", flEst), 2),
					fmtNum(r.median("floor", flPass), 1), fmtNum(r.ratio("floor", flEstP), 2))
			case "new flow ≤ 1.3×|new flow under Katran|full conntrack":
				text = fmt.Sprintf(text, fmtNum(r.median("floor", flNewPB), 0), fmtNum(r.median("floor", flNew), 0),
					fmtNum(r.ratio("floor", flNewPB), 2), fmtNum(r.median("floor", flFullPB), 0),
					fmtNum(r.median("floor", flFull), 0), fmtNum(r.ratio("floor", flFullPB), 2),
					fmtNum(r.median("floor", flNew)-r.median("packet", "minimal DNAT, match, repeat=1 (baseline floor)"), 0),
					fmtNum(r.median("floor", flFull99)/1000, 2), fmtNum(r.median("floor", flFull99P)/1000, 1))
			case "connections/s ≥ nftables|machine CPU per connection ≤|agent CPU per healthy connection ≤ 3":
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
			case "30% refused at random: penaltybox failure-rate success rate after":
				lo, med, hi := math.NaN(), math.NaN(), math.NaN()
				if f := r.find("failing", fmt.Sprintf("%s: penaltybox, failure-rate: success rate after the first %v", sPartial, partialSettle)); f != nil {
					lo, med, hi = stats(f.Samples)
				}
				text = fmt.Sprintf(text, fmtNum(med, 3)+"%", fmtNum(lo, 3)+"%", fmtNum(hi, 3)+"%",
					fmt.Sprintf("%.0f", r.median("failing", sPartial+": penaltybox, failure-rate: failed connections")))
			case "VIP port, non-VIP address ≤":
				text = fmt.Sprintf(text,
					fmtNum(r.median("packet", "pass-through, VIP port, non-VIP address"), 0),
					fmtNum(r.median("packet", "pass-through, non-VIP port"), 0))
			case "single TCP stream through a VIP ≥ 0.95× the same stream direct":
				dd, dp := bulkBest(r, bulkDirs[0])
				ud, up := bulkBest(r, bulkDirs[1])
				df, uf := bulkFloorBest(r, bulkDirs[0]), bulkFloorBest(r, bulkDirs[1])
				text = fmt.Sprintf(text, fmtNum(dd, 2), fmtNum(ud, 2), fmtNum(dp, 2), fmtNum(up, 2), fmtNum(df, 2), fmtNum(uf, 2),
					fmtNum(r.ratio("bulk", bulkRow(bulkDirs[0], bulkXDPFloor)), 2), fmtNum(r.ratio("bulk", bulkRow(bulkDirs[1], bulkXDPFloor)), 2))
			case "p99 latency < 100 ms":
				if replaysOff {
					text = fmt.Sprintf("**Dropping SYNs where replays are off.** This run's kernel refuses the live-frame mode SYN replays need (the failing part's note), so the agent replays nothing: a connection whose SYN the dropping backend swallowed completes on its client's own retransmission, a second after its SYN, which the datapath sends to a healthy backend once the silent one is ejected. This run's p99, %s, is that second. On a kernel that allows the mode it is the replay deadline, as follows. ", t.Measured) + text
				}
			case "reaction p99":
				text = fmt.Sprintf(text,
					fmtNum(r.median("reaction", "reaction time p50"), 0),
					fmtNum(r.median("reaction", "reaction time p99"), 0),
					fmtNum(r.median("reaction", "diagnostic: one Maglev-table swap (map-in-map update) under the same load, p50"), 0),
					fmtNum(r.median("reaction", "diagnostic: one Maglev-table swap (map-in-map update) under the same load, p99"), 0),
					fmtNum(r.median("reaction", floorName+"p50"), 0),
					fmtNum(r.median("reaction", floorName+"p99"), 0),
					fmtNum(r.median("reaction", floorName+"p99")/10, 0),
					fmtNum(r.ratio("reaction", "reaction time p99"), 2),
					fmtNum(r.median("reaction", reactionOwn+", p50"), 0),
					fmtNum(r.median("reaction", reactionOwn+", p99"), 0),
					fmtNum(r.median("reaction", reactionJudge+", p50"), 0),
					fmtNum(r.median("reaction", reactionJudge+", p99"), 0),
					fmtNum(r.median("reaction", reactionProgram+", p50"), 0),
					fmtNum(r.median("reaction", reactionProgram+", p99"), 0),
					fmtNum(r.median("reaction", bpfFirstRow+"p50"), 0),
					fmtNum(r.median("reaction", bpfFirstRow+"p99"), 0),
					fmtNum(r.median("reaction", bpfAgainRow+"p50"), 1))
			}
			if replaysOff {
				for _, f := range replaysOffFixes {
					text = strings.Replace(text, f.was, f.off, 1)
				}
			}
			fmt.Fprintf(w, "%s\n\n", text)
		}
	}
}

// The profile behind the packet part's explanations (issue 35): variant
// builds of pb_xdp measured beside it (section 1d of RESULTS-floor.md),
// and each revision's own bench run on this machine in the same hour. Taken
// again with profileCmd after bpf/lb.c changes.
const (
	profileCmd = "go run ./bench --only packet --rounds 5 $(bench/variants/build.sh /tmp/v asis NAME=ABLATION...)"
	// Two runs, 2026-12-04: 08:20 (bpf/lb.c of c5afeab) and 09:31 (of
	// d6b4c7f, bench/RESULTS-floor.md); each figure is "first; second".
	estClock  = "16; 14 ns (8 to 20 over rounds)"
	estKey    = "8; 7 ns"
	estSmall  = "5; 5 ns in all"
	estLean   = "22; 23 ns (71 ns left, 1.22× the floor's known flow in the second run; 1.33× in the first)"
	estPktMem = "8 ns here and 14 ns on pass-through (first run; since the split into headers the program no longer verifies without it)"
	histText  = "ded7e53 (1 Dec, before IPv6) 3.89× and 1.30×; f893bf6 (2 Dec, before the SYN guard) 4.14× and 1.36×; " +
		"05cee10 (3 Dec, the guard done) 4.02× and 1.34×; 901a150 (the evidence rules' first form) 6.27× and 1.86×; " +
		"a2d938e (the evidence rules off the forward path) 4.26× and 1.40×; 66a88e3 (the dead-man's switch; bpf/lb.c as of c5afeab) 4.19× and 1.39×. " +
		"Another hour, the same way: 04d3187 (30 Nov) 4.04× and 1.51×, ded7e53 4.31× and 1.37×, d6b4c7f (lb.c split into headers, sessionAffinity, IPIP) 4.13× and 1.43×."
	newText = "Done since (bench/RESULTS-floor.md, section 1d, variant main = the program before; two runs of 5 rounds, 11:10 and 11:16 UTC, figures \"first; second\"): " +
		"the coarse clock once a jiffy (316eac9) and a SYN's checksums summed in place instead of copied out (d0dd291; its options are still copied out, 55a9823): " +
		"1112; 1132 -> 962; 1011 ns, into a full table 1442; 1463 -> 1302; 1242 ns. The profile after them, same runs: without the reverse insert 0.74; 0.72x " +
		"(711; 731 ns), without the lookup before the insert 0.93; 0.91x, each other piece alone (the event, the guard, the checks, counters, config and slot reads) " +
		"within 1.0 +- 0.1x, the runs' noise; all of lean-new's pieces out 0.55; 0.54x (531 ns both runs, 1.36x and 1.23x the floor). Before them: " +
		"both conntrack inserts 480; 600 ns (into a full table 570; 520), of which the reverse entry's 230; 370 ns (full: 290; 290); " +
		"the SYN's checksum and option checks (syn_doomed, 901a150) 189; 170 ns; the clock reads, three here (the SYN guard's coarse clock, the flow's start, last_seen; " +
		"the hand-over check reads a fourth where the agent's dead-man bound is set, as it is by default, not in the bench) 129; 220 ns; " +
		"the SYN guard's bookkeeping while it is off (9cd279e, 1e175ca: two map reads and a clock read per SYN) 89; 131 ns; " +
		"the NEW_FLOW ring-buffer record 79; 91 ns; the conntrack lookup before the insert (a miss in a cold bucket, which only a SYN on a known tuple needs) 70; 130 ns; " +
		"the hand-over check (66a88e3: a pb_config_v2 read here) 50; 31 ns, within the noise; counters 50; 190 ns (noisy). " +
		"The checks, the guard, the hand-over test, the event, the lookup before the insert and the reverse insert out together (variant lean-new) save 520; 561 ns: " +
		"571; 651 ns are left, 1.50×; 1.35× the floor; with the clocks, counters and config reads out too (lean-all, second run) 560 ns are left, 1.16× the floor. " +
		"The pieces overlap (the guard and the hand-over check each include a clock read), so they do not add up; single pieces vary by ±150 ns from round to round, " +
		"the combinations and the inserts much less. Measured apart (section 1): a Linux client's SYN (20 bytes of options, which syn_doomed walks) costs 1.03× the bench's bare SYN; " +
		"a new flow to a service lately kube-proxy's (5a39775: the kernel's conntrack looked up per SYN, for --takeover-grace) 1.14×; to one with sessionAffinity ClientIP " +
		"(d32e237: a pb_affinity lookup and an LRU update per new flow) 1.12× (measured before the pin was written in place: see (9)). " +
		"Measured again (2026-12-05 20:52 UTC at fcbde84, one run of 5 rounds, `go run ./bench --only packet --rounds 5` with bench/variants/build.sh's " +
		"asis, no-rev-insert, no-syn-ct, no-event, no-guard, no-handover and no-stats; section 1d not rendered again here): as built 1092 ns (1012-1373), into a full table 1453 ns; " +
		"medians of the per-round ratios: without the reverse insert 0.82x (full table 0.77x), without the SYN's conntrack lookup 0.91x (full 1.05x), " +
		"without the NEW_FLOW record 0.97x, without counters 1.00x, without the SYN guard 1.02x, without the hand-over check 1.13x (noise: its rounds ran 0.97-1.63x). " +
		"So the idle guard costs nothing measurable since its clock read is the cached coarse one, and the reverse insert is still the one piece that is worth a redesign."
	newRecs = "(1) one conntrack entry per flow: the reverse insert is 230-370 ns of a new flow (290 into a full table) and half the LRU refills; " +
		"the price is on replies, which find their flow's VIP in the reverse entry today, with the one hash lookup they pay anyway: " +
		"a single entry must give them the VIP by an array read (the issue's condition), and a backend address and port that serves " +
		"two VIPs makes a backend -> VIP table ambiguous; a second hash on every reply would cost it about what the floor's known flow " +
		"pays for its lookup (section 1a). " +
		"(2) syn_doomed: done by summing in place (d0dd291), not by moving the checks: the first SYN is gone when a retransmission comes, and the agent's " +
		"connect deadline charges a timeout with no retransmission at all, so only the SYN itself can be judged. (3) clock reads: done for the coarse ones " +
		"(cached per jiffy); one bpf_ktime_get_ns remains, for the flow's start, which the handshake time is measured from. (4) the idle SYN guard: 90-130 ns when it read its own clock, " +
		"nothing measurable since the coarse clock is cached per jiffy (measured again 2026-12-05, above). (5) no NEW_FLOW record (80-90 ns), as the issue says: " +
		"the agent can take the start from conntrack with the outcome. (6) insert first, no lookup before it (70-130 ns): bpf_map_update_elem(BPF_NOEXIST), " +
		"and the known-tuple path on -EEXIST. (7) the hand-over check from the pb_config_v2 read new_flow makes for the hash seed, with the clock of (3) (up to 50 ns; within the noise here). " +
		"(8) counters and config reads. With (1)-(7) the new flow measured 571-651 ns (lean-new), 1.35-1.50× the floor; with (3) and (8) too, 560 ns, 1.16× (lean-all): within the 1.3× target. (9) sessionAffinity's pin: done (written in place when the client has one, instead of an LRU update per new flow): against the new flow SYN of the same rounds, 1.12 / 1.33 / 1.20× before and 0.92 / 0.82 / 0.92× after (medians of three 5-round runs of each build, alternating, `go run ./bench --only packet --rounds 5`, 2026-12-07 17:22 UTC; a pinned client's flow skips the Maglev pick). " +
		"The Maglev pick through pb_maglev's array of maps costs a helper call for the inner table where a flat ARRAY is one inlined read: small, not measured apart."
)

// The profiles behind the apiscale part's explanations (issue 35 part 5):
// PENALTYBOX_CPU_PROFILE=/tmp/p.prof go run ./bench --only apiscale, which
// leaves the last round's CPU profile (the whole run: start, idle, changes)
// and a heap profile at its end (/tmp/p.prof.heap); taken at 7ac2e87 (the
// figures before it at bc0d09e and earlier commits of the same day).
const (
	apiColdText = "**10,000 Services from the API server: the cold start.** Before this branch it took 38 s: the controller found each Service's " +
		"EndpointSlices by matching the labels of every slice in its namespace (43% of the agent's CPU; now an informer index), and every " +
		"hand-over re-applied all 10,000 services. 3.3-3.8 s at 7ac2e87; at the deltas' commit 3.4-4.7 s over two runs of 3 rounds, with main at 3.6-3.8 s measured between them on this shared 2-core machine (the cold path is the same but for the controller's count of the keys each Service lists), of which a whole-run CPU profile puts under 2 s of the agent's own CPU in " +
		"the start (Translate 0.3 s, table creation and first fills through mmap 0.4 s, the first Apply and accrual's adoption of 10,000 " +
		"services, GC); the rest is the agent waiting (the API server listing 20,000 objects, loading and attaching the datapath), not measured " +
		"apart here. What is left to try: handing the first desired state over in parts is ruled out (a partial state would drop services a " +
		"restarted agent had), so the levers are loading the datapath while the informers list, and the API server's streaming " +
		"lists (WatchListClient), which this run did not measure. Where the 3.5 s go (the agent's own log, 10,000 × 10, 2026-12-04, start → " +
		"programmed 3.54 s): the datapath's load 1.30 s (the verifier), the informers' lists and the first computation of every Service 1.16 s, " +
		"the first Apply through the attachment 1.14 s. Tried and not kept: the informers started before the datapath loads (the controller " +
		"built first, its metrics handed over after): 3.71 and 3.74 s against 3.54 s the same hour, because on this 2-core machine the verifier " +
		"and the list (the API server encoding 20,000 objects, the agent decoding them) compete for the same cores: the load took 2.07-2.30 s " +
		"instead of 1.30 s. On a node whose API server runs elsewhere the overlap should pay; this bench cannot show it. " +
		"Since (2026-12-04, late; 3659f6e, 92a8184, 2779ae4): the datapath loads its maps first and the program over them " +
		"(datapath.LoadMaps, then LoadProgram with every map replaced by the one loaded, data sections included), so the verifier no " +
		"longer runs in series. Measured with `go run ./bench --only apiscale` (start -> /readyz, each agent the same hour): serial " +
		"(1963707, 1 round) 3.03 s, of which the load 1.12 s, the lists 0.89 s, the first Apply through the attachment 0.96 s; the " +
		"program verified beside the first Apply (3659f6e, 2 rounds) 2.60 / 2.90 s; verified from the maps' load on at the same priority " +
		"(tried, 2 rounds) 3.01 / 3.08 s, the lists slowed from 0.9 to 1.25-1.4 s and the load to 1.25-1.35 s; from the maps' load on, " +
		"on a thread at nice 19 (92a8184, 2 rounds) 2.41 / 2.42 s, the lists back at 0.9 s; with a lighter first Apply (2779ae4: the " +
		"first state's spare tables installed once the datapath is live, tables created on both CPUs, no table copied out of each Maglev " +
		"build) the Apply takes 0.9-1.05 s from the caches' sync to ready, and the verifier, 1.5-1.8 s at nice 19 beside it (0.8 s " +
		"alone), ends with it or before: the previous version of bench/RESULTS-apiscale.md (9835873, 3 rounds: 2.49 / 2.74 / 2.97 s to /readyz, the lists 0.95-1.4 s from " +
		"round to round with the API server on the same two cores; 2.40 / 2.45 / 2.63 s in a run of 2779ae4 an hour before). What is left is thus two paths of about a second each after a 0.4 s map load and " +
		"0.9 s of lists: the verifier's 470,700 instructions processed for a program of 20,855, and about 40 µs of system calls per " +
		"service in the Apply (a table created, filled through mmap and unmapped; the backends' list; the service's entry); 2 s needs " +
		"both halved, which takes a program the verifier walks in fewer states and tables not made one map per service. Tried and not " +
		"kept: first fills through a reserved address window unmapped once per 256 tables (one TLB shootdown instead of 256) and " +
		"MAP_POPULATE: 15-24 µs a table either way, against 14-20 µs for map, copy, unmap (the mmap itself is the cost); a batch " +
		"update of a 1,021-slot table costs 200-240 µs. And pick_backend's rehashed steering tries in a global function of their own " +
		"(the verifier's log at level 2 put a third of the instructions it walked in their jhash and lookups, inlined on every path): " +
		"470,700 -> 305,316 instructions processed, but the verification time stayed 0.71-0.74 s (3 loads each): a kernel profile " +
		"(`perf record -g` of three loads) has the time in comparing states (states_equal, regsafe: about 20% of the samples against " +
		"5% in walking instructions) and the 23,000 states did not change; creating the per-CPU arrays at their default sizes " +
		"(pcpu_alloc for pb_be_stats) is another 18%. Fewer states, not fewer instructions, is what would shorten it. " +
		"Since (2026-12-05; b5e1347, 9c3b84b): the informers' lists begin before the maps load (the node's addresses first; the " +
		"controller gets its metrics once they exist), the lists are asked for without gzip (the API server compressed 20,000 objects " +
		"and the agent decompressed them on the same two cores; --api-compression asks again), a pin directory found empty is neither " +
		"adopted nor zeroed (no reads of empty maps, no counter resets for ids never handed out), and the controller drops the " +
		"informers' 10,000 initial keys before its first pass instead of computing every Service twice. The agent's log of a round: " +
		"lists begin, caches synced +1.4 s, program loaded +1.6-2.3 s (the verifier 0.95-1.7 s of it, from the maps' load on), " +
		"attached +2.6-2.9 s. Measured the same hour " +
		"(`go run ./bench --only apiscale --rounds 3 --agent BIN`, 2026-12-05 10:47-10:55 UTC, a slower hour than the figures above: the " +
		"API server's CPU at 100 changes/s 60-66% against 44-47% then): this tree 2.95 / 2.96 / 3.13 s to the maps, the agent's CPU over " +
		"the start 3.60 / 3.71 / 3.76 s, the API server's and etcd's 0.81 / 0.84 / 1.49 s; 06c6860 (before) 4.04 / 4.09 / 4.26 s, " +
		"3.92 / 3.94 / 4.32 s and 2.02 / 2.16 / 2.22 s: 0.72× the time to the maps, about half the API server's CPU. An earlier hour " +
		"(2026-12-05 07:00, without the drain): 2.31 / 2.41 / 2.99 s against 2.80 / 2.97 / 3.24 s. The 2 s target stays missed for the " +
		"reasons above: the verifier's second and the Apply's 40 µs a service. " +
		"Since (2026-12-05, later): the Apply timed phase by phase (a build with timers, 2 rounds): the desired state's sync 0.30-0.35 s " +
		"(the tables' creation in it), accrual's adoption 0.11-0.14 s, programming 0.76-0.78 s, of which the tables' first fills " +
		"0.43-0.46 s (map, copy, unmap: 44 µs a table) and the Maglev builds 0.14 s. Tried and not kept: the first fills of 512 " +
		"services at a time written side by side on both CPUs, each service flipped after its batch: 3.26 / 3.41 / 4.05 s to the maps " +
		"against 2.90 / 3.00 / 3.11 s for the same tree without it, runs alternating. A test program (4,000 tables of 1,021 slots, " +
		"another thread of the process busy, as the agent's are) says why: a fill costs 34 µs on one goroutine and 66 µs of wall " +
		"time a table on two (each munmap's TLB shootdown interrupts the other CPU, and the mappings serialise on the process's mm " +
		"lock); a batch update instead 71 µs on one and 61 µs on two; creating the tables 16-17 µs each on one goroutine and 14 µs on two. " +
		"The start is CPU-bound, not waiting: the agent's 3.6-4.0 s of CPU and the API server's and etcd's 0.8 s over a start need " +
		"2.2-2.4 s of this machine's two cores even perfectly overlapped, so 2 s takes about a core-second less work (the verifier's " +
		"states, one map per service's table, the GC of a heap near the 96 MiB soft limit), not more overlap. " +
		"Since (2026-12-06; bb75876): creating the maps was 0.3-0.5 s of every start, and the verifier cannot begin before the " +
		"maps exist. The kernel allocates a per-CPU array's elements one at a time, and pb_be_stats had 262,144 of them " +
		"(pb_svc_stats 65,536): a test program created pb_be_stats alone in 275-396 ms, the same bytes as 16,384 elements of 640 " +
		"bytes in 20-30 ms. Now 16 ids' counters share an element (pb_svc_stats_v2, pb_be_stats_v2; a reused id's slot is zeroed " +
		"in the kernel by pb_stats_reset_run): datapath.LoadMaps 0.30-0.53 s -> 0.10-0.15 s (five loads of each build, " +
		"alternating, 2026-12-06 11:55 UTC), and in the agent's log the lists' start to the maps loaded 0.80-0.88 s -> " +
		"0.27-0.49 s. Measured (`go run ./bench --only apiscale --rounds 3 --agent BIN`, the two agents one after the other, " +
		"12:23-12:33 UTC): this tree 2.50 / 2.67 / 4.95 s to the maps and 3.50 / 3.53 / 4.74 s of the agent's CPU over the start, " +
		"d3a6306 (before) 3.05 / 3.15 / 3.69 s and 4.31 / 4.43 / 4.43 s; two rounds of each 20 minutes before: 2.06 / 2.56 s " +
		"against 2.81 / 3.38 s. The slow round (4.95 s) is the lists' (caches synced 2.8 s after they began, against 1.0-1.3 s " +
		"in the other rounds). 2 s is met in some rounds and missed in most. What is left is two paths again, neither alone: the " +
		"verifier's 1.9-2.1 s at nice 19 (3.4 s in the slow round), and beside it the lists and the Apply, which ended 30 ms, " +
		"0.3 s and 0.7 s after the program was loaded in this tree's three rounds (the verifier ended last in all three of d3a6306's). " +
		"Measured again (2026-12-06 14:55-16:10 UTC, the agent of bd893ee, one run with a profiling signal handler added; 16 rounds over five runs of `go run ./bench --only " +
		"apiscale`, `make bench` among them): 1.87-3.61 s to the maps, and the spread follows the API server. In the 6 rounds " +
		"where kube-apiserver and etcd spent at most 0.82 s of CPU over the start the agent took 1.87-2.28 s (median 2.0 s, its " +
		"own CPU 2.5-2.9 s); in the 10 where they spent 1.3-2.4 s, 2.23-3.61 s. What the API server does in the slow rounds is " +
		"not pinned down: its metrics, scraped every 2 s through one run of 4 rounds, show its watch cache waiting to be fresh " +
		"(apiserver_watch_cache_read_wait_seconds) before serving the EndpointSlices in the two slow rounds and not in the two " +
		"fast ones, and no list read from etcd in any. Its CPU sampled every 0.5 s through another run (16:12-16:17 UTC, 4 " +
		"rounds: 2.46, 2.13, 2.31 and 3.12 s to the maps) puts the difference in serving the agent's own requests: from the " +
		"agent's start to its caches' sync the API server spent 0.6-0.75 s in rounds 2 and 3 (1.0 s in round 1, which began " +
		"while it was still busy after the Services' creation) and 1.9 s in the slow round 4, while before rounds 2-4 it ran " +
		"at the change window's 0.4 of a core, not at a previous round's tail. Tried and not " +
		"kept: the informers' streaming lists off " +
		"(KUBE_FEATURE_WatchListClient=false; client-go has them on by default since 1.35, so the agent asks for its initial " +
		"state as a watch that sends every object as an event). One agent built so, 3 rounds (15:53-15:59 UTC): the API " +
		"server's CPU over the start steady at 0.45-0.51 s and the start 2.32-2.53 s, but the agent's own CPU 3.2-3.7 s and " +
		"its RSS when programmed 199-243 MB (a whole list's response decoded at once), against 160-167 MB with them on in the " +
		"run right after it. The RSS target, and an API server serving a DaemonSet's lists, are better served by the streams. " +
		"Tried and not kept (2026-12-06, evening): the streams asked for at resourceVersion 0, as kube-proxy lists (the API " +
		"server streams its watch cache as it stands, where a start at no version makes it first wait for the cache to catch " +
		"up with etcd, the wait seen in the slow rounds). Two runs of 3 rounds of each agent, alternating (`go run ./bench " +
		"--only apiscale --rounds 3 --agent BIN`, 18:22-18:39 UTC): 1.81-3.82 s to the maps (median 2.77 s) as built, " +
		"2.09-3.57 s (median 2.43 s) at version 0; the API server's and etcd's CPU over the start 0.58-2.59 s and 0.66-2.51 s. " +
		"A round at version 0 still had the server spend 2.51 s, so its freshness wait is not what costs it the extra CPU; " +
		"the medians' difference is within the rounds' spread, and a start at any version may miss the last moments' " +
		"changes until the watch brings them: not worth that without a clear gain."
	apiRSSText = "**10,000 Services from the API server: RSS.** The objects are a cluster's since 6aee224 (labelled Services with selectors; slices as the EndpointSlice controller writes them, with pod references, nodes, zones, owners and copied labels): on them the agent before this change held 136 MB live after the cold start (heap profile after a GC, 5 s into a round) and peaked at 334-342 MB RSS; on the old bare objects 97 MB and 264-286 MB. " +
		"What it held: the informers' API objects (EndpointSlices with their pod references 47 MB, Services 20 MB), the reconciler's services and backends 23 MB, the controller's translated services 20 MB, accrual 9 MB, the agent's per-service policy 3 MB. " +
		"Done (ab729af, 107817b, 3b5dcb0): the informers' transform caches each EndpointSlice as the controller's compact copy (the fields Translate reads, the address parsed, conditions as flags, node names interned: about 1 KB a slice of ten endpoints, pod references and labels not kept) and a Service without its selector, status and other tools' labels and annotations; the translated endpoints are allocated at their size and shared by the reconciler instead of copied; the controller's pending map is made anew after the first hand-over instead of cleared (a map keeps its room); a cold start's 100,000 backend counter resets are written in batches of 4,096 (one batch marshalled 15 MB of boxed per-CPU zeros while the whole state was live). " +
		"Measured (`go run ./bench --only apiscale --rounds 2` with each agent, the same objects, 2026-12-04): live heap 136 -> 72 MB, peak RSS 334-342 -> 201-225 MB; a clean build at 6aee224, 3 rounds: 214.3 / 215.5 / 221.8 MB; at 29f3f1b (bench/RESULTS-apiscale.md) 208.0 / 208.2 / 210.3 MB. " +
		"What is left: the GC's live heap peaks at 90-97 MB in the middle of the first Apply and settles at 84 MB, and GOGC=100 lets the heap grow to twice that before collecting (GODEBUG=gctrace=1 in the agent's log, `--agent-logs`); the binary's own pages add about 46 MB. The live heap is now the reconciler's services and backends (15 MB: a 700-byte service record and a 96-byte backend record per endpoint), the cached slices (10 MB) and Services (8 MB), the controller's translated services (15 MB) and accrual (7 MB): the same endpoints held once per layer. 150 MB at GOGC=100 needs about 50 MB live, which takes one representation of a service's endpoints shared by the controller, the reconciler and accrual, not another trim; GOGC=50 is the operator's to set (peak about 1.5 times live, for more GC work). " +
		"Since (2026-12-05, evening; f4bb49a): a heap profile at the end of a round still had 8 MB of the 86 MB in use in the tracker's policy, one 32-byte copy per backend id grown an id at a time; " +
		"now one per service, reached through a 4-byte service id per backend. Measured (3 rounds each, the agents one after the other, 20:43-20:52 UTC): " +
		"peak RSS at the end of a round 198 / 213 / 222 MB before, 188 / 189 / 216 MB after; when programmed 182 / 187 / 194 and 177 / 185 / 186 MB: " +
		"a few MB of live heap, within the GC's own swing. " +
		"Since (2026-12-05, night; c5284e8, 9dcfd48, 94fd2e9, 59a04fc): a heap profile at the end of a round (cbf3a35) had the Services' cache at about 11 MB (the API type, 592 bytes before its strings), " +
		"the reconciler's map of backends by id at 6 MB, its id pools' maps of ids in use at 3.5 MB, each backend record in the 96-byte size class for a removal time only removed backends have, " +
		"and the controller's copy of each Service's parsed settings (184 bytes) kept for when an annotation turns invalid. " +
		"Now a Service is cached as the controller's compact copy (cachedService: the fields Translate, the Events and the policies read; sync rebuilds the API type for one Service at a time), " +
		"the backends are a slice indexed by their dense ids, the ids in use a bitmap, the removal time a map beside the backends, and the last good settings the cached annotations map they parse from. " +
		"Measured (`GODEBUG=gctrace=1 go run ./bench --only apiscale --rounds 3 --agent BIN --agent-logs DIR`, the agents before (cbf3a35) and after (59a04fc), two runs each, 22:58-23:29 UTC): " +
		"the live heap after the round's last GC 81 / 81 / 81 and 81 / 81 / 83 MB before, 71 / 69 / 69 and 69 / 70 / 69 MB after; " +
		"RSS when programmed 173 / 179 / 183 and 174 / 176 / 181 MB before, 161 / 169 / 169 and 162 / 168 / 170 MB after; " +
		"peak RSS at the end of a round 200 / 203 / 214 and 199 / 200 / 211 MB before, 177 / 180 / 182 and 178 / 179 / 202 MB after. " +
		"The start and the change window's CPU did not move beyond their noise (to the maps 2.73 / 3.31 / 3.52 and 2.78 / 3.08 / 4.11 s before, 2.69 / 4.31 / 4.35 and 2.74 / 3.01 / 3.55 s after, the slow rounds with the API server's CPU at 2.1-2.7 s instead of 0.7-1.0 s; 100 changes/s 10.7 and 10.3% before, 10.7 and 9.5% after). " +
		"Then (12f0ec1) the cached copies keep a 96-byte metadata struct of their own instead of metav1.ObjectMeta (232 bytes), answering client-go through GetObjectMeta: one run of 3 rounds (23:38-23:44 UTC) ended at 66 / 66 / 66 MB live, RSS when programmed 158 / 165 / 168 MB, peak at the end 178 / 186 / 191 MB. " +
		"150 MB still needs about 50 MB live. A heap profile at the end of a round of 12f0ec1 (62 MB in use) has no piece bigger than the cached slices (10 MB, the pods' names 1.5 MB of it): " +
		"the reconciler's services and backends about 11 MB, accrual about 10 MB, the controller's translated services and their endpoints about 7 MB, the informers' indexes about 5 MB (one set per Service key), the datapath's map handles 3 MB; " +
		"each is the same endpoints held once per layer, so what is left takes one representation shared by the layers, not another trim. " +
		"A heap profile after a GC at the end of a round's change window (2026-12-06, the agent of bd893ee, 68 MB in use) is the " +
		"same picture: the cached slices 12.5 MB (their endpoints 7 MB, the pods' names 3.5 MB), the reconciler's services and " +
		"backends 13 MB, the controller's translated services 9 MB (their endpoints 5 MB), accrual 7.6 MB, the informers' " +
		"stores and indexes 9 MB; no one piece is the 18 MB the target needs."
	apiCPUText = "**100 EndpointSlice changes/s: the agent's CPU.** 8.7-9.2% of a core (33-35% for main measured the same hour; 26-33% at 7ac2e87). " +
		"Until this branch's last change every hand-over (one per 30 ms debounce, about 25 a second here) carried all 10,000 services: " +
		"reconcile.Apply looked each one up to find it unchanged (36% of the agent's CPU), prepareTables walked them for spare tables (8%), " +
		"the controller's snapshot copied them (13%). Now a hand-over after the first is a delta (desired.State.Delta: the services of the " +
		"Services recomputed, the keys gone), and Apply's work is the changes'; the complete state still goes first and every resync. " +
		"That also took the change's p99 from 78-86 ms to 46-48 ms. In a profiled round (deltas, before the prefilter fix) the agent's loop spent 0.6 s " +
		"of the whole run, 0.17 s of it markPrefilters copying 10,000 VIP slots per hand-over (now skipped when all is marked); the rest of the agent's CPU is decoding the watch (protobuf " +
		"under gzip), Translate per changed Service, the periodic maintenance (Services() sorted for the probes and lost trips) and the GC over " +
		"a 170 MB heap. Within 5% needs those cut: to try, the watch without compression on a node-local API path, an allocation-light Translate, " +
		"maintenance over the services that can have something to do. A profile of the change window alone (`perf record -g -p` of the agent " +
		"for 14 s at 100 changes/s, 2026-12-04; 9.7% of a core) splits it: the Go runtime's sysmon thread 22% (each syscall after the process " +
		"went idle wakes it from its deep sleep, and it then polls every 20 µs for a millisecond before backing off: about 50 thread switches " +
		"per burst of work, each a hypercall on this guest), the agent's loop 26% (ProgramService 9%, of which mapping and unmapping the " +
		"tables written 4%; the Maglev build 2%), the watch's decoding 14% (gzip 2%), the controller's sync 8%, HTTP/2 and TLS reads 9%, " +
		"the periodic maintenance over all 10,000 services (syncPrefilters in Sweep, EndTakeovers, the sorted Services()) 4%. A fifth is " +
		"thus the runtime's own wake-ups, which only fewer bursts (changes applied in larger batches) would reduce. " +
		"Since (2026-12-04, later): the sorted Services() in the probation and lost-trip scans is gone (509df54; an idle agent's CPU profile " +
		"had it at 30 of 80 ms over 10 s), and the cold start's 10,000 'service served' log lines are one (8d0bba3). Tried and not kept: " +
		"the agent with GOMAXPROCS=1 (fewer idle Ps to wake): 6.94 / 7.25 / 7.55% against 7.40 / 8.04 / 8.55% for GOMAXPROCS=2 the same " +
		"hour (`go run ./bench --only apiscale` with the agent's environment set), a tenth less, while its cold start took 3.64 s against " +
		"3.37 s: not worth a reaction time on one core. A CPU profile of the change window alone at 6b1f638's parent (pprof started 9 s " +
		"into a round, 14 s; 930 ms of samples) has the agent's loop at 35% (filling tables 10%, of which mmap 8%; batch updates 6%; the " +
		"maintenance 6%), the watch's stream 24% (protobuf decoding 13%, HTTP/2 and TLS 11%, gzip 6%), the controller 9%, the GC 5%. " +
		"Profiled again (2026-12-06 14:58 UTC, the agent of bd893ee; `perf record -F 999 -g -p` for 12 s of a round's change " +
		"window, 8.2-8.9% of a core in that run): the Go runtime's sysmon 20% (a system call after the process went idle wakes " +
		"it, and it polls every 20 µs while any goroutine runs), the agent's Apply 17% (ProgramService 10%, of it the tables' " +
		"fills 5%), the watch's decoding 17% (protobuf 8.5%), HTTP/2 and TLS reads 9%, the GC 6%, the controller's sync 5%, " +
		"the scheduler's hand-offs between threads most of the rest. A Go CPU profile of the same window in another run (SIGPROF, " +
		"12 s) saw 5.2% of a core against the bench's 8.5%: about 40% of the agent's CPU here is its threads waking and sleeping " +
		"in the kernel, which only fewer, larger bursts of work would cut. No single piece of the rest is the 3.5-4 points the " +
		"target needs. Tried and not kept (2026-12-06, evening): fewer, larger hand-overs, the controller's debounce at 60 ms " +
		"instead of 30 ms (half as many Applies, each with twice the changes). Two runs of 3 rounds of each agent, alternating " +
		"(`go run ./bench --only apiscale --rounds 3 --agent BIN`, 18:48-19:05 UTC): 7.55-8.89% of a core (median 8.2%) as " +
		"built, 7.04-8.95% (median 8.2%) at 60 ms, while the change's p99 went from 43-52 ms to 72-107 ms. So the cost is not " +
		"per hand-over: it is per watch event (each decoded, then passed through the informer's goroutines to the " +
		"controller's worker, one by one) or per second, which a longer wait does not batch."
)
