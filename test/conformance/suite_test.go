// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"regexp"
	"strings"
)

// The specs are Kubernetes' own (test/e2e/network of k8s.io/kubernetes at
// the cluster's version), selected by their full Ginkgo text.

// fullFocus is what `make conformance` runs (issue 33's peer suite).
var fullFocus = []string{
	// Every [sig-network] Services test tagged [Conformance] (session
	// affinity with ClusterIP and NodePort, and the switching ones, are
	// among them).
	`\[sig-network\] Services .*\[Conformance\]`,
	// The ClusterIP session-affinity test that is not [Conformance].
	exact(`[sig-network] Services should have session affinity timeout work for service with type clusterIP [LinuxOnly]`),
	exact(`[sig-network] Services should implement service.kubernetes.io/service-proxy-name`),
	// The EndpointSlice conformance tests (and the mirroring one: the
	// slices of selector-less Services penaltybox serves).
	`\[sig-network\] EndpointSlice .*\[Conformance\]`,
	`\[sig-network\] EndpointSliceMirroring .*\[Conformance\]`,
	// The UDP conntrack test for a ClusterIP Service.
	exact(`[sig-network] Conntrack should be able to preserve UDP traffic when server pod cycles for a ClusterIP service`),
	// Topology and traffic distribution, all of test/e2e/network's.
	`\[sig-network\] Topology Hints `,
	`\[sig-network\] Traffic Distribution `,
}

// ciFocus is the fixed subset `make test` runs (go test ./test/...): one
// spec per kind of thing the datapath must get right, 2.3 minutes on
// the rig with the cluster's start and stop, where the full list takes
// about 7 (README, "Conformance"): the affinity timeout spec alone waits
// over two minutes.
var ciFocus = []string{
	// TCP to a ClusterIP, endpoints coming and going.
	exact(`[sig-network] Services should serve a basic endpoint from pods [Conformance]`),
	// TCP and UDP on the same port of one Service.
	exact(`[sig-network] Services should serve endpoints on same port and different protocols [Conformance]`),
	// A Service labelled for another proxy is left alone.
	exact(`[sig-network] Services should implement service.kubernetes.io/service-proxy-name`),
	// Session affinity: every client's connections to one endpoint, and
	// switched off and on again live.
	exact(`[sig-network] Services should have session affinity work for service with type clusterIP [LinuxOnly] [Conformance]`),
	exact(`[sig-network] Services should be able to switch session affinity for service with type clusterIP [LinuxOnly] [Conformance]`),
}

// skipped are specs the focus selects that the rig cannot run, each with
// its reason; they are passed to --ginkgo.skip and never run. None is here
// because penaltybox fails it.
var skipped = []struct{ pattern, reason string }{}

// selfSkips are the specs that the e2e framework itself skips on a cluster
// of one node in one zone, with the message it skips with (checked: a spec
// that skips for any other reason fails the run).
var selfSkips = []struct{ pattern, message, reason string }{
	{`\[sig-network\] Conntrack `, "Test requires >= 2 Ready nodes",
		"the Conntrack suite's BeforeEach puts the client and the servers on two different nodes; the rig has one"},
	{`\[sig-network\] Topology Hints `, "Requires more than one zone",
		"needs nodes in at least two zones; the rig has one node"},
	{`\[sig-network\] Traffic Distribution `, "Requires >= 3 zones",
		"needs nodes in at least three zones (and two nodes in some zones); the rig has one node"},
}

// noTraffic are specs that never connect to a Service of their namespace
// (API objects only, or a DNS lookup, which goes to kube-dns): the rest
// must show flows through penaltybox in their namespace. Read from their
// commands in a run's report.
var noTraffic = []string{
	exact(`[sig-network] Services should find a service from listing all namespaces [Conformance]`),
	exact(`[sig-network] Services should complete a service status lifecycle [Conformance]`),
	exact(`[sig-network] Services should delete a collection of services [Conformance]`),
	// nslookup of the Service that became an ExternalName.
	exact(`[sig-network] Services should be able to change the type from ClusterIP to ExternalName [Conformance]`),
	exact(`[sig-network] Services should be able to change the type from NodePort to ExternalName [Conformance]`),
	exact(`[sig-network] EndpointSlice should create Endpoints and EndpointSlices for Pods matching a Service [Conformance]`),
	exact(`[sig-network] EndpointSlice should create and delete EndpointSlices for a Service with a selector that matches no pods [Conformance]`),
	exact(`[sig-network] EndpointSlice should support creating EndpointSlice API operations [Conformance]`),
	`\[sig-network\] EndpointSliceMirroring .*\[Conformance\]`,
}

// exact is a pattern that matches the spec text s and nothing longer.
// Ginkgo matches the focus against a text that does not start with the
// outermost container's text (a space or an unnamed container comes
// first), so the start is a space or the beginning.
func exact(s string) string { return exactPrefix + regexp.QuoteMeta(s) + "$" }

const exactPrefix = `(?:^|\s)`

// anyOf is one pattern matching any of pats.
func anyOf(pats []string) string {
	parts := make([]string, len(pats))
	for i, p := range pats {
		parts[i] = "(?:" + p + ")"
	}
	return strings.Join(parts, "|")
}

func matchesAny(pats []string, s string) bool {
	for _, p := range pats {
		if regexp.MustCompile(p).MatchString(s) {
			return true
		}
	}
	return false
}
