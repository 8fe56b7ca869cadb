// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"regexp"
	"slices"
	"testing"
	"time"
)

// A Ginkgo JSON report as e2e.test --report-complete-ginkgo writes it
// (trimmed): a suite node, a spec the focus filtered out, one that passed
// in two namespaces, one the framework skipped.
const reportJSON = `[{"SuitePath": "/x", "SpecReports": [
 {"LeafNodeType": "SynchronizedBeforeSuite", "State": "passed", "RunTime": 5},
 {"ContainerHierarchyTexts": ["[sig-apps] Deployment"], "LeafNodeType": "It",
  "LeafNodeText": "should do something", "State": "skipped", "RunTime": 0},
 {"ContainerHierarchyTexts": ["[sig-network] Services"], "LeafNodeType": "It",
  "LeafNodeText": "should serve a basic endpoint from pods [Conformance]", "State": "passed",
  "RunTime": 41000000000,
  "SpecEvents": [{"SpecEventType": "By", "Message": "Destroying namespace \"services-6520\" for this suite."},
                 {"SpecEventType": "By", "Message": "Destroying namespace \"services-6520\" for this suite."}],
  "CapturedGinkgoWriterOutput": "STEP: Destroying namespace \"other-ns-12\" for this suite. @ 12/04/26 08:30:01\n"},
 {"ContainerHierarchyTexts": ["[sig-network] Traffic Distribution"], "LeafNodeType": "It",
  "LeafNodeText": "should route traffic to an endpoint in the same zone when using PreferClose",
  "State": "skipped", "RunTime": 300000000, "Failure": {"Message": "Requires >= 3 zones"}}
]}]`

func TestParseReport(t *testing.T) {
	specs, err := parseReport([]byte(reportJSON))
	if err != nil {
		t.Fatal(err)
	}
	if len(specs) != 3 {
		t.Fatalf("got %d specs, want the 3 Its: %+v", len(specs), specs)
	}
	if !specs[0].filtered() {
		t.Errorf("%+v: a spec outside the focus is not recognised as such", specs[0])
	}
	basic := specs[1]
	if basic.Name != "[sig-network] Services should serve a basic endpoint from pods [Conformance]" ||
		basic.State != "passed" || basic.RunTime != 41*time.Second || basic.filtered() {
		t.Errorf("passed spec parsed as %+v", basic)
	}
	if !slices.Equal(basic.Namespaces, []string{"services-6520", "other-ns-12"}) {
		t.Errorf("namespaces %v, want services-6520 and other-ns-12 once each", basic.Namespaces)
	}
	skip := specs[2]
	if skip.filtered() || skip.State != "skipped" {
		t.Errorf("a spec the framework skipped is taken for a filtered one: %+v", skip)
	}
	if r, ok := selfSkipReason(skip); !ok || r == "" {
		t.Errorf("the zone skip is not among the expected ones")
	}
	if _, ok := selfSkipReason(specResult{Name: skip.Name, State: "skipped", Message: "no agnhost image"}); ok {
		t.Errorf("a skip with another message is accepted")
	}
}

func TestServiceLogKeepsWhatItSaw(t *testing.T) {
	l := newServiceLog()
	scrape := func(text string) {
		t.Helper()
		if err := l.add(text); err != nil {
			t.Fatal(err)
		}
	}
	scrape(`# TYPE penaltybox_service_flows_total counter
penaltybox_service_flows_total{svc_name="affinity",svc_namespace="services-12",svc_port="80"} 3
penaltybox_service_flows_total{svc_name="web",svc_namespace="services-123",svc_port="http"} 7
# TYPE penaltybox_service_served gauge
penaltybox_service_served{reason="scope-all",svc_name="affinity",svc_namespace="services-12",svc_port="80"} 1
penaltybox_service_served{reason="scope-all",svc_name="web",svc_namespace="services-123",svc_port="http"} 1
`)
	// The Service was deleted: its series are gone, what it reached stays.
	scrape(`# TYPE penaltybox_service_flows_total counter
penaltybox_service_flows_total{svc_name="web",svc_namespace="services-123",svc_port="http"} 9
# TYPE penaltybox_service_served gauge
penaltybox_service_served{reason="scope-all",svc_name="web",svc_namespace="services-123",svc_port="http"} 1
penaltybox_service_served{reason="service-label",svc_name="web",svc_namespace="services-123",svc_port="http"} 1
`)
	flows, info := l.forNamespaces([]string{"services-12"})
	if flows != 3 || !slices.Equal(info.names, []string{"services-12/affinity:80"}) || len(info.notScopeAll) != 0 {
		t.Errorf("services-12: %v flows, %+v; want 3 flows of services-12/affinity:80 only", flows, info)
	}
	flows, info = l.forNamespaces([]string{"services-123"})
	if flows != 9 || !slices.Equal(info.notScopeAll, []string{"services-123/web:http (service-label)"}) {
		t.Errorf("services-123: %v flows, %+v; want 9 and the service-label reason", flows, info)
	}
	if l.count() != 2 || l.withFlows() != 2 {
		t.Errorf("count %d, with flows %d; want 2, 2", l.count(), l.withFlows())
	}
}

// The focus selects what the issue asks for and not the neighbours whose
// names start the same way (Ginkgo matches with Go's regexp, on a text
// that may start with a space).
func TestFocus(t *testing.T) {
	full := regexp.MustCompile(anyOf(fullFocus))
	ci := regexp.MustCompile(anyOf(ciFocus))
	for _, c := range []struct {
		name     string
		full, ci bool
	}{
		{"[sig-network] Services should serve a basic endpoint from pods [Conformance]", true, true},
		{"[sig-network] Services should have session affinity timeout work for service with type clusterIP [LinuxOnly]", true, false},
		{"[sig-network] Services should have session affinity timeout work for NodePort service [LinuxOnly]", false, false},
		{"[sig-network] Services should be able to switch session affinity for service with type clusterIP [LinuxOnly] [Conformance]", true, true},
		{"[sig-network] Services should implement service.kubernetes.io/service-proxy-name", true, true},
		{"[sig-network] Services should implement service.kubernetes.io/headless", false, false},
		{"[sig-network] Conntrack should be able to preserve UDP traffic when server pod cycles for a ClusterIP service", true, false},
		{"[sig-network] Conntrack should be able to preserve UDP traffic when server pod cycles for a ClusterIP service with InternalTrafficPolicy set to Local", false, false},
		{"[sig-network] EndpointSlice should support creating EndpointSlice API operations [Conformance]", true, false},
		{"[sig-network] EndpointSliceMirroring should mirror a custom Endpoint with multiple subsets and same IP address", false, false},
		{"[sig-network] Traffic Distribution should route traffic to an endpoint in the same zone when using PreferClose", true, false},
		{"[sig-network] DNS should provide DNS for services [Conformance]", false, false},
	} {
		for _, text := range []string{c.name, " " + c.name} {
			if got := full.MatchString(text); got != c.full {
				t.Errorf("full focus on %q: %v, want %v", text, got, c.full)
			}
			if got := ci.MatchString(text); got != c.ci {
				t.Errorf("CI focus on %q: %v, want %v", text, got, c.ci)
			}
		}
	}
}
