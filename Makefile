# penaltybox — build, test, demo and benchmark entry points.
#
#   make          build bin/agent (no clang needed: BPF objects are committed)
#   make demo     the main story, in network namespaces (root)
#   make cluster-demo  the same story on a one-node Kubernetes cluster (root)
#   make test     every test (root, as in CI)
#   make bench    benchmarks, writes bench/RESULTS.md (root)
#   make conformance  Kubernetes' e2e Services tests on the cluster rig (root, ~1 h)
#   make generate rebuild the BPF objects and Go bindings (needs clang)
#   make docs     regenerate the reference tables in docs/reference/ from the code
#   make release  agents (amd64, arm64), the multi-arch OCI image archive, the
#                 chart and SHA256SUMS into dist/, reproducibly

SHELL := /bin/bash
GO ?= go
export GOTOOLCHAIN ?= local
export GOFLAGS ?= -buildvcs=false

# Debian packages the build, tests, demo and benchmarks use, and a command
# that proves each is installed.
DEPS := clang:clang llvm-strip:llvm bpftool:bpftool ip:iproute2 nft:nftables \
        nginx:nginx haproxy:haproxy ethtool:ethtool /usr/include/bpf/bpf_helpers.h:libbpf-dev \
        /usr/include/x86_64-linux-gnu/asm/types.h:linux-libc-dev promtool:prometheus \
        buildah:buildah runc:runc /usr/lib/cni/bridge:containernetworking-plugins openssl:openssl \
        iptables:iptables qemu-system-x86_64:qemu-system-x86 /usr/share/doc/busybox-static:busybox-static \
        cpio:cpio depmod:kmod

.PHONY: all build deps generate check-generated vet check-rules prometheus-tools containerd-tools helm-tools controller-gen-tools generate-crds check-crds docs release release-check test kernel-matrix k8s-tools e2e-tools conformance demo cluster-demo bench teardown clean

all: build

build: bin/agent

# Stamped with the version and revision (scripts/version.sh: the git tag,
# else CHANGELOG.md's top release plus -dev+<commit>); `bin/agent version`
# prints them.
bin/agent: $(shell find cmd pkg internal bpf -name '*.go' -o -name '*.o' 2>/dev/null) go.mod go.sum CHANGELOG.md
	$(GO) build -ldflags "$$(scripts/version.sh --ldflags)" -o $@ ./cmd/agent

# deps installs what is missing, and nothing when all is there.
deps:
	@missing=""; for d in $(DEPS); do probe=$${d%%:*}; pkg=$${d##*:}; \
	  if [[ $$probe == /* ]]; then [ -e $$probe ] || missing="$$missing $$pkg"; \
	  else command -v $$probe >/dev/null 2>&1 || [ -x /usr/sbin/$$probe ] || missing="$$missing $$pkg"; fi; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root (or install:$$missing)"; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

generate: deps
	cd bpf && $(GO) generate ./...
	cd bench/xdpbase && $(GO) generate ./...
	cd internal/testnet/synackdelay && $(GO) generate ./...

# The BackendPolicy CRD and deep-copy functions from the Go types in
# pkg/apis (controller-gen, built from the Go module proxy and cached:
# scripts/controller-gen-tools.sh).
generate-crds:
	scripts/generate-crds.sh

controller-gen-tools:
	scripts/controller-gen-tools.sh >/dev/null

# check-crds fails when the committed CRD or deep-copy functions differ from
# what the types generate.
check-crds:
	@if ! git rev-parse --git-dir >/dev/null 2>&1; then \
	  echo "check-crds: skipped: not a git checkout (it compares with the committed files)"; exit 0; fi; \
	scripts/generate-crds.sh 2>/dev/null || exit 1; \
	if ! git diff --quiet -- deploy/backendpolicy-crd.yaml pkg/apis; then \
	  echo "the committed BackendPolicy CRD or deep-copy functions differ from what pkg/apis generates."; \
	  echo "Commit the regenerated files ('make generate-crds'):"; git --no-pager diff --stat -- deploy/backendpolicy-crd.yaml pkg/apis; exit 1; fi

# check-generated fails when the committed BPF objects or bindings differ
# from what the C sources compile to. The objects are byte for byte what
# clang $(BPF_CLANG_MAJOR) (Debian 12's, this project's CI) makes of them; another
# clang compiles the same sources to other, equally valid bytes, so the
# check only runs where the comparison means something.
BPF_CLANG_MAJOR := 14
check-generated: deps check-crds
	@if ! git rev-parse --git-dir >/dev/null 2>&1; then \
	  echo "check-generated: skipped: not a git checkout (it compares with the committed objects)"; exit 0; fi; \
	have=$$(clang --version | sed -n '1s/.*clang version \([0-9]*\).*/\1/p'); \
	if [ "$$have" != "$(BPF_CLANG_MAJOR)" ]; then \
	  echo "check-generated: skipped: clang $$have here, the committed objects are clang $(BPF_CLANG_MAJOR)'s"; exit 0; fi; \
	$(MAKE) --no-print-directory generate >/dev/null || exit 1; \
	if ! git diff --quiet -- bpf bench/xdpbase internal/testnet/synackdelay; then \
	  echo "the committed BPF objects or bindings differ from what the C sources compile to."; \
	  echo "Commit the regenerated files ('make generate'):"; git --no-pager diff --stat -- bpf bench/xdpbase internal/testnet/synackdelay; exit 1; fi

vet:
	$(GO) vet ./...
	@out=$$(gofmt -l cmd pkg internal bpf test bench examples 2>/dev/null); if [ -n "$$out" ]; then echo "gofmt:"; echo "$$out"; exit 1; fi

# The shipped alert rules: valid, and their promtool unit tests pass.
check-rules: deps
	promtool check rules deploy/monitoring/penaltybox.rules.yaml
	promtool test rules deploy/monitoring/penaltybox.rules.test.yaml

# The suites that run against Kubernetes components (make test runs them
# side by side).
KUBE_TEST_PKGS := ./test/cluster ./test/conformance ./test/e2e/k8s

# Every test, under the race detector. BPF and network tests need root
# and run in CI (which is root). k8s-tools first, so the test timeout does
# not include building the API server. Each phase's whole output is also
# kept in TEST_LOG_DIR (outside the clone, the last run's), and the cluster
# test's dump of a failure goes there too: a CI log that shows only a
# failure's head and tail can be read there in full.
TEST_LOG_DIR ?= /tmp/penaltybox-test-logs
test: deps check-generated vet check-rules release-check build k8s-tools prometheus-tools containerd-tools helm-tools e2e-tools
	@# Each phase's start is stamped, so a slow one shows in CI's log
	@# (a warm make test is meant to stay under 20 minutes).
	@mkdir -p "$(TEST_LOG_DIR)" && rm -f "$(TEST_LOG_DIR)"/*.log
	@echo "make test: unit tests, $$(date -u +%T)"
	set -o pipefail; $(GO) test -race -count=1 -timeout 12m $$($(GO) list ./... | grep -v -e /test/ -e /bench) 2>&1 | tee "$(TEST_LOG_DIR)/unit.log"
	@# The datapath under arbitrary frames from a client (pkg/datapath
	@# FuzzXDP's invariants), for a bounded time.
	@echo "make test: FuzzXDP, $$(date -u +%T)"
	set -o pipefail; $(GO) test -run='^$$' -fuzz=FuzzXDP -fuzztime=30s ./pkg/datapath 2>&1 | tee "$(TEST_LOG_DIR)/fuzz.log"
	@echo "make test: kernel matrix, $$(date -u +%T)"
	set -o pipefail; $(MAKE) --no-print-directory kernel-matrix 2>&1 | tee "$(TEST_LOG_DIR)/kernel-matrix.log"
	@# The Kubernetes suites side by side: they mostly wait on API servers,
	@# kubelets and accrual windows (a third of the two cores between them),
	@# assert with margins of seconds, and each runs in network namespaces,
	@# cgroups and state directories of its own (scripts/cluster.sh,
	@# internal/kubeapi). The rest one package at a time: on two cores, two
	@# of them side by side would measure each other.
	@echo "make test: Kubernetes suites, $$(date -u +%T)"
	set -o pipefail; TEST_LOG_DIR="$(TEST_LOG_DIR)" $(GO) test -race -count=1 -timeout 12m -p 3 $(KUBE_TEST_PKGS) 2>&1 | tee "$(TEST_LOG_DIR)/kubernetes.log"
	@echo "make test: network tests, $$(date -u +%T)"
	set -o pipefail; $(GO) test -race -count=1 -timeout 12m -p 1 $$($(GO) list ./test/... ./bench/... | grep -v -x $(patsubst ./%,-e github.com/penaltybox/penaltybox/%,$(KUBE_TEST_PKGS))) 2>&1 | tee "$(TEST_LOG_DIR)/network.log"
	@echo "make test: done, $$(date -u +%T)"

# The generated tables of docs/reference/ (flags, metrics, maps, the
# BackendPolicy's fields), rewritten from the code. make test fails when
# they are stale (the same tests, without PENALTYBOX_UPDATE_DOCS), and
# checks every relative link and anchor of every Markdown file
# (internal/repocheck).
docs:
	PENALTYBOX_UPDATE_DOCS=1 $(GO) test -count=1 -run '^(TestFlagsReference|TestMetricsReference|TestMapsReference|TestBackendPolicyReference)$$' ./cmd/agent ./pkg/metrics ./internal/repocheck

# A release into dist/ (scripts/release.sh): the static agents for
# linux/amd64 and linux/arm64, an OCI image archive holding both (buildah,
# no engine, no registry), the Helm chart and SHA256SUMS. Two runs on one
# commit give the same digests; release-check (in make test, ~40 s warm)
# proves it by building twice.
release: deps
	scripts/release.sh dist

release-check: deps
	scripts/release-check.sh

# The BPF suites (pkg/datapath, internal/testnet) on the kernels clusters
# run (Debian's 6.1 and 6.12), each booted under qemu, side by side
# (scripts/kernel-matrix.sh; kernels cached like the Kubernetes binaries).
# About 2 minutes under TCG on 2 cores.
kernel-matrix: deps
	scripts/kernel-matrix.sh

# Prometheus and promtool with Kubernetes service discovery (Debian's lack
# it) for test/e2e/k8s, built from the Go module proxy and cached outside
# the clone (scripts/prometheus-tools.sh).
prometheus-tools:
	bash scripts/prometheus-tools.sh >/dev/null

# helm (v4) for the chart's tests, the cluster test's install and `make
# release`, cached like the Kubernetes binaries (scripts/helm-tools.sh).
helm-tools:
	scripts/helm-tools.sh >/dev/null

# containerd 2 for the cluster test (scripts/containerd-tools.sh says why
# not Debian's 1.6), cached like the Kubernetes binaries.
containerd-tools:
	scripts/containerd-tools.sh >/dev/null

# The Kubernetes binaries and etcd for test/e2e/k8s and test/cluster, built from the
# Go module proxy and cached by version in /var/cache/penaltybox (the first
# build takes 10-20 minutes; later ones a second).
k8s-tools:
	scripts/k8s-tools.sh >/dev/null

# Kubernetes' e2e test binary, agnhost and CoreDNS at the cluster's
# version for test/conformance, built from the Go module proxy and cached
# like the Kubernetes binaries (scripts/e2e-tools.sh), and the tools its
# images take from this host (scripts/e2e-images.sh).
E2E_IMAGE_DEPS := nc.openbsd:netcat-openbsd curl:curl wget:wget dash:dash
e2e-tools: deps
	@$(MAKE) --no-print-directory deps DEPS="$(E2E_IMAGE_DEPS)"
	scripts/e2e-tools.sh >/dev/null

# The full peer suite (test/conformance, suite_test.go's fullFocus):
# Kubernetes' own e2e tests of Services, EndpointSlices, session affinity,
# conntrack and topology on the cluster rig with the agent serving every
# Service. make test runs a fixed subset of it (ciFocus). The JUnit report
# and the e2e log go to bin/conformance/.
conformance: deps build k8s-tools containerd-tools e2e-tools
	PENALTYBOX_CONFORMANCE=full PENALTYBOX_CONFORMANCE_REPORT=$(CURDIR)/bin/conformance \
	  $(GO) test -count=1 -timeout 200m -v -run 'TestConformance$$' ./test/conformance

demo: deps build
	$(GO) run ./examples/demo --agent bin/agent

# The seed story on a one-node cluster of real components
# (scripts/cluster.sh), with the agent's image built from this checkout.
cluster-demo: deps build k8s-tools prometheus-tools containerd-tools
	$(GO) run ./examples/cluster-demo

bench: deps build k8s-tools
	@# The raw figures too (bench/out/ is not committed): --render redraws
	@# RESULTS.md from them without measuring again.
	mkdir -p bench/out
	$(GO) run ./bench --out bench/RESULTS.md --json bench/out/results.json --agent bin/agent $(BENCHFLAGS)

# teardown removes the datapath left by a standalone agent on this host.
teardown: build
	bin/agent teardown

clean:
	rm -rf bin
