package k8s

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// Every manifest in deploy/ passes `kubectl apply --dry-run=server` against
// a real API server, with a kubectl of the server's version: the API
// server runs defaulting, validation (strict: unknown fields fail) and
// admission (Pod Security included) on each object without storing it.
//
// Two things are applied for real first, in this throwaway API server:
//   - the Namespace, because objects in a namespace that does not exist
//     fail admission even in a dry run;
//   - a PodMonitor CRD (testdata/podmonitor-crd.yaml, a stand-in written
//     for this test with the operator's field names and types), because a
//     bare API server does not know monitoring.coreos.com/v1. The PodMonitor
//     stays out of kustomization.yaml for the same reason: clusters without
//     the Prometheus Operator apply everything else.
func TestManifestsDryRun(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for the network namespace the API server runs in (CI runs as root)")
	}
	topo := testnet.New(t, testnet.Options{Backends: 1})
	c := startCluster(t, topo.Node)
	deploy := filepath.Join(repoRoot, "deploy")
	f := func(name string) string { return filepath.Join(deploy, name) }
	covered := map[string]bool{"kustomization.yaml": true}

	// kubectl and the server are the same version.
	out, err := c.kubectl("version", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Client struct{ GitVersion string } `json:"clientVersion"`
		Server struct{ GitVersion string } `json:"serverVersion"`
	}
	if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &v); err != nil {
		t.Fatalf("kubectl version: %v\n%s", err, out)
	}
	if v.Client.GitVersion == "" || v.Client.GitVersion != v.Server.GitVersion {
		t.Fatalf("kubectl %q against server %q: want the same version", v.Client.GitVersion, v.Server.GitVersion)
	}
	t.Logf("kubectl and kube-apiserver %s", v.Client.GitVersion)

	apply := func(args ...string) string {
		t.Helper()
		out, err := c.kubectl(append([]string{"apply"}, args...)...)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(out, "Warning:") {
			t.Errorf("kubectl apply %v warned:\n%s", args, out)
		}
		return out
	}
	dryRun := func(files ...string) {
		t.Helper()
		args := []string{"--dry-run=server"}
		for _, name := range files {
			args = append(args, "-f", f(name))
			covered[name] = true
		}
		out := apply(args...)
		t.Logf("dry run:\n%s", strings.TrimSpace(out))
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			if !strings.HasSuffix(line, "(server dry run)") {
				t.Errorf("not a server dry run: %q", line)
			}
		}
	}

	apply("-f", f("namespace.yaml"))
	dryRun("namespace.yaml", "backendpolicy-crd.yaml", "fleet-crd.yaml", "fleet-admission.yaml", "rbac.yaml", "daemonset.yaml")
	if out := apply("--dry-run=server", "-k", deploy); strings.Count(out, "(server dry run)") != 16 {
		t.Errorf("kubectl apply -k deploy/ --dry-run=server: want 16 objects:\n%s", out)
	}

	// The clean-up for nodes whose agent is gone, in its own namespace.
	if _, err := c.kubectl("create", "namespace", "penaltybox-cleanup", "--save-config"); err != nil {
		t.Fatal(err)
	}
	if out := apply("--dry-run=server", "-k", filepath.Join(deploy, "cleanup")); strings.Count(out, "(server dry run)") != 2 {
		t.Errorf("kubectl apply -k deploy/cleanup/ --dry-run=server: want 2 objects:\n%s", out)
	}

	// The PodMonitor, once its CRD is known.
	if out, err := c.kubectl("apply", "--dry-run=server", "-f", f("podmonitor.yaml")); err == nil {
		t.Fatalf("PodMonitor accepted before its CRD exists:\n%s", out)
	}
	apply("-f", filepath.Join("testdata", "podmonitor-crd.yaml"))
	if _, err := c.kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd/podmonitors.monitoring.coreos.com"); err != nil {
		t.Fatal(err)
	}
	dryRun("podmonitor.yaml")
	// The dry run means something: a misspelt field is rejected.
	b, err := os.ReadFile(f("podmonitor.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	broken := filepath.Join(t.TempDir(), "podmonitor-broken.yaml")
	if err := os.WriteFile(broken, []byte(strings.Replace(string(b), "targetLabel:", "targetLable:", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := c.kubectl("apply", "--dry-run=server", "-f", broken); err == nil || !strings.Contains(out, "targetLable") {
		t.Errorf("a PodMonitor with a misspelt field passed the dry run (err %v):\n%s", err, out)
	}

	// The PrometheusRule, the same way.
	apply("-f", filepath.Join("testdata", "prometheusrule-crd.yaml"))
	if _, err := c.kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd/prometheusrules.monitoring.coreos.com"); err != nil {
		t.Fatal(err)
	}
	dryRun("prometheusrule.yaml")
	b, err = os.ReadFile(f("prometheusrule.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	broken = filepath.Join(t.TempDir(), "prometheusrule-broken.yaml")
	if err := os.WriteFile(broken, []byte(strings.Replace(string(b), "annotations:", "anotations:", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := c.kubectl("apply", "--dry-run=server", "-f", broken); err == nil || !strings.Contains(out, "anotations") {
		t.Errorf("a PrometheusRule with a misspelt field passed the dry run (err %v):\n%s", err, out)
	}

	// Every manifest was checked.
	files, _ := filepath.Glob(filepath.Join(deploy, "*.yaml"))
	for _, p := range files {
		if name := filepath.Base(p); !covered[name] {
			t.Errorf("deploy/%s is not checked by this test", name)
		}
	}
	if !slices.Contains(files, f("daemonset.yaml")) {
		t.Error("deploy/daemonset.yaml is missing")
	}
}

// The Dockerfile copies only some directories into its build stage (and
// .dockerignore lets only those through): every package the agent is
// built from must live in one of them, or the image build breaks. This
// catches that without a container engine.
func TestImageSourcesCoverTheAgent(t *testing.T) {
	df, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	ignore, err := os.ReadFile(filepath.Join(repoRoot, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	var dirs []string
	for _, line := range strings.Split(string(df), "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == "COPY" && strings.HasSuffix(f[1], "/") {
			dirs = append(dirs, strings.TrimSuffix(f[1], "/"))
			if !strings.Contains(string(ignore), "!"+f[1]) {
				t.Errorf(".dockerignore does not let %s through", f[1])
			}
		}
	}
	if len(dirs) == 0 {
		t.Fatal("no COPY of a directory in the Dockerfile")
	}
	cmd := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.Dir}}{{end}}", "./cmd/agent")
	cmd.Dir = repoRoot
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, dir := range strings.Fields(string(out)) {
		rel, err := filepath.Rel(repoRoot, dir)
		if err != nil || strings.HasPrefix(rel, "..") {
			continue // a module dependency, downloaded in the image
		}
		top := strings.Split(rel, string(filepath.Separator))[0]
		if !slices.Contains(dirs, top) {
			t.Errorf("the agent is built from %s, which the Dockerfile does not copy (it copies %v)", rel, dirs)
		}
	}
}

// The clean-up DaemonSet (deploy/cleanup) reaches the pins and the
// interfaces as the agent does, with the agent's capabilities and no
// more: the same security context, host network and bpffs mount.
func TestCleanupRunsAsTheAgent(t *testing.T) {
	read := func(path string) appsv1.DaemonSet {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(repoRoot, path))
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range strings.Split(string(b), "\n---\n") {
			var ds appsv1.DaemonSet
			if err := yaml.UnmarshalStrict([]byte(doc), &ds); err == nil && ds.Kind == "DaemonSet" {
				return ds
			}
		}
		t.Fatalf("%s: no DaemonSet", path)
		return appsv1.DaemonSet{}
	}
	agent, cleanup := read("deploy/daemonset.yaml").Spec.Template.Spec, read("deploy/cleanup/cleanup.yaml").Spec.Template.Spec
	a, c := agent.Containers[0], cleanup.Containers[0]
	if !reflect.DeepEqual(a.SecurityContext, c.SecurityContext) {
		t.Errorf("security context %+v, the agent's %+v", c.SecurityContext, a.SecurityContext)
	}
	if !reflect.DeepEqual(a.VolumeMounts, c.VolumeMounts) || !reflect.DeepEqual(agent.Volumes, cleanup.Volumes) {
		t.Errorf("volumes %+v %+v, the agent's %+v %+v", c.VolumeMounts, cleanup.Volumes, a.VolumeMounts, agent.Volumes)
	}
	if !cleanup.HostNetwork || c.Image != a.Image || !slices.Equal(c.Args, []string{"teardown", "--then-wait"}) {
		t.Errorf("hostNetwork %v, image %s (the agent's %s), args %q", cleanup.HostNetwork, c.Image, a.Image, c.Args)
	}
}
