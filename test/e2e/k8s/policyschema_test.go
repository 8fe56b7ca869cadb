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
