// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"fmt"
	"net/netip"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/penaltybox/penaltybox/pkg/fleet"
)

// The fleet evidence API (deploy/fleet-crd.yaml): one cluster-scoped
// EndpointReport per node, named after it, and one EndpointVerdict per
// Service, in its namespace and named after it.
const (
	FleetGroup      = "fleet.penaltybox.io"
	FleetVersion    = "v1alpha1"
	ReportResource  = "endpointreports"
	VerdictResource = "endpointverdicts"
)

var (
	ReportGVR  = schema.GroupVersionResource{Group: FleetGroup, Version: FleetVersion, Resource: ReportResource}
	VerdictGVR = schema.GroupVersionResource{Group: FleetGroup, Version: FleetVersion, Resource: VerdictResource}
)

// ReportSpec is an EndpointReport's spec: one node's counts over its
// windows when it wrote them (WrittenAt), valid until ExpiresAt.
type ReportSpec struct {
	WrittenAt metav1.MicroTime `json:"writtenAt"`
	ExpiresAt metav1.Time      `json:"expiresAt"`
	Endpoints []ReportEntry    `json:"endpoints,omitempty"`
}

// ReportEntry is one endpoint's count in a report.
type ReportEntry struct {
	Service  string `json:"service"` // "ns/svc:port"
	Address  string `json:"address"` // "ip:port"
	Calls    uint32 `json:"calls"`
	Failures uint32 `json:"failures"`
	Suspect  bool   `json:"suspect,omitempty"`
	// Acted: the condemnation (its generation) after which the node's
	// window began; 0 or absent: none.
	Acted int64 `json:"acted,omitempty"`
}

// VerdictSpec is an EndpointVerdict's spec: the aggregator's conclusions
// for one Service, valid until ExpiresAt.
type VerdictSpec struct {
	ExpiresAt metav1.Time        `json:"expiresAt"`
	Suspects  []VerdictEndpoint  `json:"suspects,omitempty"`
	Condemned []VerdictCondemned `json:"condemned,omitempty"`
}

// VerdictEndpoint names one endpoint of the Service.
type VerdictEndpoint struct {
	Service string `json:"service"`
	Address string `json:"address"`
}

// VerdictCondemned is an endpoint the fleet's evidence ejects.
type VerdictCondemned struct {
	VerdictEndpoint `json:",inline"`
	Generation      int64  `json:"generation"`
	Level           int    `json:"level,omitempty"`
	Calls           uint32 `json:"calls"`
	Failures        uint32 `json:"failures"`
	Nodes           int    `json:"nodes"`
}

// EncodeReport is a report of counts written at at, valid until expires.
// Times keep their microseconds: the aggregator compares a report's time
// with a condemnation's.
func EncodeReport(counts []fleet.Count, at, expires time.Time) ReportSpec {
	s := ReportSpec{WrittenAt: metav1.NewMicroTime(at.UTC()), ExpiresAt: metav1.NewTime(expires.UTC().Truncate(time.Second))}
	for _, c := range counts {
		s.Endpoints = append(s.Endpoints, ReportEntry{Service: c.Service, Address: c.Addr.String(),
			Calls: c.Calls, Failures: c.Failures, Suspect: c.Suspect, Acted: c.Acted})
	}
	return s
}

// DecodeReport reads an EndpointReport. Entries that do not parse are
// left out and counted in bad: one node's bad entry must not hide the
// rest of its evidence.
func DecodeReport(u *unstructured.Unstructured) (r fleet.Report, bad int, err error) {
	var spec ReportSpec
	if err := fromUnstructuredSpec(u, &spec); err != nil {
		return fleet.Report{}, 0, err
	}
	r = fleet.Report{Node: u.GetName(), At: spec.WrittenAt.Time, Expires: spec.ExpiresAt.Time}
	for _, e := range spec.Endpoints {
		a, err := netip.ParseAddrPort(e.Address)
		if err != nil || e.Service == "" || e.Failures > e.Calls {
			bad++
			continue
		}
		r.Counts = append(r.Counts, fleet.Count{Key: fleet.Key{Service: e.Service, Addr: a},
			Calls: e.Calls, Failures: e.Failures, Suspect: e.Suspect, Acted: e.Acted})
	}
	return r, bad, nil
}

// ServiceObject returns the namespace and name of the Kubernetes Service
// behind an agent's service name ("ns/svc:port").
func ServiceObject(service string) (ns, name string, ok bool) {
	ns, rest, ok := strings.Cut(service, "/")
	if !ok || ns == "" {
		return "", "", false
	}
	name, _, ok = strings.Cut(rest, ":")
	return ns, name, ok && name != ""
}

// EncodeVerdicts splits v into one spec per Service object
// ("namespace/name"), valid until expires.
func EncodeVerdicts(v fleet.Verdicts, expires time.Time) map[string]VerdictSpec {
	out := map[string]VerdictSpec{}
	at := metav1.NewTime(expires.UTC().Truncate(time.Second))
	get := func(service string) (string, VerdictSpec, bool) {
		ns, name, ok := ServiceObject(service)
		if !ok {
			return "", VerdictSpec{}, false
		}
		k := ns + "/" + name
		s, ok := out[k]
		if !ok {
			s = VerdictSpec{ExpiresAt: at}
		}
		return k, s, true
	}
	for _, k := range v.Suspects {
		if obj, s, ok := get(k.Service); ok {
			s.Suspects = append(s.Suspects, VerdictEndpoint{Service: k.Service, Address: k.Addr.String()})
			out[obj] = s
		}
	}
	for _, c := range v.Condemned {
		if obj, s, ok := get(c.Service); ok {
			s.Condemned = append(s.Condemned, VerdictCondemned{
				VerdictEndpoint: VerdictEndpoint{Service: c.Service, Address: c.Addr.String()},
				Generation:      c.Generation, Level: c.Level, Calls: c.Calls, Failures: c.Failures, Nodes: c.Nodes})
			out[obj] = s
		}
	}
	return out
}

// DecodeVerdict reads an EndpointVerdict: its conclusions and when they
// expire. Entries that do not parse, that name a service of another
// Service object than the verdict's own, or that repeat an endpoint, are
// left out and counted in bad.
func DecodeVerdict(u *unstructured.Unstructured) (v fleet.Verdicts, expires time.Time, bad int, err error) {
	var spec VerdictSpec
	if err := fromUnstructuredSpec(u, &spec); err != nil {
		return fleet.Verdicts{}, time.Time{}, 0, err
	}
	key := func(e VerdictEndpoint) (fleet.Key, bool) {
		ns, name, ok := ServiceObject(e.Service)
		a, err := netip.ParseAddrPort(e.Address)
		return fleet.Key{Service: e.Service, Addr: a}, ok && err == nil && ns == u.GetNamespace() && name == u.GetName()
	}
	for _, e := range spec.Suspects {
		if k, ok := key(e); ok {
			v.Suspects = append(v.Suspects, k)
		} else {
			bad++
		}
	}
	seen := map[fleet.Key]bool{}
	for _, c := range spec.Condemned {
		if k, ok := key(c.VerdictEndpoint); ok && !seen[k] {
			seen[k] = true
			v.Condemned = append(v.Condemned, fleet.Condemned{Key: k, Generation: c.Generation, Level: min(max(c.Level, 0), fleet.MaxLevel),
				Calls: c.Calls, Failures: c.Failures, Nodes: c.Nodes})
		} else {
			bad++
		}
	}
	return v, spec.ExpiresAt.Time, bad, nil
}

// fromUnstructuredSpec decodes u's spec into spec.
func fromUnstructuredSpec(u *unstructured.Unstructured, spec any) error {
	m, ok, err := unstructured.NestedMap(u.Object, "spec")
	if err != nil || !ok {
		return fmt.Errorf("%s %s: no spec", u.GetKind(), u.GetName())
	}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(m, spec); err != nil {
		return fmt.Errorf("%s %s: %w", u.GetKind(), u.GetName(), err)
	}
	return nil
}

// fleetObject builds an object of kind with spec (a pointer), for
// server-side apply.
func fleetObject(kind, namespace, name string, spec any) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(spec)
	if err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{Object: map[string]any{"spec": m}}
	u.SetAPIVersion(FleetGroup + "/" + FleetVersion)
	u.SetKind(kind)
	u.SetName(name)
	if namespace != "" {
		u.SetNamespace(namespace)
	}
	u.SetLabels(map[string]string{"app.kubernetes.io/name": "penaltybox"})
	return u, nil
}
