// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// fakeSource is two services of a node: a Kubernetes Service port with
// three backends and a standalone service with two.
type fakeSource struct{}

func (fakeSource) Services() []ServiceView {
	return []ServiceView{
		{ID: 1, Name: "shop/web:http", Served: "service-label", Backends: []BackendView{{ID: 1, Endpoint: "10.0.0.1:8080"}, {ID: 2, Endpoint: "10.0.0.2:8080"}, {ID: 3, Endpoint: "10.0.0.3:8080"}}},
		{ID: 2, Name: "dns", Backends: []BackendView{{ID: 4, Endpoint: "198.18.1.2:53"}, {ID: 5, Endpoint: "198.18.2.2:53"}}},
	}
}

func (fakeSource) Accrual() []accrual.ServiceSnapshot {
	eps := func(ids ...uint32) []accrual.EndpointSnapshot {
		var out []accrual.EndpointSnapshot
		for _, id := range ids {
			e := accrual.EndpointSnapshot{ID: id, State: accrual.Ready}
			if id == 3 {
				e.State = accrual.Ejected
				e.Counters.Ejections, e.Counters.Failures.Refused = 2, 7
			}
			out = append(out, e)
		}
		return out
	}
	return []accrual.ServiceSnapshot{{ID: 1, Endpoints: eps(1, 2, 3), Ready: 2, Ejected: 1}, {ID: 2, Endpoints: eps(4, 5), Ready: 2}}
}

func (fakeSource) GlobalStats() (bpf.LbGlobalStats, error)     { return bpf.LbGlobalStats{}, nil }
func (fakeSource) ServiceStats(uint32) (bpf.LbSvcStats, error) { return bpf.LbSvcStats{}, nil }
func (fakeSource) BackendStats(uint32) (bpf.LbBeStats, error)  { return bpf.LbBeStats{}, nil }
func (fakeSource) SYNGuardStats() (bpf.LbSynGuardCpu, error)   { return bpf.LbSynGuardCpu{}, nil }
func (fakeSource) NFForgotten() (maps.NFForgotten, error)      { return maps.NFForgotten{}, nil }
func (fakeSource) AffinityFill() (int, int, error)             { return 0, 65536, nil }

// targetLabels are what the Prometheus Operator (and Kubernetes service
// discovery, and Prometheus itself) set on a target: a series of ours with
// one of them would be renamed exported_<name> under honor_labels: false.
var targetLabels = []string{"endpoint", "namespace", "pod", "service", "job", "instance", "container"}

func gather(t *testing.T, d BackendDetail) []*dto.MetricFamily {
	t.Helper()
	m := New(fakeSource{}, fakeSource{}, nil)
	m.SetBackendDetail(d)
	// Every event-driven vector with a child, so its labels are seen too.
	m.Transitions.WithLabelValues("shop/web:http", "consecutive-failures").Inc()
	m.InvalidSettings.WithLabelValues("shop/web", "penaltybox.io/max-inflight").Inc()
	m.UntrackedFlows.WithLabelValues("dns", "service_cap").Inc()
	m.ProbeRegrants.WithLabelValues("shop/web:http", "no_verdict").Inc()
	m.KernelTrips.Inc("shop/web:http/ipv6", "adopted")
	m.FlowsToEjected.Inc("shop/web:http")
	m.UnansweredUDP.WithLabelValues("dns").Inc()
	fams, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return fams
}

// No series of the project carries a label the Operator sets on targets;
// a service is svc_namespace, svc_name, svc_port; an endpoint is backend.
func TestSeriesLabelsSurviveTheOperator(t *testing.T) {
	fams := gather(t, BackendDetailed)
	seen := map[string]bool{}
	for _, f := range fams {
		if !strings.HasPrefix(f.GetName(), "penaltybox_") {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				seen[l.GetName()] = true
				if slices.Contains(targetLabels, l.GetName()) {
					t.Errorf("%s has the label %q, which the Prometheus Operator's target labels override", f.GetName(), l.GetName())
				}
			}
		}
	}
	for _, l := range []string{"svc_namespace", "svc_name", "svc_port", "backend"} {
		if !seen[l] {
			t.Errorf("no series carries %s", l)
		}
	}
	for _, tc := range []struct{ in, ns, name, port string }{
		{"shop/web:http", "shop", "web", "http"},
		{"shop/web:http/ipv6", "shop", "web", "http/ipv6"},
		{"shop/web", "shop", "web", ""},
		{"dns", "", "dns", ""},
	} {
		if ns, name, port := SplitService(tc.in); ns != tc.ns || name != tc.name || port != tc.port {
			t.Errorf("SplitService(%q) = %q %q %q, want %q %q %q", tc.in, ns, name, port, tc.ns, tc.name, tc.port)
		}
	}
}

// The series budget docs/reference/metrics.md states: per backend on each
// node, 5 series by default, 0 with none, and detailed's extra; the
// per-service series do not depend on the setting.
func TestBackendSeriesBudget(t *testing.T) {
	count := func(d BackendDetail) (perBackend map[string]int, perService int) {
		perBackend = map[string]int{}
		for _, f := range gather(t, d) {
			for _, m := range f.GetMetric() {
				var be string
				svc := false
				for _, l := range m.GetLabel() {
					switch l.GetName() {
					case "backend":
						be = l.GetValue()
					case "svc_name":
						svc = true
					}
				}
				if be != "" {
					perBackend[be]++
				} else if svc {
					perService++
				}
			}
		}
		return perBackend, perService
	}
	basic, svcBasic := count(BackendBasic)
	detailed, svcDetailed := count(BackendDetailed)
	none, svcNone := count(BackendNone)
	if len(basic) != 5 || len(detailed) != 5 || len(none) != 0 {
		t.Fatalf("backends with series: basic %d, detailed %d, none %d; want 5, 5, 0", len(basic), len(detailed), len(none))
	}
	for be, n := range basic {
		if n != 5 {
			t.Errorf("basic: %s has %d series, want 5", be, n)
		}
		if detailed[be] != 5+20 {
			t.Errorf("detailed: %s has %d series, want 25 (no window rules here)", be, detailed[be])
		}
	}
	if svcBasic != svcDetailed || svcBasic != svcNone {
		t.Errorf("per-service series: basic %d, detailed %d, none %d: want the same", svcBasic, svcDetailed, svcNone)
	}
	t.Logf("per backend: basic 5, detailed %d; per-service series of 2 services: %d", detailed["10.0.0.1:8080"], svcBasic)
}

// Every alert has a runbook_url that is a page of docs/runbooks/, and
// the rules group their series by none of the target labels but job and
// instance (which name the agent, not a series of ours).
func TestAlertsHaveRunbooks(t *testing.T) {
	b, err := os.ReadFile("../../deploy/monitoring/penaltybox.rules.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert       string            `json:"alert"`
				Expr        string            `json:"expr"`
				Annotations map[string]string `json:"annotations"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(b, &rules); err != nil {
		t.Fatal(err)
	}
	const prefix = "https://github.com/penaltybox/penaltybox/blob/main/"
	byClause := regexp.MustCompile(`(?:by|on)\s*\(([^)]*)\)`)
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			u := r.Annotations["runbook_url"]
			rel, ok := strings.CutPrefix(u, prefix)
			if !ok || !strings.HasPrefix(rel, "docs/runbooks/") {
				t.Errorf("%s: runbook_url %q, want %sdocs/runbooks/...", r.Alert, u, prefix)
				continue
			}
			page, err := os.ReadFile(filepath.Join("../..", rel))
			if err != nil {
				t.Errorf("%s: runbook %s: %v", r.Alert, rel, err)
				continue
			}
			if !strings.Contains(string(page), r.Alert) {
				t.Errorf("%s: runbook %s does not name the alert", r.Alert, rel)
			}
			for _, m := range byClause.FindAllStringSubmatch(r.Expr, -1) {
				for _, l := range strings.Split(m[1], ",") {
					l = strings.TrimSpace(l)
					if slices.Contains(targetLabels, l) && l != "job" && l != "instance" {
						t.Errorf("%s groups by %q, a label the Operator sets on targets", r.Alert, l)
					}
				}
			}
			for _, l := range []string{"service", "endpoint", "namespace", "pod"} {
				if strings.Contains(r.Annotations["summary"]+r.Annotations["description"], fmt.Sprintf("$labels.%s ", l)) {
					t.Errorf("%s: an annotation uses $labels.%s", r.Alert, l)
				}
			}
		}
	}
	if n < 10 {
		t.Fatalf("%d alerts", n)
	}
}
