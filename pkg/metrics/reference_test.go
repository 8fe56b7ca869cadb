// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/penaltybox/penaltybox/internal/repocheck"
)

// docs/reference/metrics.md lists every metric of the agent with its
// labels, its --backend-metrics level and its help, as the code registers
// them (generated: `make docs`; this test fails when it is stale).
func TestMetricsReference(t *testing.T) {
	m := New(nil, nil, nil)
	ch := make(chan *prometheus.Desc, 1024)
	v := reflect.ValueOf(m).Elem()
	for i := range v.NumField() {
		if !v.Type().Field(i).IsExported() {
			continue
		}
		if c, ok := v.Field(i).Interface().(prometheus.Collector); ok {
			c.Describe(ch)
		}
	}
	(&collector{}).Describe(ch)
	close(ch)
	basic := []*prometheus.Desc{dEpEjected, dEpEjections, dEpRestores, dEpSuccesses, dEpFailures}
	detailed := []*prometheus.Desc{dEpFailKinds, dEpProbes, dEpSuppressed, dEpByReason, dEpSlow, dEpWinCalls, dEpWinRate, dEpWinSlow,
		dBePackets, dBeBytes, dBeFlows, dBeRPackets, dBeRBytes}
	// Desc.String quotes help and unit with %q (client_golang 1.21 added
	// the unit): read the help as a Go string literal.
	re := regexp.MustCompile(`^Desc\{fqName: "([^"]+)", help: ("(?:[^"\\]|\\.)*")(?:, unit: "(?:[^"\\]|\\.)*")?, constLabels: \{[^}]*\}, variableLabels: \{([^}]*)\}\}$`)
	type row struct{ name, labels, level, help string }
	var rows []row
	seen := map[string]bool{} // the Registry field describes them all again
	for d := range ch {
		s := re.FindStringSubmatch(d.String())
		if s == nil {
			t.Fatalf("cannot read %s", d)
		}
		if !strings.HasPrefix(s[1], "penaltybox_") || seen[s[1]] {
			continue // the Go runtime's and the process's
		}
		seen[s[1]] = true
		level := "always"
		switch {
		case slices.Contains(basic, d):
			level = "basic"
		case slices.Contains(detailed, d):
			level = "detailed"
		}
		labels := strings.ReplaceAll(s[3], ",", ", ")
		help, err := strconv.Unquote(s[2])
		if err != nil {
			t.Fatalf("%s: help %s: %v", s[1], s[2], err)
		}
		rows = append(rows, row{s[1], labels, level, help})
	}
	slices.SortFunc(rows, func(a, b row) int { return strings.Compare(a.name, b.name) })
	var b strings.Builder
	b.WriteString("| metric | labels | per-backend level | help |\n| --- | --- | --- | --- |\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s |\n", r.name, repocheck.Cell(r.labels), r.level, repocheck.Cell(r.help))
	}
	repocheck.CheckRegion(t, "../../docs/reference/metrics.md", "metrics", b.String())
}
