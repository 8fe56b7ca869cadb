# The agent image that deploy/daemonset.yaml runs (penaltybox/agent):
#
#   read -r VERSION REVISION < <(scripts/version.sh)
#   docker build --build-arg VERSION=$VERSION --build-arg REVISION=$REVISION \
#     -t REGISTRY/penaltybox/agent:TAG .
#
# (`make release` builds the same agent, stamped, into a multi-architecture
# OCI archive with no engine: see docs/install.md.)
#
# Build stage: a static Go binary. The BPF object and its Go bindings are
# committed (bpf/lb_bpfel.o, bpf/lb_bpfel.go), so no clang is needed.
ARG GO_VERSION=1.26.8
FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
ENV CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY bpf/ bpf/
COPY cmd/ cmd/
COPY pkg/ pkg/
COPY internal/ internal/
ARG VERSION=0.0.0-unstamped
ARG REVISION=unknown
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    go build -trimpath -o /out/agent \
      -ldflags="-s -w -X github.com/penaltybox/penaltybox/internal/version.version=${VERSION} -X github.com/penaltybox/penaltybox/internal/version.revision=${REVISION}" \
      ./cmd/agent

# Run stage: nothing but the binary (no shell, no libc). The agent runs as
# uid 0 with only the capabilities the DaemonSet adds (BPF, NET_ADMIN,
# PERFMON, NET_RAW); distroless/static's default user is root for that
# reason.
FROM gcr.io/distroless/static-debian12
COPY --from=build /out/agent /usr/local/bin/agent
ENTRYPOINT ["/usr/local/bin/agent"]
