// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/cache"
)

// cachedService is what the controller keeps of a Service: the fields it
// reads (see object). The informers' transform (stripForCache) makes one
// of every Service before it is cached, as it does an endpointSlice of
// every slice. The API type is 592 bytes before any of its strings, slices
// and pointers, this one 192; at 10,000 Services the cache held about
// 11 MB of decoded Services (a heap profile of the apiscale bench).
type cachedService struct {
	// cacheMeta keeps the name, namespace, UID and resourceVersion (the
	// store's key; Events name the object by them), and the labels and
	// annotations the agent reads (penaltybox.io/ ones, and the Linkerd
	// spellings of our annotations).
	cacheMeta
	typ             corev1.ServiceType
	clusterIP       string
	clusterIPs      []string
	ports           []servicePort
	internalTraffic *corev1.ServiceInternalTrafficPolicy
	affinity        corev1.ServiceAffinity
	affinityConfig  *corev1.SessionAffinityConfig
}

// servicePort is one of a Service's ports: what Translate reads of it.
type servicePort struct {
	name     string
	protocol corev1.Protocol
	port     int32
}

// compactService makes the controller's copy of a Service.
func compactService(svc *corev1.Service) *cachedService {
	out := &cachedService{
		cacheMeta: metaOf(&svc.ObjectMeta,
			keepOnly(svc.Labels, func(k string) bool { return strings.HasPrefix(k, ourPrefix) }),
			keepOnly(svc.Annotations, annotationRead)),
		typ:             svc.Spec.Type,
		clusterIP:       svc.Spec.ClusterIP,
		clusterIPs:      svc.Spec.ClusterIPs,
		internalTraffic: svc.Spec.InternalTrafficPolicy,
		affinity:        svc.Spec.SessionAffinity,
		affinityConfig:  svc.Spec.SessionAffinityConfig,
	}
	// The API server keeps the first ClusterIP in both fields: one copy.
	if len(out.clusterIPs) > 0 && out.clusterIPs[0] == out.clusterIP {
		out.clusterIP = out.clusterIPs[0]
	}
	if len(svc.Spec.Ports) > 0 {
		out.ports = make([]servicePort, len(svc.Spec.Ports))
		for i, p := range svc.Spec.Ports {
			out.ports[i] = servicePort{name: p.Name, protocol: p.Protocol, port: p.Port}
		}
	}
	return out
}

// object is the Service as the API has it, with only the fields kept: what
// Translate and the Event recorder take. A new object each call, for one
// sync: the cache's copy stays small. It shares the cache's labels,
// annotations and ClusterIPs, which nothing changes in place (the
// controller keeps a Service's last good annotations by reference).
func (s *cachedService) object() *corev1.Service {
	svc := &corev1.Service{
		ObjectMeta: s.objectMeta(),
		Spec: corev1.ServiceSpec{
			Type:                  s.typ,
			ClusterIP:             s.clusterIP,
			ClusterIPs:            s.clusterIPs,
			InternalTrafficPolicy: s.internalTraffic,
			SessionAffinity:       s.affinity,
			SessionAffinityConfig: s.affinityConfig,
		},
	}
	if len(s.ports) > 0 {
		svc.Spec.Ports = make([]corev1.ServicePort, len(s.ports))
		for i, p := range s.ports {
			svc.Spec.Ports[i] = corev1.ServicePort{Name: p.name, Protocol: p.protocol, Port: p.port}
		}
	}
	return svc
}

// hasPort reports whether the Service has a port named name.
func (s *cachedService) hasPort(name string) bool {
	for _, p := range s.ports {
		if p.name == name {
			return true
		}
	}
	return false
}

// GetObjectKind makes cachedService a runtime.Object, as the informer's store
// wants; it carries no type information.
func (s *cachedService) GetObjectKind() schema.ObjectKind { return schema.EmptyObjectKind }

// DeepCopyObject copies s; the pointed-to policies, which nothing changes
// once decoded, and the ClusterIPs are shared.
func (s *cachedService) DeepCopyObject() runtime.Object {
	c := *s
	c.cacheMeta = s.cacheMeta.deepCopy()
	c.ports = append([]servicePort(nil), s.ports...)
	return &c
}

// serviceCache reads the Services informer's store, which holds services.
type serviceCache struct{ store cache.Indexer }

// get returns the cached Service namespace/name, nil when there is none.
func (c serviceCache) get(namespace, name string) *cachedService {
	key := name
	if namespace != "" {
		key = namespace + "/" + name
	}
	obj, ok, err := c.store.GetByKey(key)
	if err != nil || !ok {
		return nil
	}
	s, _ := obj.(*cachedService)
	return s
}

// keys returns the "namespace/name" of every cached Service.
func (c serviceCache) keys() []string { return c.store.ListKeys() }

// keysIn returns the "namespace/name" of the cached Services of namespace.
func (c serviceCache) keysIn(namespace string) []string {
	keys, _ := c.store.IndexKeys(cache.NamespaceIndex, namespace)
	return keys
}
