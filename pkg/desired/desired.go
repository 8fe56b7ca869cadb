// SPDX-License-Identifier: Apache-2.0

// Package desired is the agent's desired state: the services it must
// load-balance and how. The config file and Kubernetes both produce it; the
// reconciler turns it into map contents. It holds no kernel or API types.
package desired

import (
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// Protocol is an IP protocol number.
type Protocol uint8

const (
	TCP Protocol = 6
	UDP Protocol = 17
)

func (p Protocol) String() string {
	switch p {
	case TCP:
		return "tcp"
	case UDP:
		return "udp"
	}
	return fmt.Sprintf("proto(%d)", uint8(p))
}

// Endpoint is one backend of a service.
type Endpoint struct {
	// Addr is of the service's VIP's family.
	Addr netip.AddrPort
	// Name identifies the endpoint to people: the pod ("ns/pod") in
	// Kubernetes, empty in standalone mode.
	Name string
}

// Key identifies a service in the datapath. VIP is IPv4 or IPv6; a
// service's endpoints are all of its VIP's family.
type Key struct {
	VIP      netip.Addr
	Port     uint16
	Protocol Protocol
}

// String reads "198.18.100.1:80/tcp", or "[2001:2::10]:80/tcp" for IPv6.
func (k Key) String() string {
	return netip.AddrPortFrom(k.VIP, k.Port).String() + "/" + k.Protocol.String()
}

// Service is one VIP:port:protocol and its endpoints.
type Service struct {
	// Name is unique within a State: "web" in a config file, "ns/svc:port"
	// in Kubernetes. Metrics and logs use it.
	Name      string
	Key       Key
	Endpoints []Endpoint
	Accrual   accrual.Settings
	// MaxInflight caps live flows to the service; 0 means no limit.
	MaxInflight uint32
	// MaxInflightPerEndpoint caps live flows to each endpoint; 0: no limit.
	MaxInflightPerEndpoint uint32
	// RetryRefused: a new connection a backend refuses is not failed to
	// its client; its SYN retransmission (about a second later) goes to
	// another backend, once.
	RetryRefused bool
	// Affinity is sessionAffinity ClientIP's timeout: a client's new
	// connections go to the endpoint of its last one while that was less
	// than Affinity ago and the endpoint is admitted; 0: no affinity.
	Affinity time.Duration
	// Served says why the source serves the service (Kubernetes mode:
	// the scope, a label, a BackendPolicy; "" from a config file, where
	// every service listed is served).
	Served string
}

// MaxAffinity is the longest session-affinity timeout, as Kubernetes
// validates it: one day.
const MaxAffinity = 24 * time.Hour

// State is everything the agent must program.
type State struct {
	Services []Service
	// HandBack are services that still exist but are no longer served
	// (Kubernetes: a Service opted out, or out of scope): kube-proxy takes
	// their new flows while the flows the datapath admitted finish. A
	// service that leaves Services without being listed here is gone (a
	// Service deleted, a service removed from the config file).
	HandBack []Key
	// Node is what a config file also sets for the node (standalone
	// mode); nil from Kubernetes, where the node's links say where XDP
	// goes and flags set the rest.
	Node *Node
	// Delta: the state is a change to the one applied before it, not the
	// whole: Services are only the services new or changed since (in name
	// order), Gone the keys no longer asked for, and every other service
	// stays as it is. HandBack is complete either way. A source hands over
	// a complete state first (and may at any time); with 10,000 services
	// and a few changing, a delta is what keeps a hand-over's cost to the
	// changes (see Merge for what it stands for).
	Delta bool
	Gone  []Key
}

// Merge returns the complete state d stands for after st (complete): st's
// services but those d lists or has gone, and d's, in name order. A
// complete d is returned as it is.
func (st *State) Merge(d State) State {
	if !d.Delta {
		return d
	}
	drop := make(map[Key]bool, len(d.Gone)+len(d.Services))
	for _, k := range d.Gone {
		drop[k] = true
	}
	for i := range d.Services {
		drop[d.Services[i].Key] = true
	}
	out := State{HandBack: d.HandBack, Node: st.Node}
	for _, s := range st.Services {
		if !drop[s.Key] {
			out.Services = append(out.Services, s)
		}
	}
	out.Services = append(out.Services, d.Services...)
	slices.SortStableFunc(out.Services, func(a, b Service) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Node is the node-wide part of a standalone desired state.
type Node struct {
	// Interfaces get XDP; RedirectInterfaces take XDP_REDIRECT (none:
	// packets go through the stack after NAT).
	Interfaces, RedirectInterfaces []string
	// TableSize is the largest Maglev table a service gets (a prime).
	TableSize uint32
	// MaxInflightDefault is the circuit-breaker limit of services that
	// set none (each Service carries its own already; this is shown).
	MaxInflightDefault uint32
}

// Equal reports whether s and o ask for the same thing, field by field
// (endpoints in order): what the agent checks to leave a service it has
// programmed alone, cheaply, when a new desired state arrives.
func (s *Service) Equal(o *Service) bool {
	return s.SameSettings(o) && SameEndpoints(s.Endpoints, o.Endpoints)
}

// SameSettings is Equal but for the endpoints.
func (s *Service) SameSettings(o *Service) bool {
	return s.Name == o.Name && s.Key == o.Key && s.Accrual == o.Accrual &&
		s.MaxInflight == o.MaxInflight && s.MaxInflightPerEndpoint == o.MaxInflightPerEndpoint &&
		s.RetryRefused == o.RetryRefused && s.Affinity == o.Affinity && s.Served == o.Served
}

// SameEndpoints reports whether a and b list the same endpoints in the same
// order; the same slice is that without a look at its elements (successive
// snapshots of a source share the endpoints of what did not change).
func SameEndpoints(a, b []Endpoint) bool {
	if len(a) != len(b) {
		return false
	}
	if len(a) == 0 || &a[0] == &b[0] {
		return true
	}
	return slices.Equal(a, b)
}

// Equal reports whether two states are the same, service by service in
// order.
func (st *State) Equal(o *State) bool {
	if st.Delta != o.Delta || !slices.Equal(st.Gone, o.Gone) {
		return false
	}
	if len(st.Services) != len(o.Services) || !slices.Equal(st.HandBack, o.HandBack) {
		return false
	}
	for i := range st.Services {
		if !st.Services[i].Equal(&o.Services[i]) {
			return false
		}
	}
	if (st.Node == nil) != (o.Node == nil) {
		return false
	}
	return st.Node == nil || reflect.DeepEqual(st.Node, o.Node)
}
