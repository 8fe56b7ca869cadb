// SPDX-License-Identifier: Apache-2.0

// Package cluster runs penaltybox the way its users meet it: the Helm chart
// (charts/penaltybox, which renders deploy/'s objects) installed with `helm
// install` on a one-node cluster of real components
// (scripts/cluster.sh), the agent's image built here, pulled by no one and
// started by a kubelet, and the seed story told with real pods.
package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/clientlog"
	"github.com/penaltybox/penaltybox/internal/clusterrig"
)

const (
	agentNS = clusterrig.AgentNamespace
	agentDS = clusterrig.AgentDaemonSet
	// The client's success rate after an ejection is measured over this
	// many connections (20 s of its load).
	windowConns = 1000
	minRatio    = 0.995
)

// TestSeedDemoOnACluster: two good backend pods and one that passes its
// readiness probe but refuses (then, in a second round, resets) every
// connection, behind one Service with Linkerd's failure-accrual
// annotations; a client pod opens 50 new connections per second to the
// ClusterIP. Asserted, for each kind of failure: the agent ejects the bad
// pod and says so in an Event naming it, the client's success rate after
// the ejection is at least 99.5%, `kubectl get pods` shows every pod Running
// and Ready, and the healed pod rejoins (an Event, and the client's
// connections reach it again). Along the way: the agent pod is Ready through
// its probes with the DaemonSet's capabilities, `kubectl exec ... agent
// inspect` shows the ejection, and a Prometheus with Kubernetes service
// discovery scrapes the agent as the DaemonSet advertises, fires the
// ejection alert, and answers every dashboard query. Then the adoption
// story (adoption_test.go): opt-in by namespace label, the dead-man's
// switch, and the uninstall, under load.
func TestSeedDemoOnACluster(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (a kubelet, containerd, network namespaces, BPF); CI runs as root")
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	// The test gives up (and its cleanup stops the cluster) well before go
	// test's own timeout would kill it with everything still running, and
	// on SIGINT or SIGTERM.
	deadline := time.Now().Add(12 * time.Minute)
	if d, ok := t.Deadline(); ok && d.Add(-4*time.Minute).Before(deadline) {
		deadline = d.Add(-4 * time.Minute)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()

	start := time.Now()
	rig, err := clusterrig.Up(ctx, root, "pb-cluster-test", t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			dumpState(t, rig)
		}
		rig.Down()
	})
	t.Logf("cluster up with images loaded in %v", time.Since(start).Round(time.Second))
	// The chart as a user installs it (docs/install.md): only the image is
	// overridden. (test/e2e/k8s checks that it renders deploy/'s objects,
	// and that `kubectl apply -k deploy/` passes a server-side dry run.)
	if err := rig.InstallChart(ctx); err != nil {
		t.Fatal(err)
	}
	agentPod := onePod(t, ctx, rig, agentNS, "app.kubernetes.io/name=penaltybox")
	t.Logf("agent pod %s Ready %v after the cluster was up", agentPod.Metadata.Name, time.Since(start).Round(time.Second))
	agentCapabilities(t, rig)
	if err := rig.StartWorkloads(ctx); err != nil {
		t.Fatal(err)
	}
	bad := onePod(t, ctx, rig, "default", "role=bad")
	badName, badIP := bad.Metadata.Name, bad.Status.PodIP

	prom := startPrometheus(t, ctx, rig)
	setMode := func(mode string) {
		t.Helper()
		if err := rig.SetMode(badIP, mode); err != nil {
			t.Fatal(err)
		}
	}

	for i, kind := range []string{"refused", "reset"} {
		t.Logf("--- %s: pod %s (%s) fails every connection: %s", kind, badName, badIP, kind)
		failing := start
		if kind == "reset" {
			failing = time.Now()
			setMode("reset")
		}
		ejected := waitEvent(t, ctx, rig, failing, "EndpointEjected", badName, "(last: "+kind+")")
		t.Logf("Event: %s", ejected)
		ejectedAt := time.Now()
		before := badEndpoint(t, ctx, rig, badIP)

		// The client's success rate over the next 1,000 connections, from
		// the first whole second after the ejection.
		from := ejectedAt.Add(time.Second)
		var got clientlog.Second
		wctx, wcancel := context.WithTimeout(ctx, 2*time.Minute)
		err := clusterrig.Wait(wctx, func() bool {
			secs, err := rig.ClientSeconds(wctx, "default")
			if err != nil {
				return false // a slow kubectl logs: ask again
			}
			got = clientlog.Total(secs, from, time.Now())
			return got.OK+got.Failed() >= windowConns
		})
		wcancel()
		if err != nil {
			t.Fatalf("fewer than %d client connections after the ejection (%+v): %v", windowConns, got, err)
		}
		after := badEndpoint(t, ctx, rig, badIP)
		total := got.OK + got.Failed()
		ratio := float64(got.OK) / float64(total)
		t.Logf("after the ejection: %d of %d connections succeeded (%.2f%%); refused %d, reset %d, timeout %d, other %d, skipped %d; by backend %v",
			got.OK, total, 100*ratio, got.Refused, got.Reset, got.Timeout, got.Other, got.Skipped, got.Backends)
		if ratio < minRatio {
			t.Errorf("success rate %.2f%% after the ejection, want >= %.1f%%", 100*ratio, 100*minRatio)
		}
		// What the success rate alone cannot show (refused SYNs are replayed
		// to another endpoint, so the client would succeed either way): the
		// datapath gave the ejected pod no new flows but its probes, and
		// each failed probe ejected it again.
		flows, probes := after.Counters.Flows-before.Counters.Flows, after.Accrual.Ejections-before.Accrual.Ejections
		t.Logf("meanwhile the ejected pod got %d new flows, and was ejected again %d times (failed probes)", flows, probes)
		if flows > probes+1 {
			t.Errorf("the ejected pod got %d new flows while %d probes failed: it was not kept out", flows, probes)
		}

		allRunningAndReady(t, ctx, rig)
		if i == 0 {
			inspectShowsEjected(t, ctx, rig, badIP)
			prom.alertFires(t, ctx, badIP)
			prom.dashboardAnswers(t)
			lintMetrics(t, rig.HTTPClient())
		}

		// Healed, the pod rejoins: the agent says so and the client's
		// connections reach it again.
		setMode("serve")
		healed := time.Now()
		t.Logf("Event: %s", waitEvent(t, ctx, rig, healed, "EndpointRestored", badName, ""))
		wctx, wcancel = context.WithTimeout(ctx, time.Minute)
		err = clusterrig.Wait(wctx, func() bool {
			secs, err := rig.ClientSeconds(wctx, "default")
			return err == nil && clientlog.Total(secs, healed, time.Now()).Backends[badName] > 0
		})
		wcancel()
		if err != nil {
			t.Fatalf("no client connection reached the healed pod %s: %v", badName, err)
		}
		t.Logf("the healed pod serves the client again %v after it was healed", time.Since(healed).Round(time.Second))
	}
	agentLogClean(t, ctx, rig)
	adoption(t, ctx, rig)
}

// agentLogClean: nothing in the story is an error of the agent's (its
// warnings other than the ejections are shown).
func agentLogClean(t *testing.T, ctx context.Context, rig *clusterrig.Rig) {
	t.Helper()
	out, err := rig.Kubectl(ctx, "logs", "-n", agentNS, agentDS)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		switch {
		case strings.Contains(line, `"level":"ERROR"`):
			t.Errorf("the agent logged an error: %s", line)
		case strings.Contains(line, `"level":"WARN"`) && !strings.Contains(line, `"msg":"endpoint ejected"`):
			t.Logf("agent warning: %s", line)
		}
	}
}

// agentCapabilities: the agent runs with the DaemonSet's capabilities and
// nothing more (CAP_NET_ADMIN 12, CAP_NET_RAW 13, CAP_PERFMON 38, CAP_BPF
// 39), as the kubelet and runc applied them to its process on the node.
func agentCapabilities(t *testing.T, rig *clusterrig.Rig) {
	t.Helper()
	const want = 1<<12 | 1<<13 | 1<<38 | 1<<39
	out, err := exec.Command("ip", "netns", "pids", rig.Netns).Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, pid := range strings.Fields(string(out)) {
		exe, _ := os.Readlink("/proc/" + pid + "/exe")
		if filepath.Base(exe) != "agent" {
			continue
		}
		status, err := os.ReadFile("/proc/" + pid + "/status")
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(status), "\n") {
			if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
				got, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
				if err != nil || got != want {
					t.Errorf("the agent's effective capabilities: %s, want %016x (BPF, NET_ADMIN, PERFMON, NET_RAW)", strings.TrimSpace(v), uint64(want))
				}
				t.Logf("the agent (pid %s) runs with CapEff %016x: BPF, NET_ADMIN, PERFMON, NET_RAW", pid, got)
				return
			}
		}
	}
	t.Errorf("no agent process on the node")
}

// pod is what the test reads of a Pod.
type pod struct {
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Status struct {
		Phase      string `json:"phase"`
		PodIP      string `json:"podIP"`
		Conditions []struct {
			Type   string `json:"type"`
			Status string `json:"status"`
		} `json:"conditions"`
		ContainerStatuses []struct {
			Name         string `json:"name"`
			Ready        bool   `json:"ready"`
			RestartCount int    `json:"restartCount"`
		} `json:"containerStatuses"`
	} `json:"status"`
}

func (p pod) ready() bool {
	for _, c := range p.Status.Conditions {
		if c.Type == "Ready" {
			return c.Status == "True"
		}
	}
	return false
}

func pods(t *testing.T, ctx context.Context, rig *clusterrig.Rig, args ...string) []pod {
	t.Helper()
	var list struct {
		Items []pod `json:"items"`
	}
	if err := rig.KubectlJSON(ctx, &list, append([]string{"get", "pods"}, args...)...); err != nil {
		t.Fatal(err)
	}
	return list.Items
}

func onePod(t *testing.T, ctx context.Context, rig *clusterrig.Rig, ns, selector string) pod {
	t.Helper()
	ps := pods(t, ctx, rig, "-n", ns, "-l", selector)
	if len(ps) != 1 {
		t.Fatalf("%d pods in %s with %s, want 1", len(ps), ns, selector)
	}
	return ps[0]
}

// allRunningAndReady: what `kubectl get pods` shows the operator while a
// backend fails every connection: nothing wrong.
func allRunningAndReady(t *testing.T, ctx context.Context, rig *clusterrig.Rig) {
	t.Helper()
	ps := pods(t, ctx, rig, "-A")
	for _, p := range ps {
		if p.Status.Phase != "Running" || !p.ready() {
			t.Errorf("pod %s/%s: %s, ready %v", p.Metadata.Namespace, p.Metadata.Name, p.Status.Phase, p.ready())
		}
		for _, c := range p.Status.ContainerStatuses {
			if c.RestartCount != 0 {
				t.Errorf("pod %s/%s: container %s restarted %d times", p.Metadata.Namespace, p.Metadata.Name, c.Name, c.RestartCount)
			}
		}
	}
	t.Logf("kubectl get pods: all %d pods Running and Ready, none restarted", len(ps))
}

// waitEvent waits for an Event of reason whose message names pod (and
// contains also, if set), last seen at or after since, and returns its
// message. (Event times have whole seconds.)
func waitEvent(t *testing.T, ctx context.Context, rig *clusterrig.Rig, since time.Time, reason, pod, also string) string {
	t.Helper()
	var msg string
	wctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	err := clusterrig.Wait(wctx, func() bool {
		var list struct {
			Items []struct {
				Reason        string    `json:"reason"`
				Message       string    `json:"message"`
				LastTimestamp time.Time `json:"lastTimestamp"`
			} `json:"items"`
		}
		if rig.KubectlJSON(ctx, &list, "get", "events", "-n", "default", "--field-selector", "reason="+reason) != nil {
			return false
		}
		for _, e := range list.Items {
			if strings.Contains(e.Message, "/"+pod+" (") && strings.Contains(e.Message, also) &&
				!e.LastTimestamp.Before(since.Truncate(time.Second)) {
				msg = e.Message
				return true
			}
		}
		return false
	})
	if err != nil {
		out, _ := rig.Kubectl(ctx, "get", "events", "-A")
		t.Fatalf("no %s Event naming pod %s (%q): %v\n%s", reason, pod, also, err, out)
	}
	return msg
}

// inspected is one endpoint as `agent inspect --json` shows it.
type inspected struct {
	Addr     string `json:"addr"`
	Datapath string `json:"datapath"`
	Accrual  struct {
		State     string `json:"state"`
		Ejections uint64 `json:"ejections"`
	} `json:"accrual"`
	Counters struct {
		Flows uint64 `json:"flows"`
	} `json:"counters"`
}

// badEndpoint reads the endpoint at ip with `kubectl exec
// ds/penaltybox-agent -- agent inspect --json`: the pinned maps, read
// inside the agent's container.
func badEndpoint(t *testing.T, ctx context.Context, rig *clusterrig.Rig, ip string) inspected {
	t.Helper()
	out, err := rig.Kubectl(ctx, "exec", "-n", agentNS, agentDS, "--", "agent", "inspect", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var snap struct {
		Services []struct {
			Endpoints []inspected `json:"endpoints"`
		} `json:"services"`
	}
	if err := json.Unmarshal([]byte(out), &snap); err != nil {
		t.Fatalf("agent inspect --json: %v\n%s", err, out)
	}
	for _, s := range snap.Services {
		for _, e := range s.Endpoints {
			if strings.HasPrefix(e.Addr, ip+":") {
				return e
			}
		}
	}
	t.Fatalf("agent inspect shows no endpoint %s:\n%s", ip, out)
	return inspected{}
}

// inspectShowsEjected: the operator's view of the ejected pod, in human
// notation, from inside the agent's container. Between its penalty and
// its failed probe it may be in probation for a moment.
func inspectShowsEjected(t *testing.T, ctx context.Context, rig *clusterrig.Rig, ip string) {
	t.Helper()
	if e := badEndpoint(t, ctx, rig, ip); e.Accrual.State != "ejected" && e.Accrual.State != "probation" {
		t.Errorf("agent inspect: %s is %q, want ejected (or probation)", e.Addr, e.Accrual.State)
	}
	text, err := rig.Kubectl(ctx, "exec", "-n", agentNS, agentDS, "--", "agent", "inspect")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kubectl exec %s -- agent inspect:\n%s", agentDS, text)
}

// dumpState writes what a person debugging a failure looks at first to
// a file outside the cluster's directory (which Down removes): in
// $TEST_LOG_DIR, where make test keeps the run's logs, or the temp
// directory. It logs the file's name and the pods not running: CI shows a
// failing run's head and tail, and the test's own failure lines, just
// before this, must stay in that tail.
func dumpState(t *testing.T, rig *clusterrig.Rig) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	f, err := os.CreateTemp(os.Getenv("TEST_LOG_DIR"), "penaltybox-cluster-failure-*.log")
	if err != nil {
		t.Logf("the cluster's state is not dumped: %v", err)
		return
	}
	defer f.Close()
	section := func(title, body string) { fmt.Fprintf(f, "===== %s\n%s\n\n", title, body) }
	for _, args := range [][]string{
		{"get", "pods", "-A", "-o", "wide"},
		{"get", "events", "-A"},
		{"logs", "-n", agentNS, agentDS},
		{"logs", "-n", agentNS, agentDS, "--previous"},
	} {
		out, err := rig.Kubectl(ctx, args...)
		section(fmt.Sprintf("kubectl %s (%v)", strings.Join(args, " "), err), out)
		if args[0] == "get" && args[1] == "pods" {
			for _, line := range strings.Split(out, "\n") {
				if strings.Contains(line, "NAMESPACE") || strings.Contains(line, " Running ") || strings.TrimSpace(line) == "" {
					continue
				}
				t.Logf("pod not running: %s", line)
			}
		}
	}
	// The datapath's own view: what it refused to take as evidence (a
	// reply from the wrong side is a pod whose veth pb_ifaces does not
	// know as its bridge's), and the pod veths' masters it is told of.
	if m := agentMetrics(t, rig); len(m) > 0 {
		var lines []string
		for name, fam := range m {
			if !strings.HasPrefix(name, "penaltybox_datapath_") {
				continue
			}
			for _, s := range fam.GetMetric() {
				v := s.GetCounter().GetValue() + s.GetGauge().GetValue()
				if v == 0 {
					continue
				}
				var labels []string
				for _, l := range s.GetLabel() {
					labels = append(labels, l.GetName()+"="+l.GetValue())
				}
				lines = append(lines, fmt.Sprintf("%s{%s} %g", name, strings.Join(labels, ","), v))
			}
		}
		slices.Sort(lines)
		section("the agent's non-zero datapath metrics", strings.Join(lines, "\n"))
	}
	for _, args := range [][]string{
		{"ip", "-o", "link", "show", "type", "veth"},
		{"bpftool", "map", "dump", "pinned", "/sys/fs/bpf/penaltybox/pb_ifaces"},
	} {
		out, err := rig.Command(args[0], args[1:]...).CombinedOutput()
		section(fmt.Sprintf("on the node, %s (%v)", strings.Join(args, " "), err), string(out))
	}
	for _, c := range []string{"kubelet", "containerd"} {
		b, _ := os.ReadFile(filepath.Join(rig.Dir, "run", c+".log"))
		section(c+" log", string(b))
	}
	if err := f.Close(); err != nil {
		t.Logf("the cluster's state at the failure: %s: %v", f.Name(), err)
		return
	}
	t.Logf("the cluster's state at the failure: %s", f.Name())
}
