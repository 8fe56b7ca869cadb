// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"

	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/testnet"
	pbk8s "github.com/penaltybox/penaltybox/pkg/k8s"
)

// TestFleetEvidence: the dilution case on three nodes. Each node's client
// makes 12 connections a second to a Service whose three backends are one
// per node; node 3's backend refuses 30% of them. In a 10 s window each
// node sends that backend about 40 connections, and min-calls is 60: no
// node can judge it alone, while the fleet's 120 can (also without the
// node most over the threshold, which the aggregator leaves out). With
// fleet evidence off (the Service's annotation) no node ejects it over two
// and a half windows; turned on, every node ejects it, with reason fleet,
// within two windows; back through its probes after its 2 s penalty (the
// backend refuses nothing until every node has it back) and failing
// again, it is condemned again a level up and every node ejects it
// again. The agents run with bound service-account tokens of pods on their
// nodes, under deploy/'s RBAC and admission policies, which refuse a
// report written for another node and a verdict from an agent that does
// not hold the fleet Lease.
func TestFleetEvidence(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	f := testnet.NewFleet(t, testnet.FleetOptions{Nodes: 3, PodsPerNode: 2, Network: testnet.Routed})
	c := startClusterOn(t, f.Fabric, testnet.FabricAddr.String())
	if _, err := c.kubectl("apply", "-f", filepath.Join(repoRoot, "deploy", "namespace.yaml"),
		"-f", filepath.Join(repoRoot, "deploy", "rbac.yaml"), "-f", filepath.Join(repoRoot, "deploy", "fleet-crd.yaml")); err != nil {
		t.Fatal(err)
	}
	if out, err := c.kubectl("wait", "--for=condition=established", "--timeout=30s",
		"crd/endpointreports.fleet.penaltybox.io", "crd/endpointverdicts.fleet.penaltybox.io"); err != nil {
		t.Fatalf("CRDs not established: %v\n%s", err, out)
	}
	if _, err := c.kubectl("apply", "-f", filepath.Join(repoRoot, "deploy", "fleet-admission.yaml")); err != nil {
		t.Fatal(err)
	}
	admin := c.Admin

	// Each node's agent gets the token its pod would: bound to a pod on
	// that node, so the API server adds the node's name to its user info.
	kubeconfigs := map[string]string{}
	dyns := map[string]dynamic.Interface{}
	for _, n := range f.Nodes {
		name := fleetNodeName(n)
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		pod, err := admin.CoreV1().Pods("penaltybox-system").Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "penaltybox-agent-" + name},
			Spec: corev1.PodSpec{NodeName: name, ServiceAccountName: "penaltybox-agent",
				Containers: []corev1.Container{{Name: "agent", Image: "penaltybox/agent"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		tr, err := admin.CoreV1().ServiceAccounts("penaltybox-system").CreateToken(ctx, "penaltybox-agent", &authnv1.TokenRequest{
			Spec: authnv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600),
				BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		kubeconfigs[name] = c.kubeconfig("agent-"+name, tr.Status.Token)
		if dyns[name], err = dynamic.NewForConfig(c.RestConfig(tr.Status.Token)); err != nil {
			t.Fatal(err)
		}
	}
	report := func(as, name string) error {
		u := &unstructured.Unstructured{Object: map[string]any{"spec": map[string]any{
			"writtenAt": time.Now().UTC().Format(time.RFC3339), "expiresAt": time.Now().Add(time.Minute).UTC().Format(time.RFC3339)}}}
		u.SetAPIVersion(pbk8s.FleetGroup + "/" + pbk8s.FleetVersion)
		u.SetKind("EndpointReport")
		u.SetName(name)
		_, err := dyns[as].Resource(pbk8s.ReportGVR).Apply(ctx, name, u, metav1.ApplyOptions{FieldManager: "test", Force: true})
		return err
	}
	verdict := func(as string) error {
		u := &unstructured.Unstructured{Object: map[string]any{"spec": map[string]any{"expiresAt": time.Now().Add(time.Minute).UTC().Format(time.RFC3339)}}}
		u.SetAPIVersion(pbk8s.FleetGroup + "/" + pbk8s.FleetVersion)
		u.SetKind("EndpointVerdict")
		u.SetNamespace(shop)
		u.SetName("forged")
		_, err := dyns[as].Resource(pbk8s.VerdictGVR).Namespace(shop).Apply(ctx, "forged", u, metav1.ApplyOptions{FieldManager: "test", Force: true})
		return err
	}
	// The policies take effect a moment after they are created: wait for
	// the forged report to be refused, then check the rest once.
	var forged error
	waitFor(t, ctx, 20*time.Second, "node2's agent refused node1's EndpointReport", func() bool {
		forged = report("node2", "node1")
		if forged == nil {
			_ = admin.Discovery().RESTClient().Delete().AbsPath("/apis", pbk8s.FleetGroup, pbk8s.FleetVersion, pbk8s.ReportResource, "node1").Do(ctx).Error()
		}
		return apierrors.IsForbidden(forged)
	})
	t.Logf("forged report refused: %v", forged)
	if !strings.Contains(forged.Error(), "its own node") {
		t.Errorf("refusal %q does not say why", forged)
	}
	if err := report("node2", "node2"); err != nil {
		t.Fatalf("node2's agent writing its own report: %v", err)
	}
	if err := dyns["node2"].Resource(pbk8s.ReportGVR).Delete(ctx, "node2", metav1.DeleteOptions{}); err != nil {
		t.Fatalf("node2's agent deleting its own report: %v", err)
	}

	// The Service: failure-rate accrual, a 10 s window judged on 60 calls,
	// and a threshold of 15% (half the failing share: the fleet's 120 calls
	// a window cross it with a wide margin). A short first penalty lets its
	// probes bring it back, to be condemned again.
	target, backends := webOnFleet(t, ctx, admin, f, map[string]string{
		pbk8s.AnnotationMode:                 "failure-rate",
		pbk8s.AnnotationWindow:               "10s",
		pbk8s.AnnotationMinCalls:             "60",
		pbk8s.AnnotationFailureRateThreshold: "0.15",
		pbk8s.AnnotationMinPenalty:           "2s",
		pbk8s.AnnotationMaxPenalty:           "1m",
		pbk8s.AnnotationJitterRatio:          "0",
		pbk8s.AnnotationFleetEvidence:        "false",
	})
	bad, badEP := f.Node(3).Pods[1], backends[2]

	agents := make([]*agentrun.Agent, len(f.Nodes))
	for i, n := range f.Nodes {
		agents[i] = startK8sAgent(t, ctx, n.NS, kubeconfigs[fleetNodeName(n)], fleetNodeName(n), "--node-interfaces", "eth0")
	}
	for i, a := range agents {
		waitFor(t, ctx, 20*time.Second, fmt.Sprintf("node %d: the Service programmed with 3 backends", i+1), func() bool {
			return len(agentServices(t, ctx, a).service(httpSvc)) == 3
		})
	}
	if err := bad.RefuseShare(0.3); err != nil {
		t.Fatal(err)
	}

	// Clients on every node, 12 connections a second each, until the end.
	loadCtx, stopLoad := context.WithCancel(ctx)
	var wg sync.WaitGroup
	results := make([]testnet.Results, len(f.Nodes))
	for i, n := range f.Nodes {
		wg.Go(func() {
			results[i], _ = testnet.Load(loadCtx, n.Pods[0].NS, testnet.LoadSpec{Target: target, Rate: 12, Duration: 3 * time.Minute,
				ConnectTimeout: 2 * time.Second, RequestTimeout: 2 * time.Second})
		})
	}
	defer func() {
		stopLoad()
		wg.Wait()
	}()
	states := func() []string {
		out := make([]string, len(agents))
		for i, a := range agents {
			out[i] = endpointState(t, ctx, a, httpSvc, badEP)
		}
		return out
	}

	// Off: two and a half windows, and nobody ejects it.
	offUntil := time.Now().Add(25 * time.Second)
	for time.Now().Before(offUntil) {
		for i, s := range states() {
			if s != "ready" {
				t.Fatalf("fleet evidence off: node %d holds %s %s, want ready (no node sees min-calls)", i+1, badEP, s)
			}
		}
		time.Sleep(500 * time.Millisecond)
	}
	var maxCalls uint32
	for _, a := range agents {
		for _, s := range agentEndpoints(t, ctx, a).Services {
			for _, e := range s.Endpoints {
				if s.Service == httpSvc && e.Endpoint == badEP && e.Window != nil {
					maxCalls = max(maxCalls, e.Window.Calls)
				}
			}
		}
	}
	t.Logf("fleet evidence off: %s ready on every node after 25 s; the fullest node window holds %d calls (min-calls 60)", badEP, maxCalls)
	if l, err := dyns["node1"].Resource(pbk8s.ReportGVR).List(ctx, metav1.ListOptions{}); err != nil || len(l.Items) != 0 {
		t.Errorf("fleet evidence off: reports %v (%v), want none written", l, err)
	}

	// On: every node ejects it within two windows.
	on := time.Now()
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"true"}}}`, pbk8s.AnnotationFleetEvidence)
	if _, err := admin.CoreV1().Services(shop).Patch(ctx, "web", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	ejectedAt := make([]time.Duration, len(agents))
	waitFor(t, ctx, 40*time.Second, "every node ejects "+badEP, func() bool {
		all := true
		for i, s := range states() {
			if s == "ejected" && ejectedAt[i] == 0 {
				ejectedAt[i] = time.Since(on)
			}
			all = all && ejectedAt[i] != 0
		}
		return all
	})
	t.Logf("fleet evidence on: %s ejected by nodes 1, 2, 3 after %v", badEP, ejectedAt)
	for i, d := range ejectedAt {
		if d > 20*time.Second {
			t.Errorf("node %d ejected %s %v after fleet evidence was turned on, want within two windows (20s)", i+1, badEP, d.Round(100*time.Millisecond))
		}
	}
	// Its probes bring it back after its 2 s penalty: the backend answers
	// every SYN until each node has it ready again. With its 30% refusals
	// left on, a node whose probes kept failing (0.3⁴ for a minute) would
	// hold it out on its own, and the two nodes left, less the one most
	// over the threshold, are too few to judge it: no renewal, by design.
	if err := bad.RefuseShare(0); err != nil {
		t.Fatal(err)
	}
	waitFor(t, ctx, 30*time.Second, "every node returns "+badEP+" through a probe", func() bool {
		return !slices.ContainsFunc(states(), func(s string) bool { return s != "ready" })
	})
	if err := bad.RefuseShare(0.3); err != nil {
		t.Fatal(err)
	}
	t.Logf("every node returned %s through its probe %v after the last ejection", badEP, time.Since(on.Add(slices.Max(ejectedAt))).Round(100*time.Millisecond))
	for i, a := range agents {
		m, err := a.Metrics(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v := m.Get("penaltybox_endpoint_ejections_by_reason_total", "svc_namespace", shop, "svc_name", "web", "svc_port", "http", "backend", badEP, "reason", "fleet"); v < 1 {
			t.Errorf("node %d: %v ejections for fleet, want at least 1", i+1, v)
		}
		if !a.LogContains("fleet evidence condemns endpoint", badEP) {
			t.Errorf("node %d: no log line for the condemnation", i+1)
		}
	}
	waitFor(t, ctx, 20*time.Second, "an Event: ejected on node1 on the fleet's evidence", func() bool {
		evs, err := admin.CoreV1().Events(shop).List(ctx, metav1.ListOptions{FieldSelector: "reason=" + pbk8s.ReasonEndpointEjected})
		if err != nil {
			return false
		}
		for _, e := range evs.Items {
			if strings.Contains(e.Message, "web-3") && strings.Contains(e.Message, "node node1") && strings.Contains(e.Message, "fleet's evidence") {
				t.Logf("Event: %s", e.Message)
				return true
			}
		}
		return false
	})
	v, err := admin.Discovery().RESTClient().Get().AbsPath("/apis", pbk8s.FleetGroup, pbk8s.FleetVersion, "namespaces", shop, pbk8s.VerdictResource, "web").DoRaw(ctx)
	if err != nil {
		t.Fatalf("the Service's EndpointVerdict: %v", err)
	}
	t.Logf("EndpointVerdict shop/web: %s", v)
	// What an operator sees (README shows it).
	out, err := c.kubectl("-n", shop, "get", "endpointverdicts")
	if err != nil || !strings.Contains(out, "CONDEMNED") || !strings.Contains(out, badEP) {
		t.Errorf("kubectl get endpointverdicts (%v):\n%s\nwant the condemned endpoint listed", err, out)
	}
	t.Logf("kubectl -n shop get endpointverdicts:\n%s", out)
	if out, err := c.kubectl("get", "endpointreports"); err == nil {
		t.Logf("kubectl get endpointreports:\n%s", out)
	}

	// Back, it fails as before: judged on the counts of the nodes that
	// took it out (their windows hold only calls made since), the
	// condemnation is renewed a level up, and every node ejects it again.
	fleetEjections := func(a *agentrun.Agent) float64 {
		m, err := a.Metrics(ctx)
		if err != nil {
			return 0
		}
		return m.Get("penaltybox_endpoint_ejections_by_reason_total", "svc_namespace", shop, "svc_name", "web", "svc_port", "http", "backend", badEP, "reason", "fleet")
	}
	renewedFrom := on.Add(slices.Max(ejectedAt)) // the last node's first ejection
	waitFor(t, ctx, 90*time.Second, "a renewed condemnation (level 1) ejecting "+badEP+" again on every node", func() bool {
		time.Sleep(250 * time.Millisecond) // scrapes three agents: not at waitFor's pace
		for _, a := range agents {
			if fleetEjections(a) < 2 || !a.LogContains("fleet evidence condemns endpoint", badEP, `"condemnation_level":1`) {
				return false
			}
		}
		return true
	})
	t.Logf("renewed: every node ejected %s again for the fleet %v after the first ejections", badEP, time.Since(renewedFrom).Round(100*time.Millisecond))

	// Only the Lease holder writes verdicts.
	lease, err := admin.CoordinationV1().Leases("penaltybox-system").Get(ctx, pbk8s.FleetLease, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	holder := ptr.Deref(lease.Spec.HolderIdentity, "")
	other := "node1"
	if holder == other {
		other = "node2"
	}
	if err := verdict(other); !apierrors.IsForbidden(err) {
		t.Errorf("a verdict from %s, not the Lease holder %s: %v, want refused", other, holder, err)
	} else {
		t.Logf("verdict from a non-holder refused: %v", err)
	}

	// What the clients saw: the failing backend's refusals are retried on
	// another backend (retryRefused), so nearly every connection succeeds.
	stopLoad()
	wg.Wait()
	for i, rs := range results {
		t.Logf("node %d's client: %d of %d connections succeeded", i+1, rs.Count(testnet.OK), len(rs))
	}
}
