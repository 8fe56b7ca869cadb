// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/internal/promcheck"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

// The operator's kit against a live agent, through the Prometheus
// Operator's relabelling: a real Prometheus (Debian's) scrapes the agent
// with the job the Operator generates for deploy/podmonitor.yaml
// (promcheck.OperatorJob: honor_labels false, and the target labels
// namespace, pod, container, job, endpoint and node), and evaluates the
// shipped alert rules while b3 refuses every connection. The ejection
// alert fires naming backend b3 of service web, no series of the agent
// has a label renamed exported_*, every query of the shipped dashboard
// returns data, and promtool finds nothing to fix on /metrics. The agent
// runs with the default --backend-metrics (basic), which the rules and the
// dashboard must do with. (Debian's Prometheus is built without
// Kubernetes service discovery, so the target is static, with the
// __meta_kubernetes_* labels pod discovery would give it; test/e2e/k8s
// runs the same job with real discovery.)
func TestPrometheusAlertsAndDashboard(t *testing.T) {
	for _, bin := range []string{"prometheus", "promtool"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("%s not installed (make deps installs it)", bin)
		}
	}
	e := newEnv(t, 3)
	if err := e.topo.Backend(3).SetMode(testnet.Refuse); err != nil {
		t.Fatal(err)
	}
	e.startAgent(config(e.topo, all(3), accrualYAML), "--backend-metrics=basic")
	prom := startPrometheus(t, e)

	// Load for as long as the checks need: new connections keep the
	// counters moving and b3's probes failing.
	ctx, stop := context.WithCancel(e.ctx)
	loaded := make(chan error, 1)
	go func() {
		rs, err := testnet.Load(ctx, e.topo.Client, testnet.LoadSpec{Target: testnet.VIP + ":80",
			Rate: 50, Duration: 90 * time.Second, ConnectTimeout: 3 * time.Second, RequestTimeout: 3 * time.Second})
		if err == nil && rs.Count(testnet.OK) == 0 {
			err = fmt.Errorf("no connection succeeded: %v", rs)
		}
		loaded <- err
	}()
	defer func() {
		stop()
		if err := <-loaded; err != nil && ctx.Err() == nil {
			t.Error(err)
		}
	}()

	// The ejection alert, from Prometheus' own API.
	deadline := time.Now().Add(45 * time.Second)
	for {
		firing, err := prom.Firing("PenaltyboxEndpointEjected")
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range firing {
			if l["backend"] != b3 || l["svc_name"] != "web" {
				t.Errorf("ejection alert for %v, want backend %s of web", l, b3)
			}
			for k := range l {
				if strings.HasPrefix(k, "exported_") {
					t.Errorf("ejection alert with %s=%q: a label of the agent's was renamed by the Operator's target labels", k, l[k])
				}
			}
		}
		if len(firing) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("PenaltyboxEndpointEjected not firing after 45 s")
		}
		time.Sleep(time.Second)
	}

	// The agent's series: the Operator's target labels, and none of the
	// agent's own renamed.
	var labels struct {
		Data []string `json:"data"`
	}
	if err := prom.Get("/api/v1/labels", url.Values{"match[]": {`{__name__=~"penaltybox_.+"}`}}, &labels); err != nil {
		t.Fatal(err)
	}
	for _, l := range labels.Data {
		if strings.HasPrefix(l, "exported_") {
			t.Errorf("a penaltybox series has the label %s: the Operator's relabelling renamed one of the agent's labels", l)
		}
	}
	for _, want := range []string{"namespace", "pod", "container", "endpoint", "job", "instance", "node", "svc_name", "backend"} {
		if !slices.Contains(labels.Data, want) {
			t.Errorf("no penaltybox series has the label %s (labels: %v)", want, labels.Data)
		}
	}
	if n, err := prom.Series(`penaltybox_endpoint_ejected{job="penaltybox-system/penaltybox-agent",endpoint="metrics",backend="` + b3 + `"}`); err != nil || n != 1 {
		t.Errorf("penaltybox_endpoint_ejected of b3 under the PodMonitor's job: %d series, %v", n, err)
	}

	// Every dashboard query has data, with the variables at "All" and a
	// rate interval that fits the 1 s scrapes, once the scrapes span it.
	n, failed, err := prom.CheckDashboard("../../deploy/monitoring/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range failed {
		t.Error(err)
	}
	t.Logf("%d dashboard queries answered", n-len(failed))

	// promtool's lint of the live exposition.
	code, body, err := e.agent.Get(e.ctx, "/metrics")
	if err != nil || code != http.StatusOK {
		t.Fatalf("/metrics: %d, %v", code, err)
	}
	if err := promcheck.Lint("promtool", body); err != nil {
		t.Error(err)
	}
}

// promServer is a Prometheus running in the node's namespace.
type promServer struct{ *promcheck.Server }

// startPrometheus runs Debian's Prometheus in the node's namespace,
// scraping the agent every second with the job the Prometheus Operator
// generates for deploy/podmonitor.yaml, and evaluating the shipped rules
// every second.
func startPrometheus(t *testing.T, e *env) *promServer {
	t.Helper()
	rules, err := filepath.Abs("../../deploy/monitoring/penaltybox.rules.yaml")
	if err != nil {
		t.Fatal(err)
	}
	ds := struct {
		Spec struct {
			Template struct {
				Metadata struct {
					Labels map[string]string `json:"labels"`
				} `json:"metadata"`
			} `json:"template"`
		} `json:"spec"`
	}{}
	b, err := os.ReadFile("../../deploy/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &ds); err != nil {
		t.Fatal(err)
	}
	job, err := promcheck.OperatorJob("../../deploy/podmonitor.yaml", nil, "127.0.0.1:9464",
		promcheck.PodMeta("penaltybox-system", "penaltybox-agent-e2e", "node-e2e", "agent", "metrics", ds.Spec.Template.Metadata.Labels))
	if err != nil {
		t.Fatal(err)
	}
	job["scrape_interval"] = "1s"
	cfg, err := yaml.Marshal(map[string]any{
		"global":         map[string]any{"scrape_interval": "1s", "evaluation_interval": "1s"},
		"rule_files":     []string{rules},
		"scrape_configs": []any{job},
	})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := promcheck.Start(t.TempDir(), cfg, "promtool", func(config, data string) *exec.Cmd {
		return e.topo.Node.Command("prometheus", "--config.file="+config, "--storage.tsdb.path="+data,
			"--web.listen-address=127.0.0.1:9090")
	}, promcheck.API{Client: e.topo.Node.HTTPClient(time.Second), URL: "http://127.0.0.1:9090"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if tail := srv.Stop(); t.Failed() {
			t.Logf("prometheus log:\n%s", tail)
		}
	})
	return &promServer{srv}
}
