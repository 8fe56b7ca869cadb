// SPDX-License-Identifier: Apache-2.0

package promcheck

import (
	"strings"
	"testing"
	"time"
)

// The shipped dashboard's queries, with no Grafana variable left in them.
func TestDashboardQueries(t *testing.T) {
	qs, err := DashboardQueries("../../deploy/monitoring/grafana-dashboard.json", 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(qs) == 0 {
		t.Fatal("no queries")
	}
	for _, q := range qs {
		if q.Panel == "" || strings.Contains(q.Expr, "$") {
			t.Errorf("panel %q: %s", q.Panel, q.Expr)
		}
	}
}
