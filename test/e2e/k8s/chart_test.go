// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// The Helm chart (charts/penaltybox) renders deploy/'s objects. deploy/ is
// the source of truth (kustomize, the tests and the docs read it); the
// chart's templates are deploy/'s files with values put in, its crds/ and
// files/ are links to deploy/'s CRDs and monitoring files, and these tests
// fail when the two drift apart.

const chartNamespace = "penaltybox-system"

var (
	helmOnce sync.Once
	helmBin  string
	helmErr  error
)

// helm runs the helm that scripts/helm-tools.sh builds (cached).
func helm(t *testing.T, args ...string) (string, error) {
	t.Helper()
	return helmIn(t, nil, args...)
}

// helmIn runs helm in ns (where the test's API server listens), or here
// when ns is nil.
func helmIn(t *testing.T, ns *testnet.NS, args ...string) (string, error) {
	t.Helper()
	helmOnce.Do(func() {
		var dir string
		dir, helmErr = buildTools("helm-tools.sh")
		helmBin = filepath.Join(dir, "helm")
	})
	if helmErr != nil {
		t.Fatal(helmErr)
	}
	cmd := exec.Command(helmBin, args...)
	if ns != nil {
		cmd = ns.Command(helmBin, args...)
	}
	cmd.Dir = repoRoot
	// No config, cache or repositories of the user's.
	home := t.TempDir()
	cmd.Env = append(os.Environ(), "HELM_CONFIG_HOME="+home, "HELM_CACHE_HOME="+home, "HELM_DATA_HOME="+home)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	// helm notes (at level INFO) that crds/ and files/ are links; that is
	// by design, and only errors matter here.
	var keep []string
	for _, l := range strings.Split(stderr.String(), "\n") {
		if l != "" && !strings.Contains(l, "found symbolic link in path") {
			keep = append(keep, l)
		}
	}
	if err != nil {
		return stdout.String() + strings.Join(keep, "\n"), fmt.Errorf("helm %s: %w", strings.Join(args, " "), err)
	}
	if len(keep) > 0 {
		t.Logf("helm %s:\n%s", strings.Join(args, " "), strings.Join(keep, "\n"))
	}
	return stdout.String(), nil
}

func TestChartLint(t *testing.T) {
	out, err := helm(t, "lint", "--strict", "charts/penaltybox")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	// With every optional object on, too.
	out, err = helm(t, "lint", "--strict", "charts/penaltybox",
		"--set", "podMonitor.enabled=true,prometheusRule.enabled=true,dashboard.enabled=true,scope=all")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
}

// object is one decoded manifest.
type object = map[string]any

func decodeAll(t *testing.T, r io.Reader) []object {
	t.Helper()
	d := utilyaml.NewYAMLOrJSONDecoder(r, 4096)
	var out []object
	for {
		var o object
		if err := d.Decode(&o); errors.Is(err, io.EOF) {
			return out
		} else if err != nil {
			t.Fatal(err)
		}
		if o != nil {
			out = append(out, o)
		}
	}
}

func objKey(o object) string {
	md, _ := o["metadata"].(map[string]any)
	return fmt.Sprintf("%v/%v/%v", o["kind"], md["namespace"], md["name"])
}

// helmLabels are what the chart adds to every object's labels for Helm's
// own bookkeeping; selectors and pod labels stay deploy/'s.
var helmLabels = []string{"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "app.kubernetes.io/version"}

// normalise drops what may differ between the chart and deploy/: Helm's
// labels, and the image's tag (deploy/'s is "dev", for kustomize's edit
// set image; the chart's is its appVersion, checked apart).
func normalise(t *testing.T, o object) (image string) {
	t.Helper()
	if md, ok := o["metadata"].(map[string]any); ok {
		if l, ok := md["labels"].(map[string]any); ok {
			for _, k := range helmLabels {
				delete(l, k)
			}
		}
	}
	if o["kind"] != "DaemonSet" {
		return ""
	}
	spec := o["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
	for _, c := range spec["containers"].([]any) {
		c := c.(map[string]any)
		image = c["image"].(string)
		repo, _, _ := strings.Cut(image, ":")
		c["image"] = repo
	}
	return image
}

func deployObjects(t *testing.T, files ...string) map[string]object {
	t.Helper()
	out := map[string]object{}
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(repoRoot, "deploy", f))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range decodeAll(t, bytes.NewReader(b)) {
			normalise(t, o)
			out[objKey(o)] = o
		}
	}
	return out
}

func chartObjects(t *testing.T, args ...string) (map[string]object, string) {
	t.Helper()
	out, err := helm(t, append([]string{"template", "penaltybox", "charts/penaltybox", "--namespace", chartNamespace, "--include-crds"}, args...)...)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	objs := map[string]object{}
	image := ""
	for _, o := range decodeAll(t, strings.NewReader(out)) {
		if im := normalise(t, o); im != "" {
			image = im
		}
		objs[objKey(o)] = o
	}
	return objs, image
}

// kustomizeResources are the files deploy/kustomization.yaml lists.
func kustomizeResources(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, "deploy", "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct{ Resources []string }
	if err := yaml.Unmarshal(b, &k); err != nil {
		t.Fatal(err)
	}
	return k.Resources
}

func compareObjects(t *testing.T, what string, want, got map[string]object) {
	t.Helper()
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			t.Errorf("%s: the chart does not render %s", what, k)
			continue
		}
		if !reflect.DeepEqual(w, g) {
			wy, _ := yaml.Marshal(w)
			gy, _ := yaml.Marshal(g)
			t.Errorf("%s: %s differs between deploy/ and the chart (edit charts/penaltybox/templates to match deploy/):\n%s", what, k, lineDiff(string(wy), string(gy)))
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: the chart renders %s, which deploy/ does not have", what, k)
		}
	}
}

// lineDiff lists the lines only one side has (enough to find a drift).
func lineDiff(a, b string) string {
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	var out []string
	for _, l := range al {
		if !slices.Contains(bl, l) {
			out = append(out, "- deploy: "+l)
		}
	}
	for _, l := range bl {
		if !slices.Contains(al, l) {
			out = append(out, "+ chart:  "+l)
		}
	}
	return strings.Join(out, "\n")
}

// With its default values the chart renders what `kubectl apply -k
// deploy/` applies, but the Namespace (Helm installs into one: `helm
// install --create-namespace`, labelled as docs/install.md says), and with
// the monitoring values on, deploy/podmonitor.yaml, deploy/prometheusrule.yaml
// and the dashboard.
func TestChartRendersDeploy(t *testing.T) {
	var files []string
	for _, f := range kustomizeResources(t) {
		if f != "namespace.yaml" {
			files = append(files, f)
		}
	}
	want := deployObjects(t, files...)
	got, image := chartObjects(t)
	compareObjects(t, "defaults", want, got)

	var chart struct {
		Version    string `json:"version"`
		AppVersion string `json:"appVersion"`
	}
	b, err := os.ReadFile(filepath.Join(repoRoot, "charts/penaltybox/Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &chart); err != nil {
		t.Fatal(err)
	}
	if image != "penaltybox/agent:"+chart.AppVersion {
		t.Errorf("image %q, want penaltybox/agent:%s (the chart's appVersion)", image, chart.AppVersion)
	}
	// The chart's version is the project's: CHANGELOG.md's top release.
	out, err := exec.Command("bash", filepath.Join(repoRoot, "scripts/version.sh")).Output()
	if err != nil {
		t.Fatal(err)
	}
	v, _, _ := strings.Cut(strings.TrimSpace(string(out)), " ")
	base, _, _ := strings.Cut(strings.SplitN(v, "+", 2)[0], "-")
	if chart.Version != base || chart.AppVersion != base {
		t.Errorf("Chart.yaml version %s, appVersion %s; the project is at %s (CHANGELOG.md)", chart.Version, chart.AppVersion, base)
	}

	want = deployObjects(t, append(files, "podmonitor.yaml", "prometheusrule.yaml")...)
	got, _ = chartObjects(t, "--set", "podMonitor.enabled=true,prometheusRule.enabled=true,dashboard.enabled=true")
	dash := got["ConfigMap/penaltybox-system/penaltybox-dashboard"]
	delete(got, "ConfigMap/penaltybox-system/penaltybox-dashboard")
	compareObjects(t, "monitoring on", want, got)
	if dash == nil {
		t.Fatal("dashboard.enabled renders no ConfigMap penaltybox-dashboard")
	}
	j, err := os.ReadFile(filepath.Join(repoRoot, "deploy/monitoring/grafana-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var a, b2 any
	json.Unmarshal(j, &a)
	if err := json.Unmarshal([]byte(dash["data"].(map[string]any)["penaltybox.json"].(string)), &b2); err != nil || !reflect.DeepEqual(a, b2) {
		t.Errorf("the dashboard ConfigMap does not hold deploy/monitoring/grafana-dashboard.json (err %v)", err)
	}

	// Values reach the DaemonSet.
	got, image = chartObjects(t, "--set", "scope=all,image.repository=registry.example/pb,image.tag=9.9.9,interfaces.pod=cali*,adminAddress=,nodeSelector.pool=edge",
		"--set-json", `extraArgs=["--max-inflight-default=100"]`)
	ds, _ := yaml.Marshal(got["DaemonSet/penaltybox-system/penaltybox-agent"])
	for _, s := range []string{"--scope=all", "--pod-interfaces=cali*", "--admin-addr=\n", "--max-inflight-default=100", "pool: edge"} {
		if !strings.Contains(string(ds), s) {
			t.Errorf("rendered DaemonSet lacks %q:\n%s", s, ds)
		}
	}
	if image != "registry.example/pb:9.9.9" {
		t.Errorf("image %q", image)
	}
}

// values.schema.json refuses what the agent would refuse at start (or what
// would render a broken object), naming the value; helm applies it to
// install, upgrade, template and lint alike.
func TestChartValuesSchema(t *testing.T) {
	for _, tc := range []struct{ set, want string }{
		{"scope=some", "/scope"},
		{"metricsPort=70000", "/metricsPort"},
		{"image.pullPolicy=Sometimes", "/image/pullPolicy"},
		{"podMonitor.enabled=yes", "/podMonitor/enabled"},
		{"adminAddress=everywhere", "/adminAddress"},
		{"interfaces.pod=", "/interfaces/pod"},
		{"scopee=all", "scopee"},
	} {
		out, err := helm(t, "template", "penaltybox", "charts/penaltybox", "--set", tc.set)
		if err == nil || !strings.Contains(out, tc.want) {
			t.Errorf("--set %s: err %v, want a schema error naming %s:\n%.400s", tc.set, err, tc.want, out)
		}
	}
	if out, err := helm(t, "template", "penaltybox", "charts/penaltybox", "--set", "scope=all,metricsPort=9100,adminAddress=[::1]:9465"); err != nil {
		t.Errorf("good values refused: %v\n%s", err, out)
	}
}

// The chart's objects pass a server-side dry run against a real API
// server (defaulting, strict validation, admission), and `helm install`
// and `helm uninstall` work against it: everything but the CRDs (Helm
// never deletes those) is gone afterwards.
func TestChartDryRunAndInstall(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for the network namespace the API server runs in (CI runs as root)")
	}
	topo := testnet.New(t, testnet.Options{Backends: 1})
	c := startCluster(t, topo.Node)
	kubectl := func(args ...string) string {
		t.Helper()
		out, err := c.kubectl(args...)
		if err != nil {
			t.Fatalf("kubectl %v: %v\n%s", args, err, out)
		}
		return out
	}
	kubectl("apply", "-f", filepath.Join(repoRoot, "deploy/namespace.yaml"))
	kubectl("apply", "-f", filepath.Join("testdata", "podmonitor-crd.yaml"), "-f", filepath.Join("testdata", "prometheusrule-crd.yaml"))
	kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd/podmonitors.monitoring.coreos.com", "crd/prometheusrules.monitoring.coreos.com")

	rendered, err := helm(t, "template", "penaltybox", "charts/penaltybox", "--namespace", chartNamespace,
		"--set", "podMonitor.enabled=true,prometheusRule.enabled=true,dashboard.enabled=true")
	if err != nil {
		t.Fatalf("%v\n%s", err, rendered)
	}
	// CRDs first, for real: nothing else refers to them, but a dry run of
	// a CRD and of the admission policies that name its group in one apply
	// is what a first install does.
	kubectl("apply", "--server-side", "-f", filepath.Join(repoRoot, "charts/penaltybox/crds"))
	file := filepath.Join(t.TempDir(), "rendered.yaml")
	if err := os.WriteFile(file, []byte(rendered), 0o600); err != nil {
		t.Fatal(err)
	}
	out := kubectl("apply", "--dry-run=server", "-f", file)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for _, l := range lines {
		if !strings.HasSuffix(l, "(server dry run)") {
			t.Errorf("not a server dry run: %q", l)
		}
	}
	if n := strings.Count(rendered, "\nkind: "); len(lines) != n {
		t.Errorf("dry run applied %d objects, the chart rendered %d:\n%s", len(lines), n, out)
	}
	// The dry run means something: a misspelt field is refused.
	broken := filepath.Join(t.TempDir(), "broken.yaml")
	os.WriteFile(broken, []byte(strings.Replace(rendered, "dnsPolicy:", "dnsPolcy:", 1)), 0o600)
	if out, err := c.kubectl("apply", "--dry-run=server", "-f", broken); err == nil || !strings.Contains(out, "dnsPolcy") {
		t.Errorf("a misspelt DaemonSet field passed the dry run (err %v):\n%s", err, out)
	}

	// A real install and uninstall (no kubelet here: the DaemonSet's pods
	// are never scheduled; test/cluster installs the chart on a node).
	kc := c.kubeconfig("admin", c.AdminToken)
	hk := func(args ...string) string {
		t.Helper()
		out, err := helmIn(t, c.ns, append(args, "--kubeconfig", kc)...)
		if err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		return out
	}
	hk("install", "penaltybox", "charts/penaltybox", "--namespace", chartNamespace, "--set", "podMonitor.enabled=true")
	if out := kubectl("-n", chartNamespace, "get", "daemonset,serviceaccount,role,podmonitor", "-l", "app.kubernetes.io/managed-by=Helm", "-o", "name"); strings.Count(out, "\n") != 4 {
		t.Errorf("after helm install, want the DaemonSet, ServiceAccount, Role and PodMonitor labelled by Helm:\n%s", out)
	}
	hk("uninstall", "penaltybox", "--namespace", chartNamespace, "--wait")
	if out := kubectl("get", "daemonset,serviceaccount,role,rolebinding,clusterrole,clusterrolebinding,validatingadmissionpolicy,validatingadmissionpolicybinding,podmonitor",
		"-A", "-l", "app.kubernetes.io/instance=penaltybox", "-o", "name"); strings.TrimSpace(out) != "" {
		t.Errorf("after helm uninstall, left:\n%s", out)
	}
	if out := kubectl("get", "crd", "-l", "app.kubernetes.io/name=penaltybox", "-o", "name"); strings.Count(out, "\n") != 3 {
		t.Errorf("helm leaves CRDs installed (crds/): want penaltybox's 3 CRDs, got:\n%s", out)
	}
}
