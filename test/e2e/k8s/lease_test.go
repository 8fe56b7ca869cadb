// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	coordv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/utils/ptr"

	"github.com/penaltybox/penaltybox/internal/testnet"
	pbk8s "github.com/penaltybox/penaltybox/pkg/k8s"
)

// TestLeaseHoldersAreTheAgentsOwnNodes: deploy/fleet-admission.yaml's
// penaltybox-lease-holder policy on a real API server. The agents' service
// account, with a token bound to a pod on node-a (as the DaemonSet's pods
// get), may create, renew and release the Leases penaltybox-fleet and
// penaltybox-policy-status as node-a, and run client-go's leader election
// on them (create, renew, release on cancel) as the agent does; it may not
// write node-b as the holder, nor release a Lease node-b holds. The same
// service account with a token bound to no pod, another service account
// with the same RBAC, and a cluster admin may not write the Leases at
// all; the admin may delete them (a new election). Other Leases are not
// its business.
func TestLeaseHoldersAreTheAgentsOwnNodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	topo := testnet.New(t, testnet.Options{Backends: 1})
	c := startCluster(t, topo.Node)
	if _, err := c.kubectl("apply", "-f", filepath.Join(repoRoot, "deploy", "namespace.yaml"),
		"-f", filepath.Join(repoRoot, "deploy", "rbac.yaml"), "-f", filepath.Join(repoRoot, "deploy", "fleet-admission.yaml")); err != nil {
		t.Fatal(err)
	}
	const ns = "penaltybox-system"
	admin := c.Admin

	// Another service account with the agents' Lease rights and more: what
	// it may not do is the policy's doing, not RBAC's.
	if _, err := admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "intruder"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().Roles(ns).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "intruder"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"*"}}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "intruder"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "intruder"},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: "intruder", Namespace: ns}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// Tokens as the DaemonSet's pods get them: bound to a pod on a node.
	token := func(sa, node string) kubernetes.Interface {
		t.Helper()
		if _, err := admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{}); apierrors.IsNotFound(err) {
			if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		pod, err := admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: sa + "-" + node},
			Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa,
				Containers: []corev1.Container{{Name: "agent", Image: "penaltybox/agent"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		tr, err := admin.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authnv1.TokenRequest{
			Spec: authnv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600),
				BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cs, err := kubernetes.NewForConfig(c.RestConfig(tr.Status.Token))
		if err != nil {
			t.Fatal(err)
		}
		return cs
	}
	agentA := token("penaltybox-agent", "node-a")
	agentB := token("penaltybox-agent", "node-b")
	intruder := token("intruder", "node-a")
	// The agents' service account without a node: the static token the
	// other tests use (same username, no node in its user info).
	unbound, err := kubernetes.NewForConfig(c.RestConfig(c.AgentToken))
	if err != nil {
		t.Fatal(err)
	}

	// write sets the Lease's holder as cs (creating it if need be).
	write := func(cs kubernetes.Interface, name, holder string) error {
		leases := cs.CoordinationV1().Leases(ns)
		l, err := admin.CoordinationV1().Leases(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			_, err = leases.Create(ctx, &coordv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name},
				Spec: coordv1.LeaseSpec{HolderIdentity: &holder, LeaseDurationSeconds: ptr.To[int32](90)}}, metav1.CreateOptions{})
			return err
		}
		if err != nil {
			return err
		}
		l.Spec.HolderIdentity = &holder
		l.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
		_, err = leases.Update(ctx, l, metav1.UpdateOptions{})
		return err
	}
	forbidden := func(what string, err error, says string) {
		t.Helper()
		switch {
		case !apierrors.IsForbidden(err):
			t.Errorf("%s: %v, want Forbidden", what, err)
		case !strings.Contains(err.Error(), says):
			t.Errorf("%s: refused with %q, which does not say %q", what, err, says)
		}
	}

	// The policy takes effect a moment after it is created.
	var first error
	waitFor(t, ctx, 20*time.Second, "node-a's agent refused the fleet Lease as node-b", func() bool {
		first = write(agentA, pbk8s.FleetLease, "node-b")
		if first == nil {
			if err := admin.CoordinationV1().Leases(ns).Delete(ctx, pbk8s.FleetLease, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		return apierrors.IsForbidden(first)
	})
	t.Logf("refused: %v", first)
	forbidden("node-a's agent creating the fleet Lease as node-b", first, "only as its own node: holderIdentity node-b is not node-a")

	for _, name := range []string{pbk8s.FleetLease, "penaltybox-policy-status"} {
		if err := write(agentA, name, "node-a"); err != nil {
			t.Fatalf("%s: node-a's agent taking it as node-a: %v", name, err)
		}
		if err := write(agentA, name, "node-a"); err != nil {
			t.Fatalf("%s: node-a's agent renewing it: %v", name, err)
		}
		forbidden(name+": node-a's agent handing it to node-b", write(agentA, name, "node-b"), "holderIdentity node-b is not node-a")
		forbidden(name+": node-b's agent releasing node-a's", write(agentB, name, ""), "releases a Lease held by node-a")
		forbidden(name+": another service account on node-a", write(intruder, name, "node-a"), "only the penaltybox agents write the Lease "+name)
		forbidden(name+": the agents' service account without a node", write(unbound, name, "node-a"), "only with a token bound to a pod on its node")
		forbidden(name+": a cluster admin", write(admin, name, "node-a"), "only the penaltybox agents write the Lease")
		if err := write(agentA, name, ""); err != nil {
			t.Fatalf("%s: node-a's agent releasing it: %v", name, err)
		}
		// Released (or expired), it is any agent's to take, in its own name.
		if err := write(agentB, name, "node-b"); err != nil {
			t.Fatalf("%s: node-b's agent taking it as node-b: %v", name, err)
		}
		if err := admin.CoordinationV1().Leases(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatalf("%s: a cluster admin deleting it: %v", name, err)
		}
	}
	// Leases of other names are not the policy's.
	if err := write(intruder, "someone-else", "whoever"); err != nil {
		t.Fatalf("another Lease: %v", err)
	}

	// client-go's leader election, as pkg/k8s runs it (Identity: the node
	// name, ReleaseOnCancel), passes: it takes the Lease, renews it and
	// releases it on cancel.
	elect := func(cs kubernetes.Interface, identity string) (led chan struct{}, stop func()) {
		ectx, ecancel := context.WithCancel(ctx)
		led = make(chan struct{})
		done := make(chan struct{})
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock: &resourcelock.LeaseLock{LeaseMeta: metav1.ObjectMeta{Name: pbk8s.FleetLease, Namespace: ns},
				Client: cs.CoordinationV1(), LockConfig: resourcelock.ResourceLockConfig{Identity: identity}},
			LeaseDuration: 3 * time.Second, RenewDeadline: 2 * time.Second, RetryPeriod: 200 * time.Millisecond,
			ReleaseOnCancel: true,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(context.Context) { close(led) },
				OnStoppedLeading: func() {},
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			defer close(done)
			le.Run(ectx)
		}()
		return led, func() { ecancel(); <-done }
	}
	holder := func() string {
		l, err := admin.CoordinationV1().Leases(ns).Get(ctx, pbk8s.FleetLease, metav1.GetOptions{})
		if err != nil || l.Spec.HolderIdentity == nil {
			return fmt.Sprintf("(%v)", err)
		}
		return *l.Spec.HolderIdentity
	}
	led, stop := elect(agentA, "node-a")
	select {
	case <-led:
	case <-time.After(20 * time.Second):
		t.Fatalf("node-a's agent never led as node-a; the Lease's holder: %s", holder())
	}
	time.Sleep(2 * time.Second) // a few renewals
	if h := holder(); h != "node-a" {
		t.Fatalf("holder %q while node-a leads", h)
	}
	stop()
	if h := holder(); h != "" {
		t.Fatalf("holder %q after node-a's agent stopped, want its release (empty)", h)
	}
	// As another node's name it never leads.
	led, stop = elect(agentA, "node-b")
	select {
	case <-led:
		t.Error("node-a's agent led as node-b")
	case <-time.After(3 * time.Second):
	}
	stop()
	if h := holder(); h != "" {
		t.Fatalf("holder %q after the election as node-b, want still none", h)
	}
}
