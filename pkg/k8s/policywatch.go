// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"slices"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

// watchPolicies adds the BackendPolicy informer. A policy's change
// recomputes the Services it targets, before and after the change (a
// target removed from targetRefs falls back to its annotations).
func (c *Controller) watchPolicies(dyn dynamic.Interface) {
	c.dynFactory = dynamicinformer.NewDynamicSharedInformerFactory(dyn, c.opts.Resync)
	inf := c.dynFactory.ForResource(PolicyGVR).Informer()
	c.policyStore = inf.GetStore()
	c.statusQueue = workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "policy-status"})
	reg, _ := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.policyChanged(obj, false) },
		UpdateFunc: func(_, obj any) { c.policyChanged(obj, false) },
		DeleteFunc: func(obj any) { c.policyChanged(obj, true) },
	})
	// The handler's own sync, not the store's: the first desired state
	// must be computed with every policy already decoded into c.policies.
	c.synced = append(c.synced, reg.HasSynced)
}

func (c *Controller) policyChanged(obj any, deleted bool) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj, deleted = t.Obj, true
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return
	}
	key := u.GetNamespace() + "/" + u.GetName()
	var p *BackendPolicy
	if !deleted {
		var err error
		if p, err = DecodePolicy(u); err != nil {
			// The schema makes this unreachable short of an edited CRD;
			// the policy is then treated as absent.
			c.log.Warn("unreadable BackendPolicy ignored", "policy", key, "err", err)
		}
	}
	c.mu.Lock()
	var targets []string
	if old := c.policies[key]; old != nil {
		targets = old.Targets()
	}
	if p != nil {
		c.policies[key] = p
		for _, t := range p.Targets() {
			if !slices.Contains(targets, t) {
				targets = append(targets, t)
			}
		}
	} else {
		delete(c.policies, key)
	}
	// Every policy sharing a target may change verdict (a conflict won or
	// lost), so each gets its status rechecked.
	var others []string
	for k, q := range c.policies {
		if k != key && slices.ContainsFunc(q.Targets(), func(t string) bool { return slices.Contains(targets, t) }) {
			others = append(others, k)
		}
	}
	c.mu.Unlock()
	for _, t := range targets {
		c.queue.Add(t)
	}
	if !deleted {
		c.statusQueue.Add(key)
	}
	for _, k := range others {
		c.statusQueue.Add(k)
	}
}

// targetingLocked lists the policies that target a Service. Called with
// mu held.
func (c *Controller) targetingLocked(svc string) []*BackendPolicy {
	var out []*BackendPolicy
	for _, p := range c.policies {
		if slices.Contains(p.Targets(), svc) {
			out = append(out, p)
		}
	}
	return out
}

// policyStatusFor queues the status check of every policy targeting svc.
func (c *Controller) policyStatusFor(svc string) {
	if c.statusQueue == nil {
		return
	}
	c.mu.Lock()
	ps := c.targetingLocked(svc)
	c.mu.Unlock()
	for _, p := range ps {
		c.statusQueue.Add(p.Key())
	}
}
