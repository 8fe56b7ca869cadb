package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/clientlog"
	"github.com/penaltybox/penaltybox/internal/clusterrig"
)

// The adoption story's Services (test/cluster/testdata/adoption.yaml):
// one per team, each with a one-shot port and a stream ("download") port.
const (
	adoptionYAML = "test/cluster/testdata/adoption.yaml"
	teamA, teamB = "team-a", "team-b"
	enabledLabel = "penaltybox.io/enabled"
	// The DaemonSet's --dead-man-timeout, and what the test waits beyond
	// it before it changes the endpoints behind the agent's back.
	deadMan      = 30 * time.Second
	deadManSlack = 8 * time.Second
)

func httpPort(ns string) string   { return ns + "/web:http" }
func streamPort(ns string) string { return ns + "/web:stream" }

// adoption is issue 32's story on the cluster, after the seed demo (the
// agent installed from deploy/, which serves only Services that opt in):
// two teams' Services under load, neither served; one namespace labelled,
// then unlabelled; the agent kept away past its dead-man's switch while
// the endpoints change; the install deleted under load. Asserted: only
// the labelled team's Service is served (metrics, `agent inspect`), no
// connection fails and no download is cut by any of it, the datapath
// hands new flows to kube-proxy while the agent is away and takes them
// back when it returns, and nothing of penaltybox is left on the node.
func adoption(t *testing.T, ctx context.Context, rig *clusterrig.Rig) {
	logHas(t, ctx, rig, `"msg":"kube-proxy found"`, `"mode":"nftables"`)
	if _, err := rig.Kubectl(ctx, "apply", "-f", rig.Root+"/"+adoptionYAML); err != nil {
		t.Fatal(err)
	}
	for _, ns := range []string{teamA, teamB} {
		for _, d := range []string{"deploy/web", "deploy/client"} {
			if _, err := rig.Kubectl(ctx, "-n", ns, "rollout", "status", d, "--timeout=120s"); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Both clients' connections go through kube-proxy before anything is
	// asked of the agent. (Their first ones may be refused: a client can
	// start before kube-proxy has its Service's endpoints.)
	applied := time.Now()
	for _, ns := range []string{teamA, teamB} {
		waitClient(t, ctx, rig, ns, applied, func(s clientlog.Second) bool { return s.OK >= 40 && s.StreamsOK >= 1 })
	}
	begin := time.Now()
	if got := servedBy(t, rig); got[httpPort(teamA)] != "" || got[httpPort(teamB)] != "" {
		t.Fatalf("served before any label: %v", got)
	}

	t.Logf("--- opt-in: label namespace %s", teamA)
	label(t, ctx, rig, teamA, "true")
	waitServed(t, ctx, rig, teamA, "namespace-label")
	flowsGrow(t, ctx, rig, httpPort(teamA))
	if got := servedBy(t, rig); got[httpPort(teamB)] != "" {
		t.Errorf("%s served though only %s is labelled: %v", teamB, teamA, got)
	}
	rep := inspectNode(t, ctx, rig)
	if s, ok := rep.service(httpPort(teamA)); !ok || s.Served != "namespace-label" {
		t.Errorf("agent inspect: %s served %q (listed %v), want namespace-label", httpPort(teamA), s.Served, ok)
	}
	if _, ok := rep.service(httpPort(teamB)); ok {
		t.Errorf("agent inspect lists %s, which is kube-proxy's", httpPort(teamB))
	}

	t.Logf("--- opt-out: unlabel namespace %s", teamA)
	label(t, ctx, rig, teamA, "")
	waitServed(t, ctx, rig, teamA, "")
	// Every stream begun before now (8 s long) ends before the window
	// closes: whole, wherever it began.
	optedOut := time.Now()
	for _, ns := range []string{teamA, teamB} {
		waitClient(t, ctx, rig, ns, optedOut, func(s clientlog.Second) bool { return s.StreamsOK+s.StreamsCut >= 6 })
		noneLost(t, ctx, rig, ns, begin, true, "while "+teamA+" was labelled and unlabelled")
	}

	deadMansSwitch(t, ctx, rig)

	t.Log("--- uninstall under load: kubectl delete -k")
	attached := penaltyboxOnNode(t, ctx, rig)
	if len(attached.progs) == 0 {
		t.Fatal("no penaltybox program attached on the node before the uninstall")
	}
	deleted := time.Now()
	if err := rig.UninstallAgent(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: uninstalled in %v (deleted at %s)", time.Now().Format("15:04:05.000"), time.Since(deleted).Round(time.Second), deleted.Format("15:04:05.000"))
	// The datapath is gone with the install: nothing attached, nothing
	// pinned, and the programs the node ran before are freed.
	if left := penaltyboxOnNode(t, ctx, rig); len(left.progs)+len(left.pins) > 0 {
		t.Errorf("left on the node after the uninstall: programs %v, pins %v", left.progs, left.pins)
	}
	if err := clusterrig.Wait(ctx, func() bool { return progsGone(rig, attached.progs) }); err != nil {
		t.Errorf("programs %v still loaded after the uninstall", attached.progs)
	}
	after := time.Now()
	for _, ns := range []string{teamA, teamB} {
		waitClient(t, ctx, rig, ns, after, func(s clientlog.Second) bool { return s.StreamsOK+s.StreamsCut >= 6 })
		noneLost(t, ctx, rig, ns, deleted, true, "across the uninstall")
	}
}

// deadMansSwitch: team-a served again, the agent is kept off the node (a
// nodeSelector no node matches: its pod is stopped, as a restart stops
// it, so the datapath stays) for longer than the switch's bound, and
// team-a's Deployment is scaled up and down meanwhile. New connections
// reach the current endpoints through kube-proxy and none fails; the
// agent, back, takes new flows again and says how long it was away.
func deadMansSwitch(t *testing.T, ctx context.Context, rig *clusterrig.Rig) {
	t.Logf("--- dead-man's switch: %s served, the agent kept away", teamA)
	label(t, ctx, rig, teamA, "true")
	waitServed(t, ctx, rig, teamA, "namespace-label")
	flowsGrow(t, ctx, rig, httpPort(teamA))
	before := pods(t, ctx, rig, "-n", teamA, "-l", "app=web")

	away := time.Now()
	t.Logf("%s: the agent sent away", away.Format("15:04:05.000"))
	patchAgent(t, ctx, rig, `"true"`)
	if err := clusterrig.Wait(ctx, func() bool {
		return len(pods(t, ctx, rig, "-n", agentNS, "-l", "app.kubernetes.io/name=penaltybox")) == 0
	}); err != nil {
		t.Fatal("the agent's pod did not go:", err)
	}
	gone := time.Now()
	t.Logf("%s: the agent's pod is gone", gone.Format("15:04:05.000"))
	if rep := inspectNode(t, ctx, rig); rep.NewFlows.To != "penaltybox" {
		t.Errorf("just after the agent stopped, new flows go to %s (%s), want the datapath still", rep.NewFlows.To, rep.NewFlows.Why)
	}
	// The switch trips deadMan after the last heartbeat; inspect, run on
	// the node with no agent there, reads it from the pinned maps.
	wctx, cancel := context.WithTimeout(ctx, deadMan+deadManSlack+10*time.Second)
	var rep report
	err := clusterrig.Wait(wctx, func() bool {
		rep = inspectNode(t, wctx, rig)
		return rep.NewFlows.To == "kube-proxy"
	})
	cancel()
	if err != nil {
		t.Fatalf("the dead-man's switch did not trip %v after the agent went: %+v", time.Since(gone).Round(time.Second), rep.NewFlows)
	}
	t.Logf("%s: switch tripped %v after the agent's pod was gone: new flows to %s (%s), heartbeat %s old",
		time.Now().Format("15:04:05.000"), time.Since(gone).Round(time.Second), rep.NewFlows.To, rep.NewFlows.Why, rep.NewFlows.HeartbeatAge)

	// The endpoints change behind the pinned tables' back: the pods added
	// are reached (by kube-proxy: the tables do not have them), the pods
	// removed are not missed.
	scaled := time.Now()
	scale(t, ctx, rig, teamA, 4)
	newPods := map[string]bool{}
	for _, p := range pods(t, ctx, rig, "-n", teamA, "-l", "app=web") {
		newPods[p.Metadata.Name] = true
	}
	for _, p := range before {
		delete(newPods, p.Metadata.Name)
	}
	waitClient(t, ctx, rig, teamA, scaled, func(s clientlog.Second) bool {
		for name := range newPods {
			if s.Backends[name] > 0 {
				return true
			}
		}
		return false
	})
	scale(t, ctx, rig, teamA, 1)
	got := clientlog.Total(clientSeconds(t, ctx, rig, teamA), scaled, time.Now())
	t.Logf("while the endpoints changed: %d connections, %d failed; by pod %v (new: %v)",
		got.OK+got.Failed(), got.Failed(), got.Backends, newPods)

	t.Logf("%s: the agent let back", time.Now().Format("15:04:05.000"))
	patchAgent(t, ctx, rig, "null")
	if _, err := rig.Kubectl(ctx, "-n", agentNS, "rollout", "status", agentDS, "--timeout=180s"); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: agent back %v after it went", time.Now().Format("15:04:05.000"), time.Since(away).Round(time.Second))
	flowsGrow(t, ctx, rig, httpPort(teamA))
	if rep := inspectNode(t, ctx, rig); rep.NewFlows.To != "penaltybox" {
		t.Errorf("with the agent back, new flows go to %s (%s)", rep.NewFlows.To, rep.NewFlows.Why)
	}
	logHas(t, ctx, rig, `no agent for longer than the dead-man's bound`)
	logHas(t, ctx, rig, `heartbeat resumed: the datapath takes new flows back`)
	m := agentMetrics(t, rig)
	t.Logf("the kernel's conntrack entries the datapath expired: %v taken over, %v handed over",
		m.Get("penaltybox_datapath_conntrack_forgotten_total", "why", "taken_over"),
		m.Get("penaltybox_datapath_conntrack_forgotten_total", "why", "handed_over"))
	if n := m.Get("penaltybox_datapath_kube_proxy_flows_total", "why", "handed_over"); n == 0 {
		t.Error("penaltybox_datapath_kube_proxy_flows_total{why=\"handed_over\"} is 0")
	}
	// Streams to the pods scaled away are cut by their pods' exit, which is
	// kube-proxy's (and the application's) behaviour: only connections count.
	noneLost(t, ctx, rig, teamA, away, false, "while the agent was away and the endpoints changed")
}

// waitClient waits until the client in ns has shown, since from, what ok
// wants.
func waitClient(t *testing.T, ctx context.Context, rig *clusterrig.Rig, ns string, from time.Time, ok func(clientlog.Second) bool) {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var got clientlog.Second
	if err := clusterrig.Wait(wctx, func() bool {
		secs, err := rig.ClientSeconds(wctx, ns)
		if err != nil {
			return false
		}
		got = clientlog.Total(secs, from, time.Now())
		return ok(got)
	}); err != nil {
		t.Fatalf("client in %s since %s: %+v", ns, from.Format(time.TimeOnly), got)
	}
}

func clientSeconds(t *testing.T, ctx context.Context, rig *clusterrig.Rig, ns string) []clientlog.Second {
	t.Helper()
	secs, err := rig.ClientSeconds(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}
	return secs
}

// noneLost: the client in ns had no failed connection since from (and,
// with streams, no cut download).
func noneLost(t *testing.T, ctx context.Context, rig *clusterrig.Rig, ns string, from time.Time, streams bool, when string) {
	t.Helper()
	secs := clientSeconds(t, ctx, rig, ns)
	got := clientlog.Total(secs, from, time.Now())
	t.Logf("%s, %s: %d connections, %d failed (refused %d, reset %d, timeout %d, other %d); streams %d whole, %d cut",
		ns, when, got.OK+got.Failed(), got.Failed(), got.Refused, got.Reset, got.Timeout, got.Other, got.StreamsOK, got.StreamsCut)
	if got.Failed() > 0 {
		t.Errorf("%s: %d connections failed %s", ns, got.Failed(), when)
	}
	if got.Failed() > 0 || (streams && got.StreamsCut > 0) {
		for _, s := range secs {
			if s.T.After(from) && (s.Failed() > 0 || s.StreamsCut > 0) {
				t.Logf("  %s at %s: %+v", ns, s.T.Format("15:04:05.000"), s)
			}
		}
	}
	if streams && got.StreamsCut > 0 {
		t.Errorf("%s: %d downloads cut %s", ns, got.StreamsCut, when)
	}
}

// label sets (or with "" removes) the opt-in label on namespace ns.
func label(t *testing.T, ctx context.Context, rig *clusterrig.Rig, ns, value string) {
	t.Helper()
	arg := enabledLabel + "-"
	if value != "" {
		arg = enabledLabel + "=" + value
	}
	if _, err := rig.Kubectl(ctx, "label", "--overwrite", "namespace", ns, arg); err != nil {
		t.Fatal(err)
	}
}

// waitServed waits until the agent's metrics say ns's Service is served
// for reason ("": not served), on both of its ports.
func waitServed(t *testing.T, ctx context.Context, rig *clusterrig.Rig, ns, reason string) {
	t.Helper()
	start := time.Now()
	var got map[string]string
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := clusterrig.Wait(wctx, func() bool {
		got = servedBy(t, rig)
		return got[httpPort(ns)] == reason && got[streamPort(ns)] == reason
	}); err != nil {
		t.Fatalf("%s served %q, want %q: %v", ns, got[httpPort(ns)], reason, got)
	}
	t.Logf("%s served %q after %v", ns, reason, time.Since(start).Round(100*time.Millisecond))
}

// flowsGrow waits until the datapath admits new flows to service.
func flowsGrow(t *testing.T, ctx context.Context, rig *clusterrig.Rig, service string) {
	t.Helper()
	first := agentMetrics(t, rig).Get("penaltybox_service_flows_total", "service", service)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := clusterrig.Wait(wctx, func() bool {
		return agentMetrics(t, rig).Get("penaltybox_service_flows_total", "service", service) >= first+20
	}); err != nil {
		t.Fatalf("the datapath admits no new flows to %s", service)
	}
}

// servedBy is penaltybox_service_served: service → reason.
func servedBy(t *testing.T, rig *clusterrig.Rig) map[string]string {
	t.Helper()
	out := map[string]string{}
	fam, ok := agentMetrics(t, rig)["penaltybox_service_served"]
	if !ok {
		return out
	}
	for _, m := range fam.Metric {
		var svc, reason string
		for _, l := range m.Label {
			switch l.GetName() {
			case "service":
				svc = l.GetValue()
			case "reason":
				reason = l.GetValue()
			}
		}
		out[svc] = reason
	}
	return out
}

// agentMetrics scrapes the agent on the node (an empty set while it is
// away or starting).
func agentMetrics(t *testing.T, rig *clusterrig.Rig) agentrun.Metrics {
	t.Helper()
	resp, err := rig.HTTPClient().Get(fmt.Sprintf("http://%s:9464/metrics", clusterrig.NodeIP))
	if err != nil {
		return agentrun.Metrics{}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		return agentrun.Metrics{}
	}
	m, err := agentrun.ParseMetrics(string(b))
	if err != nil {
		t.Fatalf("the agent's /metrics: %v", err)
	}
	return m
}

// report is what the test reads of `agent inspect --json`.
type report struct {
	NewFlows struct {
		To, Why, HeartbeatAge string
	} `json:"newFlows"`
	Services []struct {
		Name   string `json:"name"`
		Served string `json:"served"`
	} `json:"services"`
}

func (r report) service(name string) (s struct{ Name, Served string }, ok bool) {
	for _, x := range r.Services {
		if x.Name == name {
			return struct{ Name, Served string }{x.Name, x.Served}, true
		}
	}
	return s, false
}

// inspectNode runs `agent inspect --json` on the node, as an operator
// would with the agent's image: the pinned maps, and the agent's view of
// the services when it answers.
func inspectNode(t *testing.T, ctx context.Context, rig *clusterrig.Rig) report {
	t.Helper()
	out, err := rig.Command(rig.AgentBinary(), "inspect", "--json").Output()
	if err != nil {
		t.Fatalf("agent inspect on the node: %v", err)
	}
	var r report
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("agent inspect --json: %v\n%s", err, out)
	}
	return r
}

// patchAgent sets (a JSON string) or removes (null) a nodeSelector on the
// agent's DaemonSet that no node matches.
func patchAgent(t *testing.T, ctx context.Context, rig *clusterrig.Rig, value string) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"template":{"spec":{"nodeSelector":{"penaltybox.io/test-away":%s}}}}}`, value)
	if _, err := rig.Kubectl(ctx, "-n", agentNS, "patch", agentDS, "--type=merge", "-p", patch); err != nil {
		t.Fatal(err)
	}
}

func scale(t *testing.T, ctx context.Context, rig *clusterrig.Rig, ns string, n int) {
	t.Helper()
	if _, err := rig.Kubectl(ctx, "-n", ns, "scale", "deploy/web", fmt.Sprint("--replicas=", n)); err != nil {
		t.Fatal(err)
	}
	if _, err := rig.Kubectl(ctx, "-n", ns, "rollout", "status", "deploy/web", "--timeout=120s"); err != nil {
		t.Fatal(err)
	}
	// Scaled down, the rollout is done before the old pods have exited.
	if err := clusterrig.Wait(ctx, func() bool { return len(pods(t, ctx, rig, "-n", ns, "-l", "app=web")) == n }); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %s/web scaled to %d", time.Now().Format("15:04:05.000"), ns, n)
}

// logHas: some line of the agent's log holds every one of parts.
func logHas(t *testing.T, ctx context.Context, rig *clusterrig.Rig, parts ...string) {
	t.Helper()
	out, err := rig.Kubectl(ctx, "logs", "-n", agentNS, agentDS)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			return
		}
	}
	t.Errorf("no line of the agent's log has %q", parts)
}

// onNode is what of penaltybox the node holds: XDP and tc programs
// attached in its network namespace (ids), and pins on its bpffs.
type onNode struct {
	progs []int
	pins  []string
}

func penaltyboxOnNode(t *testing.T, ctx context.Context, rig *clusterrig.Rig) onNode {
	t.Helper()
	var n onNode
	out, err := rig.Command("bpftool", "net", "show", "-j").Output()
	if err != nil {
		t.Fatalf("bpftool net show: %v", err)
	}
	var nets []map[string][]struct {
		ID   int    `json:"id"`
		Name string `json:"name"`
	}
	if err := json.Unmarshal(out, &nets); err != nil {
		t.Fatalf("bpftool net show: %v\n%s", err, out)
	}
	for _, kinds := range nets {
		for _, attached := range kinds {
			for _, a := range attached {
				if a.ID > 0 {
					n.progs = append(n.progs, a.ID)
				}
			}
		}
	}
	out, _ = rig.Command("find", "/sys/fs/bpf", "-path", "*penaltybox*").Output()
	n.pins = strings.Fields(string(out))
	return n
}

// progsGone: no program of ids is loaded any more.
func progsGone(rig *clusterrig.Rig, ids []int) bool {
	for _, id := range ids {
		if rig.Command("bpftool", "prog", "show", "id", fmt.Sprint(id)).Run() == nil {
			return false
		}
	}
	return true
}
