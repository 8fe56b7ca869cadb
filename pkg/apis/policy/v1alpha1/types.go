// SPDX-License-Identifier: Apache-2.0

package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// BackendPolicy sets penaltybox's failure accrual and circuit breaker for
// the Services it targets, in its own namespace. Each targeted Service
// (each of its ports, or the one port sectionName names) gets its own
// limits. When two policies target one Service (or one port), the older
// one (by creation time, then by name) is in force and the other is
// reported Conflicted; a policy that names a port (sectionName) is layered
// over one that targets the whole Service, field by field.
//
// +genclient
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=bp,categories=penaltybox
// +kubebuilder:metadata:labels="app.kubernetes.io/name=penaltybox"
// +kubebuilder:metadata:labels="gateway.networking.k8s.io/policy=Direct"
// +kubebuilder:printcolumn:name="Targets",type=string,JSONPath=`.spec.targetRefs[*].name`
// +kubebuilder:printcolumn:name="Accepted",type=string,JSONPath=`.status.ancestors[*].conditions[?(@.type=="Accepted")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type BackendPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// What the policy sets. Every field is optional; an absent field keeps
	// the Service's annotation, or the default.
	Spec BackendPolicySpec `json:"spec"`
	// Written by the penaltybox agents (one of them at a time).
	// +optional
	Status PolicyStatus `json:"status,omitempty"`
}

// BackendPolicyList is a list of BackendPolicies.
//
// +kubebuilder:object:root=true
type BackendPolicyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []BackendPolicy `json:"items"`
}

// BackendPolicySpec: the targets, failure accrual with the config file's
// fields, the circuit breaker's limits in the Gateway API's words, and
// retryRefused.
type BackendPolicySpec struct {
	// The Services the policy applies to, in the policy's namespace; with
	// sectionName, only that port of the Service (its name in
	// spec.ports). As Gateway API policies: a Service named twice needs a
	// sectionName in each reference, and a different one.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=16
	// +listType=atomic
	// +kubebuilder:validation:XValidation:message="sectionName must be specified when targetRefs includes 2 or more references to the same target",rule="self.all(p1, self.all(p2, p1.group == p2.group && p1.kind == p2.kind && p1.name == p2.name ? ((!has(p1.sectionName) || p1.sectionName == '') == (!has(p2.sectionName) || p2.sectionName == '')) : true))"
	// +kubebuilder:validation:XValidation:message="sectionName must be unique when targetRefs includes 2 or more references to the same target",rule="self.all(p1, self.exists_one(p2, p1.group == p2.group && p1.kind == p2.kind && p1.name == p2.name && (((!has(p1.sectionName) || p1.sectionName == '') && (!has(p2.sectionName) || p2.sectionName == '')) || (has(p1.sectionName) && has(p2.sectionName) && p1.sectionName == p2.sectionName))))"
	TargetRefs []LocalPolicyTargetReferenceWithSectionName `json:"targetRefs"`

	// Failure accrual, with the config file's fields, units and defaults
	// (and the annotations' penaltybox.io/failure-accrual-*). Durations
	// are Go durations such as 500ms, 10s, 1m.
	// +optional
	FailureAccrual *FailureAccrual `json:"failureAccrual,omitempty"`

	// Live connections (flows) the node lets each targeted Service, and
	// each of its endpoints, hold; a new connection over a limit gets an
	// immediate RST.
	// +optional
	CircuitBreaker *CircuitBreaker `json:"circuitBreaker,omitempty"`

	// A refused new connection's SYN is replayed at once to another
	// endpoint; its client sees one more round trip, not the refusal
	// (default true; false lets refusals reach clients).
	// +optional
	RetryRefused *bool `json:"retryRefused,omitempty"`
}

// LocalPolicyTargetReferenceWithSectionName is the Gateway API's reference
// to a target in the policy's namespace: here a Service, or one of its
// ports.
type LocalPolicyTargetReferenceWithSectionName struct {
	// The target's API group; "" (core) for a Service.
	// +kubebuilder:validation:Enum=""
	Group string `json:"group"`
	// The target's kind; Service.
	// +kubebuilder:validation:Enum=Service
	Kind string `json:"kind"`
	// The Service's name.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name"`
	// The name of one of the Service's ports (spec.ports[].name): the
	// policy applies to that port alone. Absent: every port.
	// +optional
	SectionName *SectionName `json:"sectionName,omitempty"`
}

// SectionName is the name of a section of a target: a Service port's name
// (a DNS label, as Kubernetes requires of port names).
// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
// +kubebuilder:validation:MinLength=1
// +kubebuilder:validation:MaxLength=253
type SectionName string

// Duration is a Go duration: 500ms, 10s, 1m30s.
// +kubebuilder:validation:Pattern=`^(0|(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h))+)$`
// +kubebuilder:validation:MaxLength=32
type Duration string

// FailureAccrual: when an endpoint is ejected, for how long, and how it
// comes back (a probe).
//
// +kubebuilder:validation:XValidation:rule="!has(self.minPenalty) || !has(self.maxPenalty) || duration(self.minPenalty) <= duration(self.maxPenalty)",message="minPenalty must not exceed maxPenalty",fieldPath=".minPenalty"
// +kubebuilder:validation:XValidation:rule="!has(self.failureRateThreshold) || !has(self.successRateThreshold)",message="set either failureRateThreshold or successRateThreshold (1 minus the other), not both",fieldPath=".successRateThreshold"
// +kubebuilder:validation:XValidation:rule="!has(self.minCalls) || !has(self.windowCalls) || self.windowCalls == 0 || self.minCalls <= self.windowCalls",message="minCalls must not exceed windowCalls (the window could never hold that many)",fieldPath=".minCalls"
// +kubebuilder:validation:XValidation:rule="!has(self.slowConnectThreshold) || !has(self.connectTimeout) || duration(self.slowConnectThreshold) < duration(self.connectTimeout)",message="slowConnectThreshold must be below connectTimeout (a slower handshake is a timeout)",fieldPath=".slowConnectThreshold"
type FailureAccrual struct {
	// consecutive (default): eject after maxFailures failures in a row;
	// failure-rate: eject when the window's failure rate exceeds
	// failureRateThreshold; unified: either; none: never eject.
	// +kubebuilder:validation:Enum=consecutive;failure-rate;unified;none
	// +optional
	Mode *string `json:"mode,omitempty"`
	// Consecutive failures that eject an endpoint (default 7; at most
	// 1000000).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000
	// +optional
	MaxFailures *int64 `json:"maxFailures,omitempty"`
	// First ejection's penalty, doubled on each relapse up to maxPenalty
	// (default 1s).
	// +optional
	MinPenalty *Duration `json:"minPenalty,omitempty"`
	// Cap of the doubling penalty (default 1m; at most 24h, so no doubling
	// or jitter can overflow).
	// +kubebuilder:validation:XValidation:rule="duration(self) <= duration('24h')",message="maxPenalty must be at most 24h"
	// +optional
	MaxPenalty *Duration `json:"maxPenalty,omitempty"`
	// A penalty varies uniformly by this ratio either way (default 0.5).
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1
	// +optional
	JitterRatio *float64 `json:"jitterRatio,omitempty"`
	// No SYN-ACK within this is a timeout failure (default 1s; at most 30s,
	// as every connection is tracked on the node for this long).
	// +kubebuilder:validation:XValidation:rule="duration(self) <= duration('30s')",message="connectTimeout must be at most 30s"
	// +optional
	ConnectTimeout *Duration `json:"connectTimeout,omitempty"`
	// The failures that count (default refused, timeout, reset).
	// +kubebuilder:validation:MaxItems=4
	// +listType=set
	// +optional
	FailureKinds []FailureKind `json:"failureKinds,omitempty"`
	// At most this share of a Service's endpoints is ejected at once
	// (default 100).
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +optional
	MaxEjectionPercent *int64 `json:"maxEjectionPercent,omitempty"`
	// The time window the rate rules judge (default 10s; from 10ms to 1h).
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('10ms') && duration(self) <= duration('1h')",message="window must be within [10ms, 1h]"
	// +optional
	Window *Duration `json:"window,omitempty"`
	// When above 0, a window of the last windowCalls connections instead
	// of a time window (default 0).
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100000
	// +optional
	WindowCalls *int64 `json:"windowCalls,omitempty"`
	// Connections the window must hold before a rate is judged (default 5).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100000
	// +optional
	MinCalls *int64 `json:"minCalls,omitempty"`
	// Modes failure-rate and unified eject an endpoint whose window's
	// failure rate is above this (default 0.2).
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:ExclusiveMinimum=true
	// +kubebuilder:validation:Maximum=1
	// +kubebuilder:validation:ExclusiveMaximum=true
	// +optional
	FailureRateThreshold *float64 `json:"failureRateThreshold,omitempty"`
	// Linkerd's spelling of the same rule, 1 minus failureRateThreshold
	// (e.g. 0.8). Set one of the two.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:ExclusiveMinimum=true
	// +kubebuilder:validation:Maximum=1
	// +kubebuilder:validation:ExclusiveMaximum=true
	// +optional
	SuccessRateThreshold *float64 `json:"successRateThreshold,omitempty"`
	// A handshake at least this long is a slow connect; 0s (default) turns
	// the rule off. Below connectTimeout.
	// +optional
	SlowConnectThreshold *Duration `json:"slowConnectThreshold,omitempty"`
	// An endpoint whose window's share of slow connects is above this is
	// ejected (default 0.5).
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:ExclusiveMinimum=true
	// +kubebuilder:validation:Maximum=1
	// +kubebuilder:validation:ExclusiveMaximum=true
	// +optional
	SlowConnectRateThreshold *float64 `json:"slowConnectRateThreshold,omitempty"`
	// Eject endpoints whose success rate is an outlier among their peers'
	// (Envoy's success-rate rule; default false).
	// +optional
	Outliers *bool `json:"outliers,omitempty"`
	// Standard deviations below the mean that make an outlier (default
	// 1.9).
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:ExclusiveMinimum=true
	// +optional
	OutlierStdevFactor *float64 `json:"outlierStdevFactor,omitempty"`
	// Endpoints with enough calls needed before outliers are judged
	// (default 5).
	// +kubebuilder:validation:Minimum=2
	// +kubebuilder:validation:Maximum=100000
	// +optional
	OutlierMinHosts *int64 `json:"outlierMinHosts,omitempty"`
	// Calls an endpoint's window needs to be judged an outlier (default
	// 100).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100000
	// +optional
	OutlierMinCalls *int64 `json:"outlierMinCalls,omitempty"`
}

// FailureKind is an L4 failure that can count against an endpoint.
// +kubebuilder:validation:Enum=refused;timeout;reset;reset-after-data
type FailureKind string

// CircuitBreaker: live flows per Service port and per endpoint.
type CircuitBreaker struct {
	// Live flows per Service port; 0 is no limit. Absent, the annotation
	// penaltybox.io/max-inflight or the agent's --max-inflight-default
	// applies.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=4294967295
	// +optional
	MaxInflightRequests *int64 `json:"maxInflightRequests,omitempty"`
	// Live flows per endpoint; 0 is no limit (default).
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=4294967295
	// +optional
	MaxInflightRequestsPerEndpoint *int64 `json:"maxInflightRequestsPerEndpoint,omitempty"`
}

// PolicyStatus is the Gateway API's PolicyStatus: one entry per target
// (its "ancestor": a Service, or a port of it) and controller.
type PolicyStatus struct {
	// One entry per targeted Service (or Service port) and controller, as
	// Gateway API policies report.
	// +kubebuilder:validation:MaxItems=16
	// +listType=atomic
	// +optional
	Ancestors []PolicyAncestorStatus `json:"ancestors,omitempty"`
}

// PolicyAncestorStatus is the Gateway API's: the ancestor, the controller
// that judged the policy there, and its conditions.
type PolicyAncestorStatus struct {
	// The target the status is about.
	AncestorRef ParentReference `json:"ancestorRef"`
	// penaltybox.io/agent for penaltybox's verdict.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	ControllerName string `json:"controllerName"`
	// Accepted: True when the policy is in force on the Service (port);
	// False with reason Conflicted (an older policy targets it), Invalid
	// (its settings, over the Service's annotations, are not valid: the
	// message names the field) or TargetNotFound.
	// +kubebuilder:validation:MaxItems=8
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// ParentReference is the Gateway API's, as far as a Service target needs
// it.
type ParentReference struct {
	// +optional
	Group *string `json:"group,omitempty"`
	// +optional
	Kind *string `json:"kind,omitempty"`
	// +optional
	Namespace *string `json:"namespace,omitempty"`
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name"`
	// The port's name, for a policy that targets one.
	// +optional
	SectionName *SectionName `json:"sectionName,omitempty"`
}
