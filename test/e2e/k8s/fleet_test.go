// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/testnet"
	pbadmin "github.com/penaltybox/penaltybox/pkg/admin"
	pbk8s "github.com/penaltybox/penaltybox/pkg/k8s"
)

// TestPodNetworks: three nodes, one agent each in Kubernetes mode (as the
// DaemonSet runs it: the node's name, the DaemonSet's capabilities, the
// default pod and tunnel interface patterns, the uplink eth0 as the node's
// interface) against one API server, on a routed pod
// network and on a flannel-style VXLAN overlay. Pod 1 of each node is a
// client, pod 2 a backend of one Service. Asserted on each network: 1,000
// connections from node 1's client through the ClusterIP all succeed and
// reach the backends on all three nodes (two of them across nodes), the
// other way too (node 3's client); with the backend on node 3 refusing,
// node 1's agent ejects it (an Event naming the pod and node 1) and node
// 1's clients keep succeeding; healed, it rejoins on node 1 through a
// probe across the pod network and serves again; and node 1's circuit
// breaker caps live flows to pods on other nodes and gets its slots back as
// they end.
func TestPodNetworks(t *testing.T) {
	for _, pn := range []testnet.PodNetwork{testnet.Routed, testnet.VXLAN} {
		t.Run(string(pn), func(t *testing.T) { podNetwork(t, pn, true) })
	}
	// The control: without XDP on the tunnel, the replies from pods on
	// other nodes go back to the client unrewritten, from the pod's own
	// address, and those connections fail; only node 1's own backend
	// answers.
	t.Run("vxlan-without-tunnel-xdp", func(t *testing.T) { podNetwork(t, testnet.VXLAN, false) })
}

func podNetwork(t *testing.T, pn testnet.PodNetwork, tunnelXDP bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	f := testnet.NewFleet(t, testnet.FleetOptions{Nodes: 3, PodsPerNode: 2, Network: pn})
	c := startClusterOn(t, f.Fabric, testnet.FabricAddr.String())
	if _, err := c.kubectl("apply", "-f", filepath.Join(repoRoot, "deploy", "namespace.yaml"),
		"-f", filepath.Join(repoRoot, "deploy", "rbac.yaml")); err != nil {
		t.Fatal(err)
	}
	admin := c.Admin
	target, backends := webOnFleet(t, ctx, admin, f, map[string]string{
		pbk8s.AnnotationMode:        "consecutive",
		pbk8s.AnnotationMaxFailures: "5",
		pbk8s.AnnotationMinPenalty:  "3s",
		pbk8s.AnnotationJitterRatio: "0",
	})

	agents := make([]*agentrun.Agent, len(f.Nodes))
	for i, n := range f.Nodes {
		args := []string{"--node-interfaces", "eth0"}
		if !tunnelXDP {
			args = append(args, "--tunnel-interfaces", "")
		}
		agents[i] = startK8sAgent(t, ctx, n.NS, c.AgentKubeconfig, fleetNodeName(n), args...)
	}
	for i, a := range agents {
		waitFor(t, ctx, 20*time.Second, fmt.Sprintf("node %d: the Service programmed with 3 backends", i+1), func() bool {
			return len(agentServices(t, ctx, a).service(httpSvc)) == 3
		})
		if pn == testnet.VXLAN && tunnelXDP {
			var v struct {
				Interfaces []string `json:"interfaces"`
			}
			if err := a.JSON(ctx, "/admin/services", &v); err != nil || !slices.Contains(v.Interfaces, testnet.Tunnel) {
				t.Errorf("node %d: XDP on %v (%v), want %s among them", i+1, v.Interfaces, err, testnet.Tunnel)
			}
		}
	}

	load := func(from *testnet.FleetNode, n int) testnet.Results {
		t.Helper()
		rs, err := testnet.Load(ctx, from.Pods[0].NS, testnet.LoadSpec{Target: target, Rate: 200, Count: n,
			ConnectTimeout: 2 * time.Second, RequestTimeout: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		return rs
	}
	served := func(rs testnet.Results) map[string]int { return rs.ByBackend() }
	if !tunnelXDP {
		rs := load(f.Node(1), 300)
		by := served(rs)
		t.Logf("without XDP on %s: %d of 300 connections from node 1 succeeded, by backend %v", testnet.Tunnel, rs.Count(testnet.OK), by)
		if by[f.Node(2).Pods[1].Name]+by[f.Node(3).Pods[1].Name] != 0 || by[f.Node(1).Pods[1].Name] == 0 {
			t.Errorf("without XDP on the tunnel, want only node 1's backend to answer: %v", rs)
		}
		return
	}
	for _, from := range []int{1, 3} {
		n := 1000
		if from == 3 {
			n = 300
		}
		rs := load(f.Node(from), n)
		by := served(rs)
		t.Logf("%s: %d connections from node %d's client: %d succeeded, by backend %v", pn, n, from, rs.Count(testnet.OK), by)
		if rs.Count(testnet.OK) != n {
			t.Errorf("%d of %d connections from node %d failed: %v", n-rs.Count(testnet.OK), n, from, rs)
		}
		for _, node := range f.Nodes {
			if by[node.Pods[1].Name] == 0 {
				t.Errorf("no connection from node %d reached the backend on node %d", from, node.Index)
			}
		}
	}

	// Node 3's backend refuses: node 1's agent ejects it, from the replies
	// that came back across the pod network.
	bad := f.Node(3).Pods[1]
	if err := bad.SetMode(testnet.Refuse); err != nil {
		t.Fatal(err)
	}
	rs := load(f.Node(1), 300)
	waitFor(t, ctx, 10*time.Second, "node 1's agent holds node 3's backend ejected", func() bool {
		return endpointState(t, ctx, agents[0], httpSvc, backends[2]) == "ejected"
	})
	waitFor(t, ctx, 20*time.Second, "an Event naming web-3 ejected on node1", func() bool {
		evs, err := admin.CoreV1().Events(shop).List(ctx, metav1.ListOptions{FieldSelector: "reason=" + pbk8s.ReasonEndpointEjected})
		if err != nil {
			return false
		}
		for _, e := range evs.Items {
			if strings.Contains(e.Message, "web-3") && strings.Contains(e.Message, "on node "+fleetNodeName(f.Node(1))) {
				t.Logf("Event: %s", e.Message)
				return true
			}
		}
		return false
	})
	after := load(f.Node(1), 300)
	t.Logf("%s: with node 3's backend refusing: %d of 300 succeeded after the ejection (%d of 300 before it), by backend %v",
		pn, after.Count(testnet.OK), rs.Count(testnet.OK), served(after))
	if after.Count(testnet.OK) != 300 {
		t.Errorf("%d of 300 connections failed after the ejection: %v", 300-after.Count(testnet.OK), after)
	}

	// Healed, it rejoins on node 1 through a probe that crossed the pod
	// network, and serves node 1's clients again.
	if err := bad.SetMode(testnet.Serve); err != nil {
		t.Fatal(err)
	}
	waitFor(t, ctx, 30*time.Second, "node 1's agent readmits node 3's backend", func() bool {
		load(f.Node(1), 20) // new flows, one of them the probe
		return endpointState(t, ctx, agents[0], httpSvc, backends[2]) == "ready"
	})
	rejoined := load(f.Node(1), 300)
	t.Logf("%s: healed: %d of 300 succeeded, by backend %v", pn, rejoined.Count(testnet.OK), served(rejoined))
	if rejoined.Count(testnet.OK) != 300 || served(rejoined)[bad.Name] == 0 {
		t.Errorf("after the rejoin: %v, want all 300 to succeed and some on %s", rejoined, bad.Name)
	}

	// The circuit breaker across nodes: only the backends on nodes 2 and
	// 3, holding every connection open, and at most 10 live flows. Node
	// 1's agent lets exactly 10 of 25 concurrent connections through and
	// refuses the rest; once the connections end (the ends seen across the
	// pod network give the slots back), 10 more get through.
	for _, i := range []int{2, 3} {
		if err := f.Node(i).Pods[1].SetMode(testnet.Hold); err != nil {
			t.Fatal(err)
		}
	}
	cur, err := admin.DiscoveryV1().EndpointSlices(shop).Get(ctx, "web-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cur.Endpoints = cur.Endpoints[1:]
	if _, err := admin.DiscoveryV1().EndpointSlices(shop).Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"10"}}}`, pbk8s.AnnotationMaxInflight)
	if _, err := admin.CoreV1().Services(shop).Patch(ctx, "web", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	var cb pbadmin.CircuitBreakersView
	defer func() {
		if t.Failed() {
			t.Logf("node 1's circuit breakers: %+v", cb)
		}
	}()
	waitFor(t, ctx, 10*time.Second, "node 1: 2 backends and the limit programmed", func() bool {
		return len(agentServices(t, ctx, agents[0]).service(httpSvc)) == 2 &&
			agents[0].JSON(ctx, "/admin/circuit_breakers", &cb) == nil && webBreaker(cb).MaxInflight == 10
	})
	burst := func(n int) (ok, refused int) {
		t.Helper()
		conns := make([]net.Conn, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				conns[i], errs[i] = f.Node(1).Pods[0].Dialer(3*time.Second).DialContext(ctx, "tcp", target)
			}()
		}
		wg.Wait()
		for i := range n {
			switch {
			case errs[i] == nil:
				ok++
				conns[i].Close()
			case errors.Is(errs[i], syscall.ECONNREFUSED):
				refused++
			default:
				t.Errorf("connect: %v", errs[i])
			}
		}
		return ok, refused
	}
	ok, refused := burst(25)
	t.Logf("%s: breaker: %d of 25 concurrent connections to pods on other nodes got through, %d refused by node 1", pn, ok, refused)
	if ok != 10 || refused != 15 {
		t.Errorf("breaker: %d connected and %d refused, want exactly 10 and 15", ok, refused)
	}
	// The backends end the held connections (once they have accepted all
	// of them): their FINs come back across the pod network, where node
	// 1's datapath sees them end.
	waitFor(t, ctx, 10*time.Second, "the backends hold the connections that got through", func() bool {
		return f.Node(2).Pods[1].Stats().Held+f.Node(3).Pods[1].Stats().Held == ok
	})
	for _, i := range []int{2, 3} {
		f.Node(i).Pods[1].CloseHeld()
	}
	waitFor(t, ctx, 10*time.Second, "node 1's breaker back to 0 in flight", func() bool {
		return agents[0].JSON(ctx, "/admin/circuit_breakers", &cb) == nil && webBreaker(cb).MaxInflight == 10 && webBreaker(cb).Inflight == 0
	})
	if ok, refused := burst(10); ok != 10 || refused != 0 {
		t.Errorf("after the slots came back: %d connected and %d refused, want 10 and 0", ok, refused)
	}
}

// webOnFleet serves HTTP on pod 2 of every node and creates the Service
// shop/web (port http, 80 → 8080) with annotations ann and one
// EndpointSlice of those pods. It returns the ClusterIP:80 to dial and the
// backends, ip:8080, by node.
func webOnFleet(t *testing.T, ctx context.Context, admin kubernetes.Interface, f *testnet.Fleet, ann map[string]string) (target string, backends []string) {
	t.Helper()
	for _, n := range f.Nodes {
		if err := n.Pods[1].ServeHTTP(8080); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: shop}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	svc, err := admin.CoreV1().Services(shop).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Annotations: ann},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "web"},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "web-1", Namespace: shop, Labels: map[string]string{discoveryv1.LabelServiceName: "web"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}
	for _, n := range f.Nodes {
		backends = append(backends, fleetBackend(n).String()+":8080")
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{fleetBackend(n).String()},
			Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)},
			NodeName:   ptr.To(fleetNodeName(n)),
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: shop, Name: fmt.Sprintf("web-%d", n.Index)},
		})
	}
	if _, err := admin.DiscoveryV1().EndpointSlices(shop).Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return netip.AddrPortFrom(netip.MustParseAddr(svc.Spec.ClusterIP), 80).String(), backends
}

// fleetBackend is the address of node n's pod 2, the Service's backend.
func fleetBackend(n *testnet.FleetNode) netip.Addr { return n.PodCIDR.Addr().Next().Next().Next() }

func webBreaker(v pbadmin.CircuitBreakersView) pbadmin.CircuitBreaker {
	for _, s := range v.Services {
		if s.Service == httpSvc {
			return s
		}
	}
	return pbadmin.CircuitBreaker{}
}

// fleetNodeName is node n's Kubernetes name.
func fleetNodeName(n *testnet.FleetNode) string { return fmt.Sprintf("node%d", n.Index) }
