// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes"
)

// StatusOptions configure who writes the policies' status. Every agent
// judges every policy the same way (Judge is a function of the cluster's
// objects alone), so one writer is enough: the agent holding the Lease
// writes, and only when a status would change. A fleet of N nodes costs
// one write per change, not N.
type StatusOptions struct {
	Client    kubernetes.Interface // for the Lease
	Namespace string               // the Lease's namespace (the agents')
	Identity  string               // this agent's name in the Lease (the node name)
	// LeaseName defaults to "penaltybox-policy-status".
	LeaseName string
}

// maxAncestors is the CRD's maxItems for status.ancestors (the Gateway
// API's limit).
const maxAncestors = 16

// leadPolicyStatus competes for the Lease until ctx ends, writing the
// policies' status while it holds it.
func (c *Controller) leadPolicyStatus(ctx context.Context) {
	so := c.opts.Status
	name := so.LeaseName
	if name == "" {
		name = "penaltybox-policy-status"
	}
	leaseJob{
		Client: so.Client, Namespace: so.Namespace, Name: name, Identity: so.Identity, Gauge: c.metrics.PolicyStatusLeader, Log: c.log,
		Doing:     "writing BackendPolicy status: this agent holds the lease",
		Stopped:   "no longer writing BackendPolicy status",
		Elsewhere: "BackendPolicy status is written by another agent",
		Disabled:  "BackendPolicy status will not be written",
		Work: func(ctx context.Context) {
			// Get blocks: a key unblocks it when leadership ends, so the
			// worker stops at once (after a write in flight) and never
			// outlives the term that started it.
			stop := context.AfterFunc(ctx, func() { c.statusQueue.Add(stopKey) })
			defer stop()
			c.writeStatuses(ctx)
		},
	}.run(ctx)
}

// stopKey is no policy's key ("namespace/name" always has a slash).
const stopKey = "stop"

// writeStatuses checks every policy, then each one queued, until ctx ends
// (leadership lost or the agent stopping).
func (c *Controller) writeStatuses(ctx context.Context) {
	for _, k := range c.policyStore.ListKeys() {
		c.statusQueue.Add(k)
	}
	for {
		key, shutdown := c.statusQueue.Get()
		if shutdown {
			return
		}
		if key == stopKey || ctx.Err() != nil {
			c.statusQueue.Forget(key)
			c.statusQueue.Done(key)
			if key != stopKey {
				c.statusQueue.Add(key) // for the next term
			}
			if ctx.Err() != nil {
				return
			}
			continue
		}
		err := c.writeStatus(ctx, key)
		result := "ok"
		switch {
		case err == errUnchanged:
			result = ""
			c.statusQueue.Forget(key)
		case err == nil:
			c.statusQueue.Forget(key)
		case apierrors.IsConflict(err):
			// Our copy was older than the API server's (another policy's
			// event queued this one before its own update arrived): the
			// update's event queues it again with the current copy.
			result = "conflict"
			c.statusQueue.Forget(key)
		case apierrors.IsInvalid(err):
			// Retrying the same status cannot help; the next change of the
			// policy or its targets tries again.
			result = "error"
			c.log.Warn("BackendPolicy status refused by the API server", "policy", key, "err", err)
			c.statusQueue.Forget(key)
		default:
			result = "error"
			c.log.Warn("BackendPolicy status write failed, retrying", "policy", key, "err", err)
			c.statusQueue.AddRateLimited(key)
		}
		if c.metrics.PolicyStatusWrites != nil && result != "" {
			c.metrics.PolicyStatusWrites.WithLabelValues(result).Inc()
		}
		c.statusQueue.Done(key)
	}
}

type unchanged struct{}

func (unchanged) Error() string { return "status unchanged" }

var errUnchanged error = unchanged{}

// writeStatus writes one policy's status if it differs from what the API
// server has. Other controllers' entries are kept as they are.
func (c *Controller) writeStatus(ctx context.Context, key string) error {
	obj, ok, err := c.policyStore.GetByKey(key)
	if err != nil || !ok {
		return errUnchanged // deleted: nothing to write
	}
	u := obj.(*unstructured.Unstructured).DeepCopy()
	p, err := DecodePolicy(u)
	if err != nil {
		return errUnchanged
	}
	verdicts := Judge(p, c.serviceExists, c.targeting, c.annotated)
	next := ancestorStatus(p.Status.Ancestors, verdicts, p.Generation, metav1.Now())
	was, _ := json.Marshal(p.Status.Ancestors)
	now, _ := json.Marshal(next)
	if bytes.Equal(was, now) {
		return errUnchanged
	}
	// Through JSON, so the object holds the plain types the dynamic
	// client expects.
	var ancestors []any
	if err := json.Unmarshal(now, &ancestors); err != nil {
		return err
	}
	if err := unstructured.SetNestedField(u.Object, map[string]any{"ancestors": ancestors}, "status"); err != nil {
		return err
	}
	_, err = c.opts.Policies.Resource(PolicyGVR).Namespace(p.Namespace).UpdateStatus(ctx, u, metav1.UpdateOptions{FieldManager: "penaltybox-agent"})
	if apierrors.IsNotFound(err) {
		return errUnchanged
	}
	if err == nil {
		for _, v := range verdicts {
			c.log.Info("BackendPolicy status", "policy", key, "service", v.Target, "section", v.Section, "accepted", v.Accepted, "reason", v.Reason)
		}
	}
	return err
}

// ancestorStatus is the status.ancestors to write: other controllers'
// entries unchanged, then one of ours per target in targetRefs order, as
// many as fit under maxAncestors. A condition keeps its
// lastTransitionTime while its status stays.
func ancestorStatus(old []PolicyAncestorStatus, verdicts []Verdict, generation int64, now metav1.Time) []PolicyAncestorStatus {
	var out []PolicyAncestorStatus
	for _, a := range old {
		if a.ControllerName != ControllerName {
			out = append(out, a)
		}
	}
	for _, v := range verdicts {
		if len(out) >= maxAncestors {
			break
		}
		ns, name, _ := strings.Cut(v.Target, "/")
		ref := AncestorRef{Group: "", Kind: "Service", Namespace: ns, Name: name, SectionName: v.Section}
		var conds []metav1.Condition
		for _, a := range old {
			if a.ControllerName == ControllerName && a.AncestorRef == ref {
				conds = append(conds, a.Conditions...)
			}
		}
		status := metav1.ConditionFalse
		if v.Accepted {
			status = metav1.ConditionTrue
		}
		meta.SetStatusCondition(&conds, metav1.Condition{Type: ConditionAccepted, Status: status, Reason: v.Reason,
			Message: v.Message, ObservedGeneration: generation, LastTransitionTime: now})
		out = append(out, PolicyAncestorStatus{AncestorRef: ref, ControllerName: ControllerName, Conditions: conds})
	}
	return out
}

// The Judge inputs, from the controller's caches.

func (c *Controller) serviceExists(key, section string) bool {
	ns, name, _ := strings.Cut(key, "/")
	svc := c.services.get(ns, name)
	return svc != nil && (section == "" || svc.hasPort(section))
}

func (c *Controller) targeting(key string) []*BackendPolicy {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.targetingLocked(key)
}

// annotated is what a policy on a Service is judged against: the settings
// from its annotations, or the defaults while they are invalid. It depends
// on the cluster's objects alone (not on what this agent saw before), so
// whichever agent holds the Lease writes the same verdict.
func (c *Controller) annotated(key string) Settings {
	ns, name, _ := strings.Cut(key, "/")
	base := DefaultSettings(c.opts.MaxInflight)
	var ann map[string]string
	if svc := c.services.get(ns, name); svc != nil {
		ann = svc.Annotations
	}
	s, errs := ParseAnnotations(ann, base)
	if len(errs) > 0 {
		return base
	}
	return s
}
