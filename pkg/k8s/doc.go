// SPDX-License-Identifier: Apache-2.0

// Package k8s feeds the agent from the Kubernetes API: Services and
// discovery.k8s.io/v1 EndpointSlices become the same desired state the
// config file produces (one desired service per ClusterIP port, its
// backends the ready endpoints, kube-proxy's rules throughout), failure
// accrual is configured by annotations on the Service (Linkerd's
// balancer.linkerd.io spellings accepted), and accrual decisions come back
// as Events on the Service, so `kubectl describe svc` shows which pod was
// ejected and why.
//
// Data flows one way, as in the rest of the agent: informers → work queue
// → per-Service recomputation from the listers → a full desired.State
// snapshot for the agent's loop at start (and every resync), and after
// that deltas of the Services recomputed. Events flow back through Notify,
// which never blocks the loop.
package k8s
