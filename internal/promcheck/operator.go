// SPDX-License-Identifier: Apache-2.0

package promcheck

import (
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"

	"sigs.k8s.io/yaml"
)

// OperatorJob is the scrape job the Prometheus Operator generates for the
// first podMetricsEndpoint of the PodMonitor in file (deploy/podmonitor.yaml),
// as its config generator writes it (prometheus-operator
// pkg/prometheus/promcfg.go, generatePodMonitorConfig): pod-role discovery
// in the PodMonitor's namespaces; keep rules for its selector's labels and
// its port; then the target labels the Operator sets on every target,
// namespace, container, pod, job (<namespace>/<name>) and endpoint (the
// port's name); then the PodMonitor's own relabelings; and the sharding
// hashmod. honor_labels is false, the Operator's default: a series label
// of the agent's that collides with a target label would be renamed
// exported_<label>, which is what the project's labels avoid.
//
// sd is the kubernetes_sd_config to use (api_server, tls_config,
// authorization for a Prometheus outside the cluster), or nil for a
// static target: then the job scrapes staticTarget with the given
// __meta_kubernetes_* labels standing in for what pod discovery would
// give, and the same relabelling runs on them.
func OperatorJob(file string, sd map[string]any, staticTarget string, meta map[string]string) (map[string]any, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var pm struct {
		Kind     string `json:"kind"`
		Metadata struct {
			Name      string `json:"name"`
			Namespace string `json:"namespace"`
		} `json:"metadata"`
		Spec struct {
			Selector struct {
				MatchLabels map[string]string `json:"matchLabels"`
			} `json:"selector"`
			NamespaceSelector struct {
				MatchNames []string `json:"matchNames"`
			} `json:"namespaceSelector"`
			PodMetricsEndpoints []struct {
				Port        string           `json:"port"`
				Path        string           `json:"path"`
				Interval    string           `json:"interval"`
				Relabelings []map[string]any `json:"relabelings"`
			} `json:"podMetricsEndpoints"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(b, &pm); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	if pm.Kind != "PodMonitor" || len(pm.Spec.PodMetricsEndpoints) == 0 {
		return nil, fmt.Errorf("%s: kind %q with %d podMetricsEndpoints, want a PodMonitor with one", file, pm.Kind, len(pm.Spec.PodMetricsEndpoints))
	}
	ep := pm.Spec.PodMetricsEndpoints[0]
	ns, name := pm.Metadata.Namespace, pm.Metadata.Name
	relabel := []map[string]any{
		{"source_labels": []string{"job"}, "target_label": "__tmp_prometheus_job_name"},
		// Not the pods that finished.
		{"source_labels": []string{"__meta_kubernetes_pod_phase"}, "regex": "(Failed|Succeeded)", "action": "drop"},
	}
	keys := make([]string, 0, len(pm.Spec.Selector.MatchLabels))
	for k := range pm.Spec.Selector.MatchLabels {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		l := sanitize(k)
		relabel = append(relabel, map[string]any{"action": "keep",
			"source_labels": []string{"__meta_kubernetes_pod_label_" + l, "__meta_kubernetes_pod_labelpresent_" + l},
			"regex":         fmt.Sprintf("(%s);true", pm.Spec.Selector.MatchLabels[k])})
	}
	relabel = append(relabel,
		map[string]any{"action": "keep", "source_labels": []string{"__meta_kubernetes_pod_container_port_name"}, "regex": ep.Port},
		map[string]any{"source_labels": []string{"__meta_kubernetes_namespace"}, "target_label": "namespace"},
		map[string]any{"source_labels": []string{"__meta_kubernetes_pod_container_name"}, "target_label": "container"},
		map[string]any{"source_labels": []string{"__meta_kubernetes_pod_name"}, "target_label": "pod"},
		map[string]any{"target_label": "job", "replacement": ns + "/" + name},
		map[string]any{"target_label": "endpoint", "replacement": ep.Port},
	)
	for _, r := range ep.Relabelings {
		relabel = append(relabel, snakeKeys(r))
	}
	relabel = append(relabel,
		map[string]any{"source_labels": []string{"__address__"}, "target_label": "__tmp_hash", "modulus": 1, "action": "hashmod"},
		map[string]any{"source_labels": []string{"__tmp_hash"}, "regex": "0", "action": "keep"},
	)
	job := map[string]any{
		"job_name":        fmt.Sprintf("podMonitor/%s/%s/0", ns, name),
		"honor_labels":    false,
		"metrics_path":    ep.Path,
		"relabel_configs": relabel,
	}
	if ep.Interval != "" {
		job["scrape_interval"] = ep.Interval
	}
	if sd != nil {
		sd = maps(sd)
		sd["role"] = "pod"
		sd["namespaces"] = map[string]any{"names": pm.Spec.NamespaceSelector.MatchNames}
		job["kubernetes_sd_configs"] = []any{sd}
	} else {
		job["static_configs"] = []any{map[string]any{"targets": []string{staticTarget}, "labels": meta}}
	}
	return job, nil
}

// PodMeta is what pod-role discovery says of a pod, for OperatorJob's
// static target: its namespace, name, node, labels, and the container
// and port the PodMonitor scrapes.
func PodMeta(namespace, pod, node, container, port string, labels map[string]string) map[string]string {
	m := map[string]string{
		"__meta_kubernetes_namespace":                   namespace,
		"__meta_kubernetes_pod_name":                    pod,
		"__meta_kubernetes_pod_node_name":               node,
		"__meta_kubernetes_pod_phase":                   "Running",
		"__meta_kubernetes_pod_container_name":          container,
		"__meta_kubernetes_pod_container_port_name":     port,
		"__meta_kubernetes_pod_ready":                   "true",
		"__meta_kubernetes_pod_controller_kind":         "DaemonSet",
		"__meta_kubernetes_pod_container_port_protocol": "TCP",
	}
	for k, v := range labels {
		m["__meta_kubernetes_pod_label_"+sanitize(k)] = v
		m["__meta_kubernetes_pod_labelpresent_"+sanitize(k)] = "true"
	}
	return m
}

var invalid = regexp.MustCompile(`[^a-zA-Z0-9_]`)

// sanitize is Prometheus' (and the Operator's) label name for a
// Kubernetes label key.
func sanitize(k string) string { return invalid.ReplaceAllString(k, "_") }

// snakeKeys turns a PodMonitor relabeling (sourceLabels, targetLabel) into
// Prometheus' relabel_config (source_labels, target_label).
func snakeKeys(r map[string]any) map[string]any {
	out := map[string]any{}
	for k, v := range r {
		var b strings.Builder
		for _, c := range k {
			if c >= 'A' && c <= 'Z' {
				b.WriteByte('_')
				c += 'a' - 'A'
			}
			b.WriteRune(c)
		}
		key := b.String()
		if key == "action" {
			v = strings.ToLower(fmt.Sprint(v))
		}
		out[key] = v
	}
	return out
}

func maps(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}
