package k8s

import (
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/desired"
)

// Test fixtures: a Service "shop/web" and slices for it. Addresses are in
// 198.18.0.0/15 like every test address of the project.

const (
	vip  = "198.19.0.10"
	vip6 = "2001:2:0:200::10"
)

type svcOpt func(*corev1.Service)

func service(opts ...svcOpt) *corev1.Service {
	s := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web", UID: "uid-web"},
		Spec: corev1.ServiceSpec{
			Type:       corev1.ServiceTypeClusterIP,
			ClusterIP:  vip,
			ClusterIPs: []string{vip},
			Selector:   map[string]string{"app": "web"},
			Ports: []corev1.ServicePort{
				{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)},
			},
		},
	}
	for _, o := range opts {
		o(s)
	}
	return s
}

func ports(ps ...corev1.ServicePort) svcOpt {
	return func(s *corev1.Service) { s.Spec.Ports = ps }
}

type ep struct {
	ip                          string
	pod                         string
	ready, serving, terminating *bool
	node                        string
	zones, nodes                []string // topology hints
}

func slice(name string, sp []discoveryv1.EndpointPort, eps ...ep) *discoveryv1.EndpointSlice {
	sl := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: name,
			Labels: map[string]string{discoveryv1.LabelServiceName: "web"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       sp,
	}
	for _, e := range eps {
		x := discoveryv1.Endpoint{
			Addresses:  []string{e.ip},
			Conditions: discoveryv1.EndpointConditions{Ready: e.ready, Serving: e.serving, Terminating: e.terminating},
		}
		if e.pod != "" {
			x.TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: "shop", Name: e.pod}
		}
		if e.node != "" {
			x.NodeName = ptr.To(e.node)
		}
		if e.zones != nil || e.nodes != nil {
			x.Hints = &discoveryv1.EndpointHints{}
			for _, z := range e.zones {
				x.Hints.ForZones = append(x.Hints.ForZones, discoveryv1.ForZone{Name: z})
			}
			for _, n := range e.nodes {
				x.Hints.ForNodes = append(x.Hints.ForNodes, discoveryv1.ForNode{Name: n})
			}
		}
		sl.Endpoints = append(sl.Endpoints, x)
	}
	return sl
}

// slice6 is slice with addressType IPv6.
func slice6(name string, sp []discoveryv1.EndpointPort, eps ...ep) *discoveryv1.EndpointSlice {
	sl := slice(name, sp, eps...)
	sl.AddressType = discoveryv1.AddressTypeIPv6
	return sl
}

func sport(name string, port int32, proto corev1.Protocol) discoveryv1.EndpointPort {
	p := discoveryv1.EndpointPort{Port: ptr.To(port), Protocol: ptr.To(proto)}
	if name != "" {
		p.Name = ptr.To(name)
	}
	return p
}

var httpPort = []discoveryv1.EndpointPort{sport("http", 8080, corev1.ProtocolTCP)}

func readyEP(ip, pod string) ep { return ep{ip: ip, pod: pod, ready: ptr.To(true)} }

func dep(addr, name string) desired.Endpoint {
	return desired.Endpoint{Addr: netip.MustParseAddrPort(addr), Name: name}
}

func dsvc(name string, port uint16, proto desired.Protocol, eps ...desired.Endpoint) desired.Service {
	return dsvcAt(vip, name, port, proto, eps...)
}

func dsvcAt(at, name string, port uint16, proto desired.Protocol, eps ...desired.Endpoint) desired.Service {
	return desired.Service{
		Name:      name,
		Key:       desired.Key{VIP: netip.MustParseAddr(at), Port: port, Protocol: proto},
		Endpoints: eps,
		Accrual:   accrual.Defaults(),
		// Refused SYNs are replayed unless a Service says otherwise.
		RetryRefused: true,
	}
}

func TestTranslate(t *testing.T) {
	T, F := ptr.To(true), ptr.To(false)
	tests := []struct {
		name   string
		svc    *corev1.Service
		slices []*discoveryv1.EndpointSlice
		node   string
		addrs  []string // the node's own addresses
		want   []desired.Service
		// hostLocal are the ports left to kube-proxy.
		hostLocal []string
	}{
		{
			name:   "one port, ready endpoints sorted by address, named by pod",
			svc:    service(),
			slices: []*discoveryv1.EndpointSlice{slice("web-1", httpPort, readyEP("198.18.2.2", "web-b"), readyEP("198.18.1.2", "web-a"))},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP,
				dep("198.18.1.2:8080", "shop/web-a"), dep("198.18.2.2:8080", "shop/web-b"))},
		},
		{
			name: "multi-port TCP and UDP, each port its own service",
			svc: service(ports(
				corev1.ServicePort{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP},
				corev1.ServicePort{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP},
				corev1.ServicePort{Name: "dns-tcp", Port: 53, Protocol: corev1.ProtocolTCP},
			)),
			slices: []*discoveryv1.EndpointSlice{slice("web-1", []discoveryv1.EndpointPort{
				sport("http", 8080, corev1.ProtocolTCP),
				sport("dns", 5353, corev1.ProtocolUDP),
				sport("dns-tcp", 5354, corev1.ProtocolTCP),
			}, readyEP("198.18.1.2", "web-a"))},
			want: []desired.Service{
				dsvc("shop/web:http", 80, desired.TCP, dep("198.18.1.2:8080", "shop/web-a")),
				dsvc("shop/web:dns", 53, desired.UDP, dep("198.18.1.2:5353", "shop/web-a")),
				dsvc("shop/web:dns-tcp", 53, desired.TCP, dep("198.18.1.2:5354", "shop/web-a")),
			},
		},
		{
			name: "port matched by name and protocol, not by number",
			svc: service(ports(
				corev1.ServicePort{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP},
			)),
			slices: []*discoveryv1.EndpointSlice{slice("web-1", []discoveryv1.EndpointPort{
				sport("dns", 5354, corev1.ProtocolTCP), // same name, other protocol
				sport("dns", 5353, corev1.ProtocolUDP),
			}, readyEP("198.18.1.2", "web-a"))},
			want: []desired.Service{dsvc("shop/web:dns", 53, desired.UDP, dep("198.18.1.2:5353", "shop/web-a"))},
		},
		{
			name: "unnamed single port is named by number; slice port nil protocol is TCP",
			svc:  service(ports(corev1.ServicePort{Port: 8443, Protocol: corev1.ProtocolTCP})),
			slices: []*discoveryv1.EndpointSlice{slice("web-1",
				[]discoveryv1.EndpointPort{{Port: ptr.To[int32](443)}}, readyEP("198.18.1.2", "web-a"))},
			want: []desired.Service{dsvc("shop/web:8443", 8443, desired.TCP, dep("198.18.1.2:443", "shop/web-a"))},
		},
		{
			// A named targetPort resolves per pod: pods with different
			// numbers for "web" land in different slices.
			name: "named target port resolved differently in two slices",
			svc: service(ports(corev1.ServicePort{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP,
				TargetPort: intstr.FromString("web")})),
			slices: []*discoveryv1.EndpointSlice{
				slice("web-1", []discoveryv1.EndpointPort{sport("http", 8080, corev1.ProtocolTCP)}, readyEP("198.18.1.2", "web-a")),
				slice("web-2", []discoveryv1.EndpointPort{sport("http", 9090, corev1.ProtocolTCP)}, readyEP("198.18.2.2", "web-b")),
			},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP,
				dep("198.18.1.2:8080", "shop/web-a"), dep("198.18.2.2:9090", "shop/web-b"))},
		},
		{
			name: "two slices for one Service are merged; a duplicate counts once, ready copy wins",
			svc:  service(),
			slices: []*discoveryv1.EndpointSlice{
				slice("web-b", httpPort, readyEP("198.18.2.2", "web-b"), readyEP("198.18.1.2", "web-a-new")),
				slice("web-a", httpPort, ep{ip: "198.18.1.2", pod: "web-a-old", ready: F}, readyEP("198.18.3.2", "web-c")),
			},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP,
				dep("198.18.1.2:8080", "shop/web-a-new"), dep("198.18.2.2:8080", "shop/web-b"), dep("198.18.3.2:8080", "shop/web-c"))},
		},
		{
			name: "not ready endpoints are left out; nil ready counts as ready",
			svc:  service(),
			slices: []*discoveryv1.EndpointSlice{slice("web-1", httpPort,
				ep{ip: "198.18.1.2", pod: "web-a", ready: F},
				ep{ip: "198.18.2.2", pod: "web-b"},
				ep{ip: "198.18.3.2", pod: "web-c", ready: F, serving: T}, // serving but not terminating: not used
			)},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP, dep("198.18.2.2:8080", "shop/web-b"))},
		},
		{
			name: "terminating endpoints are not used while any endpoint is ready",
			svc:  service(),
			slices: []*discoveryv1.EndpointSlice{slice("web-1", httpPort,
				readyEP("198.18.1.2", "web-a"),
				ep{ip: "198.18.2.2", pod: "web-b", ready: F, serving: T, terminating: T},
			)},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP, dep("198.18.1.2:8080", "shop/web-a"))},
		},
		{
			name: "with no ready endpoint, serving terminating ones are used (not the non-serving ones)",
			svc:  service(),
			slices: []*discoveryv1.EndpointSlice{slice("web-1", httpPort,
				ep{ip: "198.18.1.2", pod: "web-a", ready: F, serving: T, terminating: T},
				ep{ip: "198.18.2.2", pod: "web-b", ready: F, serving: F, terminating: T},
				ep{ip: "198.18.3.2", pod: "web-c", ready: F},
			)},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP, dep("198.18.1.2:8080", "shop/web-a"))},
		},
		{
			name: "no endpoints at all: the service exists and drops new flows",
			svc:  service(),
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP)},
		},
		{
			name: "internalTrafficPolicy Local keeps this node's endpoints",
			svc: service(func(s *corev1.Service) {
				s.Spec.InternalTrafficPolicy = ptr.To(corev1.ServiceInternalTrafficPolicyLocal)
			}),
			node: "n1",
			slices: []*discoveryv1.EndpointSlice{slice("web-1", httpPort,
				ep{ip: "198.18.1.2", pod: "web-a", ready: T, node: "n1"},
				ep{ip: "198.18.2.2", pod: "web-b", ready: T, node: "n2"},
			)},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP, dep("198.18.1.2:8080", "shop/web-a"))},
		},
		{
			name: "internalTrafficPolicy Local falls back to local serving terminating endpoints, never remote ones",
			svc: service(func(s *corev1.Service) {
				s.Spec.InternalTrafficPolicy = ptr.To(corev1.ServiceInternalTrafficPolicyLocal)
			}),
			node: "n1",
			slices: []*discoveryv1.EndpointSlice{slice("web-1", httpPort,
				ep{ip: "198.18.1.2", pod: "web-a", ready: F, serving: T, terminating: T, node: "n1"},
				ep{ip: "198.18.2.2", pod: "web-b", ready: T, node: "n2"},
			)},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP, dep("198.18.1.2:8080", "shop/web-a"))},
		},
		{
			name: "Service without selector: its manually managed slices are used; endpoints without targetRef unnamed",
			svc:  service(func(s *corev1.Service) { s.Spec.Selector = nil }),
			slices: []*discoveryv1.EndpointSlice{slice("web-manual", httpPort,
				ep{ip: "198.18.9.2"}, readyEP("198.18.8.2", ""))},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP,
				dep("198.18.8.2:8080", ""), dep("198.18.9.2:8080", ""))},
		},
		{
			name:   "headless Service: nothing",
			svc:    service(func(s *corev1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "None", []string{"None"} }),
			slices: []*discoveryv1.EndpointSlice{slice("web-1", httpPort, readyEP("198.18.1.2", "web-a"))},
		},
		{
			name: "ExternalName Service: nothing",
			svc: service(func(s *corev1.Service) {
				s.Spec.Type, s.Spec.ClusterIP, s.Spec.ClusterIPs, s.Spec.ExternalName = corev1.ServiceTypeExternalName, "", nil, "db.shop.svc.cluster.local"
			}),
		},
		{
			name:   "NodePort and LoadBalancer Services keep their ClusterIP",
			svc:    service(func(s *corev1.Service) { s.Spec.Type = corev1.ServiceTypeLoadBalancer }),
			slices: []*discoveryv1.EndpointSlice{slice("web-1", httpPort, readyEP("198.18.1.2", "web-a"))},
			want:   []desired.Service{dsvc("shop/web:http", 80, desired.TCP, dep("198.18.1.2:8080", "shop/web-a"))},
		},
		{
			name: "dual-stack: a desired service per family, over its own family's slices; the second family's name says it",
			svc: service(func(s *corev1.Service) {
				s.Spec.ClusterIP, s.Spec.ClusterIPs = vip6, []string{vip6, vip}
			}),
			slices: []*discoveryv1.EndpointSlice{
				slice6("web-v6", httpPort, readyEP("2001:2:0:1::2", "web-a")),
				slice("web-v4", httpPort, readyEP("198.18.1.2", "web-a")),
			},
			want: []desired.Service{
				dsvcAt(vip6, "shop/web:http", 80, desired.TCP, dep("[2001:2:0:1::2]:8080", "shop/web-a")),
				dsvc("shop/web:http/ipv4", 80, desired.TCP, dep("198.18.1.2:8080", "shop/web-a")),
			},
		},
		{
			name: "IPv6-only Service: its IPv6 slices, named as usual",
			svc:  service(func(s *corev1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = vip6, []string{vip6} }),
			slices: []*discoveryv1.EndpointSlice{
				slice("web-1", httpPort, readyEP("198.18.1.2", "web-a")),
				slice6("web-2", httpPort, readyEP("2001:2:0:2::2", "web-b"), readyEP("::ffff:198.18.3.2", "web-c")),
			},
			want: []desired.Service{dsvcAt(vip6, "shop/web:http", 80, desired.TCP, dep("[2001:2:0:2::2]:8080", "shop/web-b"))},
		},
		{
			name:   "IPv4 Service: IPv6 slices are not its",
			svc:    service(),
			slices: []*discoveryv1.EndpointSlice{slice6("web-2", httpPort, readyEP("2001:2:0:2::2", "web-b"))},
			want:   []desired.Service{dsvc("shop/web:http", 80, desired.TCP)},
		},
		{
			name: "SCTP ports are skipped",
			svc: service(ports(
				corev1.ServicePort{Name: "sig", Port: 3868, Protocol: corev1.ProtocolSCTP},
				corev1.ServicePort{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP},
			)),
			slices: []*discoveryv1.EndpointSlice{slice("web-1", []discoveryv1.EndpointPort{
				sport("sig", 3868, corev1.ProtocolSCTP), sport("http", 8080, corev1.ProtocolTCP),
			}, readyEP("198.18.1.2", "web-a"))},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP, dep("198.18.1.2:8080", "shop/web-a"))},
		},
		{
			name: "slices of other Services, a port missing from a slice, and endpoints without addresses are ignored",
			svc:  service(),
			slices: []*discoveryv1.EndpointSlice{
				func() *discoveryv1.EndpointSlice {
					sl := slice("api-1", httpPort, readyEP("198.18.7.2", "api-a"))
					sl.Labels[discoveryv1.LabelServiceName] = "api"
					return sl
				}(),
				func() *discoveryv1.EndpointSlice {
					sl := slice("web-other-ns", httpPort, readyEP("198.18.6.2", "web-x"))
					sl.Namespace = "other"
					return sl
				}(),
				slice("web-noport", []discoveryv1.EndpointPort{sport("metrics", 9090, corev1.ProtocolTCP)}, readyEP("198.18.5.2", "web-m")),
				func() *discoveryv1.EndpointSlice {
					sl := slice("web-1", httpPort, readyEP("198.18.1.2", "web-a"))
					sl.Endpoints = append(sl.Endpoints, discoveryv1.Endpoint{Conditions: discoveryv1.EndpointConditions{Ready: T}})
					return sl
				}(),
			},
			want: []desired.Service{dsvc("shop/web:http", 80, desired.TCP, dep("198.18.1.2:8080", "shop/web-a"))},
		},
		{
			// A host-network pod on this node: its replies never cross an
			// XDP hook, so the port is left to kube-proxy.
			name: "a port with a backend on the node's own address is left to kube-proxy",
			svc: service(ports(
				corev1.ServicePort{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP},
				corev1.ServicePort{Name: "admin", Port: 81, Protocol: corev1.ProtocolTCP},
			)),
			addrs: []string{"198.18.0.1", "198.18.1.1"},
			slices: []*discoveryv1.EndpointSlice{
				slice("web-1", httpPort, readyEP("198.18.1.1", "web-hostnet"), readyEP("198.18.2.2", "web-b")),
				slice("web-2", []discoveryv1.EndpointPort{sport("admin", 9000, corev1.ProtocolTCP)}, readyEP("198.18.2.2", "web-b")),
			},
			want:      []desired.Service{dsvc("shop/web:admin", 81, desired.TCP, dep("198.18.2.2:9000", "shop/web-b"))},
			hostLocal: []string{"shop/web:http"},
		},
		{
			name:   "a not-ready endpoint on the node's address does not matter",
			svc:    service(),
			addrs:  []string{"198.18.1.1"},
			slices: []*discoveryv1.EndpointSlice{slice("web-1", httpPort, ep{ip: "198.18.1.1", ready: F}, readyEP("198.18.2.2", "web-b"))},
			want:   []desired.Service{dsvc("shop/web:http", 80, desired.TCP, dep("198.18.2.2:8080", "shop/web-b"))},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			node := Node{Name: tt.node, Addrs: map[netip.Addr]bool{}}
			for _, a := range tt.addrs {
				node.Addrs[netip.MustParseAddr(a)] = true
			}
			got, hostLocal := Translate(tt.svc, tt.slices, DefaultSettings(0), node)
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got\n%+v\nwant\n%+v", got, tt.want)
			}
			if !reflect.DeepEqual(hostLocal, tt.hostLocal) {
				t.Errorf("left to kube-proxy: %v, want %v", hostLocal, tt.hostLocal)
			}
		})
	}
}

func TestTranslateCarriesSettings(t *testing.T) {
	st := DefaultSettings(100)
	st.Accrual.MaxFailures = 3
	st.MaxInflightPerEndpoint = 10
	got, _ := Translate(service(ports(
		corev1.ServicePort{Name: "a", Port: 80, Protocol: corev1.ProtocolTCP},
		corev1.ServicePort{Name: "b", Port: 81, Protocol: corev1.ProtocolUDP},
	)), nil, st, Node{})
	if len(got) != 2 {
		t.Fatalf("got %d services, want 2", len(got))
	}
	for _, s := range got {
		if s.Accrual != st.Accrual || s.MaxInflight != 100 || s.MaxInflightPerEndpoint != 10 {
			t.Errorf("%s: accrual %+v, limits %d/%d; want the Service's settings on every port",
				s.Name, s.Accrual, s.MaxInflight, s.MaxInflightPerEndpoint)
		}
	}
}

// sessionAffinity reaches every port of the Service as kube-proxy applies
// it: ClientIP with its timeout, 3 hours when unset, None as none; a
// timeout the API server would refuse is taken as the default (zero or
// less) or the maximum (more than a day).
func TestTranslateSessionAffinity(t *testing.T) {
	secs := func(n int32) *int32 { return &n }
	for _, c := range []struct {
		name     string
		affinity corev1.ServiceAffinity
		timeout  *int32
		want     time.Duration
	}{
		{"none", corev1.ServiceAffinityNone, nil, 0},
		{"unset", "", nil, 0},
		{"ClientIP, default timeout", corev1.ServiceAffinityClientIP, nil, 3 * time.Hour},
		{"ClientIP, 60s", corev1.ServiceAffinityClientIP, secs(60), time.Minute},
		{"ClientIP, 0s", corev1.ServiceAffinityClientIP, secs(0), 3 * time.Hour},
		{"ClientIP, two days", corev1.ServiceAffinityClientIP, secs(172800), 24 * time.Hour},
		{"None with a timeout", corev1.ServiceAffinityNone, secs(60), 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			svc := service(ports(
				corev1.ServicePort{Name: "a", Port: 80, Protocol: corev1.ProtocolTCP},
				corev1.ServicePort{Name: "b", Port: 81, Protocol: corev1.ProtocolUDP},
			), func(s *corev1.Service) {
				s.Spec.SessionAffinity = c.affinity
				if c.timeout != nil {
					s.Spec.SessionAffinityConfig = &corev1.SessionAffinityConfig{
						ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: c.timeout}}
				}
			})
			got, _ := Translate(svc, nil, DefaultSettings(0), Node{})
			if len(got) != 2 {
				t.Fatalf("got %d services, want 2", len(got))
			}
			for _, s := range got {
				if s.Affinity != c.want {
					t.Errorf("%s: affinity %v, want %v", s.Name, s.Affinity, c.want)
				}
			}
		})
	}
}

// Topology hints, as kube-proxy follows them: the endpoints hinted for
// this node, else for its zone, when every ready endpoint has hints and
// one names it; all endpoints otherwise. internalTrafficPolicy Local
// ignores them.
func TestTranslateTopologyHints(t *testing.T) {
	zoned := func(ip, pod string, zones ...string) ep {
		e := readyEP(ip, pod)
		e.zones = zones
		return e
	}
	a := zoned("198.18.211.2", "a", "zone-a")
	b := zoned("198.18.211.3", "b", "zone-b")
	ab := zoned("198.18.211.4", "ab", "zone-a", "zone-b")
	plain := readyEP("198.18.211.5", "plain")
	notReady := ep{ip: "198.18.211.6", pod: "nr", ready: ptr.To(false)}
	onNode := readyEP("198.18.211.7", "n")
	onNode.nodes, onNode.zones, onNode.node = []string{"node-1"}, []string{"zone-a"}, "node-1"
	elsewhere := readyEP("198.18.211.8", "e")
	elsewhere.nodes, elsewhere.zones, elsewhere.node = []string{"node-2"}, []string{"zone-a"}, "node-2"
	names := func(svcs []desired.Service) []string {
		var out []string
		for _, e := range svcs[0].Endpoints {
			out = append(out, strings.TrimPrefix(e.Name, "shop/"))
		}
		return out
	}
	local := func(s *corev1.Service) {
		s.Spec.InternalTrafficPolicy = ptr.To(corev1.ServiceInternalTrafficPolicyLocal)
	}
	for _, c := range []struct {
		name string
		node Node
		eps  []ep
		opts []svcOpt
		want []string
	}{
		{"hints for the node's zone", Node{Name: "node-1", Zone: "zone-a"}, []ep{a, b, ab}, nil, []string{"a", "ab"}},
		{"the other zone", Node{Name: "node-1", Zone: "zone-b"}, []ep{a, b, ab}, nil, []string{"b", "ab"}},
		{"no endpoint for the zone: all", Node{Name: "node-1", Zone: "zone-c"}, []ep{a, b}, nil, []string{"a", "b"}},
		{"a node without a zone: all", Node{Name: "node-1"}, []ep{a, b}, nil, []string{"a", "b"}},
		{"one ready endpoint without hints: all", Node{Name: "node-1", Zone: "zone-a"}, []ep{a, b, plain}, nil, []string{"a", "b", "plain"}},
		{"a not-ready endpoint's missing hints do not count", Node{Name: "node-1", Zone: "zone-a"}, []ep{a, b, notReady}, nil, []string{"a"}},
		{"node hints first", Node{Name: "node-1", Zone: "zone-a"}, []ep{onNode, elsewhere}, nil, []string{"n"}},
		{"node hints for another node: the zone's", Node{Name: "node-3", Zone: "zone-a"}, []ep{onNode, elsewhere}, nil, []string{"n", "e"}},
		{"internalTrafficPolicy Local ignores hints", Node{Name: "node-1", Zone: "zone-b"}, []ep{onNode, elsewhere}, []svcOpt{local}, []string{"n"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, _ := Translate(service(c.opts...), []*discoveryv1.EndpointSlice{slice("s1", httpPort, c.eps...)}, DefaultSettings(0), c.node)
			if len(got) != 1 {
				t.Fatalf("got %d services", len(got))
			}
			if g := names(got); !slices.Equal(g, c.want) {
				t.Errorf("endpoints %v, want %v", g, c.want)
			}
		})
	}
}
