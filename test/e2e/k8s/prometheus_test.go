// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/internal/promcheck"
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
			Containers: []corev1.Container{{Name: tmpl.Spec.Containers[0].Name, Image: "penaltybox/agent:e2e",
				Ports: tmpl.Spec.Containers[0].Ports}}},
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
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte(w.c.AdminToken), 0o600); err != nil {
		t.Fatal(err)
	}
	jobs, err := promcheck.ShippedJob(filepath.Join(repoRoot, "deploy", "monitoring", "prometheus-scrape.yaml"),
		"https://"+w.c.Addr, w.c.CAFile, token)
	if err != nil {
		t.Fatal(err)
	}
	// And the job the Prometheus Operator generates for the shipped
	// PodMonitor, with the same discovery.
	sd := map[string]any{"api_server": "https://" + w.c.Addr, "tls_config": map[string]any{"ca_file": w.c.CAFile},
		"authorization": map[string]any{"credentials_file": token}}
	opJob, err := promcheck.OperatorJob(filepath.Join(repoRoot, "deploy", "podmonitor.yaml"), sd, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	opJob["scrape_interval"] = "1s"
	cfg, err := yaml.Marshal(map[string]any{
		"global":         map[string]any{"scrape_interval": "1s"},
		"scrape_configs": append(slices.Clone(jobs), opJob),
	})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := promcheck.Start(dir, cfg, filepath.Join(bin, "promtool"), func(config, data string) *exec.Cmd {
		return w.topo.Node.Command(filepath.Join(bin, "prometheus"), "--config.file="+config,
			"--storage.tsdb.path="+data, "--web.listen-address=127.0.0.1:9091")
	}, promcheck.API{Client: w.topo.Node.HTTPClient(time.Second), URL: "http://127.0.0.1:9091"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if tail := srv.Stop(); t.Failed() {
			t.Logf("prometheus log:\n%s", tail)
		}
	}()
	get := func(path string, v any) error { return srv.Get(path, nil, v) }
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
	// A target reads "up" once its scrape is reported, which can be a
	// moment before that scrape's samples are committed and queryable:
	// the series are waited for (a scrape a second), not taken at once.
	var n int
	var serr error
	w.eventually(5*time.Second, "penaltybox_endpoints from the discovered target", func() bool {
		n, serr = srv.Series(`penaltybox_endpoints{job="penaltybox-agent"}`)
		return serr == nil && n > 0
	})
	// The PodMonitor's job finds the same pod, sets the Operator's target
	// labels, and leaves every label of the agent's series as it is: no
	// exported_*, and svc_* and backend as the agent wrote them.
	podMonitorJob := ds.Namespace + "/penaltybox-agent"
	w.eventually(40*time.Second, "the PodMonitor's job scrapes the agent with the Operator's target labels", func() bool {
		n, serr = srv.Series(fmt.Sprintf(`penaltybox_endpoint_ejections_total{job=%q,namespace=%q,pod=%q,container="agent",endpoint="metrics",node=%q,svc_namespace=%q,svc_name="web",svc_port="http"}`,
			podMonitorJob, ds.Namespace, pod.Name, nodeName, shop))
		return serr == nil && n > 0
	})
	var labels struct {
		Data []string `json:"data"`
	}
	if err := srv.Get("/api/v1/labels", url.Values{"match[]": {`{__name__=~"penaltybox_.+"}`}}, &labels); err != nil {
		t.Fatal(err)
	}
	for _, l := range labels.Data {
		if strings.HasPrefix(l, "exported_") {
			t.Errorf("a penaltybox series has the label %s under the PodMonitor's job", l)
		}
	}
	if err := w.c.Admin.CoreV1().Pods(ds.Namespace).Delete(w.ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Error(err)
	}
}
