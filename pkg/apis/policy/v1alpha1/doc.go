// SPDX-License-Identifier: Apache-2.0

// Package v1alpha1 holds the BackendPolicy API (policy.penaltybox.io/v1alpha1):
// the Go types with the kubebuilder markers that controller-gen turns into
// deploy/backendpolicy-crd.yaml and zz_generated.deepcopy.go (`make
// generate-crds`; `make check-generated` fails when the committed files
// differ from what these types generate).
//
// The agent reads policies with the dynamic client (pkg/k8s.DecodePolicy),
// keeping spec.failureAccrual as written so that a field the policy leaves
// out keeps the Service's annotation; a test decodes every field of these
// types that way, so the two cannot drift apart.
//
// +kubebuilder:object:generate=true
// +groupName=policy.penaltybox.io
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// SchemeGroupVersion is the group and version of these types.
var SchemeGroupVersion = schema.GroupVersion{Group: "policy.penaltybox.io", Version: "v1alpha1"}

// AddToScheme registers BackendPolicy and BackendPolicyList.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(SchemeGroupVersion, &BackendPolicy{}, &BackendPolicyList{})
	metav1.AddToGroupVersion(s, SchemeGroupVersion)
	return nil
}
