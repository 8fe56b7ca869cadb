// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// The BackendPolicy schema refuses the values past the bounds the agents
// enforce (pkg/accrual.Settings.Validate), naming the field, so a tenant
// hears at kubectl apply rather than from a status condition: a maxPenalty
// beyond 24h, a connectTimeout beyond 30s, a window beyond 1h, counts
// beyond their limits. Values at the bounds pass.
func TestBackendPolicySchemaBounds(t *testing.T) {
	topo := testnet.New(t, testnet.Options{Backends: 1})
	c := startCluster(t, topo.Node)
	deploy := func(name string) string { return filepath.Join(repoRoot, "deploy", name) }
	if out, err := c.kubectl("apply", "-f", deploy("namespace.yaml"), "-f", deploy("backendpolicy-crd.yaml")); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if out, err := c.kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd/backendpolicies.policy.penaltybox.io"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	dir := t.TempDir()
	apply := func(i int, accrual string) (string, error) {
		doc := fmt.Sprintf("apiVersion: policy.penaltybox.io/v1alpha1\nkind: BackendPolicy\nmetadata:\n  name: p%d\n  namespace: penaltybox-system\n"+
			"spec:\n  targetRefs: [{group: \"\", kind: Service, name: web}]\n  failureAccrual: %s\n", i, accrual)
		f := filepath.Join(dir, fmt.Sprintf("p%d.yaml", i))
		if err := os.WriteFile(f, []byte(doc), 0o600); err != nil {
			t.Fatal(err)
		}
		return c.kubectl("apply", "--dry-run=server", "-f", f)
	}
	for i, tc := range []struct {
		accrual, field string // field "": accepted
	}{
		{"{maxPenalty: 25h}", "spec.failureAccrual.maxPenalty"},
		{"{maxPenalty: 2562047h}", "spec.failureAccrual.maxPenalty"},
		{"{maxPenalty: 24h}", ""},
		{"{connectTimeout: 31s}", "spec.failureAccrual.connectTimeout"},
		{"{connectTimeout: 30s}", ""},
		{"{window: 61m}", "spec.failureAccrual.window"},
		{"{window: 5ms}", "spec.failureAccrual.window"},
		{"{window: 1h}", ""},
		{"{maxFailures: 1000001}", "spec.failureAccrual.maxFailures"},
		{"{outlierMinHosts: 100001}", "spec.failureAccrual.outlierMinHosts"},
	} {
		out, err := apply(i, tc.accrual)
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("%s refused: %v\n%s", tc.accrual, err, out)
		case tc.field != "" && err == nil:
			t.Errorf("%s accepted, want it refused at %s:\n%s", tc.accrual, tc.field, out)
		case tc.field != "" && !strings.Contains(out, tc.field):
			t.Errorf("%s refused without naming %s:\n%s", tc.accrual, tc.field, out)
		}
	}
}

// The generated CRD follows Gateway API policy attachment (GEP-713): the
// Direct policy label, targetRefs with an optional sectionName (a Service
// port's name), a Service named twice only with a different sectionName
// each time, and status ancestors that name the port.
func TestBackendPolicySchemaSectionName(t *testing.T) {
	topo := testnet.New(t, testnet.Options{Backends: 1})
	c := startCluster(t, topo.Node)
	deploy := func(name string) string { return filepath.Join(repoRoot, "deploy", name) }
	if out, err := c.kubectl("apply", "-f", deploy("namespace.yaml"), "-f", deploy("backendpolicy-crd.yaml")); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if out, err := c.kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd/backendpolicies.policy.penaltybox.io"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if out, err := c.kubectl("get", "crd", "-l", "gateway.networking.k8s.io/policy=Direct", "-o", "name"); err != nil ||
		strings.TrimSpace(out) != "customresourcedefinition.apiextensions.k8s.io/backendpolicies.policy.penaltybox.io" {
		t.Errorf("the CRD lacks the label gateway.networking.k8s.io/policy=Direct (err %v):\n%s", err, out)
	}
	dir := t.TempDir()
	for i, tc := range []struct {
		refs, refused string // refused "": accepted
	}{
		{`[{group: "", kind: Service, name: web, sectionName: http}]`, ""},
		{`[{group: "", kind: Service, name: web, sectionName: http}, {group: "", kind: Service, name: web, sectionName: grpc}]`, ""},
		{`[{group: "", kind: Service, name: web}, {group: "", kind: Service, name: api}]`, ""},
		{`[{group: "", kind: Service, name: web}, {group: "", kind: Service, name: web}]`, "sectionName must be unique"},
		{`[{group: "", kind: Service, name: web}, {group: "", kind: Service, name: web, sectionName: http}]`, "sectionName must be specified"},
		{`[{group: "", kind: Service, name: web, sectionName: Not_A_Port}]`, "spec.targetRefs[0].sectionName"},
		{`[{group: "", kind: Pod, name: web}]`, "spec.targetRefs[0].kind"},
	} {
		doc := fmt.Sprintf("apiVersion: policy.penaltybox.io/v1alpha1\nkind: BackendPolicy\nmetadata:\n  name: s%d\n  namespace: penaltybox-system\n"+
			"spec:\n  targetRefs: %s\n", i, tc.refs)
		f := filepath.Join(dir, fmt.Sprintf("s%d.yaml", i))
		if err := os.WriteFile(f, []byte(doc), 0o600); err != nil {
			t.Fatal(err)
		}
		out, err := c.kubectl("apply", "-f", f)
		switch {
		case tc.refused == "" && err != nil:
			t.Errorf("%s refused: %v\n%s", tc.refs, err, out)
		case tc.refused != "" && err == nil:
			t.Errorf("%s accepted, want it refused (%s):\n%s", tc.refs, tc.refused, out)
		case tc.refused != "" && !strings.Contains(out, tc.refused):
			t.Errorf("%s refused without saying %q:\n%s", tc.refs, tc.refused, out)
		}
	}
	// A status the agents write, naming a port, is accepted as the
	// Gateway API shapes it.
	status := `{"status":{"ancestors":[{"ancestorRef":{"group":"","kind":"Service","namespace":"penaltybox-system","name":"web","sectionName":"http"},` +
		`"controllerName":"penaltybox.io/agent","conditions":[{"type":"Accepted","status":"True","reason":"Accepted","message":"in force","observedGeneration":1,"lastTransitionTime":"2026-12-04T00:00:00Z"}]}]}}`
	if out, err := c.kubectl("patch", "backendpolicy", "s0", "-n", "penaltybox-system", "--subresource=status", "--type=merge", "-p", status); err != nil {
		t.Errorf("status with sectionName refused: %v\n%s", err, out)
	}
}
