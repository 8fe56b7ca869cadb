// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"cmp"
	"net/netip"
	"slices"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/penaltybox/penaltybox/pkg/desired"
)

// ServiceName is the desired-state name of one port of a Service:
// "namespace/name:port-name", or the port number when the port is unnamed
// (a single-port Service).
func ServiceName(namespace, name string, port corev1.ServicePort) string {
	p := port.Name
	if p == "" {
		p = strconv.Itoa(int(port.Port))
	}
	return namespace + "/" + name + ":" + p
}

// Translate turns one Service and its EndpointSlices into desired services,
// one per ClusterIP port, following kube-proxy's rules:
//
//   - Services without a ClusterIP (ExternalName) and headless Services
//     (ClusterIP None) are not load-balanced: DNS answers for them.
//   - A Service without a selector is load-balanced like any other, from
//     whatever EndpointSlices carry its kubernetes.io/service-name label.
//   - Each ClusterIP (one per family: IPv4, IPv6 or both) is a desired
//     service per port, over the EndpointSlices of its family (addressType
//     IPv4 or IPv6). The primary family's (ClusterIPs[0]) are named as
//     usual; a dual-stack Service's second family's get "/ipv4" or "/ipv6"
//     after the name, so every desired service's name stays its own.
//   - Ports: TCP and UDP (SCTP is not load-balanced). A Service port takes
//     the slice ports of the same name and protocol; the slice port's number
//     is the pod's (named targetPorts are resolved per pod by the slice).
//   - An endpoint's first address is used. Ready is true unless the
//     condition says false; serving defaults to ready; terminating to false.
//   - Backends are the ready endpoints. When none is ready, endpoints that
//     are terminating but still serving are used instead, so connections
//     during a rollout's last pod shutting down still land somewhere.
//   - internalTrafficPolicy: Local keeps only this node's endpoints (by
//     the endpoint's nodeName), with the same terminating fallback.
//   - An endpoint listed in two slices (during a slice's handover) counts
//     once; a ready copy wins over a not-ready one.
//   - sessionAffinity ClientIP: a client's connections stay with one
//     endpoint for the configured timeout after its last (see affinity).
//
// One rule is ours: a port with a backend on one of the node's own
// addresses (a host-network pod on this node, like the API server on a
// control-plane node) is left out and reported in hostLocal, for
// kube-proxy to handle. That backend's replies leave the host's own
// network stack straight into the client's veth without crossing any XDP
// hook, so nothing would rewrite their source back to the ClusterIP.
//
// Topology, as kube-proxy has it (its CategorizeEndpoints): when every
// ready endpoint carries hints (the EndpointSlice controller writes them
// for trafficDistribution PreferSameNode, PreferSameZone or PreferClose,
// and for topology-aware routing) and at least one names this node
// (hints.forNodes) or else this node's zone (hints.forZones, the node's
// topology.kubernetes.io/zone label), only the endpoints so named are
// used; otherwise all are. Accrual and the ejection budget then work
// within that set. internalTrafficPolicy Local ignores hints, as
// kube-proxy does.
//
// Endpoints are sorted by address, so the result does not depend on slice
// or list order. epSlices may include slices of other Services: only those
// labelled with this Service's name in its namespace are used.
func Translate(svc *corev1.Service, epSlices []*discoveryv1.EndpointSlice, settings Settings, node Node) (out []desired.Service, hostLocal []string) {
	return translate(svc, compactSlices(epSlices), settings, node)
}

// translate is Translate on the slices as the controller caches them.
func translate(svc *corev1.Service, epSlices []*endpointSlice, settings Settings, node Node) (out []desired.Service, hostLocal []string) {
	vips := clusterIPs(svc)
	local := svc.Spec.InternalTrafficPolicy != nil && *svc.Spec.InternalTrafficPolicy == corev1.ServiceInternalTrafficPolicyLocal
	for i, vip := range vips {
		o, h := translateFamily(svc, vip, i > 0, epSlices, settings, node, local)
		out, hostLocal = append(out, o...), append(hostLocal, h...)
	}
	return out, hostLocal
}

// translateFamily is Translate for one of the Service's ClusterIPs;
// second is true for a dual-stack Service's second family.
func translateFamily(svc *corev1.Service, vip netip.Addr, second bool, epSlices []*endpointSlice,
	settings Settings, node Node, local bool) (out []desired.Service, hostLocal []string) {
	for _, port := range svc.Spec.Ports {
		proto, ok := protocol(port.Protocol)
		if !ok {
			continue
		}
		name := ServiceName(svc.Namespace, svc.Name, port)
		if second {
			name += "/" + familyName(vip)
		}
		eps := choose(endpointsFor(svc, port, epSlices, vip.Is4()), local, node)
		if slices.ContainsFunc(eps, func(e desired.Endpoint) bool { return node.Addrs[e.Addr.Addr()] }) {
			hostLocal = append(hostLocal, name)
			continue
		}
		// A BackendPolicy with sectionName may set this port's own.
		ps := settings.ForPort(port.Name)
		out = append(out, desired.Service{
			Name:      name,
			Key:       desired.Key{VIP: vip, Port: uint16(port.Port), Protocol: proto},
			Endpoints: eps,
			Accrual:   ps.Accrual,
			// Each port is its own desired service, so each gets the
			// Service's limit.
			MaxInflight:            ps.MaxInflight,
			MaxInflightPerEndpoint: ps.MaxInflightPerEndpoint,
			RetryRefused:           ps.RetryRefused,
			Affinity:               affinity(svc),
		})
	}
	return out, hostLocal
}

// affinity is the Service's sessionAffinity timeout as kube-proxy applies
// it: ClientIP with sessionAffinityConfig.clientIP.timeoutSeconds, 10800
// (3 hours) when unset; 0 for None. The API server keeps the timeout
// within (0, 86400]; one outside is taken as the default or the maximum.
func affinity(svc *corev1.Service) time.Duration {
	if svc.Spec.SessionAffinity != corev1.ServiceAffinityClientIP {
		return 0
	}
	secs := int32(corev1.DefaultClientIPServiceAffinitySeconds)
	if c := svc.Spec.SessionAffinityConfig; c != nil && c.ClientIP != nil && c.ClientIP.TimeoutSeconds != nil &&
		*c.ClientIP.TimeoutSeconds > 0 {
		secs = *c.ClientIP.TimeoutSeconds
	}
	return min(time.Duration(secs)*time.Second, desired.MaxAffinity)
}

// Keys are the datapath keys Translate would give the Service's ports
// (every ClusterIP, TCP and UDP ports), endpoints or not: those of a
// Service left to kube-proxy, which the datapath hands back.
func Keys(svc *corev1.Service) []desired.Key {
	var out []desired.Key
	for _, vip := range clusterIPs(svc) {
		for _, port := range svc.Spec.Ports {
			if proto, ok := protocol(port.Protocol); ok {
				out = append(out, desired.Key{VIP: vip, Port: uint16(port.Port), Protocol: proto})
			}
		}
	}
	return out
}

// Node is what Translate needs to know of the node it runs on.
type Node struct {
	Name string
	// Zone is the node's topology.kubernetes.io/zone label ("": none).
	Zone string
	// Addrs are the node's own addresses.
	Addrs map[netip.Addr]bool
}

// clusterIPs returns the Service's ClusterIPs, primary family first, at
// most one per family; none for headless and ExternalName Services.
func clusterIPs(svc *corev1.Service) []netip.Addr {
	if svc.Spec.Type == corev1.ServiceTypeExternalName {
		return nil
	}
	ips := svc.Spec.ClusterIPs
	if len(ips) == 0 && svc.Spec.ClusterIP != "" {
		ips = []string{svc.Spec.ClusterIP}
	}
	var out []netip.Addr
	for _, s := range ips {
		if s == corev1.ClusterIPNone {
			return nil
		}
		a, err := netip.ParseAddr(s)
		if err != nil || a.Is4In6() || a.Zone() != "" {
			continue
		}
		if !slices.ContainsFunc(out, func(b netip.Addr) bool { return b.Is4() == a.Is4() }) {
			out = append(out, a)
		}
	}
	return out
}

// familyName is "ipv4" or "ipv6".
func familyName(a netip.Addr) string {
	if a.Is4() {
		return "ipv4"
	}
	return "ipv6"
}

func protocol(p corev1.Protocol) (desired.Protocol, bool) {
	switch p {
	case corev1.ProtocolTCP, "": // the API server defaults it to TCP
		return desired.TCP, true
	case corev1.ProtocolUDP:
		return desired.UDP, true
	}
	return 0, false
}

// endpoint is one slice endpoint for one Service port, with the
// conditions kube-proxy looks at.
type endpoint struct {
	desired.Endpoint
	ready, serving, terminating bool
	node                        string
	// forZones and forNodes are the endpoint's topology hints.
	forZones, forNodes []string
}

// endpointsFor collects the endpoints of one Service port from the slices
// of one family (v4: addressType IPv4, else IPv6), deduplicated by address.
func endpointsFor(svc *corev1.Service, port corev1.ServicePort, all []*endpointSlice, v4 bool) []endpoint {
	want, _ := protocol(port.Protocol)
	addrType := discoveryv1.AddressTypeIPv6
	if v4 {
		addrType = discoveryv1.AddressTypeIPv4
	}
	ordered := make([]*endpointSlice, 0, len(all))
	n := 0
	for _, sl := range all {
		if sl.Namespace == svc.Namespace && sl.service == svc.Name && sl.addressType == addrType {
			ordered = append(ordered, sl)
			n += len(sl.endpoints)
		}
	}
	slices.SortFunc(ordered, func(a, b *endpointSlice) int { return cmp.Compare(a.Name, b.Name) })

	byAddr := make(map[netip.AddrPort]int, n)
	out := make([]endpoint, 0, n)
	for _, sl := range ordered {
		var portNum int32
		found := false
		for _, p := range sl.ports {
			if !p.known {
				continue
			}
			if p.name == port.Name && p.proto == want && p.hasPort {
				portNum, found = p.port, true
				break
			}
		}
		if !found || portNum <= 0 || portNum > 65535 {
			continue
		}
		for i := range sl.endpoints {
			e := &sl.endpoints[i]
			addr := e.addr
			if !addr.IsValid() || addr.Is4() != v4 || addr.Is4In6() || addr.Zone() != "" {
				continue
			}
			ep := endpoint{
				Endpoint:    desired.Endpoint{Addr: netip.AddrPortFrom(addr, uint16(portNum)), Name: e.name},
				ready:       e.flags&epReady != 0,
				serving:     e.flags&epServing != 0,
				terminating: e.flags&epTerminating != 0,
				node:        e.nodeName(),
			}
			if e.hints != nil {
				ep.forZones, ep.forNodes = e.hints.zones, e.hints.nodes
			}
			if i, dup := byAddr[ep.Addr]; dup {
				if ep.ready && !out[i].ready {
					out[i] = ep
				}
				continue
			}
			byAddr[ep.Addr] = len(out)
			out = append(out, ep)
		}
	}
	return out
}

// endpointName names the endpoint for people: "namespace/pod" from its
// targetRef, else its hostname, else nothing (the address stands alone).
func endpointName(namespace string, e discoveryv1.Endpoint) string {
	if r := e.TargetRef; r != nil && r.Name != "" {
		ns := r.Namespace
		if ns == "" {
			ns = namespace
		}
		return ns + "/" + r.Name
	}
	if e.Hostname != nil {
		return namespace + "/" + *e.Hostname
	}
	return ""
}

// choose picks the backends among eps: ready ones (of the node's topology
// when the hints say so, see topology), else serving terminating ones;
// only this node's when local.
func choose(eps []endpoint, local bool, node Node) []desired.Endpoint {
	// Counted first: the result is kept (the controller's and the
	// reconciler's desired state) and an append's doubling would leave it
	// up to twice its size, at 10,000 Services megabytes.
	usable := func(pick func(endpoint) bool) []desired.Endpoint {
		use := func(e endpoint) bool { return (!local || e.node == node.Name) && pick(e) }
		n := 0
		for _, e := range eps {
			if use(e) {
				n++
			}
		}
		if n == 0 {
			return nil
		}
		out := make([]desired.Endpoint, 0, n)
		for _, e := range eps {
			if use(e) {
				out = append(out, e.Endpoint)
			}
		}
		return out
	}
	inTopology := func(endpoint) bool { return true }
	if !local {
		inTopology = topology(eps, node)
	}
	out := usable(func(e endpoint) bool { return e.ready && inTopology(e) })
	if len(out) == 0 {
		out = usable(func(e endpoint) bool { return e.serving && e.terminating })
	}
	slices.SortFunc(out, func(a, b desired.Endpoint) int { return a.Addr.Compare(b.Addr) })
	return out
}

// topology is kube-proxy's topologyModeFromHints and availableForTopology:
// when every ready endpoint has node hints and one names this node, the
// endpoints hinted for this node; else, when every ready endpoint has zone
// hints and one names this node's zone, those hinted for the zone; else
// every endpoint. With no ready endpoint, every endpoint (the terminating
// fallback ignores hints).
func topology(eps []endpoint, node Node) func(endpoint) bool {
	allNodes, allZones := true, true
	forNode, forZone := false, false
	ready := 0
	for _, e := range eps {
		if !e.ready {
			continue
		}
		ready++
		if len(e.forNodes) == 0 {
			allNodes = false
		} else if node.Name != "" && slices.Contains(e.forNodes, node.Name) {
			forNode = true
		}
		if len(e.forZones) == 0 {
			allZones = false
		} else if node.Zone != "" && slices.Contains(e.forZones, node.Zone) {
			forZone = true
		}
	}
	switch {
	case ready > 0 && allNodes && forNode:
		return func(e endpoint) bool { return slices.Contains(e.forNodes, node.Name) }
	case ready > 0 && allZones && forZone:
		return func(e endpoint) bool { return slices.Contains(e.forZones, node.Zone) }
	}
	return func(endpoint) bool { return true }
}
