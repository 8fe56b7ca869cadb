// SPDX-License-Identifier: Apache-2.0

// Package conformance holds penaltybox against the tests every Kubernetes
// Service implementation is judged by: Kubernetes' own e2e tests
// (`e2e.test`, built from k8s.io/kubernetes test/e2e at the cluster's
// version by scripts/e2e-tools.sh), run on the one-node cluster rig
// (scripts/cluster.sh) with the agent installed from deploy/ and serving
// every Service (--scope=all), its images built from source
// (scripts/e2e-images.sh).
//
// `go test ./test/conformance` (in make test) runs a fixed subset;
// PENALTYBOX_CONFORMANCE=full (make conformance) runs the whole list of
// suite_test.go; any other value is a focus pattern of its own (one spec
// again, say). The JUnit report and Ginkgo's full JSON report go to
// $PENALTYBOX_CONFORMANCE_REPORT (default: a new directory under $TMPDIR,
// kept and named in the output).
//
// A run that passes proves something only if penaltybox carried the
// tests' connections, so the runner scrapes the agent's metrics while the
// tests run and fails any spec that connects to a Service but left no
// flow in penaltybox's service_flows_total for a Service of its
// namespace, or whose Services penaltybox did not serve with reason
// scope-all.
package conformance

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/internal/clusterrig"
)

const (
	netns = "pb-conformance"
	// The zone (and region) the node is labelled with.
	zone   = "pb-zone-a"
	region = "pb-region"
	// As scripts/cluster.sh sets the kubelet's clusterDNS.
	dnsIP = "198.19.240.10"
)

func TestConformance(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (a kubelet, containerd, network namespaces, BPF); CI runs as root")
	}
	focus, budget := ciFocus, 20*time.Minute
	switch os.Getenv("PENALTYBOX_CONFORMANCE") {
	case "full":
		focus, budget = fullFocus, 3*time.Hour
	case "":
	default:
		// A pattern of its own: one spec again, say.
		focus, budget = []string{os.Getenv("PENALTYBOX_CONFORMANCE")}, 3*time.Hour
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(budget)
	if d, ok := t.Deadline(); ok && d.Add(-3*time.Minute).Before(deadline) {
		deadline = d.Add(-3 * time.Minute)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()

	reportDir := os.Getenv("PENALTYBOX_CONFORMANCE_REPORT")
	if reportDir == "" {
		reportDir, err = os.MkdirTemp("", "penaltybox-conformance-")
		if err != nil {
			t.Fatal(err)
		}
	} else if reportDir, err = filepath.Abs(reportDir); err != nil {
		t.Fatal(err)
	}
	// A report left by an earlier run must not be read as this one's.
	for _, f := range []string{"junit_01.xml", "ginkgo", "e2e.log", "services.json"} {
		os.RemoveAll(filepath.Join(reportDir, f))
	}
	if err := os.MkdirAll(reportDir, 0o755); err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	e2eBin := tool(t, ctx, root, "scripts/e2e-tools.sh")
	images := filepath.Join("/tmp", netns+"-e2e-images")
	defer os.RemoveAll(images)
	tool(t, ctx, root, "scripts/e2e-images.sh", images)
	t.Logf("e2e.test, agnhost, CoreDNS and images ready in %v", time.Since(start).Round(time.Second))

	start = time.Now()
	rig, err := clusterrig.Up(ctx, root, netns, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			dumpState(t, rig)
		}
		rig.Down()
	})
	tars, _ := filepath.Glob(filepath.Join(images, "*.tar"))
	if err := rigScript(ctx, rig, append([]string{"import"}, tars...)...); err != nil {
		t.Fatal(err)
	}
	if err := prepare(ctx, rig, root); err != nil {
		t.Fatal(err)
	}
	if err := installAgentScopeAll(ctx, rig); err != nil {
		t.Fatal(err)
	}
	t.Logf("cluster up, DNS, zone labels and the agent (--scope=all) ready in %v", time.Since(start).Round(time.Second))

	// The agent's view of the Services, sampled while the tests run.
	seen := newServiceLog()
	scrapeCtx, stopScrape := context.WithCancel(ctx)
	scraped := make(chan error, 1)
	go func() { scraped <- seen.scrape(scrapeCtx, rig) }()

	start = time.Now()
	runErr := runE2E(ctx, t, rig, e2eBin, reportDir, focus)
	stopScrape()
	if err := <-scraped; err != nil {
		t.Errorf("scraping the agent's metrics: %v", err)
	}
	t.Logf("e2e.test ran for %v; reports in %s (junit_01.xml, ginkgo/report.json, e2e.log, services.json)",
		time.Since(start).Round(time.Second), reportDir)

	if err := seen.save(filepath.Join(reportDir, "services.json")); err != nil {
		t.Errorf("saving what the agent served: %v", err)
	}
	specs, err := readReport(filepath.Join(reportDir, "ginkgo", "report.json"))
	if err != nil {
		t.Fatalf("e2e.test: %v; no report: %v", runErr, err)
	}
	judge(t, specs, focus, seen)
	if runErr != nil && !t.Failed() {
		t.Errorf("e2e.test: %v, although every spec passed or was skipped as expected", runErr)
	}
}

// tool runs one of the build scripts and returns the directory it prints
// last.
func tool(t *testing.T, ctx context.Context, root, script string, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(ctx, filepath.Join(root, script), args...)
	cmd.WaitDelay = 5 * time.Second
	var out strings.Builder
	cmd.Stdout = &out
	cmd.Stderr = &tlogWriter{t: t}
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s: %v", script, err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	return lines[len(lines)-1]
}

type tlogWriter struct{ t *testing.T }

func (w *tlogWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

func rigEnv(rig *clusterrig.Rig) []string {
	return append(os.Environ(), "CLUSTER_DIR="+rig.Dir, "CLUSTER_NETNS="+rig.Netns)
}

// rigScript runs scripts/cluster.sh with args on the rig.
func rigScript(ctx context.Context, rig *clusterrig.Rig, args ...string) error {
	cmd := exec.CommandContext(ctx, filepath.Join(rig.Root, "scripts/cluster.sh"), args...)
	cmd.Env = rigEnv(rig)
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("cluster.sh %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// prepare labels the node with a zone and region (as a cloud's nodes are),
// and starts the cluster's DNS (CoreDNS at the kubelet's clusterDNS
// address): the tests reach Services by name too.
func prepare(ctx context.Context, rig *clusterrig.Rig, root string) error {
	if _, err := rig.Kubectl(ctx, "label", "node", "--all", "--overwrite",
		"topology.kubernetes.io/zone="+zone, "topology.kubernetes.io/region="+region); err != nil {
		return err
	}
	b, err := os.ReadFile(filepath.Join(root, "test/conformance/testdata/coredns.yaml"))
	if err != nil {
		return err
	}
	mod, err := os.ReadFile(filepath.Join(root, "test/e2e/k8stools/coredns/go.mod"))
	if err != nil {
		return err
	}
	m := regexp.MustCompile(`(?m)^\s*(?:require\s+)?github\.com/coredns/coredns (v\S+)`).FindSubmatch(mod)
	if m == nil {
		return fmt.Errorf("no github.com/coredns/coredns version in test/e2e/k8stools/coredns/go.mod")
	}
	manifest := strings.NewReplacer("IMAGE", "localhost/penaltybox-test/coredns:"+string(m[1]), "DNS_IP", dnsIP).Replace(string(b))
	f := filepath.Join(rig.Dir, "coredns.yaml")
	if err := os.WriteFile(f, []byte(manifest), 0o644); err != nil {
		return err
	}
	if _, err := rig.Kubectl(ctx, "apply", "-f", f); err != nil {
		return err
	}
	_, err = rig.Kubectl(ctx, "-n", "kube-system", "rollout", "status", "deploy/coredns", "--timeout=120s")
	return err
}

// installAgentScopeAll applies deploy/ as clusterrig.InstallAgent does
// (`kubectl apply -k`, the image overridden), with one more change: the
// DaemonSet's --scope=opt-in becomes --scope=all, so the agent serves
// every Service the e2e tests create.
func installAgentScopeAll(ctx context.Context, rig *clusterrig.Rig) error {
	b, err := os.ReadFile(filepath.Join(rig.Root, "deploy/daemonset.yaml"))
	if err != nil {
		return err
	}
	var ds struct {
		Spec struct {
			Template struct {
				Spec struct {
					Containers []struct {
						Name string   `json:"name"`
						Args []string `json:"args"`
					} `json:"containers"`
				} `json:"spec"`
			} `json:"template"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(b, &ds); err != nil {
		return fmt.Errorf("deploy/daemonset.yaml: %w", err)
	}
	if len(ds.Spec.Template.Spec.Containers) == 0 {
		return fmt.Errorf("deploy/daemonset.yaml: no containers")
	}
	at := -1
	for i, a := range ds.Spec.Template.Spec.Containers[0].Args {
		if strings.HasPrefix(a, "--scope=") {
			at = i
		}
	}
	if at < 0 {
		return fmt.Errorf("deploy/daemonset.yaml: the agent has no --scope argument to set")
	}
	overlay, err := os.MkdirTemp("", "penaltybox-overlay")
	if err != nil {
		return err
	}
	defer os.RemoveAll(overlay)
	base, err := filepath.Rel(overlay, filepath.Join(rig.Root, "deploy"))
	if err != nil {
		return err
	}
	kust := fmt.Sprintf(`resources:
  - %s
images:
  - name: penaltybox/agent
    newName: %s
    newTag: %s
patches:
  - target: {kind: DaemonSet, name: penaltybox-agent}
    patch: |
      - op: replace
        path: /spec/template/spec/containers/0/args/%d
        value: --scope=all
`, base, clusterrig.AgentImage, clusterrig.AgentTag, at)
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), []byte(kust), 0o644); err != nil {
		return err
	}
	if _, err := rig.Kubectl(ctx, "apply", "-k", overlay); err != nil {
		return err
	}
	if _, err := rig.Kubectl(ctx, "-n", clusterrig.AgentNamespace, "rollout", "status", clusterrig.AgentDaemonSet, "--timeout=180s"); err != nil {
		return err
	}
	out, err := rig.Kubectl(ctx, "-n", clusterrig.AgentNamespace, "get", clusterrig.AgentDaemonSet,
		"-o", "jsonpath={.spec.template.spec.containers[0].args}")
	if err != nil {
		return err
	}
	if !strings.Contains(out, `"--scope=all"`) {
		return fmt.Errorf("the agent's DaemonSet runs with %s, not --scope=all", out)
	}
	return nil
}

// runE2E runs e2e.test on the node (its network and mount namespaces: the
// API server, the kubelet and the pods are reachable there) with the
// cluster admin's kubeconfig, and passes its progress on.
func runE2E(ctx context.Context, t *testing.T, rig *clusterrig.Rig, bin, reportDir string, focus []string) error {
	tools, err := os.ReadFile(filepath.Join(rig.Dir, "run", "tools.env"))
	if err != nil {
		return err
	}
	m := regexp.MustCompile(`(?m)^K8S=(\S+)$`).FindSubmatch(tools)
	if m == nil {
		return fmt.Errorf("no K8S= in %s/run/tools.env", rig.Dir)
	}
	k8sBin := strings.Trim(string(m[1]), `'"`)
	args := []string{
		"--kubeconfig=" + rig.AdminKubeconfig(),
		"--kubectl-path=" + filepath.Join(k8sBin, "kubectl"),
		"--provider=local",
		"--report-dir=" + reportDir,
		"--report-complete-ginkgo",
		"--disable-log-dump",
		"--ginkgo.focus=" + anyOf(focus),
		"--ginkgo.no-color",
		"--ginkgo.timeout=" + time.Until(deadlineOf(ctx)).Truncate(time.Minute).String(),
	}
	if len(skipped) > 0 {
		pats := make([]string, len(skipped))
		for i, s := range skipped {
			pats[i] = s.pattern
		}
		args = append(args, "--ginkgo.skip="+anyOf(pats))
	}
	logf, err := os.Create(filepath.Join(reportDir, "e2e.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.CommandContext(ctx, filepath.Join(rig.Root, "scripts/cluster.sh"), append([]string{"exec", filepath.Join(bin, "e2e.test")}, args...)...)
	// kubectl (which the framework runs for exec and logs) keeps its
	// discovery cache in the cluster's directory, not ~/.kube.
	cmd.Env = append(rigEnv(rig), "KUBECACHEDIR="+filepath.Join(rig.Dir, "kube-cache"), "HOME="+rig.Dir)
	cmd.Dir = reportDir
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 2 * time.Minute
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	t.Logf("running e2e.test %s", strings.Join(args, " "))
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		// One line per spec as it ends (the full output is in e2e.log).
		progress := regexp.MustCompile(`^(?:• \[|S \[SKIPPED\]|\[(?:FAILED|PANICKED|TIMEDOUT)\] \[|Ran \d+ of \d+ Specs)`)
		for sc.Scan() {
			fmt.Fprintln(logf, sc.Text())
			if progress.MatchString(sc.Text()) {
				t.Log(sc.Text())
			}
		}
		io.Copy(io.Discard, pr)
	}()
	err = cmd.Wait()
	pw.Close()
	<-done
	return err
}

func deadlineOf(ctx context.Context) time.Time {
	d, ok := ctx.Deadline()
	if !ok {
		return time.Now().Add(3 * time.Hour)
	}
	// Leave time to read the report and stop the cluster.
	return d.Add(-2 * time.Minute)
}

// judge fails the test for each spec that failed, skipped for a reason not
// listed, or passed without penaltybox carrying its connections, and
// prints the results.
func judge(t *testing.T, specs []specResult, focus []string, seen *serviceLog) {
	t.Helper()
	var ran []specResult
	for _, s := range specs {
		if s.filtered() {
			continue
		}
		ran = append(ran, s)
	}
	sort.Slice(ran, func(i, j int) bool { return ran[i].Name < ran[j].Name })
	if len(ran) == 0 {
		t.Fatalf("the focus selected no spec")
	}
	// Every exact name in the focus must be among the specs.
	for _, f := range focus {
		if !strings.HasPrefix(f, exactPrefix) {
			continue
		}
		re := regexp.MustCompile(f)
		found := false
		for _, s := range ran {
			found = found || re.MatchString(s.Name)
		}
		if !found {
			t.Errorf("no spec matches %s (renamed in this Kubernetes version?)", f)
		}
	}

	counts := map[string]int{}
	var table strings.Builder
	fmt.Fprintf(&table, "%-8s %7s %8s  %s\n", "result", "time", "flows", "spec")
	for _, s := range ran {
		flows, served := seen.forNamespaces(s.Namespaces)
		result := s.State
		switch {
		case s.State == "passed":
		case s.State == "skipped":
			if reason, ok := selfSkipReason(s); ok {
				result = "skipped"
				t.Logf("skipped by the e2e framework: %s: %s (%s)", s.Name, oneLine(s.Message), reason)
			} else {
				t.Errorf("%s: skipped for a reason the rig does not account for: %s", s.Name, oneLine(s.Message))
			}
		default:
			t.Errorf("%s: %s: %s", s.Name, s.State, s.Message)
		}
		if s.State == "passed" || s.State == "failed" {
			switch {
			case len(s.Namespaces) == 0:
				t.Errorf("%s: no test namespace in its output: cannot tell whether penaltybox served it", s.Name)
			case len(served.notScopeAll) > 0:
				t.Errorf("%s: services served for a reason other than scope-all: %v", s.Name, served.notScopeAll)
			case flows == 0 && !matchesAny(noTraffic, s.Name):
				t.Errorf("%s: penaltybox admitted no flow to a Service of namespace %v (served: %v): the test's connections bypassed it",
					s.Name, s.Namespaces, served.names)
			}
		}
		counts[result]++
		fmt.Fprintf(&table, "%-8s %6.0fs %8.0f  %s\n", result, s.RunTime.Seconds(), flows, s.Name)
	}
	t.Logf("results: %d specs: %d passed, %d failed, %d skipped (others: %v); flows = new flows penaltybox admitted to the spec's Services\n%s",
		len(ran), counts["passed"], counts["failed"], counts["skipped"], others(counts), table.String())
	t.Logf("penaltybox served %d Services during the run, %d of them with flows", seen.count(), seen.withFlows())
}

func selfSkipReason(s specResult) (string, bool) {
	for _, k := range selfSkips {
		if regexp.MustCompile(k.pattern).MatchString(s.Name) && strings.Contains(s.Message, k.message) {
			return k.reason, true
		}
	}
	return "", false
}

func others(counts map[string]int) map[string]int {
	o := map[string]int{}
	for k, v := range counts {
		if k != "passed" && k != "failed" && k != "skipped" {
			o[k] = v
		}
	}
	return o
}

func oneLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return s
}

func dumpState(t *testing.T, rig *clusterrig.Rig) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, args := range [][]string{
		{"get", "pods", "-A", "-o", "wide"},
		{"logs", "-n", clusterrig.AgentNamespace, clusterrig.AgentDaemonSet, "--tail=40"},
		{"logs", "-n", "kube-system", "deploy/coredns", "--tail=20"},
	} {
		out, err := rig.Kubectl(ctx, args...)
		t.Logf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}
