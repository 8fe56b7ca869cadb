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
	{"established path|reply path", `**Established and reply paths against the minimal DNAT.** Both do a full DNAT like the floor, but on top of it: a pb_ports prefilter read, two hash lookups (pb_services, 20-byte key; pb_ct, 40-byte IPv6-ready key) where the floor hashes one 8-byte key, a copy of the 48-byte conntrack value, bpf_ktime_get_coarse_ns for the once-a-second last_seen refresh, the partial-checksum test of l4csum_replace, two per-CPU counter updates and the pb_config read in forward(). Profile (` + "`perf record -a -g -- go run ./bench --spin established`" + `, leaf functions of samples inside pb_xdp): 45% the program's own instructions, 32% htab_map_hash (jhash is linear in key length: 60 key bytes per packet against 8), 7% bucket walk, 5% memcmp of the 40-byte key, 7% bpf_ktime_get_coarse_ns (ktime_get_coarse_ts64 + timespec normalisation). The minimal DNAT under the same profile: 41% htab_map_hash, 32% its instructions. What would close the gap (bpf/, not done here): look up conntrack first and pb_services only for SYN/FIN/RST or a conntrack miss (the conntrack value carries svc_id: one 20-byte hash less per packet); refresh last_seen from bpf_jiffies64() (a variable read) instead of bpf_ktime_get_coarse_ns; hash only the used bytes of an IPv4 conntrack key (16 of 40). Still, at %s ns the established path is far under Katran's 187 ns.`},
	{"new-flow path|new flow under Katran", `**New flow against 4× the minimal DNAT and Katran's 399 ns.** Profile (` + "`perf record -a -g -- go run ./bench --spin newflow`" + `, leaf functions of samples inside pb_xdp): **58% is the ring buffer's wake-up**: bpf_ringbuf_submit → irq_work_queue → arch_irq_work_raise → x2APIC MSR write (pvm_write_msr), a self-IPI that traps to the hypervisor on this paravirtualised guest. It fires on every NEW_FLOW event because the agent's reader keeps up (the consumer position equals the record's, so the kernel wakes it each time). Another 16% is pvm_irq_enable (the irqrestore of the LRU list lock, the conntrack bucket locks and the ring lock, also a hypervisor call here), 10% the conntrack bucket walk, 8% the program's own instructions. What would close the gap (bpf/, not done here): submit the success-side events (NEW_FLOW, ESTABLISHED, FIRST_DATA, FLOW_END) with BPF_RB_NO_WAKEUP and only failures (REFUSED, RESET, SYN_RETRANS) with the default or BPF_RB_FORCE_WAKEUP, plus a short reader poll timeout in the agent (pkg/outcomes) so successes are still drained within milliseconds: the hot path loses the IPI, ejections lose no reaction time. Also BPF_F_NO_COMMON_LRU on pb_ct (per-CPU LRU lists: no global LRU lock on insert). The minimal DNAT emits no event at all, so part of this ratio is the price of observing every connection, which is the product. New flows into a full conntrack LRU (every insert evicts: the steady state of a busy node) cost more again, see that row.`},
	{"reaction p99", `**Reaction time** (median over rounds: p50 %s µs, p99 %s µs). Per ejection the agent (cmd/agent handleTransitions → reconcile.ProgramService) writes the endpoint's state EJECTED into pb_backends — from that write on the datapath steers new flows away from it — then fills the service's idle Maglev table through a memory map and flips the pb_services entry to it (no map-in-map update, so no RCU grace period: the diagnostic rows show what one would cost under this load, p50 %s µs, p99 %s µs), persists pb_health, and logs reaction_us. ` + "`perf trace -s -p <agent>`" + ` during this scenario: the agent's bpf() calls average 20–50 µs and its log writes 35 µs, so the work per ejection is a fraction of a millisecond; the rest of the tail is waiting to run — futex waits (the hand-off from the ring-buffer reader goroutine to the loop goroutine) and epoll wake-ups of up to 100+ ms at the extremes — on 2 cores that the load generator and the servers (in the benchmark process) keep busy, on a machine shared with other jobs. What would help (agent, not done here): give the agent CPU priority over the workloads of its node (a DaemonSet priority class and CPU request, or nice), and take the reader → loop channel hop out of the ejection path (classify failures on the reader's goroutine).`},
	{"programmed in < 5 s", `**10,000 × 10 start-up is bound by the number of bpf() syscalls.** On-CPU profile of the agent from exec to ready (` + "`perf record -g -p <agent pid>`" + `): 50% applyDesired — ProgramService 25% (per-backend SetBackend state writes, ResetBackendStats writing a per-CPU value each, InstallTables 8%) and reconcile.Apply/syncBackends 19%; 17% reconcile.New → adopt → maps.Backends, which walks all 262,144 entries of pb_backends with a MapIterator (NextKey + Lookup: two syscalls per entry) even when the maps were just created; 10% map creation in datapath.Load. ` + "`perf trace -s`" + ` over the same start counts several hundred thousand bpf() calls at about 20 µs each: the syscalls, not the Maglev builds (0.2 ms per default-size table, below), are the time. What would meet the target (pkg/maps, pkg/reconcile, not done here): read pb_backends and pb_ports with BatchLookup, or skip adoption for maps this load created; write backend entries, their per-CPU counter resets and pb_svc_backends with BatchUpdate (one syscall per few thousand entries); skip resetting counters of ids never used before.`},
	{"agent RSS", `**Agent RSS.** /proc/PID/status of the agent when ready (same config, checked after this run): RssAnon about 130 MB, RssFile about 39 MB (the 23 MB binary and a few hundred memory-mapped maps). The anonymous part is the Go heap: GODEBUG=gctrace=1 shows about 66 MB live when ready and a GC goal of about 102 MB (GOGC=100 lets the heap grow to twice the live data before collecting), plus the runtime's own. What would meet the target (agent, not done here): a soft memory limit (debug.SetMemoryLimit, or GOMEMLIMIT ≈ 100 MiB in the DaemonSet) so the GC collects before the heap doubles, for a little more GC work; in the longer run, fewer live bytes per endpoint (about 660 bytes per backend now, the reconciler's, accrual's and the metrics' state together).`},
	{"above HAProxy|failures ≥ 99.9%", `**Refusing backend against HAProxy's passive checks.** Median failed connections per run: penaltybox %s, HAProxy %s; the last of them %s s and %s s after the start. Both act after maxFailures = error-limit = 5 consecutive failures, so five client-visible failures is the least either can do with that setting: a tie at five is the floor of any consecutive-failure detector, not a shortfall of accrual (penaltybox's fifth failure comes sooner: HAProxy retries each refused connect on the same server for about a second before giving up). A probe after the penalty that still fails is one more client-visible failure (penaltybox's design, as Linkerd's: probes are real connections; runs during this work with the same settings showed one or two per 6 s run, HAProxy with ` + "`inter 60s`" + ` none — and no recovery). Being strictly above HAProxy would take rescuing the first failures themselves: the datapath already re-picks the retransmitted SYN of an unanswered flow (why "dropping SYNs" has no failures at all); doing the same when a backend answers a new flow's SYN with RST — drop the RST while the flow is unestablished, and send the client's retransmitted SYN to another backend — would hide refusals too, at the price of a 1 s retransmission for those clients (bpf/, not done here).`},
	{"ring buffer", `**Ring buffer.** The ring (4 MiB, the agent's default) holds about 87,000 events; the agent's reader drains about 1.6–1.9 million events per second when the producer is unpaced (the saturation rows). A loss at a paced rate below that is a reader that was off the CPU for longer than the ring lasts at that rate (about 160 ms at 550,000/s, 87 ms at 1,000,000/s) on this shared 2-core machine; a larger ring (` + "`--events-bytes`" + `) scales the margin linearly.`},
	{"connections/s ≥ nftables", `**End to end against nftables.** Machine CPU per connection: penaltybox %s µs (XDP_PASS mode) against nftables' %s µs, and the agent process alone accounts for %s µs of it (the "of which" rows): it is woken for, reads, decodes and runs through accrual the four events every successful connection produces (NEW_FLOW, ESTABLISHED, FIRST_DATA, FLOW_END), each one waking it separately because it keeps up with the ring — about 30 µs per event on this machine, wake-ups and goroutine hand-offs included. Without that share penaltybox's CPU per connection is about nftables' (its XDP work is tens of nanoseconds per packet, part 1); with both cores saturated by the client and the servers, the agent's share comes straight out of connections per second. What would close the gap (bpf/ and agent, not done here): the wake-up batching described for the new-flow path (success events with BPF_RB_NO_WAKEUP, failures waking the reader at once, a short poll for the rest), so the agent wakes once per batch rather than once per event; and fewer events per healthy connection where accrual does not use them.`},
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
			case "connections/s ≥ nftables":
				text = fmt.Sprintf(text,
					fmtNum(r.median("e2e", "penaltybox, XDP_PASS after NAT: machine CPU per connection"), 0),
					fmtNum(r.median("e2e", "nftables DNAT (kube-proxy nftables mode): machine CPU per connection"), 0),
					fmtNum(r.median("e2e", "penaltybox, XDP_PASS after NAT: of which its own process (agent / haproxy)"), 0))
			case "above HAProxy|failures ≥ 99.9%":
				sc := strings.SplitN(t.What, ":", 2)[0]
				text = fmt.Sprintf(text,
					fmtNum(r.median("failing", sc+": penaltybox: failed connections"), -1),
					fmtNum(r.median("failing", sc+": HAProxy, passive L4 checks: failed connections"), -1),
					fmtNum(r.median("failing", sc+": penaltybox: time until the last failure"), 2),
					fmtNum(r.median("failing", sc+": HAProxy, passive L4 checks: time until the last failure"), 2))
			case "reaction p99":
				text = fmt.Sprintf(text,
					fmtNum(r.median("reaction", "reaction time p50"), 0),
					fmtNum(r.median("reaction", "reaction time p99"), 0),
					fmtNum(r.median("reaction", "diagnostic: one Maglev-table swap (map-in-map update) under the same load, p50"), 0),
					fmtNum(r.median("reaction", "diagnostic: one Maglev-table swap (map-in-map update) under the same load, p99"), 0))
			}
			fmt.Fprintf(w, "%s\n\n", text)
		}
	}
}
