// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"net/netip"
	"slices"
	"unique"

	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/penaltybox/penaltybox/pkg/desired"
)

// endpointSlice is what the controller keeps of a discovery.k8s.io/v1
// EndpointSlice: the fields Translate reads, the first address of each
// endpoint already parsed. The informers' transform (stripForCache) makes
// one of every slice before it is cached, so the cache does not hold the
// API object: a slice of ten endpoints took about 2.3 KB as decoded and
// takes about 1 KB so, and the pod references, node and zone names and
// copied labels that real clusters' slices carry are not kept at all.
type endpointSlice struct {
	// cacheMeta keeps the name, namespace, UID and resourceVersion: what
	// the informer's store and the controller's ordering use.
	cacheMeta
	// service is the kubernetes.io/service-name label: the Service the
	// slice belongs to.
	service     string
	addressType discoveryv1.AddressType
	ports       []slicePort
	endpoints   []sliceEndpoint
}

// slicePort is one of a slice's ports.
type slicePort struct {
	name string
	// proto is the port's protocol (unset: TCP); known is false for a
	// protocol the datapath does not balance (SCTP), which matches no
	// Service port.
	proto   desired.Protocol
	known   bool
	port    int32
	hasPort bool // port was set
}

// sliceEndpoint is one of a slice's endpoints.
type sliceEndpoint struct {
	// addr is the endpoint's first address (kube-proxy uses only that);
	// the zero Addr when it has none or it does not parse.
	addr netip.Addr
	name string // endpointName: "namespace/pod", or "" when unnamed
	// node is nodeName, interned: the endpoints of a node share one copy
	// of its name (the zero handle: unset).
	node  unique.Handle[string]
	flags endpointFlags
	hints *sliceHints // nil: no hints
}

// endpointFlags are an endpoint's conditions as kube-proxy reads them.
type endpointFlags uint8

const (
	epReady       endpointFlags = 1 << iota // ready, or unset
	epServing                               // serving, or unset and ready
	epTerminating                           // terminating
)

// sliceHints are an endpoint's topology hints: the zones and nodes it is
// hinted for.
type sliceHints struct {
	zones, nodes []string
}

// nodeName is the endpoint's nodeName, "" when unset.
func (e *sliceEndpoint) nodeName() string {
	if e.node == (unique.Handle[string]{}) {
		return ""
	}
	return e.node.Value()
}

// compactSlice makes the controller's copy of an EndpointSlice.
func compactSlice(sl *discoveryv1.EndpointSlice) *endpointSlice {
	out := &endpointSlice{
		cacheMeta:   metaOf(&sl.ObjectMeta, nil, nil),
		service:     sl.Labels[discoveryv1.LabelServiceName],
		addressType: internAddressType(sl.AddressType),
	}
	if len(sl.Ports) > 0 {
		out.ports = make([]slicePort, len(sl.Ports))
	}
	for i, p := range sl.Ports {
		sp := slicePort{proto: desired.TCP, known: true}
		if p.Name != nil {
			sp.name = *p.Name
		}
		if p.Protocol != nil {
			sp.proto, sp.known = protocol(*p.Protocol)
		}
		if p.Port != nil {
			sp.port, sp.hasPort = *p.Port, true
		}
		out.ports[i] = sp
	}
	if len(sl.Endpoints) > 0 {
		out.endpoints = make([]sliceEndpoint, len(sl.Endpoints))
	}
	for i, e := range sl.Endpoints {
		se := sliceEndpoint{name: endpointName(out.Namespace, e)}
		if len(e.Addresses) > 0 {
			if a, err := netip.ParseAddr(e.Addresses[0]); err == nil {
				se.addr = a
			}
		}
		ready := e.Conditions.Ready == nil || *e.Conditions.Ready
		serving := ready
		if e.Conditions.Serving != nil {
			serving = *e.Conditions.Serving
		}
		if ready {
			se.flags |= epReady
		}
		if serving {
			se.flags |= epServing
		}
		if e.Conditions.Terminating != nil && *e.Conditions.Terminating {
			se.flags |= epTerminating
		}
		if e.NodeName != nil && *e.NodeName != "" {
			se.node = unique.Make(*e.NodeName)
		}
		if h := e.Hints; h != nil && (len(h.ForZones) > 0 || len(h.ForNodes) > 0) {
			se.hints = &sliceHints{}
			for _, z := range h.ForZones {
				se.hints.zones = append(se.hints.zones, z.Name)
			}
			for _, n := range h.ForNodes {
				se.hints.nodes = append(se.hints.nodes, n.Name)
			}
		}
		out.endpoints[i] = se
	}
	return out
}

// compactSlices converts API slices (Translate's callers hold those).
func compactSlices(in []*discoveryv1.EndpointSlice) []*endpointSlice {
	out := make([]*endpointSlice, len(in))
	for i, sl := range in {
		out[i] = compactSlice(sl)
	}
	return out
}

// internAddressType returns the package's constant for the usual types.
func internAddressType(t discoveryv1.AddressType) discoveryv1.AddressType {
	switch t {
	case discoveryv1.AddressTypeIPv4:
		return discoveryv1.AddressTypeIPv4
	case discoveryv1.AddressTypeIPv6:
		return discoveryv1.AddressTypeIPv6
	case discoveryv1.AddressTypeFQDN:
		return discoveryv1.AddressTypeFQDN
	}
	return t
}

// GetObjectKind makes endpointSlice a runtime.Object, as the informer's
// store wants; it carries no type information.
func (s *endpointSlice) GetObjectKind() schema.ObjectKind { return schema.EmptyObjectKind }

// DeepCopyObject copies s; the hints, which nothing changes once made,
// are shared.
func (s *endpointSlice) DeepCopyObject() runtime.Object {
	c := *s
	c.cacheMeta = s.cacheMeta.deepCopy()
	c.ports = slices.Clone(s.ports)
	c.endpoints = slices.Clone(s.endpoints)
	return &c
}
