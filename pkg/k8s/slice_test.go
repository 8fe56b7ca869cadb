// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"net/netip"
	"testing"
	"unsafe"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/penaltybox/penaltybox/pkg/desired"
)

// The cached copy of a slice keeps what Translate reads, each condition
// as kube-proxy defaults it, and nothing else.
func TestCompactSlice(t *testing.T) {
	yes, no := true, false
	node, zone := "node-a", "zone-1"
	sctp, udp := corev1.ProtocolSCTP, corev1.ProtocolUDP
	http, dns := "http", "dns"
	p80, p53 := int32(80), int32(53)
	sl := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "web-abc", Namespace: "shop", UID: types.UID("u1"), ResourceVersion: "7",
			Labels:          map[string]string{discoveryv1.LabelServiceName: "web", "app": "web"},
			Annotations:     map[string]string{"endpoints.kubernetes.io/last-change-trigger-time": "now"},
			OwnerReferences: []metav1.OwnerReference{{Kind: "Service", Name: "web"}}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports: []discoveryv1.EndpointPort{
			{Name: &http, Port: &p80},
			{Name: &dns, Port: &p53, Protocol: &udp},
			{Protocol: &sctp, Port: &p80},
			{Name: &http},
		},
		Endpoints: []discoveryv1.Endpoint{
			{Addresses: []string{"198.18.0.1", "198.18.0.9"}, NodeName: &node,
				TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: "web-1", UID: "p1"},
				Hints:     &discoveryv1.EndpointHints{ForZones: []discoveryv1.ForZone{{Name: zone}}}},
			{Addresses: []string{"198.18.0.2"}, Conditions: discoveryv1.EndpointConditions{Ready: &no, Serving: &yes, Terminating: &yes}},
			{Addresses: []string{"not-an-address"}, Conditions: discoveryv1.EndpointConditions{Ready: &no}},
			{},
		},
	}
	c := compactSlice(sl)
	if c.Name != "web-abc" || c.Namespace != "shop" || c.UID != "u1" || c.ResourceVersion != "7" || c.service != "web" ||
		c.addressType != discoveryv1.AddressTypeIPv4 {
		t.Errorf("meta: %+v, service %q, type %q", c.cacheMeta, c.service, c.addressType)
	}
	if c.Labels != nil || c.Annotations != nil {
		t.Errorf("kept what nothing reads: labels %v, annotations %v", c.Labels, c.Annotations)
	}
	wantPorts := []slicePort{
		{name: "http", proto: desired.TCP, known: true, port: 80, hasPort: true},
		{name: "dns", proto: desired.UDP, known: true, port: 53, hasPort: true},
		{known: false, port: 80, hasPort: true},
		{name: "http", proto: desired.TCP, known: true},
	}
	if len(c.ports) != len(wantPorts) {
		t.Fatalf("ports %+v", c.ports)
	}
	for i, p := range wantPorts {
		if c.ports[i] != p {
			t.Errorf("port %d = %+v, want %+v", i, c.ports[i], p)
		}
	}
	if len(c.endpoints) != 4 {
		t.Fatalf("endpoints %+v", c.endpoints)
	}
	e := c.endpoints[0]
	if e.addr != netip.MustParseAddr("198.18.0.1") || e.name != "shop/web-1" || e.nodeName() != "node-a" ||
		e.flags != epReady|epServing || e.hints == nil || len(e.hints.zones) != 1 || e.hints.zones[0] != zone {
		t.Errorf("endpoint 0: %+v (hints %+v)", e, e.hints)
	}
	if e := c.endpoints[1]; e.flags != epServing|epTerminating || e.nodeName() != "" || e.hints != nil {
		t.Errorf("endpoint 1 (not ready, serving, terminating): %+v", e)
	}
	if e := c.endpoints[2]; e.addr.IsValid() || e.flags != 0 {
		t.Errorf("endpoint 2 (bad address, not ready): %+v", e)
	}
	if e := c.endpoints[3]; e.addr.IsValid() || e.flags != epReady|epServing {
		t.Errorf("endpoint 3 (no address, conditions unset): %+v", e)
	}
	// Endpoints of one node share one copy of its name, not each the
	// string its slice was decoded with.
	other := "node-" + string([]byte{'a'})
	sl2 := &discoveryv1.EndpointSlice{Endpoints: []discoveryv1.Endpoint{{NodeName: &other}}}
	n1, n2 := c.endpoints[0].nodeName(), compactSlice(sl2).endpoints[0].nodeName()
	if n1 != "node-a" || unsafe.StringData(n1) != unsafe.StringData(n2) || unsafe.StringData(n2) == unsafe.StringData(other) {
		t.Error("node names not interned")
	}
	// A copy is independent of the original.
	c.Labels = map[string]string{"k": "v"}
	cp := c.DeepCopyObject().(*endpointSlice)
	cp.endpoints[0].name = "changed"
	cp.ports[0].port = 1
	cp.Labels["k"] = "changed"
	if c.endpoints[0].name != "shop/web-1" || c.ports[0].port != 80 || c.Labels["k"] != "v" {
		t.Error("DeepCopyObject shares the endpoints, ports or metadata")
	}
}
