package k8s

import (
	"net/netip"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/penaltybox/penaltybox/pkg/desired"
)

// Under the opt-in scope a Service is served only when it asks: its own
// label, its namespace's, or a BackendPolicy targeting it. Each switch
// takes effect with the next desired state, and says why.
func TestControllerOptInScope(t *testing.T) {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}
	optIn := func(h *harness, o *Options) { o.Scope = ScopeOptIn }
	h := newHarnessWith(t, debounce, optIn, ns, service(), slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")))
	if got := h.next(); len(got.Services) != 0 {
		t.Fatalf("services %v: none asked to be served", got.Services)
	}

	// The namespace opts in: its Service is served.
	ns.Labels = map[string]string{LabelEnabled: "true"}
	if _, err := h.client.CoreV1().Namespaces().Update(h.ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	s, ok := byName(h.next())["shop/web:http"]
	if !ok || s.Served != ServedNamespace {
		t.Fatalf("namespace labelled: served %v (%q), want it, because of %q", ok, s.Served, ServedNamespace)
	}

	// The Service opts out, whatever its namespace says.
	svc := service()
	svc.Labels = map[string]string{LabelEnabled: "false"}
	h.updateService(svc)
	webKey := desired.Key{VIP: netip.MustParseAddr(vip), Port: 80, Protocol: desired.TCP}
	if got := h.next(); len(got.Services) != 0 || !slices.Equal(got.HandBack, []desired.Key{webKey}) {
		t.Fatalf("the Service opted out: services %v, handed back %v; want none, %v", got.Services, got.HandBack, webKey)
	}

	// The namespace opts out, the Service in.
	ns.Labels = nil
	if _, err := h.client.CoreV1().Namespaces().Update(h.ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.quiet()
	svc.Labels = map[string]string{LabelEnabled: "true"}
	h.updateService(svc)
	if s := byName(h.next())["shop/web:http"]; s.Served != ServedService {
		t.Fatalf("Service labelled: served because %q, want %q", s.Served, ServedService)
	}
	svc.Labels = nil
	h.updateService(svc)
	if got := h.next(); len(got.Services) != 0 || len(got.HandBack) != 1 {
		t.Fatalf("services %v, handed back %v after the label went", got.Services, got.HandBack)
	}
	// Deleted: not handed back, gone.
	if err := h.client.CoreV1().Services("shop").Delete(h.ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := h.next(); len(got.Services) != 0 || len(got.HandBack) != 0 {
		t.Fatalf("the Service deleted: services %v, handed back %v; want neither", got.Services, got.HandBack)
	}
}

// A BackendPolicy's target is served under the opt-in scope, for as long
// as the policy targets it.
func TestControllerOptInByPolicy(t *testing.T) {
	ph := newPolicyHarnessScope(t, ScopeOptIn, nil, service(), slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")))
	if got := ph.next(); len(got.Services) != 0 {
		t.Fatalf("services %v: no policy yet", got.Services)
	}
	ph.createPolicy(t, policy("limits", 0, `{"minPenalty":"10s"}`, "web"))
	if s := byName(ph.next())["shop/web:http"]; s.Served != ServedPolicy+"shop/limits" {
		t.Fatalf("served because %q, want the policy", s.Served)
	}
	ph.deletePolicy(t, "limits")
	if got := ph.next(); len(got.Services) != 0 {
		t.Fatalf("services %v after the policy went", got.Services)
	}
}

// Under the all scope every Service is served but one labelled "false".
func TestControllerScopeAll(t *testing.T) {
	out := service()
	out.Name = "internal"
	out.Labels = map[string]string{LabelEnabled: "false"}
	h := newHarness(t, service(), slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")), out)
	got := byName(h.next())
	if s, ok := got["shop/web:http"]; !ok || s.Served != ServedAll {
		t.Fatalf("shop/web served %v because %q, want %q", ok, s.Served, ServedAll)
	}
	for name := range got {
		if name != "shop/web:http" {
			t.Errorf("%s served: it opted out", name)
		}
	}
}
