// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"maps"
	"net/netip"
	"reflect"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
)

// The controller translates the cache's copy of a Service (cachedService),
// not the API object: every field Translate reads must survive the copy.
func TestCachedServiceTranslatesTheSame(t *testing.T) {
	sp := []discoveryv1.EndpointPort{sport("http", 8080, corev1.ProtocolTCP), sport("dns", 5353, corev1.ProtocolUDP)}
	slices := []*discoveryv1.EndpointSlice{
		slice("web-a", sp,
			ep{ip: "198.18.1.1", pod: "web-1", node: "n1"},
			ep{ip: "198.18.1.2", pod: "web-2", node: "n2"},
			ep{ip: "198.18.1.3", pod: "web-3", node: "n1", ready: ptr.To(false), serving: ptr.To(true), terminating: ptr.To(true)}),
		slice6("web-b", sp, ep{ip: "2001:2::1:1", pod: "web-1", node: "n1"}),
	}
	twoPorts := ports(
		corev1.ServicePort{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP},
		corev1.ServicePort{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP},
		corev1.ServicePort{Name: "sctp", Port: 9, Protocol: corev1.ProtocolSCTP})
	cases := map[string]*corev1.Service{
		"plain":              service(),
		"two ports and SCTP": service(twoPorts),
		"dual stack": service(twoPorts, func(s *corev1.Service) {
			s.Spec.ClusterIPs = []string{vip, vip6}
		}),
		"ClusterIPs unset": service(func(s *corev1.Service) { s.Spec.ClusterIPs = nil }),
		"headless":         service(func(s *corev1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "None", []string{"None"} }),
		"ExternalName":     service(func(s *corev1.Service) { s.Spec.Type = corev1.ServiceTypeExternalName }),
		"internal traffic local": service(func(s *corev1.Service) {
			s.Spec.InternalTrafficPolicy = ptr.To(corev1.ServiceInternalTrafficPolicyLocal)
		}),
		"client IP affinity": service(func(s *corev1.Service) {
			s.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
			s.Spec.SessionAffinityConfig = &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](60)}}
		}),
		"unnamed port": service(ports(corev1.ServicePort{Port: 8443})),
	}
	node := Node{Name: "n1", Addrs: map[netip.Addr]bool{}}
	for name, svc := range cases {
		svc.Labels = map[string]string{LabelEnabled: "true"}
		svc.Annotations = map[string]string{AnnotationMaxFailures: "3"}
		cached := compactService(svc.DeepCopy())
		obj := cached.object()
		want, wantLocal := Translate(svc, slices, DefaultSettings(0), node)
		got, gotLocal := Translate(obj, slices, DefaultSettings(0), node)
		if !reflect.DeepEqual(got, want) || !reflect.DeepEqual(gotLocal, wantLocal) {
			t.Errorf("%s: from the cache %+v %v, from the API object %+v %v", name, got, gotLocal, want, wantLocal)
		}
		if k, w := Keys(obj), Keys(svc); !reflect.DeepEqual(k, w) {
			t.Errorf("%s: keys from the cache %v, from the API object %v", name, k, w)
		}
		if affinity(obj) != affinity(svc) {
			t.Errorf("%s: affinity %v from the cache, %v from the API object", name, affinity(obj), affinity(svc))
		}
		if obj.Name != "web" || obj.Namespace != "shop" || obj.UID != svc.UID ||
			!maps.Equal(obj.Labels, svc.Labels) || !maps.Equal(obj.Annotations, svc.Annotations) {
			t.Errorf("%s: what servedBecause, settings and Events read changed: %+v", name, obj.ObjectMeta)
		}
		for _, p := range svc.Spec.Ports {
			if !cached.hasPort(p.Name) {
				t.Errorf("%s: port %q lost", name, p.Name)
			}
		}
		if cached.hasPort("no-such-port") {
			t.Errorf("%s: has a port it was not given", name)
		}
	}
	// The cases are not vacuous: some translate to something, one per
	// family and port, one with affinity.
	dual, _ := Translate(cases["dual stack"], slices, DefaultSettings(0), node)
	aff, _ := Translate(cases["client IP affinity"], slices, DefaultSettings(0), node)
	if len(dual) != 4 || len(dual[0].Endpoints) == 0 || len(aff) != 1 || aff[0].Affinity == 0 {
		t.Fatalf("the fixtures translate to %+v and %+v", dual, aff)
	}
}

// client-go's store keys, indexes and versions the cached copies through
// meta.Accessor: both kinds must answer it as the API objects would.
func TestCachedCopiesAnswerMetaAccessor(t *testing.T) {
	svc := service()
	svc.ResourceVersion = "41"
	sl := slice("web-a", nil)
	sl.UID, sl.ResourceVersion = "uid-slice", "42"
	for _, c := range []struct {
		obj           runtime.Object
		key, uid, ver string
	}{
		{compactService(svc), "shop/web", "uid-web", "41"},
		{compactSlice(sl), "shop/web-a", "uid-slice", "42"},
	} {
		a, err := meta.Accessor(c.obj)
		if err != nil {
			t.Fatalf("%T: %v", c.obj, err)
		}
		key, err := cache.MetaNamespaceKeyFunc(c.obj)
		ns, _ := cache.MetaNamespaceIndexFunc(c.obj)
		if err != nil || key != c.key || string(a.GetUID()) != c.uid || a.GetResourceVersion() != c.ver || !reflect.DeepEqual(ns, []string{"shop"}) {
			t.Errorf("%T: key %q (%v), uid %q, version %q, namespace index %v", c.obj, key, err, a.GetUID(), a.GetResourceVersion(), ns)
		}
		tomb := cache.DeletedFinalStateUnknown{Key: c.key, Obj: c.obj}
		if k, err := cache.DeletionHandlingMetaNamespaceKeyFunc(tomb); err != nil || k != c.key {
			t.Errorf("%T tombstone: key %q, %v", c.obj, k, err)
		}
	}
}
