// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// InstallRemoved says whether the agent's install is being removed (its
// DaemonSet deleted: kubectl delete, helm uninstall) rather than the agent
// restarted (a rolling update, an eviction, a node drain), and why. An
// agent told to stop asks on its way out: a restart keeps the datapath,
// a removal takes it away. Credentials that no longer work say the
// install is going (its service account or roles were deleted with it);
// anything else it cannot tell is taken for a restart, the state from
// which the dead-man's switch and the documented clean-up recover.
func InstallRemoved(ctx context.Context, c kubernetes.Interface, namespace, pod string) (bool, string) {
	gone := func(err error) bool { return apierrors.IsUnauthorized(err) || apierrors.IsForbidden(err) }
	p, err := c.CoreV1().Pods(namespace).Get(ctx, pod, metav1.GetOptions{})
	switch {
	case gone(err):
		return true, "the agent's credentials no longer work: its service account or roles were deleted"
	case err != nil:
		return false, fmt.Sprintf("cannot read pod %s/%s: %v", namespace, pod, err)
	}
	owner := metav1.GetControllerOf(p)
	if owner == nil || owner.Kind != "DaemonSet" {
		return false, "the pod is not a DaemonSet's"
	}
	ds, err := c.AppsV1().DaemonSets(namespace).Get(ctx, owner.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return true, "DaemonSet " + owner.Name + " deleted"
	case gone(err):
		return true, "the agent's credentials no longer work: its service account or roles were deleted"
	case err != nil:
		return false, fmt.Sprintf("cannot read DaemonSet %s/%s: %v", namespace, owner.Name, err)
	case ds.DeletionTimestamp != nil:
		return true, "DaemonSet " + owner.Name + " being deleted"
	case ds.UID != owner.UID:
		return false, "DaemonSet " + owner.Name + " replaced by a new one"
	}
	return false, "DaemonSet " + owner.Name + " in place"
}
