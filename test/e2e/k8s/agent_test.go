// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/admin"

	"github.com/cilium/ebpf"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/internal/testnet"
	pbk8s "github.com/penaltybox/penaltybox/pkg/k8s"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

const (
	nodeName = "e2e-node"
	shop     = "shop"
	httpSvc  = "shop/web:http"
	dnsSvc   = "shop/web:dns"
)

// servicesView is GET /admin/services.
type servicesView admin.ServicesView

// endpointsView is GET /admin/endpoints.
type endpointsView admin.EndpointsView

// world is the test's node, cluster and agent.
type world struct {
	t     *testing.T
	ctx   context.Context
	topo  *testnet.Topology
	c     *cluster
	agent *agentrun.Agent
}

// The scenario, end to end: a Service with annotations and an
// EndpointSlice pointing at real servers in backend namespaces; the agent
// in Kubernetes mode, with only the DaemonSet's capabilities and only the
// RBAC of deploy/, load-balances its ClusterIP; a refusing endpoint is
// ejected with a Warning Event; annotations retune it live; pod veths are
// attached and released as they come and go; a deleted Service leaves the
// maps.
func TestKubernetesMode(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for network namespaces and BPF (CI runs as root)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	w := &world{t: t, ctx: ctx, topo: testnet.New(t, testnet.Options{Backends: 3})}
	for _, b := range w.topo.Backends {
		if err := b.ServeHTTP(8080); err != nil {
			t.Fatal(err)
		}
		if err := b.ServeUDPEcho(5353); err != nil {
			t.Fatal(err)
		}
	}
	w.c = startCluster(t, w.topo.Node)

	// The agent's identity gets exactly what deploy/rbac.yaml grants.
	if out, err := w.c.kubectl("apply", "-f", filepath.Join(repoRoot, "deploy", "namespace.yaml"),
		"-f", filepath.Join(repoRoot, "deploy", "rbac.yaml")); err != nil {
		t.Fatal(err)
	} else {
		t.Logf("kubectl apply:\n%s", strings.TrimSpace(out))
	}

	// A Service configured with our annotations and Linkerd's.
	admin := w.c.Admin
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: shop}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	annotations := map[string]string{
		pbk8s.AnnotationMode:       "consecutive",
		pbk8s.AnnotationMinPenalty: "20s",
		pbk8s.AnnotationMaxPenalty: "1m",
		// No jitter: the ejection must outlast the checks that follow it.
		pbk8s.AnnotationJitterRatio:    "0",
		pbk8s.AnnotationConnectTimeout: "300ms",
	}
	annotations["balancer.linkerd.io/failure-accrual-consecutive-max-failures"] = "5" // Linkerd's spelling
	svc, err := admin.CoreV1().Services(shop).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Annotations: annotations},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "web"},
			Ports: []corev1.ServicePort{
				{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)},
				{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP, TargetPort: intstr.FromInt32(5353)},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vip := netip.MustParseAddr(svc.Spec.ClusterIP)
	if !netip.MustParsePrefix("198.18.0.0/15").Contains(vip) {
		t.Fatalf("ClusterIP %s outside the test range", vip)
	}
	t.Logf("Service shop/web has ClusterIP %s", vip)
	// No controller-manager runs: the test is the EndpointSlice controller.
	slice := endpointSlice(1, 2, 3)
	if _, err := admin.DiscoveryV1().EndpointSlices(shop).Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	w.startAgent()
	w.eventually(10*time.Second, "both ports programmed with 3 backends", func() bool {
		v := w.services()
		return len(v.service(httpSvc)) == 3 && len(v.service(dnsSvc)) == 3
	})

	step := w.steps(t)

	step("ClusterIP reaches every backend, TCP and UDP", func(t *testing.T) {
		rs, err := testnet.Load(ctx, w.topo.Client, testnet.LoadSpec{
			Target: netip.AddrPortFrom(vip, 80).String(), Rate: 100, Count: 90, ConnectTimeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if rs.Failures() > 0 || len(rs.ByBackend()) != 3 {
			t.Fatalf("through %s:80: %v, by backend %v; want all OK from b1, b2 and b3", vip, rs, rs.ByBackend())
		}
		seen := map[string]bool{}
		for range 12 {
			seen[w.udpEcho(netip.AddrPortFrom(vip, 53))] = true
		}
		if len(seen) < 2 {
			t.Errorf("12 UDP flows to %s:53 all went to %v", vip, seen)
		}
	})

	step("Prometheus finds the agent through Kubernetes service discovery, as the DaemonSet advertises", w.prometheusSD)

	step("a dual-stack Service is balanced in both families", func(t *testing.T) {
		policy := corev1.IPFamilyPolicyRequireDualStack
		ds, err := admin.CoreV1().Services(shop).Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "web46"},
			Spec: corev1.ServiceSpec{
				IPFamilyPolicy: &policy,
				IPFamilies:     []corev1.IPFamily{corev1.IPv4Protocol, corev1.IPv6Protocol},
				Selector:       map[string]string{"app": "web"},
				Ports:          []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)}},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(ds.Spec.ClusterIPs) != 2 {
			t.Fatalf("ClusterIPs %v, want one per family", ds.Spec.ClusterIPs)
		}
		for _, family := range []discoveryv1.AddressType{discoveryv1.AddressTypeIPv4, discoveryv1.AddressTypeIPv6} {
			sl := endpointSlice(1, 2, 3)
			sl.Name, sl.Labels[discoveryv1.LabelServiceName] = "web46-"+strings.ToLower(string(family)), "web46"
			sl.Ports = sl.Ports[:1]
			if family == discoveryv1.AddressTypeIPv6 {
				sl.AddressType = family
				for i := range sl.Endpoints {
					sl.Endpoints[i].Addresses = []string{w.topo.Backend(i + 1).AddrV6.String()}
				}
			}
			if _, err := admin.DiscoveryV1().EndpointSlices(shop).Create(ctx, sl, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		// The second family's desired service is named after it.
		w.eventually(10*time.Second, "both families programmed with 3 backends", func() bool {
			v := w.services()
			return len(v.service("shop/web46:http")) == 3 && len(v.service("shop/web46:http/ipv6")) == 3
		})
		for _, ip := range ds.Spec.ClusterIPs {
			rs, err := testnet.Load(ctx, w.topo.Client, testnet.LoadSpec{
				Target: netip.AddrPortFrom(netip.MustParseAddr(ip), 80).String(), Rate: 100, Count: 60, ConnectTimeout: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if rs.Failures() > 0 || len(rs.ByBackend()) != 3 {
				t.Errorf("through ClusterIP %s: %v, by backend %v; want all OK from b1, b2 and b3", ip, rs, rs.ByBackend())
			}
		}
		if err := admin.CoreV1().Services(shop).Delete(ctx, "web46", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.eventually(10*time.Second, "both families removed", func() bool {
			v := w.services()
			return len(v.service("shop/web46:http")) == 0 && len(v.service("shop/web46:http/ipv6")) == 0
		})
	})

	step("endpoint changes apply within a second and keep established flows", func(t *testing.T) {
		conn, first := w.keepAlive(netip.AddrPortFrom(vip, 80))
		defer conn.Close()
		i := int(first[1] - '0') // "b2" → 2
		rest := slices.DeleteFunc([]int{1, 2, 3}, func(x int) bool { return x == i })
		took := w.updateSlice(rest...)
		// The delay is logged (typically a few hundred ms); the wait leaves
		// room for the API server's and etcd's pauses on 2 busy cores.
		w.eventually(3*time.Second, fmt.Sprintf("b%d leaves %s", i, httpSvc), func() bool {
			return len(w.services().service(httpSvc)) == 2
		})
		t.Logf("endpoint removal programmed %v after the API write", time.Since(took).Round(time.Millisecond))
		if got := conn.get(); got != first {
			t.Fatalf("the established connection to %s now answers %q", first, got)
		}
		took = w.updateSlice(1, 2, 3)
		w.eventually(3*time.Second, "the endpoint is back", func() bool { return len(w.services().service(httpSvc)) == 3 })
		t.Logf("endpoint addition programmed %v after the API write", time.Since(took).Round(time.Millisecond))
		if got := conn.get(); got != first {
			t.Fatalf("the established connection to %s now answers %q", first, got)
		}
	})

	step("a refusing endpoint is ejected, with an Event and metrics", func(t *testing.T) {
		if err := w.topo.Backend(3).SetMode(testnet.Refuse); err != nil {
			t.Fatal(err)
		}
		// Refused SYNs are replayed by default, through BPF_PROG_RUN in
		// live-frame mode, so no client sees a refusal. A kernel that
		// refuses the mode (some hardened ones do, even to root) gets them
		// through a raw socket, with the DaemonSet's NET_RAW. Without
		// either its clients would wait for their own retransmission (1
		// s), and need a longer connect timeout to see no failure.
		replays := bpftest.Replays(t)
		connect := time.Second
		if !replays {
			connect = 3 * time.Second
		}
		rs, err := testnet.Load(ctx, w.topo.Client, testnet.LoadSpec{
			Target: netip.AddrPortFrom(vip, 80).String(), Rate: 100, Duration: 2 * time.Second, ConnectTimeout: connect})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("load while b3 refuses: %v", rs)
		if st := w.endpointState(httpSvc, "198.18.3.2:8080"); st != "ejected" {
			t.Fatalf("b3 is %q, want ejected", st)
		}
		ev := w.waitEvent("Warning", pbk8s.ReasonEndpointEjected, "shop/web-3")
		for _, want := range []string{"198.18.3.2:8080", "port http", "node " + nodeName, "refused"} {
			if !strings.Contains(ev.Message, want) {
				t.Errorf("Event message %q does not contain %q", ev.Message, want)
			}
		}
		if ev.Source.Host != nodeName || ev.InvolvedObject.UID != svc.UID {
			t.Errorf("Event source %+v, object %+v", ev.Source, ev.InvolvedObject)
		}
		out, err := w.c.kubectl("describe", "service", "web", "-n", shop)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out, pbk8s.ReasonEndpointEjected) || !strings.Contains(out, "shop/web-3") {
			t.Errorf("kubectl describe service does not show the ejection:\n%s", out)
		}
		m := w.metrics()
		if got := m.Get("penaltybox_endpoints", "svc_namespace", shop, "svc_name", "web", "svc_port", "http", "state", "ejected"); got != 1 {
			t.Errorf(`penaltybox_endpoints{service=%q,state="ejected"} = %v, want 1`, httpSvc, got)
		}
		if got := m.Get("penaltybox_endpoint_ejections_total", "svc_namespace", shop, "svc_name", "web", "svc_port", "http", "backend", "198.18.3.2:8080"); got < 1 {
			t.Errorf("penaltybox_endpoint_ejections_total of b3 = %v", got)
		}
		// The DaemonSet's capabilities allow the replays.
		if got := m.Get("penaltybox_syn_replays_total", "reason", "refused", "result", "sent"); replays && got < 5 {
			t.Errorf("penaltybox_syn_replays_total{sent} = %v, want >= 5 (maxFailures)", got)
		}
		if f := rs.Failures(); f != 0 {
			t.Errorf("%d connections failed with refused SYNs kept from their clients: %v", f, rs)
		}
	})

	step("an annotation change takes effect", func(t *testing.T) {
		start := w.annotate(pbk8s.AnnotationMode, "none")
		w.eventually(2*time.Second, "accrual mode none, b3 ready again", func() bool {
			return w.mode(httpSvc) == "none" && w.endpointState(httpSvc, "198.18.3.2:8080") == "ready"
		})
		t.Logf("annotation applied %v after the API write", time.Since(start).Round(time.Millisecond))
		ev := w.waitEvent("Normal", pbk8s.ReasonEndpointRestored, "shop/web-3")
		if !strings.Contains(ev.Message, "failure accrual was turned off") {
			t.Errorf("restore Event %q", ev.Message)
		}
	})

	step("an invalid annotation keeps the last good settings, with a Warning and a metric", func(t *testing.T) {
		w.annotate(pbk8s.AnnotationMaxFailures, "lots")
		ev := w.waitEvent("Warning", pbk8s.ReasonInvalidAnnotation, pbk8s.AnnotationMaxFailures)
		if !strings.Contains(ev.Message, `"lots"`) {
			t.Errorf("Event %q does not name the value", ev.Message)
		}
		w.eventually(5*time.Second, "the invalid-settings metric", func() bool {
			return w.metrics().Get("penaltybox_invalid_settings_total", "svc_namespace", "shop", "svc_name", "web", "key", pbk8s.AnnotationMaxFailures) == 1
		})
		if m := w.mode(httpSvc); m != "none" {
			t.Errorf("mode %q, want the last good setting (none)", m)
		}
	})

	step("a Service backed by the node's own address is left to kube-proxy", func(t *testing.T) {
		// Like the API server behind default/kubernetes on a control-plane
		// node: the backend lives in the node's network namespace, where
		// no XDP hook would see its replies.
		hostSvc, err := admin.CoreV1().Services(shop).Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "hostnet"},
			Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		sl := &discoveryv1.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{Name: "hostnet-1", Namespace: shop,
				Labels: map[string]string{discoveryv1.LabelServiceName: "hostnet"}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(corev1.ProtocolTCP)}},
			Endpoints: []discoveryv1.Endpoint{{Addresses: []string{"198.18.1.1"}, NodeName: ptr.To(nodeName),
				Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
		}
		if _, err := admin.DiscoveryV1().EndpointSlices(shop).Create(ctx, sl, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		// The Service may reach the maps alone, with no endpoints, before
		// its slice does; once the slice is seen, it must leave them, and
		// the node's own address must never be programmed.
		w.eventually(2*time.Second, "the agent to leave shop/hostnet:http to kube-proxy", func() bool {
			eps := w.services().service("shop/hostnet:http")
			if slices.Contains(eps, "198.18.1.1:8080") {
				t.Fatalf("shop/hostnet:http (ClusterIP %s) is programmed with the node's own address: %v", hostSvc.Spec.ClusterIP, eps)
			}
			return eps == nil && w.agent.LogContains("left to kube-proxy", "shop/hostnet", "shop/hostnet:http")
		})
		if err := admin.CoreV1().Services(shop).Delete(ctx, "hostnet", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	})

	step("pod veths are attached as they appear and released as they go", func(t *testing.T) {
		if _, err := w.topo.Node.Run("ip", "link", "add", "b99", "type", "veth", "peer", "name", "p99"); err != nil {
			t.Fatal(err)
		}
		pin := filepath.Join(w.agent.BPFFSRoot, "links", "b99")
		w.eventually(2*time.Second, "XDP on the new veth b99", func() bool {
			_, err := os.Stat(pin)
			return slices.Contains(w.services().Interfaces, "b99") && err == nil
		})
		if slices.Contains(w.services().Interfaces, "p99") {
			t.Errorf("p99 does not match the pod pattern but got XDP")
		}
		// A pod's packets may carry checksums left to the device: the
		// datapath must know this interface can hand it such packets.
		ifc, err := w.topo.Node.Run("cat", "/sys/class/net/b99/ifindex")
		if err != nil {
			t.Fatal(err)
		}
		partial, err := ebpf.LoadPinnedMap(filepath.Join(w.agent.BPFFSRoot, bpf.LbMapPbIfaces), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer partial.Close()
		var idx uint32
		fmt.Sscan(strings.TrimSpace(ifc), &idx)
		w.eventually(2*time.Second, "b99 in pb_ifaces, partial", func() bool {
			var v bpf.LbIface
			return partial.Lookup(idx, &v) == nil && v.Flags&1 != 0
		})
		if _, err := w.topo.Node.Run("ip", "link", "del", "b99"); err != nil {
			t.Fatal(err)
		}
		w.eventually(2*time.Second, "b99 released", func() bool {
			_, err := os.Stat(pin)
			return !slices.Contains(w.services().Interfaces, "b99") && os.IsNotExist(err)
		})
	})

	step("a deleted Service leaves the maps", func(t *testing.T) {
		v := w.services()
		var ids, backends []uint32
		for _, s := range v.Services {
			if strings.HasPrefix(s.Name, "shop/") {
				ids = append(ids, s.ID)
				for _, b := range s.Backends {
					backends = append(backends, b.ID)
				}
			}
		}
		if n := w.maglevTables(); n == 0 {
			t.Fatal("pb_maglev holds no table before the Service is deleted")
		}
		if err := admin.CoreV1().Services(shop).Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := admin.DiscoveryV1().EndpointSlices(shop).Delete(ctx, "web-1", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.eventually(2*time.Second, "shop/web gone from the agent", func() bool {
			for _, s := range w.services().Services {
				if strings.HasPrefix(s.Name, "shop/") {
					return false
				}
			}
			return true
		})
		w.checkMapsWithout(vip, ids, backends)
	})
}

// steps returns the runner of t's steps. Each step builds on the one
// before (a failed step ends the test), and the world's helpers report to
// the running step's t.
func (w *world) steps(t *testing.T) func(name string, f func(t *testing.T)) {
	return func(name string, f func(t *testing.T)) {
		ok := t.Run(name, func(st *testing.T) {
			w.t = st
			defer func() { w.t = t }()
			f(st)
		})
		if !ok {
			t.FailNow()
		}
	}
}

// startAgent runs the agent in Kubernetes mode in the node namespace, with
// the DaemonSet's capabilities only.
func (w *world) startAgent() {
	w.agent = startK8sAgent(w.t, w.ctx, w.topo.Node, w.c.AgentKubeconfig, nodeName,
		"--pod-interfaces", "cl*,b*", "--node-interfaces", "")
}

// startK8sAgent runs the agent in Kubernetes mode as node in ns, with
// exactly the capabilities deploy/daemonset.yaml adds, and fails the test
// at its end if the agent logged an error.
func startK8sAgent(t *testing.T, ctx context.Context, ns *testnet.NS, kubeconfig, node string, args ...string) *agentrun.Agent {
	t.Helper()
	dir := t.TempDir()
	caps := daemonSetCapabilities(t)
	wrapper := filepath.Join(dir, "agent-with-caps")
	script := fmt.Sprintf("#!/bin/sh\nexec setpriv --bounding-set=-all,%s --inh-caps=-all %s \"$@\"\n", caps, agentBin)
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	a, err := agentrun.New(wrapper, ns, dir, "")
	if err != nil {
		t.Fatal(err)
	}
	// Every Service, unless the test says: the scenarios here predate the
	// opt-in scope, which has tests of its own.
	if !slices.Contains(args, "--scope") {
		args = append([]string{"--scope", "all"}, args...)
	}
	a.Args = append([]string{"--node-name", node, "--kubeconfig", kubeconfig, "--log-level", "debug"}, args...)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("agent %s log tail:\n%s", node, a.LogTail(60))
		}
		// Nothing in the scenarios is an agent error; warnings are shown.
		b, _ := os.ReadFile(a.LogPath())
		for _, line := range strings.Split(string(b), "\n") {
			switch {
			case strings.Contains(line, `"level":"ERROR"`) && strings.Contains(line, "operation not permitted"):
				t.Errorf("the agent needs a capability deploy/daemonset.yaml does not grant (it runs with exactly %s): %s", caps, line)
			case strings.Contains(line, `"level":"ERROR"`):
				t.Errorf("agent %s logged an error: %s", node, line)
			case strings.Contains(line, `"level":"WARN"`) && strings.Contains(line, "conntrack sweep"):
				// Its programs (pb_ct_expire_run, pb_ct_sweep_run) need no
				// capability beyond the DaemonSet's.
				t.Errorf("agent %s: a conntrack sweep program refused or failed with exactly %s: %s", node, caps, line)
			case strings.Contains(line, `"level":"WARN"`):
				t.Logf("agent %s warning: %s", node, line)
			}
		}
		if err := a.Close(); err != nil {
			t.Logf("agent close: %v", err)
		}
	})
	start := time.Now()
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("agent %s ready in %v with capabilities %s (%s)", node, time.Since(start).Round(time.Millisecond), caps, agentCapEff(a))
	return a
}

// shippedDaemonSet is deploy/daemonset.yaml, parsed strictly.
func shippedDaemonSet(t *testing.T) *appsv1.DaemonSet {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, "deploy", "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var ds appsv1.DaemonSet
	if err := yaml.UnmarshalStrict(b, &ds); err != nil {
		t.Fatal(err)
	}
	return &ds
}

// daemonSetCapabilities reads the capabilities deploy/daemonset.yaml adds,
// in setpriv's spelling ("+bpf,+net_admin,...").
func daemonSetCapabilities(t *testing.T) string {
	sc := shippedDaemonSet(t).Spec.Template.Spec.Containers[0].SecurityContext
	if sc == nil || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) == 0 {
		t.Fatalf("daemonset.yaml: want capabilities drop [ALL] and an add list, got %+v", sc)
	}
	var out []string
	for _, c := range sc.Capabilities.Add {
		out = append(out, "+"+strings.ToLower(strings.TrimPrefix(string(c), "CAP_")))
	}
	return strings.Join(out, ",")
}

// agentCapEff finds the agent process by its bpffs root and returns its
// effective capability mask, as evidence in the log.
func agentCapEff(a *agentrun.Agent) string {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !bytes.Contains(b, []byte(a.BPFFSRoot)) || bytes.Contains(b, []byte("setpriv")) {
			continue
		}
		st, err := os.ReadFile(filepath.Join(filepath.Dir(p), "status"))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(st), "\n") {
			if strings.HasPrefix(line, "CapEff:") {
				return strings.Join(strings.Fields(line), " ")
			}
		}
	}
	return "CapEff unknown"
}

// endpointSlice is the Service's slice with backends i (1..3): pod
// shop/web-i at 198.18.i.2 on this node.
func endpointSlice(backends ...int) *discoveryv1.EndpointSlice {
	sl := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "web-1", Namespace: shop,
			Labels: map[string]string{discoveryv1.LabelServiceName: "web"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports: []discoveryv1.EndpointPort{
			{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(corev1.ProtocolTCP)},
			{Name: ptr.To("dns"), Port: ptr.To[int32](5353), Protocol: ptr.To(corev1.ProtocolUDP)},
		},
	}
	for _, i := range backends {
		sl.Endpoints = append(sl.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{fmt.Sprintf("198.18.%d.2", i)},
			Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)},
			NodeName:   ptr.To(nodeName),
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: shop, Name: fmt.Sprintf("web-%d", i)},
		})
	}
	return sl
}

// updateSlice sets the slice's endpoints and returns when the API server
// took the write.
func (w *world) updateSlice(backends ...int) time.Time {
	w.t.Helper()
	cur, err := w.c.Admin.DiscoveryV1().EndpointSlices(shop).Get(w.ctx, "web-1", metav1.GetOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	cur.Endpoints = endpointSlice(backends...).Endpoints
	if _, err := w.c.Admin.DiscoveryV1().EndpointSlices(shop).Update(w.ctx, cur, metav1.UpdateOptions{}); err != nil {
		w.t.Fatal(err)
	}
	return time.Now()
}

// annotate sets one annotation on the Service (a merge patch, as
// `kubectl annotate` does) and returns when the API server took it.
func (w *world) annotate(key, value string) time.Time {
	w.t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, key, value)
	if _, err := w.c.Admin.CoreV1().Services(shop).Patch(w.ctx, "web", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		w.t.Fatal(err)
	}
	return time.Now()
}

func (w *world) services() servicesView { return agentServices(w.t, w.ctx, w.agent) }

// agentServices is a's /admin/services.
func agentServices(t *testing.T, ctx context.Context, a *agentrun.Agent) servicesView {
	t.Helper()
	var v servicesView
	if err := a.JSON(ctx, "/admin/services", &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// service returns the endpoints of the named service (nil if absent).
func (v servicesView) service(name string) []string {
	for _, s := range v.Services {
		if s.Name == name {
			out := []string{}
			for _, b := range s.Backends {
				out = append(out, b.Endpoint)
			}
			return out
		}
	}
	return nil
}

func (w *world) endpoints() endpointsView { return agentEndpoints(w.t, w.ctx, w.agent) }

// agentEndpoints is a's /admin/endpoints.
func agentEndpoints(t *testing.T, ctx context.Context, a *agentrun.Agent) endpointsView {
	t.Helper()
	var v endpointsView
	if err := a.JSON(ctx, "/admin/endpoints", &v); err != nil {
		t.Fatal(err)
	}
	return v
}

func (w *world) endpointState(service, ep string) string {
	return endpointState(w.t, w.ctx, w.agent, service, ep)
}

// endpointState is ep's accrual state in service as a reports it, "" if
// a does not know it.
func endpointState(t *testing.T, ctx context.Context, a *agentrun.Agent, service, ep string) string {
	t.Helper()
	for _, s := range agentEndpoints(t, ctx, a).Services {
		if s.Service != service {
			continue
		}
		for _, e := range s.Endpoints {
			if e.Endpoint == ep {
				return e.State
			}
		}
	}
	return ""
}

func (w *world) mode(service string) string {
	for _, s := range w.endpoints().Services {
		if s.Service == service {
			return string(s.Mode)
		}
	}
	return ""
}

func (w *world) metrics() agentrun.Metrics {
	w.t.Helper()
	m, err := w.agent.Metrics(w.ctx)
	if err != nil {
		w.t.Fatal(err)
	}
	return m
}

// waitEvent waits for an Event on Service shop/web with the given type and
// reason whose message contains sub.
func (w *world) waitEvent(typ, reason, sub string) corev1.Event {
	w.t.Helper()
	var found corev1.Event
	w.eventually(10*time.Second, fmt.Sprintf("%s Event %s mentioning %q on shop/web", typ, reason, sub), func() bool {
		l, err := w.c.Admin.CoreV1().Events(shop).List(w.ctx, metav1.ListOptions{
			FieldSelector: "involvedObject.kind=Service,involvedObject.name=web"})
		if err != nil {
			w.t.Fatal(err)
		}
		for _, e := range l.Items {
			if e.Type == typ && e.Reason == reason && strings.Contains(e.Message, sub) {
				found = e
				return true
			}
		}
		return false
	})
	w.t.Logf("Event: %s %s %q (from %s/%s)", found.Type, found.Reason, found.Message, found.Source.Component, found.Source.Host)
	return found
}

// udpEcho sends one datagram on a new flow and returns the answering
// backend's name.
func (w *world) udpEcho(to netip.AddrPort) string {
	w.t.Helper()
	c, err := w.topo.Client.DialContext(w.ctx, "udp", to.String())
	if err != nil {
		w.t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		w.t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	if err != nil {
		w.t.Fatalf("UDP echo through %s: %v", to, err)
	}
	name, payload, _ := strings.Cut(string(buf[:n]), "\n")
	if payload != "ping" {
		w.t.Fatalf("UDP echo %q", buf[:n])
	}
	return name
}

// httpConn is one keep-alive HTTP connection through the VIP.
type httpConn struct {
	t *testing.T
	net.Conn
	r *bufio.Reader
}

func (w *world) keepAlive(to netip.AddrPort) (*httpConn, string) {
	w.t.Helper()
	c, err := w.topo.Client.DialContext(w.ctx, "tcp", to.String())
	if err != nil {
		w.t.Fatal(err)
	}
	hc := &httpConn{t: w.t, Conn: c, r: bufio.NewReader(c)}
	return hc, hc.get()
}

// get sends a request and returns the answering backend ("b1", ...).
func (c *httpConn) get() string {
	c.t.Helper()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte("GET / HTTP/1.1\r\nHost: web\r\n\r\n")); err != nil {
		c.t.Fatalf("established connection: write: %v", err)
	}
	resp, err := http.ReadResponse(c.r, nil)
	if err != nil {
		c.t.Fatalf("established connection: read: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// checkMapsWithout asserts, on the pinned maps themselves, that a deleted
// Service left them: no pb_services key holds its ClusterIP, no Maglev
// table remains, and its backends are retired (kept only for flows still
// using them, freed by the sweep after a cooldown). What is left in
// pb_services is exactly what the agent reports: the API server's own
// default/kubernetes Service, which has no endpoints here.
func (w *world) checkMapsWithout(vip netip.Addr, ids, backends []uint32) {
	t := w.t
	root := w.agent.BPFFSRoot
	open := func(name string) *ebpf.Map {
		m, err := ebpf.LoadPinnedMap(filepath.Join(root, name), nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	svcs := open(bpf.LbMapPbServices)
	var key, value []byte
	n := 0
	ip := vip.As4()
	for it := svcs.Iterate(); it.Next(&key, &value); {
		n++
		if bytes.Contains(key, ip[:]) {
			t.Errorf("pb_services still has a key with %s: % x", vip, key)
		}
	}
	if want := len(w.services().Services); n != want {
		t.Errorf("pb_services has %d entries, the agent reports %d services", n, want)
	}
	// Only default/kubernetes is left, and it has no endpoints: no Maglev
	// table may remain at all.
	if n := w.maglevTables(); n != 0 {
		t.Errorf("pb_maglev holds %d tables after the only Service with endpoints was deleted", n)
	}
	bes := open(bpf.LbMapPbBackends)
	for _, id := range backends {
		var b bpf.LbBackend
		if err := bes.Lookup(id, &b); err != nil {
			continue // already freed
		}
		if st := maps.BackendState(b.State); st != maps.BackendRemoved {
			t.Errorf("backend %d of the deleted Service is %v, want removed", id, st)
		}
	}
	t.Logf("pinned maps: pb_services has %d entries (none for %s), no Maglev table, backends %v (of service ids %v) retired",
		n, vip, backends, ids)
}

// maglevTables counts the tables in pb_maglev (populated slots: no
// knowledge of how tables are keyed needed).
func (w *world) maglevTables() int {
	w.t.Helper()
	outer, err := ebpf.LoadPinnedMap(filepath.Join(w.agent.BPFFSRoot, bpf.LbMapPbMaglev), nil)
	if err != nil {
		w.t.Fatal(err)
	}
	defer outer.Close()
	var k, id uint32
	n := 0
	it := outer.Iterate()
	for it.Next(&k, &id) {
		n++
	}
	if err := it.Err(); err != nil {
		w.t.Fatalf("pb_maglev: %v", err)
	}
	return n
}

func (w *world) eventually(d time.Duration, what string, cond func() bool) {
	w.t.Helper()
	waitFor(w.t, w.ctx, d, what, cond)
}

// waitFor polls cond every 20 ms until it holds, failing the test after d
// or when ctx ends.
func waitFor(t *testing.T, ctx context.Context, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) || ctx.Err() != nil {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
