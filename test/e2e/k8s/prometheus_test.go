package k8s

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

// prometheusSD: a Prometheus with Kubernetes service discovery (built from
// the module proxy: Debian's has none) finds the agent the way the
// DaemonSet advertises it, with deploy/monitoring/prometheus-scrape.yaml's
// job as shipped: pod role, the DaemonSet template's labels and
// prometheus.io/* annotations, the pod's IP and the annotated port. No
// kubelet runs here, so the agent's pod is an API object the test writes
// (the template's metadata, the node's name, Running with the address the
// agent serves on); the agent itself runs in the node's namespace as in
// the rest of the test. Asserted: promtool accepts the config, the target
// is found and up with the node and pod labels the job sets, and the
// agent's series are in Prometheus.
func (w *world) prometheusSD(t *testing.T) {
	bin, err := buildTools("prometheus-tools.sh")
	if err != nil {
		t.Fatal(err)
	}
	ds := shippedDaemonSet(t)
	tmpl := ds.Spec.Template
	pod, err := w.c.Admin.CoreV1().Pods(ds.Namespace).Create(w.ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "penaltybox-agent-e2e", Labels: tmpl.Labels, Annotations: tmpl.Annotations},
		Spec: corev1.PodSpec{NodeName: nodeName, HostNetwork: true, ServiceAccountName: tmpl.Spec.ServiceAccountName,
			AutomountServiceAccountToken: ptr.To(false),
			Containers:                   []corev1.Container{{Name: "agent", Image: "penaltybox/agent:e2e"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "127.0.0.1", PodIPs: []corev1.PodIP{{IP: "127.0.0.1"}}}
	if _, err := w.c.Admin.CoreV1().Pods(ds.Namespace).UpdateStatus(w.ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	// The shipped job, with what a Prometheus outside the cluster needs to
	// reach the API server added to its service discovery.
	job, err := os.ReadFile(filepath.Join(repoRoot, "deploy", "monitoring", "prometheus-scrape.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var jobs []map[string]any
	if err := yaml.Unmarshal(job, &jobs); err != nil || len(jobs) != 1 {
		t.Fatalf("prometheus-scrape.yaml: %v, %d jobs", err, len(jobs))
	}
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte(w.c.adminToken), 0o600); err != nil {
		t.Fatal(err)
	}
	sd := jobs[0]["kubernetes_sd_configs"].([]any)[0].(map[string]any)
	sd["api_server"] = "https://" + apiserverAddr
	sd["tls_config"] = map[string]any{"ca_file": w.c.caFile}
	sd["authorization"] = map[string]any{"credentials_file": token}
	cfg, err := yaml.Marshal(map[string]any{
		"global":         map[string]any{"scrape_interval": "1s"},
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
	cmd := w.topo.Node.Command(filepath.Join(bin, "prometheus"), "--config.file="+cfgPath,
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address=127.0.0.1:9091")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		log.Close()
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			lines := strings.Split(strings.TrimSpace(string(b)), "\n")
			t.Logf("prometheus log:\n%s", strings.Join(lines[max(0, len(lines)-30):], "\n"))
		}
	}()
	client := w.topo.Node.HTTPClient(time.Second)
	get := func(path string, v any) error {
		resp, err := client.Get("http://127.0.0.1:9091" + path)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s: %s", path, resp.Status)
		}
		var buf bytes.Buffer
		buf.ReadFrom(resp.Body)
		return json.Unmarshal(buf.Bytes(), v)
	}
	w.eventually(40*time.Second, "Prometheus finds the agent's pod and scrapes it", func() bool {
		var targets struct {
			Data struct {
				ActiveTargets []struct {
					Labels map[string]string `json:"labels"`
					Health string            `json:"health"`
				} `json:"activeTargets"`
			} `json:"data"`
		}
		if get("/api/v1/targets", &targets) != nil {
			return false
		}
		for _, tg := range targets.Data.ActiveTargets {
			l := tg.Labels
			if l["job"] == "penaltybox-agent" && tg.Health == "up" && l["node"] == nodeName && l["pod"] == pod.Name &&
				l["instance"] == fmt.Sprintf("127.0.0.1:%s", tmpl.Annotations["prometheus.io/port"]) {
				return true
			}
		}
		return false
	})
	var res struct {
		Data struct {
			Result []json.RawMessage `json:"result"`
		} `json:"data"`
	}
	if err := get(`/api/v1/query?query=penaltybox_endpoints%7Bjob%3D%22penaltybox-agent%22%7D`, &res); err != nil || len(res.Data.Result) == 0 {
		t.Errorf("penaltybox_endpoints from the discovered target: %v, %d series", err, len(res.Data.Result))
	}
	if err := w.c.Admin.CoreV1().Pods(ds.Namespace).Delete(w.ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Error(err)
	}
}
