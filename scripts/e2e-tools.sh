#!/usr/bin/env bash
# Builds, once per Kubernetes version, Kubernetes' own end-to-end test binary
# (e2e.test, the package k8s.io/kubernetes/test/e2e compiled with `go test -c`)
# and agnhost (k8s.io/kubernetes/test/images/agnhost, the workload nearly
# every e2e test runs), for the conformance run (test/conformance), and
# prints the directory that holds them on the last line of stdout (progress
# goes to stderr):
#
#   bin=$(scripts/e2e-tools.sh | tail -n1)
#   "$bin/e2e.test" --version          # v1.37.2
#   "$bin/agnhost" --version           # app version 2.66.1 (the tag the e2e framework pulls)
#   "$bin/coredns" -version            # CoreDNS-1.14.6 (the cluster's DNS)
#
# The version comes from the wrapper module test/e2e/k8stools/e2etest, which
# must require the same k8s.io/kubernetes as test/e2e/k8stools/apiserver (the
# cluster's binaries): e2e.test is built at the cluster's version. Same
# approach as scripts/k8s-tools.sh: the staging modules replaced with their
# published tags, the project's own go.mod never sees kubernetes. CoreDNS
# (the rig has no cluster DNS, and the Services tests reach Services by
# name) comes from test/e2e/k8stools/coredns, at the version kubeadm of this
# Kubernetes release installs, with only the plugins a cluster DNS needs.
#
# Cached outside the clone, keyed by version, in
#   ${PENALTYBOX_CACHE:-/var/cache/penaltybox}/e2e-<k8s version>/
# each binary built under a temporary name, checked (--version) and renamed
# into place, so an interrupted build never leaves a broken binary there;
# concurrent runs are serialised with flock.
#
# Needs Go and the Go module proxy. Cold (Go build cache warm from
# scripts/k8s-tools.sh) about 12 minutes on 2 cores; cached, under a second.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOLS=$ROOT/test/e2e/k8stools

log() { echo "e2e-tools: $*" >&2; }
die() { log "error: $*"; exit 1; }

modver() {
  awk -v m="$2" '
    $1 == m && $2 ~ /^v/ { print $2; exit }
    $1 == "require" && $2 == m { print $3; exit }
  ' "$1"
}

K8S_VERSION=$(modver "$TOOLS/e2etest/go.mod" k8s.io/kubernetes)
CLUSTER_VERSION=$(modver "$TOOLS/apiserver/go.mod" k8s.io/kubernetes)
[[ $K8S_VERSION =~ ^v1\.([0-9]+)\.[0-9]+$ ]] ||
  die "no k8s.io/kubernetes v1.N.P in $TOOLS/e2etest/go.mod (got '$K8S_VERSION')"
K8S_MINOR=${BASH_REMATCH[1]}
[[ $K8S_VERSION == "$CLUSTER_VERSION" ]] ||
  die "e2etest requires kubernetes $K8S_VERSION but the cluster runs $CLUSTER_VERSION: run test/e2e/k8stools/update.sh"

export GOTOOLCHAIN=local
export GOWORK=off
export GOFLAGS=-mod=readonly
export CGO_ENABLED=0

# The agnhost tag the framework asks for is the VERSION file beside its
# sources (test/utils/image/manifest.go holds the same number).
K8S_SRC=$(cd "$TOOLS/e2etest" && go list -m -f '{{.Dir}}' k8s.io/kubernetes 2>/dev/null) ||
  K8S_SRC=$(cd "$TOOLS/e2etest" && go mod download -json k8s.io/kubernetes | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
[[ -d $K8S_SRC/test/images/agnhost ]] || die "no kubernetes sources for $K8S_VERSION (go mod download failed?)"
AGNHOST_VERSION=$(tr -d '[:space:]' <"$K8S_SRC/test/images/agnhost/VERSION")
grep -q "\"agnhost\", \"$AGNHOST_VERSION\"}" "$K8S_SRC/test/utils/image/manifest.go" ||
  die "test/images/agnhost/VERSION ($AGNHOST_VERSION) is not the tag test/utils/image/manifest.go pulls"

COREDNS_VERSION=$(modver "$TOOLS/coredns/go.mod" github.com/coredns/coredns)
[[ $COREDNS_VERSION =~ ^v1\.[0-9]+\.[0-9]+$ ]] ||
  die "no github.com/coredns/coredns v1.N.P in $TOOLS/coredns/go.mod (got '$COREDNS_VERSION')"

CACHE_ROOT=${PENALTYBOX_CACHE:-/var/cache/penaltybox}
BIN=$CACHE_ROOT/e2e-$K8S_VERSION

K8S_LDFLAGS="-s -w \
 -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=$K8S_MINOR \
 -X k8s.io/component-base/version.gitTreeState=clean"

ok() {
  local file=$2 out
  [[ -f $file && -x $file ]] || return 1
  case $1 in
    e2e.test) out=$("$file" --version 2>/dev/null) || return 1; [[ $out == "$K8S_VERSION" ]] ;;
    agnhost) out=$("$file" --version 2>/dev/null) || return 1; [[ $out == "app version $AGNHOST_VERSION" ]] ;;
    coredns) out=$("$file" -version 2>/dev/null) || return 1; [[ $out == "CoreDNS-${COREDNS_VERSION#v}"* ]] ;;
    *) return 1 ;;
  esac
}

mkdir -p "$BIN" 2>/dev/null || die "cannot create $BIN; set PENALTYBOX_CACHE to a writable directory"
exec 9>"$BIN/.lock"
if ! flock -n 9; then
  log "waiting for another e2e-tools.sh run to release $BIN/.lock"
  flock 9
fi

missing=()
for tool in e2e.test agnhost coredns; do ok "$tool" "$BIN/$tool" || missing+=("$tool"); done
if ((${#missing[@]} == 0)); then
  log "cached: e2e.test $K8S_VERSION, agnhost $AGNHOST_VERSION, coredns $COREDNS_VERSION in $BIN"
  echo "$BIN"
  exit 0
fi

rm -rf "$BIN"/.build.*
TMP=$(mktemp -d "$BIN/.build.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

install_tool() {
  ok "$1" "$TMP/$1" || die "the freshly built $1 does not report the expected version"
  mv -f "$TMP/$1" "$BIN/$1"
  log "installed $BIN/$1"
}
want() { [[ " ${missing[*]} " == *" $1 "* ]]; }

if want agnhost; then
  log "building agnhost $AGNHOST_VERSION"
  start=$SECONDS
  (cd "$TOOLS/e2etest" &&
    go build -trimpath -ldflags "-s -w -X main.Version=$AGNHOST_VERSION" -o "$TMP/agnhost" k8s.io/kubernetes/test/images/agnhost) >&2
  log "built agnhost in $((SECONDS - start))s"
  install_tool agnhost
fi

if want coredns; then
  log "building coredns $COREDNS_VERSION"
  start=$SECONDS
  (cd "$TOOLS/coredns" &&
    go build -trimpath -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" -o "$TMP/coredns" .) >&2
  log "built coredns in $((SECONDS - start))s"
  install_tool coredns
fi

if want e2e.test; then
  log "building e2e.test $K8S_VERSION (go $(go env GOVERSION); 10-30 minutes with a cold Go build cache)"
  start=$SECONDS
  (cd "$TOOLS/e2etest" &&
    go test -c -trimpath -ldflags "$K8S_LDFLAGS" -o "$TMP/e2e.test" k8s.io/kubernetes/test/e2e) >&2
  log "built e2e.test in $((SECONDS - start))s"
  install_tool e2e.test
fi

echo "$BIN"
