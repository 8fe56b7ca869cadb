// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// A backend is judged by its service's current policy, and by none once
// it has left the service or the service is gone.
func TestPolicyFollowsTheBackendsService(t *testing.T) {
	e := newEnv(t)
	a := web(80, 3, settings(func(s *accrual.Settings) { s.ConnectTimeout = time.Second }))
	b := web(81, 2, settings(func(s *accrual.Settings) { s.ConnectTimeout = 2 * time.Second }))
	b.Name = "web-81"
	e.start(state(a, b))
	sa, bea := e.ids(a)
	sb, beb := e.ids(b)
	want := func(be, svc uint32, timeout time.Duration) {
		t.Helper()
		p := e.a.policyOf(be)
		if !p.Tracked || p.Service != svc || p.ConnectTimeout != timeout {
			t.Errorf("backend %d: tracked %v, service %d, connect timeout %v; want true, %d, %v",
				be, p.Tracked, p.Service, p.ConnectTimeout, svc, timeout)
		}
	}
	wantNone := func(be uint32) {
		t.Helper()
		if p := e.a.policyOf(be); p.Tracked || p.Service != 0 {
			t.Errorf("backend %d: still judged, by service %d", be, p.Service)
		}
	}
	for _, be := range bea {
		want(be, sa, time.Second)
	}
	for _, be := range beb {
		want(be, sb, 2*time.Second)
	}

	// New settings reach every backend of the service, none of the other's.
	a.Accrual.ConnectTimeout = 3 * time.Second
	e.a.Apply(state(a, b))
	for _, be := range bea {
		want(be, sa, 3*time.Second)
	}
	for _, be := range beb {
		want(be, sb, 2*time.Second)
	}

	// An endpoint that leaves its service is judged no more; the others
	// keep their service's policy.
	a.Endpoints = a.Endpoints[:2]
	e.a.Apply(state(a, b))
	want(bea[0], sa, 3*time.Second)
	want(bea[1], sa, 3*time.Second)
	wantNone(bea[2])

	// Nor are a removed service's backends.
	e.a.Apply(state(a))
	for _, be := range beb {
		wantNone(be)
	}
	want(bea[0], sa, 3*time.Second)
	wantNone(1 << 20) // an id never handed out
}
