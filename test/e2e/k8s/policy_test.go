// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"

	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/admin"
	pbk8s "github.com/penaltybox/penaltybox/pkg/k8s"
)

// BackendPolicies against the real API server: the CRD from deploy/
// installs and documents itself to kubectl explain; invalid policies are
// refused with the field named; a policy's limit reaches the datapath
// (maxInflightRequests 20: exactly 20 of 50 concurrent clients served);
// two policies on one Service give the oldest, with status on both;
// removing policies falls back to the annotation, then to the default.
func TestBackendPolicy(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for network namespaces and BPF (CI runs as root)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	w := &world{t: t, ctx: ctx, topo: testnet.New(t, testnet.Options{Backends: 3})}
	for _, b := range w.topo.Backends {
		if err := b.ServeHTTP(8080); err != nil {
			t.Fatal(err)
		}
	}
	w.c = startCluster(t, w.topo.Node)
	deploy := func(name string) string { return filepath.Join(repoRoot, "deploy", name) }
	if out, err := w.c.kubectl("apply", "-f", deploy("namespace.yaml"), "-f", deploy("backendpolicy-crd.yaml"),
		"-f", deploy("rbac.yaml")); err != nil {
		t.Fatal(err)
	} else if strings.Contains(out, "Warning:") {
		t.Errorf("kubectl apply warned:\n%s", out)
	}
	if out, err := w.c.kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd/backendpolicies.policy.penaltybox.io"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	dyn, err := dynamic.NewForConfig(w.c.RestConfig(w.c.AdminToken))
	if err != nil {
		t.Fatal(err)
	}
	policies := dyn.Resource(pbk8s.PolicyGVR).Namespace(shop)
	dir := t.TempDir()
	// kubectlPolicy applies a policy written in YAML, as a user would.
	kubectlPolicy := func(name, spec string) (string, error) {
		doc := fmt.Sprintf("apiVersion: policy.penaltybox.io/v1alpha1\nkind: BackendPolicy\nmetadata:\n  name: %s\n  namespace: %s\nspec:\n%s", name, shop, spec)
		f := filepath.Join(dir, name+".yaml")
		if err := os.WriteFile(f, []byte(doc), 0o600); err != nil {
			t.Fatal(err)
		}
		return w.c.kubectl("apply", "-f", f)
	}

	step := w.steps(t)

	step("kubectl explain documents the fields", func(t *testing.T) {
		// The API server publishes a new CRD's schema a moment after it
		// is established.
		var out string
		w.eventually(15*time.Second, "kubectl explain backendpolicy", func() bool {
			out, err = w.c.kubectl("explain", "backendpolicy.spec.failureAccrual.minPenalty")
			return err == nil
		})
		if !strings.Contains(out, "First ejection's penalty") {
			t.Errorf("kubectl explain minPenalty:\n%s", out)
		}
		out, err = w.c.kubectl("explain", "backendpolicy.spec.circuitBreaker")
		if err != nil || !strings.Contains(out, "maxInflightRequests") {
			t.Errorf("kubectl explain circuitBreaker (%v):\n%s", err, out)
		}
	})

	if _, err := w.c.Admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: shop}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	step("invalid policies are refused, naming the field", func(t *testing.T) {
		target := "  targetRefs: [{group: \"\", kind: Service, name: web}]\n"
		for _, c := range []struct{ spec, want string }{
			{target + "  failureAccrual: {minPenalty: 2m, maxPenalty: 1m}\n", "spec.failureAccrual.minPenalty"},
			{target + "  failureAccrual: {maxFailures: 0}\n", "spec.failureAccrual.maxFailures"},
			{target + "  failureAccrual: {minPenalty: soon}\n", "spec.failureAccrual.minPenalty"},
			{target + "  failureAccrual: {failureRateThreshold: 0.2, successRateThreshold: 0.8}\n", "spec.failureAccrual.successRateThreshold"},
			{target + "  failureAccrual: {jitterRatio: 1.5}\n", "spec.failureAccrual.jitterRatio"},
			{target + "  circuitBreaker: {maxInflightRequests: -1}\n", "spec.circuitBreaker.maxInflightRequests"},
			{"  targetRefs: [{group: apps, kind: Deployment, name: web}]\n", "spec.targetRefs[0].kind"},
			{"  failureAccrual: {maxFailures: 3}\n", "spec.targetRefs"},
		} {
			out, err := kubectlPolicy("bad", c.spec)
			if err == nil {
				t.Errorf("accepted:\n%s", c.spec)
				continue
			}
			t.Logf("refused: %s", strings.TrimSpace(out))
			if !strings.Contains(out, c.want) {
				t.Errorf("refusal of\n%sdoes not name %s:\n%s", c.spec, c.want, out)
			}
		}
		if l, err := policies.List(ctx, metav1.ListOptions{}); err != nil || len(l.Items) != 0 {
			t.Fatalf("policies stored: %v (%v)", l, err)
		}
	})

	// The Service's annotation says 40; the policy will say 20.
	svc, err := w.c.Admin.CoreV1().Services(shop).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Annotations: map[string]string{pbk8s.AnnotationMaxInflight: "40"}},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "web"}, Ports: []corev1.ServicePort{
			{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vip := netip.MustParseAddr(svc.Spec.ClusterIP)
	sl := endpointSlice(1, 2, 3)
	sl.Ports = sl.Ports[:1]
	if _, err := w.c.Admin.DiscoveryV1().EndpointSlices(shop).Create(ctx, sl, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if out, err := kubectlPolicy("limits", "  targetRefs: [{group: \"\", kind: Service, name: web}]\n  circuitBreaker: {maxInflightRequests: 20}\n"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	w.startAgent()
	limit := func() uint32 {
		var v admin.CircuitBreakersView
		if err := w.agent.JSON(ctx, "/admin/circuit_breakers", &v); err != nil {
			t.Fatal(err)
		}
		return v.BackendMaxInflightRequests[httpSvc]
	}
	// The agent's first state already has the policy's limit.
	if got := limit(); got != 20 {
		t.Fatalf("limit %d at start, want the policy's 20", got)
	}
	accepted := func(name string) (status, reason, message string) {
		u, err := policies.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p, err := pbk8s.DecodePolicy(u)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range p.Status.Ancestors {
			if a.ControllerName == pbk8s.ControllerName && a.AncestorRef.Name == "web" {
				for _, c := range a.Conditions {
					if c.Type == pbk8s.ConditionAccepted {
						return string(c.Status), c.Reason, c.Message
					}
				}
			}
		}
		return "", "", ""
	}
	w.eventually(20*time.Second, "policy limits Accepted", func() bool {
		s, _, _ := accepted("limits")
		return s == "True"
	})
	if out, err := w.c.kubectl("get", "backendpolicies", "-n", shop); err != nil || !strings.Contains(out, "True") {
		t.Errorf("kubectl get backendpolicies (%v):\n%s", err, out)
	} else {
		t.Logf("kubectl get backendpolicies:\n%s", out)
	}

	step("maxInflightRequests 20: 20 of 50 concurrent clients served", func(t *testing.T) {
		for _, b := range w.topo.Backends {
			b.SetMode(testnet.Hold)
		}
		conns := make([]net.Conn, 50)
		errs := make([]error, 50)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range conns {
			wg.Go(func() {
				<-start
				conns[i], errs[i] = w.topo.Client.Dialer(3*time.Second).DialContext(ctx, "tcp", netip.AddrPortFrom(vip, 80).String())
			})
		}
		close(start)
		wg.Wait()
		var ok, refused int
		for i, err := range errs {
			switch {
			case err == nil:
				ok++
				defer conns[i].Close()
			case errors.Is(err, syscall.ECONNREFUSED):
				refused++
			default:
				t.Errorf("connect: %v", err)
			}
		}
		if ok != 20 || refused != 30 {
			t.Fatalf("%d connected and %d refused, want exactly 20 and 30", ok, refused)
		}
		var v admin.CircuitBreakersView
		if err := w.agent.JSON(ctx, "/admin/circuit_breakers", &v); err != nil {
			t.Fatal(err)
		}
		if v.BackendInflightCurrent[httpSvc] != 20 || v.RejectedBackendByName[httpSvc] != 30 || v.RejectedBackendTotal != 30 {
			t.Errorf("circuit_breakers: inflight %v, rejected %v (total %d); want 20 and 30",
				v.BackendInflightCurrent, v.RejectedBackendByName, v.RejectedBackendTotal)
		}
	})

	step("a second policy on the Service: the older stays in force", func(t *testing.T) {
		time.Sleep(1100 * time.Millisecond) // creation timestamps have 1s resolution
		if out, err := kubectlPolicy("newer", "  targetRefs: [{group: \"\", kind: Service, name: web}]\n  circuitBreaker: {maxInflightRequests: 5}\n"); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		w.eventually(10*time.Second, "policy newer Conflicted", func() bool {
			_, r, _ := accepted("newer")
			return r == pbk8s.ReasonConflicted
		})
		if s, r, _ := accepted("limits"); s != "True" {
			t.Errorf("limits: %s %s, want still Accepted", s, r)
		}
		_, _, msg := accepted("newer")
		if !strings.Contains(msg, "shop/limits") {
			t.Errorf("Conflicted message %q does not name the policy in force", msg)
		}
		if got := limit(); got != 20 {
			t.Errorf("limit %d, want the older policy's 20", got)
		}
		// The older goes: the newer is in force and says so.
		if err := policies.Delete(ctx, "limits", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.eventually(5*time.Second, "the newer policy's limit", func() bool { return limit() == 5 })
		w.eventually(10*time.Second, "policy newer Accepted", func() bool {
			s, _, _ := accepted("newer")
			return s == "True"
		})
	})

	step("without policies the annotation, then the default", func(t *testing.T) {
		if err := policies.Delete(ctx, "newer", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.eventually(5*time.Second, "the annotation's limit", func() bool { return limit() == 40 })
		if _, err := w.c.Admin.CoreV1().Services(shop).Patch(ctx, "web", "application/merge-patch+json",
			[]byte(`{"metadata":{"annotations":{"`+pbk8s.AnnotationMaxInflight+`":null}}}`), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		w.eventually(5*time.Second, "the default limit (none)", func() bool { return limit() == 0 })
	})

	step("a policy invalid over the defaults: Invalid, the settings in force stay", func(t *testing.T) {
		// Valid to the schema (no maxPenalty to compare with), not over
		// the default maxPenalty of 1m.
		if out, err := kubectlPolicy("slow", "  targetRefs: [{group: \"\", kind: Service, name: web}]\n  failureAccrual: {minPenalty: 2m}\n  circuitBreaker: {maxInflightRequests: 7}\n"); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		w.eventually(10*time.Second, "policy slow Invalid", func() bool {
			_, r, _ := accepted("slow")
			return r == pbk8s.ReasonInvalid
		})
		if _, _, msg := accepted("slow"); !strings.Contains(msg, "spec.failureAccrual.minPenalty") || !strings.Contains(msg, `"2m"`) {
			t.Errorf("Invalid message %q does not name the field and value", msg)
		}
		w.eventually(5*time.Second, "the invalid-settings metric", func() bool {
			return w.metrics().Get("penaltybox_invalid_settings_total", "svc_namespace", "shop", "svc_name", "web", "key", "BackendPolicy shop/slow") == 1
		})
		if got := limit(); got != 0 {
			t.Errorf("limit %d, want the one in force before (none)", got)
		}
	})

	step("one agent writes the status, holding the Lease", func(t *testing.T) {
		m := w.metrics()
		if got := m.Get("penaltybox_policy_status_leader"); got != 1 {
			t.Errorf("penaltybox_policy_status_leader = %v, want 1", got)
		}
		// limits: Accepted; newer: Conflicted, then Accepted; slow:
		// Invalid. A write per verdict, not one per event.
		if got := m.Get("penaltybox_policy_status_writes_total", "result", "ok"); got < 4 || got > 8 {
			t.Errorf("penaltybox_policy_status_writes_total{result=ok} = %v, want 4 to 8", got)
		} else {
			t.Logf("%v status writes", got)
		}
		lease, err := w.c.Admin.CoordinationV1().Leases("penaltybox-system").Get(ctx, "penaltybox-policy-status", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if h := lease.Spec.HolderIdentity; h == nil || *h != nodeName {
			t.Errorf("Lease holder %v, want %s", h, nodeName)
		}
	})
}
