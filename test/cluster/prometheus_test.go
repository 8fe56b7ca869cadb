package cluster

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/internal/clusterrig"
	"github.com/penaltybox/penaltybox/internal/promcheck"
)

// rateInterval stands for the dashboard's $__rate_interval: 15 scrapes.
const rateInterval = 15 * time.Second

type prometheus struct {
	promcheck.API
	started time.Time
}

// startPrometheus runs, on the node, a Prometheus with Kubernetes service
// discovery (built from the module proxy: Debian's has none) with the
// shipped pod-role job (deploy/monitoring/prometheus-scrape.yaml, plus the
// API server's address and credentials a Prometheus outside the cluster
// needs) and the shipped rules, scraping and evaluating every second.
func startPrometheus(t *testing.T, ctx context.Context, rig *clusterrig.Rig) *prometheus {
	t.Helper()
	out, err := exec.Command(filepath.Join(rig.Root, "scripts/prometheus-tools.sh")).Output()
	if err != nil {
		t.Fatalf("prometheus-tools.sh: %v", err)
	}
	bin := strings.TrimSpace(string(out))
	bin = bin[strings.LastIndexByte(bin, '\n')+1:]

	job, err := os.ReadFile(filepath.Join(rig.Root, "deploy/monitoring/prometheus-scrape.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var jobs []map[string]any
	if err := yaml.Unmarshal(job, &jobs); err != nil || len(jobs) != 1 {
		t.Fatalf("prometheus-scrape.yaml: %v, %d jobs", err, len(jobs))
	}
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	csv, err := os.ReadFile(filepath.Join(rig.Dir, "etc/tokens.csv"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(token, []byte(strings.SplitN(string(csv), ",", 2)[0]), 0o600); err != nil {
		t.Fatal(err)
	}
	sd := jobs[0]["kubernetes_sd_configs"].([]any)[0].(map[string]any)
	sd["api_server"] = "https://" + clusterrig.NodeIP + ":6443"
	sd["tls_config"] = map[string]any{"ca_file": filepath.Join(rig.Dir, "apiserver-certs/apiserver.crt")}
	sd["authorization"] = map[string]any{"credentials_file": token}
	rules, err := filepath.Abs(filepath.Join(rig.Root, "deploy/monitoring/penaltybox.rules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := yaml.Marshal(map[string]any{
		"global":         map[string]any{"scrape_interval": "1s", "evaluation_interval": "1s"},
		"rule_files":     []string{rules},
		"scrape_configs": jobs,
	})
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, cfg, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(filepath.Join(bin, "promtool"), "check", "config", cfgPath).CombinedOutput(); err != nil {
		t.Fatalf("promtool check config: %v\n%s", err, out)
	}
	log, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := rig.Command(filepath.Join(bin, "prometheus"), "--config.file="+cfgPath,
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address=127.0.0.1:9091")
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
			lines := strings.Split(strings.TrimSpace(string(b)), "\n")
			t.Logf("prometheus log:\n%s", strings.Join(lines[max(0, len(lines)-30):], "\n"))
		}
	})
	p := &prometheus{API: promcheck.API{Client: rig.Node.HTTPClient(time.Second), URL: "http://127.0.0.1:9091"}, started: time.Now()}
	if err := p.Ready(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	return p
}

// alertFires: the ejection alert fires for the bad pod's endpoint, on the
// target service discovery found (the agent's pod, labelled with its node
// and pod names as the job relabels them).
func (p *prometheus) alertFires(t *testing.T, ctx context.Context, ip string) {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, 45*time.Second)
	defer cancel()
	var firing []map[string]string
	err := clusterrig.Wait(wctx, func() bool {
		var err error
		firing, err = p.Firing("PenaltyboxEndpointEjected")
		if err != nil {
			return false
		}
		for _, l := range firing {
			if strings.HasPrefix(l["endpoint"], ip+":") {
				t.Logf("alert firing: %v", l)
				return true
			}
		}
		return false
	})
	if err != nil {
		t.Errorf("PenaltyboxEndpointEjected not firing for %s: %v; firing: %v", ip, err, firing)
	}
	n, err := p.Series(`up{job="penaltybox-agent", node="pb-node"} == 1`)
	if err != nil || n != 1 {
		t.Errorf("the agent's pod as a discovered target, up, labelled with its node: %d series, %v", n, err)
	}
}

// dashboardAnswers: every query of the shipped dashboard returns data,
// once the scrapes span the rate interval.
func (p *prometheus) dashboardAnswers(t *testing.T, ctx context.Context) {
	t.Helper()
	if d := time.Until(p.started.Add(rateInterval + 5*time.Second)); d > 0 {
		time.Sleep(d)
	}
	qs, err := promcheck.DashboardQueries(filepath.Join("../../deploy/monitoring/grafana-dashboard.json"), rateInterval)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range qs {
		if n, err := p.Series(q.Expr); err != nil || n == 0 {
			t.Errorf("dashboard panel %q: %s: %d series, %v", q.Panel, q.Expr, n, err)
		}
	}
	t.Logf("all %d dashboard queries answered", len(qs))
}

// lintMetrics: promtool finds nothing to fix on the agent's live /metrics
// (the DaemonSet's port, on the node: the agent is hostNetwork).
func lintMetrics(t *testing.T, client *http.Client) {
	t.Helper()
	resp, err := client.Get(fmt.Sprintf("http://%s:9464/metrics", clusterrig.NodeIP))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b strings.Builder
	if _, err := io.Copy(&b, resp.Body); err != nil {
		t.Fatal(err)
	}
	if err := promcheck.Lint("promtool", []byte(b.String())); err != nil {
		t.Error(err)
	}
}
