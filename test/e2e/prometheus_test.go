package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

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
		var alerts struct {
			Data struct {
				Alerts []struct {
					Labels map[string]string `json:"labels"`
					State  string            `json:"state"`
				} `json:"alerts"`
			} `json:"data"`
		}
		prom.get(t, "/api/v1/alerts", nil, &alerts)
		fired := false
		for _, a := range alerts.Data.Alerts {
			if a.Labels["alertname"] == "PenaltyboxEndpointEjected" && a.State == "firing" {
				if a.Labels["endpoint"] != b3 || a.Labels["service"] != "web" {
					t.Errorf("ejection alert for %v, want endpoint %s of web", a.Labels, b3)
				}
				fired = true
			}
		}
		if fired {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("PenaltyboxEndpointEjected not firing after 45 s; alerts: %+v", alerts.Data.Alerts)
		}
		time.Sleep(time.Second)
	}

	// Every dashboard query has data, with the variables at "All" and a
	// rate interval that fits the 1 s scrapes, once the scrapes span it.
	if d := time.Until(prom.started.Add(rateInterval + 5*time.Second)); d > 0 {
		time.Sleep(d)
	}
	b, err := os.ReadFile("../../deploy/monitoring/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	vars := strings.NewReplacer("$service", ".*", "$instance", ".*", "$__rate_interval", rateInterval.String())
	queries := 0
	for _, p := range dash.Panels {
		for _, q := range p.Targets {
			queries++
			var res struct {
				Status string `json:"status"`
				Data   struct {
					Result []json.RawMessage `json:"result"`
				} `json:"data"`
			}
			expr := vars.Replace(q.Expr)
			prom.get(t, "/api/v1/query", url.Values{"query": {expr}}, &res)
			if res.Status != "success" || len(res.Data.Result) == 0 {
				t.Errorf("panel %q: %s: status %q, %d series", p.Title, expr, res.Status, len(res.Data.Result))
			}
		}
	}
	t.Logf("%d dashboard queries answered", queries)

	// promtool's lint of the live exposition.
	code, body, err := e.agent.Get(e.ctx, "/metrics")
	if err != nil || code != http.StatusOK {
		t.Fatalf("/metrics: %d, %v", code, err)
	}
	cmd := exec.Command("promtool", "check", "metrics")
	cmd.Stdin = bytes.NewReader(body)
	out, err := cmd.CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
}

// rateInterval stands for the dashboard's $__rate_interval: 15 scrapes.
const rateInterval = 15 * time.Second

// promServer is a Prometheus running in the node's namespace.
type promServer struct {
	client  *http.Client
	started time.Time
}

// startPrometheus runs Debian's Prometheus in the node's namespace,
// scraping the agent every second as job penaltybox-agent and evaluating
// the shipped rules every second.
func startPrometheus(t *testing.T, e *env) *promServer {
	t.Helper()
	dir := t.TempDir()
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
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	log, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := e.topo.Node.Command("prometheus", "--config.file="+cfgPath,
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address=127.0.0.1:9090")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		log.Close()
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			t.Logf("prometheus log:\n%s", tail(string(b), 30))
		}
	})
	p := &promServer{client: e.topo.Node.HTTPClient(time.Second), started: time.Now()}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := p.client.Get("http://127.0.0.1:9090/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("prometheus not ready after 30 s: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// get decodes the JSON answer to path?q.
func (p *promServer) get(t *testing.T, path string, q url.Values, v any) {
	t.Helper()
	u := "http://127.0.0.1:9090" + path
	if q != nil {
		u += "?" + q.Encode()
	}
	resp, err := p.client.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
