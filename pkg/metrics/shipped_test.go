package metrics

import (
	"encoding/json"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/yaml"
)

// The alert rules and the dashboard in deploy/ name metrics by string:
// every name they use must be one the agent exports, so a renamed metric
// breaks this test and not an operator's alert.
func TestShippedRulesAndDashboardUseExportedMetrics(t *testing.T) {
	exported := exportedNames(t)
	for _, file := range []string{"monitoring/penaltybox.rules.yaml", "prometheusrule.yaml", "monitoring/grafana-dashboard.json"} {
		b, err := os.ReadFile("../../deploy/" + file)
		if err != nil {
			t.Fatal(err)
		}
		used := regexp.MustCompile(`penaltybox_[a-z_]+`).FindAllString(string(b), -1)
		if len(used) == 0 {
			t.Errorf("%s names no penaltybox metric", file)
		}
		for _, n := range used {
			base := n
			for _, suf := range []string{"_bucket", "_sum", "_count"} {
				if b, ok := strings.CutSuffix(n, suf); ok && exported[b] {
					base = b
				}
			}
			if !exported[base] {
				t.Errorf("%s uses %s, which the agent does not export", file, n)
			}
		}
	}
}

// exportedNames are the names of every metric the agent registers.
func exportedNames(t *testing.T) map[string]bool {
	t.Helper()
	m := New(nil, nil, nil)
	ch := make(chan *prometheus.Desc, 1024)
	v := reflect.ValueOf(m).Elem()
	for i := range v.NumField() {
		if c, ok := v.Field(i).Interface().(prometheus.Collector); ok {
			c.Describe(ch)
		}
	}
	(&collector{}).Describe(ch)
	close(ch)
	re := regexp.MustCompile(`fqName: "([^"]+)"`)
	out := map[string]bool{}
	for d := range ch {
		if s := re.FindStringSubmatch(d.String()); s != nil {
			out[s[1]] = true
		}
	}
	if !out["penaltybox_endpoint_state"] || !out["penaltybox_kernel_trips_total"] {
		t.Fatalf("exported names incomplete: %v", out)
	}
	return out
}

// The PrometheusRule carries the plain rules file's groups unchanged, and
// every alert has a promtool test.
func TestPrometheusRuleMatchesRulesFile(t *testing.T) {
	var plain struct {
		Groups []map[string]any `json:"groups"`
	}
	var cr struct {
		Kind string `json:"kind"`
		Spec struct {
			Groups []map[string]any `json:"groups"`
		} `json:"spec"`
	}
	read := func(path string, v any) string {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := yaml.Unmarshal(b, v); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		return string(b)
	}
	read("../../deploy/monitoring/penaltybox.rules.yaml", &plain)
	read("../../deploy/prometheusrule.yaml", &cr)
	tests := read("../../deploy/monitoring/penaltybox.rules.test.yaml", &map[string]any{})
	if cr.Kind != "PrometheusRule" || len(plain.Groups) == 0 {
		t.Fatalf("kind %q, %d groups", cr.Kind, len(plain.Groups))
	}
	if !reflect.DeepEqual(plain.Groups, cr.Spec.Groups) {
		t.Error("deploy/prometheusrule.yaml's spec.groups differ from deploy/monitoring/penaltybox.rules.yaml")
	}
	for _, g := range plain.Groups {
		rules, _ := g["rules"].([]any)
		for _, r := range rules {
			name, _ := r.(map[string]any)["alert"].(string)
			if name == "" {
				t.Errorf("a rule without an alert name: %v", r)
				continue
			}
			if !strings.Contains(tests, "alertname: "+name+"\n") {
				t.Errorf("alert %s has no promtool test in penaltybox.rules.test.yaml", name)
			}
		}
	}
}

// The dashboard is well-formed as Grafana reads it: unique panel ids,
// panels inside the 24-column grid, every graph with a Prometheus query
// on the dashboard's data source variable.
func TestDashboardIsWellFormed(t *testing.T) {
	b, err := os.ReadFile("../../deploy/monitoring/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID        string `json:"uid"`
		Templating struct {
			List []struct{ Name, Type string } `json:"list"`
		} `json:"templating"`
		Panels []struct {
			ID         int    `json:"id"`
			Type       string `json:"type"`
			Title      string `json:"title"`
			Datasource struct {
				UID string `json:"uid"`
			} `json:"datasource"`
			GridPos struct{ X, Y, W, H int } `json:"gridPos"`
			Targets []struct {
				RefID string `json:"refId"`
				Expr  string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	var vars []string
	for _, v := range d.Templating.List {
		vars = append(vars, v.Name)
	}
	if d.UID == "" || !slices.Contains(vars, "datasource") {
		t.Fatalf("uid %q, variables %v: want a uid and a datasource variable", d.UID, vars)
	}
	ids := map[int]bool{}
	graphs := 0
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		if g := p.GridPos; g.X < 0 || g.W <= 0 || g.X+g.W > 24 || g.H <= 0 {
			t.Errorf("panel %q: gridPos %+v outside the grid", p.Title, g)
		}
		if p.Type == "row" {
			continue
		}
		graphs++
		if p.Datasource.UID != "${datasource}" || len(p.Targets) == 0 {
			t.Errorf("panel %q: datasource %q, %d queries", p.Title, p.Datasource.UID, len(p.Targets))
		}
		refs := map[string]bool{}
		for _, q := range p.Targets {
			if q.Expr == "" || refs[q.RefID] || q.RefID == "" {
				t.Errorf("panel %q: query %q with refId %q", p.Title, q.Expr, q.RefID)
			}
			refs[q.RefID] = true
		}
	}
	if graphs < 10 {
		t.Errorf("%d panels with queries, want the whole story", graphs)
	}
}
