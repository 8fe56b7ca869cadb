# penaltybox — build, test, demo and benchmark entry points.
#
#   make          build bin/agent (no clang needed: BPF objects are committed)
#   make demo     the main story, in network namespaces (root)
#   make test     every test (root, as in CI)
#   make bench    benchmarks, writes bench/RESULTS.md (root)
#   make generate rebuild the BPF objects and Go bindings (needs clang)

SHELL := /bin/bash
GO ?= go
export GOTOOLCHAIN ?= local
export GOFLAGS ?= -buildvcs=false

# Debian packages the build, tests, demo and benchmarks use, and a command
# that proves each is installed.
DEPS := clang:clang llvm-strip:llvm bpftool:bpftool ip:iproute2 nft:nftables \
        nginx:nginx haproxy:haproxy ethtool:ethtool /usr/include/bpf/bpf_helpers.h:libbpf-dev \
        /usr/include/x86_64-linux-gnu/asm/types.h:linux-libc-dev

.PHONY: all build deps generate check-generated vet test test-unit test-bpf test-e2e demo bench teardown clean

all: build

build: bin/agent

bin/agent: $(shell find cmd pkg bpf -name '*.go' -o -name '*.o' 2>/dev/null) go.mod go.sum
	$(GO) build -o $@ ./cmd/agent

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

# check-generated fails when the committed BPF objects or bindings differ
# from what the C sources compile to.
check-generated: deps
	cd bpf && $(GO) generate ./...
	@if ! git diff --quiet -- bpf; then \
	  echo "bpf/: the committed objects or bindings differ from what the C sources compile to."; \
	  echo "Commit the regenerated files ('make generate'):"; git --no-pager diff --stat -- bpf; exit 1; fi

vet:
	$(GO) vet ./...
	@out=$$(gofmt -l cmd pkg internal bpf test bench examples 2>/dev/null); if [ -n "$$out" ]; then echo "gofmt:"; echo "$$out"; exit 1; fi

# Userspace packages under the race detector; BPF and network tests need
# root and run in CI (which is root).
test: deps check-generated vet build
	$(GO) test -race -count=1 -timeout 10m ./...

demo: deps build
	$(GO) run ./examples/demo --agent bin/agent

bench: deps build
	$(GO) run ./bench --out bench/RESULTS.md

# teardown removes the datapath left by a standalone agent on this host.
teardown: build
	bin/agent teardown

clean:
	rm -rf bin
