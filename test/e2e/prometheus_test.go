// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/promcheck"
	"github.com/penaltybox/penaltybox/internal/testnet"
)

// The operator's kit against a live agent: a real Prometheus (Debian's)
// scrapes the agent and evaluates the shipped alert rules while b3 refuses
// every connection; the ejection alert fires naming b3, every query of the
// shipped dashboard returns data, and promtool finds nothing to fix on the
// agent's /metrics. (Debian's Prometheus is built without Kubernetes
// service discovery, so it scrapes a static target under the job name the
// rules expect; deploy/monitoring/prometheus-scrape.yaml is the pod-role
// job for a Prometheus that has it.)
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
	e.startAgent(config(e.topo, all(3), accrualYAML))
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
			if l["endpoint"] != b3 || l["service"] != "web" {
				t.Errorf("ejection alert for %v, want endpoint %s of web", l, b3)
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
// scraping the agent every second as job penaltybox-agent and evaluating
// the shipped rules every second.
func startPrometheus(t *testing.T, e *env) *promServer {
	t.Helper()
	rules, err := filepath.Abs("../../deploy/monitoring/penaltybox.rules.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [%q]
scrape_configs:
  - job_name: penaltybox-agent
    static_configs:
      - targets: ["127.0.0.1:9464"]
`, rules)
	srv, err := promcheck.Start(t.TempDir(), []byte(cfg), "promtool", func(config, data string) *exec.Cmd {
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
