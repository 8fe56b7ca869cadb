// SPDX-License-Identifier: Apache-2.0

// Command coredns is CoreDNS with only the plugins a cluster's DNS needs
// (kubernetes, cache, health, ready, errors, log, loadbalance), for the
// cluster rig's kube-dns in the conformance run (scripts/e2e-images.sh).
// The full build pulls in every cloud provider's SDK; these plugins are
// what kubeadm's default Corefile uses that can work without an upstream
// resolver (the rig has none: `forward` is left out).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The directives in the order of CoreDNS' plugin.cfg, which decides the
// order a query passes through them.
func init() {
	dnsserver.Directives = []string{"ready", "health", "errors", "log", "loadbalance", "cache", "kubernetes"}
}

func main() { coremain.Run() }
