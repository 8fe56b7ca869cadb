// SPDX-License-Identifier: Apache-2.0

// Command bench measures penaltybox beside the alternatives a user would
// pick instead, on the same machine in the same run, and writes the
// results as markdown (bench/RESULTS.md via `make bench`):
//
//	go run ./bench --out bench/RESULTS.md [--only packet,e2e,failing,flood,reaction,control,apiscale,fleet,bulk] [--rounds 5]
//
// Parts (each can run on its own with --only):
//
//	packet    per-packet cost of the XDP program with BPF_PROG_TEST_RUN, beside
//	          an XDP_PASS-only program, a minimal DNAT and the conntracking
//	          floor (bench/xdpbase: lb_new, lb_known), and the circuit
//	          breaker's counting cost; with --pb-variant NAME=OBJ, other
//	          builds of pb_xdp beside it (bench/variants/build.sh)
//	e2e       connections per second and machine CPU per connection through
//	          network namespaces: penaltybox (XDP_PASS and redirect modes),
//	          nftables DNAT as kube-proxy's nftables mode writes it, HAProxy
//	          in TCP mode, and plain routing
//	agentcpu  the agent's own CPU per healthy connection at a paced 10,000
//	          new connections/s, in each accrual mode
//	failing   one of three backends refusing, then dropping SYNs: penaltybox,
//	          nftables DNAT, HAProxy with passive layer-4 checks
//	flood     a SYN flood beside legit load and long-lived connections:
//	          penaltybox and nftables DNAT at the same offered SYN rates
//	reaction  kernel timestamp of the deciding failure → endpoint out of the
//	          maps, over ≥ 1,000 ejections
//	control   10,000 services × 10 backends from a config file, one backend
//	          change end to end, Maglev builds, accrual engine and ring
//	          buffer throughput
//	apiscale  10,000 Services × 10 endpoints from a real kube-apiserver
//	          (the e2e tests' servers): agent start → every table in the
//	          maps, RSS, then 100 EndpointSlice changes/s: agent CPU and
//	          each change's latency to the maps
//	fleet     an endpoint diluted over 1 to 200 client nodes: time to eject
//	          with and without fleet evidence (the agent's decision code on
//	          a simulated clock)
//	bulk      one TCP stream of 256 MiB through a VIP beside the same
//	          stream to the backend directly, both directions, same rounds
//
// It needs root (BPF, network namespaces), nft and haproxy. Nothing is
// asserted on speed: the targets are reported as met or missed.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

type options struct {
	out    string
	only   []string
	rounds int
	quick  bool
	agent  string
	hold   time.Duration // agentcpu: keep the last agent under load this long
	ctSize int           // agentcpu: the agents' --conntrack-size (0: the agent's default)
	// agentLogs: apiscale copies each round's agent log here.
	agentLogs string
	// variants: other builds of pb_xdp for the packet part (--pb-variant).
	variants variantFlag
}

var allParts = []string{"packet", "e2e", "agentcpu", "failing", "flood", "reaction", "control", "apiscale", "fleet", "bulk"}

func main() {
	var o options
	only := flag.String("only", strings.Join(allParts, ","), "parts to run, comma-separated: "+strings.Join(allParts, ","))
	flag.StringVar(&o.out, "out", "", "write the results as markdown to this file (e.g. bench/RESULTS.md)")
	flag.IntVar(&o.rounds, "rounds", 5, "rounds per figure (min/median/max are over rounds)")
	flag.BoolVar(&o.quick, "quick", false, "tiny durations and sizes: a smoke run that proves every path works, not a measurement")
	flag.StringVar(&o.agent, "agent", "", "agent binary (default: build ./cmd/agent)")
	flag.IntVar(&o.ctSize, "agentcpu-conntrack-size", 0, fmt.Sprintf("agentcpu: the agents' --conntrack-size (0: the agent's default; %d before closed flows left at their last ACK)", agentCPUOldConntrack))
	flag.DurationVar(&o.hold, "agentcpu-hold", 0, "agentcpu: after the last round, keep its agent under the same load this long (for perf record -p PID; the pid is logged)")
	flag.StringVar(&o.agentLogs, "agent-logs", "", "apiscale: copy each round's agent log (its output, GODEBUG=gctrace=1's lines too) into this directory as apiscale-N.log")
	jsonOut := flag.String("json", "", "also write the raw figures as JSON to this file")
	render := flag.String("render", "", "do not measure: re-render --out (and the table) from a JSON file written by --json")
	spinPath := flag.String("spin", "", "instead of measuring, run one datapath path in a loop for a profiler: established, reply, passthrough, newflow, newflow-noreader, dnat, floor-known, floor-new")
	spinFor := flag.Duration("spin-for", 10*time.Second, "how long --spin runs")
	flag.Var(&o.variants, "pb-variant", "NAME=OBJECT: also measure this build of pb_xdp (bench/variants/build.sh) beside the datapath's in the packet part, with its maps; repeatable")
	floorChild := flag.Bool(wakeFloorFlag, false, "internal: be the reaction part's wake-up floor process")
	flag.Parse()
	if *floorChild {
		if err := wakeFloorChild(); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		return
	}
	if *spinPath != "" {
		if err := spin(*spinPath, *spinFor); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		return
	}
	for _, p := range strings.Split(*only, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		if !slices.Contains(allParts, p) {
			fmt.Fprintf(os.Stderr, "bench: unknown part %q (want %s)\n", p, strings.Join(allParts, ","))
			os.Exit(2)
		}
		o.only = append(o.only, p)
	}
	// Made now: a path that cannot be written fails before the minutes
	// of setup, not after the round it was to keep.
	if o.agentLogs != "" {
		if err := os.MkdirAll(o.agentLogs, 0o755); err != nil {
			fmt.Fprintln(os.Stderr, "bench: --agent-logs:", err)
			os.Exit(2)
		}
	}
	var (
		res *Results
		m   Machine
		err error
	)
	if *render != "" {
		res, m, err = load(*render)
	} else {
		if os.Geteuid() != 0 {
			fmt.Fprintln(os.Stderr, "bench: needs root (BPF, network namespaces)")
			os.Exit(1)
		}
		cleanUpOnInterrupt()
		res, m, err = run(o, func(format string, args ...any) {
			fmt.Fprintf(os.Stderr, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
		})
		if o.agent == "" && agentPath != "" {
			os.RemoveAll(filepath.Dir(agentPath)) // the agent binary built for this run
		}
		if res != nil && *jsonOut != "" {
			if werr := save(*jsonOut, res, m); werr != nil {
				fmt.Fprintln(os.Stderr, "bench:", werr)
			}
		}
	}
	if res != nil {
		res.Text(os.Stdout, m)
		if o.out != "" {
			var buf bytes.Buffer
			res.Markdown(&buf, m)
			if werr := os.WriteFile(o.out, buf.Bytes(), 0o644); werr != nil {
				fmt.Fprintln(os.Stderr, "bench:", werr)
				os.Exit(1)
			}
			fmt.Fprintf(os.Stderr, "wrote %s\n", o.out)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// sizes are the knobs of every part; quick shrinks them for smoke runs.
type sizes struct {
	packet   packetOpts
	e2e      e2eOpts
	failing  failingOpts
	flood    floodOpts
	reaction reactionOpts
	control  controlOpts
	apiscale apiscaleOpts
	fleet    fleetOpts
	bulk     bulkOpts
	agentcpu agentCPUOpts
}

func sizesFor(rounds int, quick bool) sizes {
	if quick {
		return sizes{
			packet:   packetOpts{Rounds: rounds, Repeat: 1001, NewFlows: 200, Trips: 50},
			e2e:      e2eOpts{Rounds: rounds, Duration: 300 * time.Millisecond, Warmup: 100 * time.Millisecond, Workers: 4},
			failing:  failingOpts{Rounds: rounds, Duration: time.Second, Rate: 200},
			flood:    floodOpts{Rounds: rounds, Duration: 2 * time.Second, Legit: 50, Rates: []int{5000}},
			reaction: reactionOpts{Ejections: 20, Services: 4, Rate: 400, Timeout: 20 * time.Second, Rounds: rounds, Admitted: time.Second, AdmittedRate: 2000},
			control:  controlOpts{Rounds: rounds, Services: 50, PerService: 10, RingDuration: 200 * time.Millisecond, GoBenchTime: "10x"},
			apiscale: apiscaleOpts{Rounds: rounds, Services: 50, PerService: 10, Rate: 20, ChangeFor: time.Second, Idle: 200 * time.Millisecond},
			fleet:    fleetOpts{Rounds: rounds, Nodes: []int{1, 50}, Rate: 500, Limit: 30 * time.Second},
			bulk:     bulkOpts{Rounds: rounds, Bytes: 8 << 20},
			agentcpu: agentCPUOpts{Rounds: rounds, Rate: 2000, Duration: 300 * time.Millisecond, Warmup: 100 * time.Millisecond},
		}
	}
	return sizes{
		packet:  packetOpts{Rounds: rounds, Repeat: 1_000_001, NewFlows: 20000, Trips: 2000},
		e2e:     e2eOpts{Rounds: rounds, Duration: 4 * time.Second, Warmup: 500 * time.Millisecond, Workers: 32},
		failing: failingOpts{Rounds: rounds, Duration: 6 * time.Second, Rate: 250},
		// Two rounds: each run saturates the machine for 10 s.
		flood:    floodOpts{Rounds: min(rounds, 2), Duration: 12 * time.Second, Legit: 100, Rates: []int{60000, 120000, 400000}},
		reaction: reactionOpts{Ejections: 1000, Services: 4, Rate: 400, Timeout: 60 * time.Second, Rounds: rounds, Admitted: 5 * time.Second, AdmittedRate: 2000},
		control:  controlOpts{Rounds: rounds, Services: 10000, PerService: 10, RingDuration: 2 * time.Second, GoBenchTime: "300ms"},
		apiscale: apiscaleOpts{Rounds: rounds, Services: 10000, PerService: 10, Rate: 100, ChangeFor: 20 * time.Second, Idle: 3 * time.Second},
		fleet:    fleetOpts{Rounds: rounds, Nodes: []int{1, 10, 50, 200}, Rate: 500, Limit: 2 * time.Minute},
		bulk:     bulkOpts{Rounds: rounds, Bytes: 256 << 20},
		agentcpu: agentCPUOpts{Rounds: rounds, Rate: 10000, Duration: 10 * time.Second, Warmup: 11 * time.Second},
	}
}

func run(o options, logf func(string, ...any)) (*Results, Machine, error) {
	start := time.Now()
	m := machine()
	m.Rounds = o.rounds
	m.Command = benchCommand()
	m.Parts = o.only
	res := newResults()
	sz := sizesFor(o.rounds, o.quick)
	sz.packet.Variants = o.variants
	var errs []string
	for _, p := range o.only {
		t0 := time.Now()
		logf("part %s: start", p)
		var err error
		switch p {
		case "packet":
			err = runPacket(res, sz.packet, logf)
		case "e2e":
			err = runE2E(res, sz.e2e, o.agent, logf)
		case "agentcpu":
			sz.agentcpu.Hold = o.hold
			sz.agentcpu.ConntrackSize = o.ctSize
			err = runAgentCPU(res, sz.agentcpu, o.agent, logf)
		case "failing":
			err = runFailing(res, sz.failing, o.agent, logf)
		case "flood":
			err = runFlood(res, sz.flood, o.agent, logf)
		case "reaction":
			err = runReaction(res, sz.reaction, o.agent, logf)
		case "control":
			err = runControl(res, sz.control, o.agent, logf)
		case "apiscale":
			sz.apiscale.LogDir = o.agentLogs
			err = runAPIScale(res, sz.apiscale, o.agent, logf)
		case "fleet":
			err = runFleet(res, sz.fleet, logf)
		case "bulk":
			err = runBulk(res, sz.bulk, o.agent, logf)
		}
		logf("part %s: done in %v", p, time.Since(t0).Round(time.Second))
		if err != nil {
			logf("part %s: FAILED: %v", p, err)
			errs = append(errs, fmt.Sprintf("%s: %v", p, err))
			res.note(p, "**This part failed in this run:** %v", err)
		}
	}
	m.Duration = time.Since(start)
	if len(errs) > 0 {
		return res, m, fmt.Errorf("%s", strings.Join(errs, "; "))
	}
	return res, m, nil
}

type saved struct {
	Machine Machine
	Results *Results
}

func save(path string, r *Results, m Machine) error {
	b, err := json.MarshalIndent(saved{m, r}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

func load(path string) (*Results, Machine, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, Machine{}, err
	}
	var s saved
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, Machine{}, err
	}
	return s.Results, s.Machine, nil
}

// benchCommand is this run's command line, as `go run ./bench` and its
// flags (the header of the markdown says how it was made).
func benchCommand() string {
	return strings.TrimSpace("go run ./bench " + strings.Join(os.Args[1:], " "))
}
