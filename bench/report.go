// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"time"
)

// Figure is one measured quantity: one sample per round.
type Figure struct {
	Part    string    // "packet", "e2e", ...
	Name    string    // row label
	Unit    string    // "ns/pkt", "conn/s", ...
	Samples []float64 // one per round
	// Baseline names the figure (same part) this one is compared with; the
	// ratio is taken round by round (both were measured in the same round)
	// and reported as min/median/max of those ratios.
	Baseline string
	Note     string
	// Digits after the decimal point in the table (default 0 or 1 by size).
	Digits int
}

// Results collects figures, targets and notes of a run.
type Results struct {
	Figures []*Figure
	Targets []Target
	Notes   map[string][]string // part -> method notes
	Extra   map[string][]string // part -> extra lines (e.g. verifier counts)
}

// Target is one of the targets, judged on a median.
type Target struct {
	Part     string
	What     string // "established path ≤ 2× minimal DNAT"
	Measured string // "1.7×"
	Met      bool
	Missing  string // when not met: by how much
}

func newResults() *Results {
	return &Results{Notes: map[string][]string{}, Extra: map[string][]string{}}
}

func (r *Results) add(f *Figure) *Figure {
	r.Figures = append(r.Figures, f)
	return f
}

// figure returns the figure of part named name, creating it.
func (r *Results) figure(part, name, unit string) *Figure {
	for _, f := range r.Figures {
		if f.Part == part && f.Name == name {
			return f
		}
	}
	return r.add(&Figure{Part: part, Name: name, Unit: unit})
}

func (r *Results) find(part, name string) *Figure {
	for _, f := range r.Figures {
		if f.Part == part && f.Name == name {
			return f
		}
	}
	return nil
}

func (r *Results) note(part, format string, args ...any) {
	r.Notes[part] = append(r.Notes[part], fmt.Sprintf(format, args...))
}

func (r *Results) extra(part, format string, args ...any) {
	r.Extra[part] = append(r.Extra[part], fmt.Sprintf(format, args...))
}

// target records a target check: measured v against limit; lower says
// whether v must be at most (true) or at least (false) limit.
func (r *Results) target(part, what string, v, limit float64, lower bool, format string) {
	t := Target{Part: part, What: what, Measured: fmt.Sprintf(format, v)}
	if math.IsNaN(v) {
		t.Measured = "n/a"
		t.Missing = "not measured"
	} else if lower {
		t.Met = v <= limit
		if !t.Met {
			t.Missing = fmt.Sprintf("over by %.0f%%", 100*(v/limit-1))
		}
	} else {
		t.Met = v >= limit
		if !t.Met && limit == 0 {
			t.Missing = "short by " + fmt.Sprintf(format, -v)
		} else if !t.Met && strings.HasSuffix(format, "%%") {
			t.Missing = fmt.Sprintf("short by %.3f percentage points", limit-v)
		} else if !t.Met {
			t.Missing = fmt.Sprintf("short by %.1f%%", 100*(1-v/limit))
		}
	}
	r.Targets = append(r.Targets, t)
}

func stats(xs []float64) (lo, med, hi float64) {
	if len(xs) == 0 {
		return math.NaN(), math.NaN(), math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	med = s[n/2]
	if n%2 == 0 {
		med = (s[n/2-1] + s[n/2]) / 2
	}
	return s[0], med, s[n-1]
}

func median(xs []float64) float64 { _, m, _ := stats(xs); return m }

// split is the figures of other parts and those of part, each in order:
// a part that orders its own rows puts them back after the others.
func (r *Results) split(part string) (other, in []*Figure) {
	for _, f := range r.Figures {
		if f.Part == part {
			in = append(in, f)
		} else {
			other = append(other, f)
		}
	}
	return other, in
}

// Median of a figure, NaN when absent.
func (r *Results) median(part, name string) float64 {
	f := r.find(part, name)
	if f == nil {
		return math.NaN()
	}
	return median(f.Samples)
}

// ratios are the per-round ratios of f to its baseline.
func (r *Results) ratios(f *Figure) []float64 {
	if f.Baseline == "" {
		return nil
	}
	b := r.find(f.Part, f.Baseline)
	if b == nil {
		return nil
	}
	n := min(len(f.Samples), len(b.Samples))
	var out []float64
	for i := range n {
		if b.Samples[i] != 0 {
			out = append(out, f.Samples[i]/b.Samples[i])
		}
	}
	return out
}

// ratio is the median per-round ratio of part/name to its baseline.
func (r *Results) ratio(part, name string) float64 {
	f := r.find(part, name)
	if f == nil {
		return math.NaN()
	}
	return median(r.ratios(f))
}

func fmtNum(v float64, digits int) string {
	if math.IsNaN(v) {
		return "–"
	}
	if digits == 0 {
		switch a := math.Abs(v); {
		case a == 0:
			return "0"
		case a < 10:
			digits = 2
		case a < 100:
			digits = 1
		}
	}
	if digits < 0 {
		digits = 0
	}
	s := fmt.Sprintf("%.*f", digits, v)
	return s
}

// Machine describes where the run happened.
type Machine struct {
	CPU, Kernel, Go, Commit, Date string
	Cores                         int
	Duration                      time.Duration
	Rounds                        int
	Parts                         []string
	// Command is how the run was started (go run ./bench and its flags).
	Command string `json:",omitempty"`
}

func machine() Machine {
	m := Machine{Go: runtime.Version(), Cores: runtime.NumCPU(), Date: time.Now().UTC().Format("2006-01-02 15:04 MST")}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	if out, err := exec.Command("uname", "-r").Output(); err == nil {
		m.Kernel = strings.TrimSpace(string(out))
	}
	m.Commit = "unknown"
	if out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output(); err == nil {
		m.Commit = strings.TrimSpace(string(out))
		if err := exec.Command("git", "diff", "--quiet", "HEAD").Run(); err != nil {
			m.Commit += "+dirty"
		}
	}
	return m
}

var partTitles = map[string]string{
	"packet":   "1. Per-packet cost of the XDP program (BPF_PROG_TEST_RUN)",
	"floor":    "1a. Against the conntracking floor (bench/xdpbase lb_new, lb_known) and XDP_PASS",
	"variant":  "1d. Variant builds of pb_xdp, measured beside it (diagnostic: --pb-variant)",
	"breaker":  "1b. Circuit breaker: added per-packet cost of counting",
	"trip":     "1c. Kernel trip: the XDP run of the deciding failure (deciding failure → endpoint excluded, in the kernel)",
	"e2e":      "2. End to end through network namespaces",
	"agentcpu": "2b. The agent's CPU per healthy connection at a paced rate",
	"failing":  "3. Failing backend",
	"flood":    "3b. SYN flood beside legit load",
	"reaction": "4. Reaction time (kernel timestamp of the deciding failure → maps written)",
	"control":  "5. Control plane",
	"apiscale": "5b. Control plane at scale, against a real kube-apiserver",
	"fleet":    "6. Fleet evidence: an endpoint diluted over many client nodes (simulated)",
	"bulk":     "7. Bulk throughput: one TCP stream through a VIP beside the same stream direct",
}

var partOrder = []string{"packet", "floor", "breaker", "trip", "variant", "e2e", "agentcpu", "failing", "flood", "reaction", "control", "apiscale", "fleet", "bulk"}

// table writes the figures of one part as a markdown table.
func (r *Results) table(w io.Writer, part string) {
	var rows []*Figure
	for _, f := range r.Figures {
		if f.Part == part {
			rows = append(rows, f)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(w, "| figure | unit | min | median | max | n | vs. | ratio (min / median / max) |\n")
	fmt.Fprintf(w, "|---|---|--:|--:|--:|--:|---|---|\n")
	for _, f := range rows {
		lo, med, hi := stats(f.Samples)
		ratio := ""
		if rs := r.ratios(f); len(rs) > 0 {
			a, b, c := stats(rs)
			ratio = fmt.Sprintf("%.2f / **%.2f×** / %.2f", a, b, c)
		}
		name := f.Name
		if f.Note != "" {
			name += " — " + f.Note
		}
		d := f.Digits
		if f.Unit == "count" && d == 0 {
			d = -1 // whole numbers
		}
		fmt.Fprintf(w, "| %s | %s | %s | **%s** | %s | %d | %s | %s |\n", name, f.Unit,
			fmtNum(lo, d), fmtNum(med, d), fmtNum(hi, d), len(f.Samples), f.Baseline, ratio)
	}
}

// Markdown renders the whole report.
func (r *Results) Markdown(w io.Writer, m Machine) {
	fmt.Fprintf(w, "# penaltybox benchmark results\n\n")
	cmd := "`make bench` (`go run ./bench --out bench/RESULTS.md`)"
	if m.Command != "" {
		cmd = "`" + m.Command + "`"
	}
	fmt.Fprintf(w, "Generated by %s; every figure is measured in this run, on this machine, beside its baseline.\n\n", cmd)
	fmt.Fprintf(w, "| | |\n|---|---|\n")
	fmt.Fprintf(w, "| machine | %s, %d cores |\n| kernel | %s |\n| date | %s |\n| commit | %s |\n| Go | %s |\n| rounds | %d (min / median / max over rounds; ratios are taken round by round) |\n| parts | %s |\n| run time | %s |\n\n",
		m.CPU, m.Cores, m.Kernel, m.Date, m.Commit, m.Go, m.Rounds, strings.Join(m.Parts, ", "), m.Duration.Round(time.Second))

	if len(r.Targets) > 0 {
		fmt.Fprintf(w, "## Targets\n\n| part | target | measured (median) | |\n|---|---|---|---|\n")
		for _, t := range r.Targets {
			verdict := "met"
			if !t.Met {
				verdict = "**missed** (" + t.Missing + ")"
			}
			fmt.Fprintf(w, "| %s | %s | %s | %s |\n", t.Part, t.What, t.Measured, verdict)
		}
		fmt.Fprintln(w)
	}
	for _, p := range partOrder {
		has := false
		for _, f := range r.Figures {
			has = has || f.Part == p
		}
		if !has && len(r.Notes[p]) == 0 {
			continue
		}
		fmt.Fprintf(w, "## %s\n\n", partTitles[p])
		r.table(w, p)
		fmt.Fprintln(w)
		for _, l := range r.Extra[p] {
			fmt.Fprintln(w, l)
		}
		if len(r.Extra[p]) > 0 {
			fmt.Fprintln(w)
		}
		for _, n := range r.Notes[p] {
			fmt.Fprintf(w, "- %s\n", n)
		}
		if len(r.Notes[p]) > 0 {
			fmt.Fprintln(w)
		}
	}
	r.closingNote(w)
}

// Text prints the tables for a terminal (the same markdown, which reads
// fine as text).
func (r *Results) Text(w io.Writer, m Machine) {
	fmt.Fprintf(w, "\nmachine: %s, %d cores; kernel %s; %s; commit %s; %s; %d rounds; %s\n\n",
		m.CPU, m.Cores, m.Kernel, m.Date, m.Commit, m.Go, m.Rounds, m.Duration.Round(time.Second))
	for _, p := range partOrder {
		if r.has(p) {
			fmt.Fprintf(w, "%s\n", partTitles[p])
			r.table(w, p)
			fmt.Fprintln(w)
		}
	}
	if len(r.Targets) > 0 {
		fmt.Fprintf(w, "targets:\n")
		for _, t := range r.Targets {
			verdict := "met"
			if !t.Met {
				verdict = "MISSED (" + t.Missing + ")"
			}
			fmt.Fprintf(w, "  %-8s %-70s %-22s %s\n", t.Part, t.What, t.Measured, verdict)
		}
	}
}

func (r *Results) has(part string) bool {
	for _, f := range r.Figures {
		if f.Part == part {
			return true
		}
	}
	return false
}
