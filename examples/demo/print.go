// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/penaltybox/penaltybox/internal/agentrun"
)

// printer writes the demo's report.
type printer struct {
	w io.Writer
}

func (p *printer) line(format string, args ...any) {
	fmt.Fprintf(p.w, format+"\n", args...)
}

func (p *printer) title(s string) {
	p.line("%s\n%s", s, strings.Repeat("=", len([]rune(s))))
}

func (p *printer) section(s string) {
	p.line("\n%s\n%s", s, strings.Repeat("-", len([]rune(s))))
}

// table returns a tabwriter indented by two spaces; call Flush.
func (p *printer) table() *table {
	return &table{tw: tabwriter.NewWriter(p.w, 0, 0, 2, ' ', 0)}
}

type table struct{ tw *tabwriter.Writer }

func (t *table) row(cells ...any) {
	s := make([]string, len(cells))
	for i, c := range cells {
		s[i] = fmt.Sprint(c)
	}
	fmt.Fprintf(t.tw, "  %s\n", strings.Join(s, "\t"))
}

func (t *table) flush() { t.tw.Flush() }

// series is one sample of a metric family, with its labels rendered the
// Prometheus way.
type series struct {
	labels map[string]string
	value  float64
}

func (s series) name(family string, keys ...string) string {
	var parts []string
	for _, k := range keys {
		if v, ok := s.labels[k]; ok {
			parts = append(parts, fmt.Sprintf("%s=%q", k, v))
		}
	}
	if len(parts) == 0 {
		return family
	}
	return family + "{" + strings.Join(parts, ",") + "}"
}

// allSeries lists the counter or gauge series of family, sorted by labels.
func allSeries(m agentrun.Metrics, family string) []series {
	fam, ok := m[family]
	if !ok {
		return nil
	}
	var out []series
	for _, s := range fam.Metric {
		x := series{labels: map[string]string{}}
		for _, l := range s.Label {
			x.labels[l.GetName()] = l.GetValue()
		}
		switch {
		case s.Counter != nil:
			x.value = s.Counter.GetValue()
		case s.Gauge != nil:
			x.value = s.Gauge.GetValue()
		case s.Untyped != nil:
			x.value = s.Untyped.GetValue()
		}
		out = append(out, x)
	}
	sort.Slice(out, func(i, j int) bool { return fmt.Sprint(out[i].labels) < fmt.Sprint(out[j].labels) })
	return out
}

// histogram returns the sample count and sum of family (summed over series).
func histogram(m agentrun.Metrics, family string) (count uint64, sum float64, ok bool) {
	fam, found := m[family]
	if !found {
		return 0, 0, false
	}
	for _, s := range fam.Metric {
		if h := s.Histogram; h != nil {
			count += h.GetSampleCount()
			sum += h.GetSampleSum()
			ok = true
		}
	}
	return count, sum, ok
}

func pct(n, of int) string {
	if of == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(n)/float64(of))
}

func num(v float64) string {
	if v == float64(int64(v)) {
		return fmt.Sprintf("%d", int64(v))
	}
	return fmt.Sprintf("%g", v)
}
