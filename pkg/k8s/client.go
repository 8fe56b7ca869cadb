// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"fmt"
	"slices"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/penaltybox/penaltybox/internal/version"
)

// Clients are the agent's connections to the API server.
type Clients struct {
	// Core reads and writes the built-in types (Services, EndpointSlices,
	// Events, Leases) in protobuf.
	Core kubernetes.Interface
	// Dynamic reads BackendPolicies and writes their status, in JSON (a
	// custom resource has no protobuf).
	Dynamic dynamic.Interface
}

// NewClients connects with the kubeconfig file at path, or, when path is
// empty, with the pod's service account (in-cluster config). Responses
// come uncompressed unless compression is set (and the kubeconfig's
// disable-compression is not): see below.
func NewClients(path string, compression bool) (Clients, error) {
	var cfg *rest.Config
	var err error
	if path != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", path)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return Clients{}, fmt.Errorf("kubernetes client config: %w", err)
	}
	// "penaltybox-agent/0.1.0 (9f29218c0a1b)": audit logs and API
	// priority and fairness can tell the agent's versions apart.
	cfg.UserAgent = version.UserAgent()
	// The API server gzips large lists (10,000 Services is megabytes) on
	// the node's cores as the agent starts, and the agent un-gzips them on
	// the same ones: CPU on both sides to save bytes on a link that, in a
	// cluster, is fast. kube-controller-manager and kube-scheduler turn it
	// off for the same reason (kubernetes/kubernetes#112296).
	cfg.DisableCompression = cfg.DisableCompression || !compression
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return Clients{}, fmt.Errorf("kubernetes client: %w", err)
	}
	// Protobuf is cheaper than JSON for the API server and for us; every
	// built-in type the agent reads or writes has it.
	pb := rest.CopyConfig(cfg)
	pb.ContentType = "application/vnd.kubernetes.protobuf"
	pb.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	core, err := kubernetes.NewForConfig(pb)
	if err != nil {
		return Clients{}, fmt.Errorf("kubernetes client: %w", err)
	}
	return Clients{Core: core, Dynamic: dyn}, nil
}

// PoliciesServed reports whether the API server serves BackendPolicies
// (deploy/backendpolicy-crd.yaml is installed).
func PoliciesServed(d discovery.DiscoveryInterface) (bool, error) {
	return served(d, PolicyGroup+"/"+PolicyVersion, PolicyResource)
}

// FleetServed reports whether the API server serves the fleet evidence
// CRDs (deploy/fleet-crd.yaml is installed).
func FleetServed(d discovery.DiscoveryInterface) (bool, error) {
	return served(d, FleetGroup+"/"+FleetVersion, ReportResource, VerdictResource)
}

// served reports whether the API server serves every one of resources in
// groupVersion.
func served(d discovery.DiscoveryInterface, groupVersion string, resources ...string) (bool, error) {
	rl, err := d.ServerResourcesForGroupVersion(groupVersion)
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("discovery of %s: %w", groupVersion, err)
	}
	for _, want := range resources {
		if !slices.ContainsFunc(rl.APIResources, func(r metav1.APIResource) bool { return r.Name == want }) {
			return false, nil
		}
	}
	return true, nil
}
