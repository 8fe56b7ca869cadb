// SPDX-License-Identifier: Apache-2.0

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
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/internal/clusterrig"
	"github.com/penaltybox/penaltybox/internal/promcheck"
)

type prometheus struct{ *promcheck.Server }

// startPrometheus runs, on the node, a Prometheus with Kubernetes service
// discovery (built from the module proxy: Debian's has none) with the
// shipped pod-role job (deploy/monitoring/prometheus-scrape.yaml, plus the
// API server's address and credentials a Prometheus outside the cluster
// needs) and the shipped rules, scraping and evaluating every second.
func startPrometheus(t *testing.T, ctx context.Context, rig *clusterrig.Rig) *prometheus {
	t.Helper()
	out, err := exec.CommandContext(ctx, filepath.Join(rig.Root, "scripts/prometheus-tools.sh")).Output()
	if err != nil {
		t.Fatalf("prometheus-tools.sh: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	bin := lines[len(lines)-1]

	dir := t.TempDir()
	csv, err := os.ReadFile(filepath.Join(rig.Dir, "etc/tokens.csv"))
	if err != nil {
		t.Fatal(err)
	}
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte(strings.SplitN(string(csv), ",", 2)[0]), 0o600); err != nil {
		t.Fatal(err)
	}
	jobs, err := promcheck.ShippedJob(filepath.Join(rig.Root, "deploy/monitoring/prometheus-scrape.yaml"),
		"https://"+clusterrig.NodeIP+":6443", filepath.Join(rig.Dir, "apiserver-certs/apiserver.crt"), token)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := yaml.Marshal(map[string]any{
		"global":         map[string]any{"scrape_interval": "1s", "evaluation_interval": "1s"},
		"rule_files":     []string{filepath.Join(rig.Root, "deploy/monitoring/penaltybox.rules.yaml")},
		"scrape_configs": jobs,
	})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := promcheck.Start(dir, cfg, filepath.Join(bin, "promtool"), func(config, data string) *exec.Cmd {
		return rig.Command(filepath.Join(bin, "prometheus"), "--config.file="+config,
			"--storage.tsdb.path="+data, "--web.listen-address=127.0.0.1:9091")
	}, promcheck.API{Client: rig.HTTPClient(), URL: "http://127.0.0.1:9091"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if tail := srv.Stop(); t.Failed() {
			t.Logf("prometheus log:\n%s", tail)
		}
	})
	return &prometheus{srv}
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
			if strings.HasPrefix(l["backend"], ip+":") {
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
func (p *prometheus) dashboardAnswers(t *testing.T) {
	t.Helper()
	n, failed, err := p.CheckDashboard("../../deploy/monitoring/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range failed {
		t.Error(err)
	}
	t.Logf("%d of %d dashboard queries answered", n-len(failed), n)
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
