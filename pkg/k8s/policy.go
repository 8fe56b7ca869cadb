// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/penaltybox/penaltybox/pkg/config"
)

// The BackendPolicy resource (deploy/backendpolicy-crd.yaml): failure
// accrual and circuit-breaker settings attached to Services through
// targetRefs, the Gateway API's policy attachment (GEP-713).
const (
	PolicyGroup    = "policy.penaltybox.io"
	PolicyVersion  = "v1alpha1"
	PolicyKind     = "BackendPolicy"
	PolicyResource = "backendpolicies"
	// ControllerName is the agents' controllerName in a policy's status.
	ControllerName = "penaltybox.io/agent"
)

// PolicyGVR names the resource for the dynamic client.
var PolicyGVR = schema.GroupVersionResource{Group: PolicyGroup, Version: PolicyVersion, Resource: PolicyResource}

// BackendPolicy is the agent's reading of one policy. The API server
// validates it against the CRD's schema first; the agent checks again,
// because a schema can be edited and the combination with a Service's
// annotations is only known here.
type BackendPolicy struct {
	metav1.ObjectMeta `json:"metadata"`
	Spec              BackendPolicySpec `json:"spec"`
	Status            PolicyStatus      `json:"status"`
}

// BackendPolicySpec mirrors a service of the config file: failureAccrual
// with the config file's fields, the circuit breaker's limits in the
// Gateway API's words, retryRefused.
type BackendPolicySpec struct {
	TargetRefs []TargetRef `json:"targetRefs"`
	// FailureAccrual is kept as written and read by
	// config.ResolveFailureAccrual, so it has exactly the config file's
	// fields, units and checks.
	FailureAccrual json.RawMessage       `json:"failureAccrual,omitempty"`
	CircuitBreaker *PolicyCircuitBreaker `json:"circuitBreaker,omitempty"`
	RetryRefused   *bool                 `json:"retryRefused,omitempty"`
}

// TargetRef is a Gateway API LocalPolicyTargetReferenceWithSectionName: a
// Service in the policy's namespace, or with SectionName one of its ports
// (by name).
type TargetRef struct {
	Group       string `json:"group"`
	Kind        string `json:"kind"`
	Name        string `json:"name"`
	SectionName string `json:"sectionName,omitempty"`
}

// PolicyCircuitBreaker: live flows each targeted Service (each of its
// ports) and each of its endpoints may hold; 0 is no limit, absent is the
// annotation's or the default.
type PolicyCircuitBreaker struct {
	MaxInflightRequests            *int64 `json:"maxInflightRequests,omitempty"`
	MaxInflightRequestsPerEndpoint *int64 `json:"maxInflightRequestsPerEndpoint,omitempty"`
}

// PolicyStatus is the Gateway API's PolicyStatus: one entry per target
// (its "ancestor"), per controller.
type PolicyStatus struct {
	Ancestors []PolicyAncestorStatus `json:"ancestors,omitempty"`
}

type PolicyAncestorStatus struct {
	AncestorRef    AncestorRef        `json:"ancestorRef"`
	ControllerName string             `json:"controllerName"`
	Conditions     []metav1.Condition `json:"conditions,omitempty"`
}

// AncestorRef is the Gateway API's ParentReference, as far as a Service
// target (or one of its ports) needs it.
type AncestorRef struct {
	Group       string `json:"group"`
	Kind        string `json:"kind"`
	Namespace   string `json:"namespace,omitempty"`
	Name        string `json:"name"`
	SectionName string `json:"sectionName,omitempty"`
}

// The condition a policy reports per target, with the Gateway API's
// reasons.
const (
	ConditionAccepted    = "Accepted"
	ReasonAccepted       = "Accepted"
	ReasonConflicted     = "Conflicted"
	ReasonInvalid        = "Invalid"
	ReasonTargetNotFound = "TargetNotFound"
)

// DecodePolicy reads a BackendPolicy from the dynamic client's object.
func DecodePolicy(u *unstructured.Unstructured) (*BackendPolicy, error) {
	j, err := u.MarshalJSON()
	if err != nil {
		return nil, err
	}
	var p BackendPolicy
	if err := json.Unmarshal(j, &p); err != nil {
		return nil, fmt.Errorf("BackendPolicy %s/%s: %w", u.GetNamespace(), u.GetName(), err)
	}
	return &p, nil
}

// Key is "namespace/name".
func (p *BackendPolicy) Key() string { return p.Namespace + "/" + p.Name }

// Targets returns the keys ("namespace/name") of the Services p targets,
// each once, in order.
func (p *BackendPolicy) Targets() []string {
	var out []string
	for _, r := range p.Spec.TargetRefs {
		if r.Group != "" || r.Kind != "Service" || r.Name == "" {
			continue // the schema allows only Services; anything else is not ours
		}
		k := p.Namespace + "/" + r.Name
		if !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return out
}

// Target is one thing a policy applies to: a Service ("namespace/name"),
// the whole of it (Section "") or the port named Section.
type Target struct {
	Service string
	Section string
}

// Refs returns what p targets, each once, in order.
func (p *BackendPolicy) Refs() []Target {
	var out []Target
	for _, r := range p.Spec.TargetRefs {
		if r.Group != "" || r.Kind != "Service" || r.Name == "" {
			continue
		}
		t := Target{Service: p.Namespace + "/" + r.Name, Section: r.SectionName}
		if !slices.Contains(out, t) {
			out = append(out, t)
		}
	}
	return out
}

// targets reports whether p targets svc's section ("" the whole Service).
func (p *BackendPolicy) targets(svc, section string) bool {
	return slices.Contains(p.Refs(), Target{Service: svc, Section: section})
}

// older orders policies the way GEP-713 resolves conflicts: the oldest by
// creation time wins, then the first by "namespace/name".
func older(a, b *BackendPolicy) int {
	if c := a.CreationTimestamp.Time.Compare(b.CreationTimestamp.Time); c != 0 {
		return c
	}
	return cmp.Compare(a.Key(), b.Key())
}

// Winner returns the oldest of the policies targeting a Service, whole or
// a port of it (nil when there are none): the one a Service served because
// a policy targets it names.
func Winner(targeting []*BackendPolicy) *BackendPolicy {
	if len(targeting) == 0 {
		return nil
	}
	return slices.MinFunc(targeting, older)
}

// WinnerFor returns the policy in force on svc's section ("" the whole
// Service) among targeting: the oldest that targets exactly that (GEP-713);
// the others that do are Conflicted. A section's policy is layered over
// the whole Service's (see Controller.withSections), so the two never
// conflict.
func WinnerFor(targeting []*BackendPolicy, svc, section string) *BackendPolicy {
	var w *BackendPolicy
	for _, p := range targeting {
		if p.targets(svc, section) && (w == nil || older(p, w) < 0) {
			w = p
		}
	}
	return w
}

// ApplyPolicy overlays the fields p sets onto base, the Service's settings
// from its annotations (or the defaults), and validates the result: a
// policy beats an annotation field by field, and a field the policy leaves
// out keeps the annotation's value. On error base is returned unchanged;
// the error names the field ("spec.circuitBreaker.maxInflightRequests")
// and its value.
func ApplyPolicy(p *BackendPolicy, base Settings) (Settings, error) {
	s := base
	acc, err := config.ResolveFailureAccrual("spec.failureAccrual", p.Spec.FailureAccrual, base.Accrual)
	if err != nil {
		return base, err
	}
	s.Accrual = acc
	var errs []error
	limit := func(dst *uint32, v *int64, path string) {
		if v == nil {
			return
		}
		if *v < 0 || *v > math.MaxUint32 {
			errs = append(errs, &config.FieldError{Path: path, Value: fmt.Sprint(*v), Msg: "want a whole number of flows within [0, 4294967295], 0 for no limit"})
			return
		}
		*dst = uint32(*v)
	}
	if cb := p.Spec.CircuitBreaker; cb != nil {
		limit(&s.MaxInflight, cb.MaxInflightRequests, "spec.circuitBreaker.maxInflightRequests")
		limit(&s.MaxInflightPerEndpoint, cb.MaxInflightRequestsPerEndpoint, "spec.circuitBreaker.maxInflightRequestsPerEndpoint")
	}
	if len(errs) > 0 {
		return base, errors.Join(errs...)
	}
	if p.Spec.RetryRefused != nil {
		s.RetryRefused = *p.Spec.RetryRefused
	}
	return s, nil
}

// Verdict is what one policy is, on one target.
type Verdict struct {
	Target   string // "namespace/name" of the Service
	Section  string // the port's name, for a targetRef with sectionName
	Accepted bool
	Reason   string // ReasonAccepted, ReasonConflicted, ReasonInvalid, ReasonTargetNotFound
	Message  string
}

// Judge says what p is on each of its targets. exists reports whether a
// Service exists, and with a section whether it has a port of that name;
// targeting lists the policies targeting a Service (whole or a port);
// annotated gives a Service's settings before any policy (its annotations
// over the defaults). It is a pure function of the cluster's objects, so
// every agent reaches the same verdicts.
func Judge(p *BackendPolicy, exists func(svc, section string) bool, targeting func(svc string) []*BackendPolicy,
	annotated func(svc string) Settings) []Verdict {
	var out []Verdict
	for _, t := range p.Refs() {
		v := Verdict{Target: t.Service, Section: t.Section, Reason: ReasonAccepted}
		what := "Service " + t.Service
		if t.Section != "" {
			what += " port " + t.Section
		}
		switch w := WinnerFor(targeting(t.Service), t.Service, t.Section); {
		case !exists(t.Service, ""):
			v.Reason, v.Message = ReasonTargetNotFound, "Service "+t.Service+" not found, or not one penaltybox balances (headless, or labelled for another proxy)"
		case !exists(t.Service, t.Section):
			v.Reason, v.Message = ReasonTargetNotFound, "Service "+t.Service+" has no port named "+t.Section
		case w != nil && w.Key() != p.Key():
			v.Reason = ReasonConflicted
			v.Message = fmt.Sprintf("%s is already targeted by BackendPolicy %s, created earlier (%s); that one is in force",
				what, w.Key(), w.CreationTimestamp.UTC().Format("2006-01-02T15:04:05Z"))
		default:
			if _, err := ApplyPolicy(p, annotated(t.Service)); err != nil {
				v.Reason, v.Message = ReasonInvalid, err.Error()
				break
			}
			v.Accepted, v.Message = true, "in force on "+what
		}
		out = append(out, v)
	}
	return out
}
