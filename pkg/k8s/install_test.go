// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"
)

func TestInstallRemoved(t *testing.T) {
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "penaltybox-agent", Namespace: "pb", UID: "ds-1"}}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "agent-x", Namespace: "pb", OwnerReferences: []metav1.OwnerReference{{
		APIVersion: "apps/v1", Kind: "DaemonSet", Name: "penaltybox-agent", UID: "ds-1", Controller: ptr.To(true)}}}}
	deleting := ds.DeepCopy()
	deleting.DeletionTimestamp = &metav1.Time{}
	deleting.Finalizers = []string{"foregroundDeletion"}
	replaced := ds.DeepCopy()
	replaced.UID = "ds-2"
	forbidden := func(resource string) k8stesting.ReactionFunc {
		return func(k8stesting.Action) (bool, runtime.Object, error) {
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: resource}, "x", nil)
		}
	}
	for _, c := range []struct {
		name    string
		objs    []runtime.Object
		react   func(*fake.Clientset)
		removed bool
	}{
		{"DaemonSet in place: a restart", []runtime.Object{pod, ds}, nil, false},
		{"DaemonSet deleted", []runtime.Object{pod}, nil, true},
		{"DaemonSet being deleted", []runtime.Object{pod, deleting}, nil, true},
		{"DaemonSet replaced", []runtime.Object{pod, replaced}, nil, false},
		{"roles deleted", []runtime.Object{pod, ds}, func(c *fake.Clientset) { c.PrependReactor("get", "daemonsets", forbidden("daemonsets")) }, true},
		{"service account deleted", nil, func(c *fake.Clientset) {
			c.PrependReactor("get", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
				return true, nil, apierrors.NewUnauthorized("token")
			})
		}, true},
		{"the pod unreadable otherwise", nil, nil, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			cs := fake.NewClientset(c.objs...)
			if c.react != nil {
				c.react(cs)
			}
			got, why := InstallRemoved(context.Background(), cs, "pb", "agent-x")
			if got != c.removed {
				t.Errorf("removed %v (%s), want %v", got, why, c.removed)
			}
		})
	}
}
