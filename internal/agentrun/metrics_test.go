// SPDX-License-Identifier: Apache-2.0

package agentrun

import (
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// NonZero lists the non-zero series of the families with the prefix, in
// order, labels and all.
func TestMetricsNonZero(t *testing.T) {
	text := `# TYPE penaltybox_datapath_kube_proxy_flows_total counter
penaltybox_datapath_kube_proxy_flows_total{why="handed_over"} 3
penaltybox_datapath_kube_proxy_flows_total{why="taken_over"} 0
# TYPE penaltybox_datapath_flows gauge
penaltybox_datapath_flows 2
# TYPE penaltybox_other_total counter
penaltybox_other_total 9
`
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	got := Metrics(fams).NonZero("penaltybox_datapath_")
	want := []string{"penaltybox_datapath_flows{} 2", "penaltybox_datapath_kube_proxy_flows_total{why=handed_over} 3"}
	if !slices.Equal(got, want) {
		t.Errorf("NonZero = %q, want %q", got, want)
	}
}
