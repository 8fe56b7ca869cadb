#!/usr/bin/env bash
# Builds, once per version, a real kube-apiserver, kubectl and etcd for the
# end-to-end tests, and the rest of a node for the cluster test (kubelet,
# kube-controller-manager, kube-scheduler, kube-proxy), and prints the directory that holds them on the last line
# of stdout (all progress goes to stderr):
#
#   bin=$(scripts/k8s-tools.sh | tail -n1)
#   "$bin/kube-apiserver" --version
#
# Versions come from the wrapper modules in test/e2e/k8stools/ (apiserver/ for
# every Kubernetes binary, etcd/ for etcd); to change them run
# test/e2e/k8stools/update.sh. The project's own go.mod never depends on them.
#
# Binaries are cached outside the clone, keyed by version, in
#   ${PENALTYBOX_CACHE:-/var/cache/penaltybox}/k8s-<k8s version>-etcd-<etcd version>/
# and only a missing (or broken) binary is rebuilt. Each binary is built under
# a temporary name, checked with --version and then renamed into place, so an
# interrupted build never leaves a broken binary in the cache. Concurrent runs
# are serialised with flock.
#
# Needs only Go and the Go module proxy. A cold build takes 10-20 minutes on
# 2 cores (about 22 CPU-minutes, ~2.4 GB RSS, ~3.7 GB of Go build cache). A
# rebuild with a warm Go build cache takes about 20 s, and a cached run under 1 s.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOLS=$ROOT/test/e2e/k8stools

log() { echo "k8s-tools: $*" >&2; }
die() { log "error: $*"; exit 1; }

# modver GOMOD MODULE: the version of MODULE required by GOMOD.
modver() {
  awk -v m="$2" '
    $1 == m && $2 ~ /^v/ { print $2; exit }
    $1 == "require" && $2 == m { print $3; exit }
  ' "$1"
}

K8S_VERSION=$(modver "$TOOLS/apiserver/go.mod" k8s.io/kubernetes)
ETCD_VERSION=$(modver "$TOOLS/etcd/go.mod" go.etcd.io/etcd/server/v3)
[[ $K8S_VERSION =~ ^v1\.([0-9]+)\.[0-9]+$ ]] ||
  die "no k8s.io/kubernetes v1.N.P in $TOOLS/apiserver/go.mod (got '$K8S_VERSION')"
K8S_MINOR=${BASH_REMATCH[1]}
[[ $ETCD_VERSION =~ ^v3\.[0-9]+\.[0-9]+$ ]] ||
  die "no go.etcd.io/etcd/server/v3 v3.N.P in $TOOLS/etcd/go.mod (got '$ETCD_VERSION')"

CACHE_ROOT=${PENALTYBOX_CACHE:-/var/cache/penaltybox}
BIN=$CACHE_ROOT/k8s-$K8S_VERSION-etcd-$ETCD_VERSION

# The machine's Go (kubernetes declares go 1.26.0), no go.work from a parent
# directory, go.sum as committed, and static binaries with no C toolchain.
export GOTOOLCHAIN=local
export GOWORK=off
export GOFLAGS=-mod=readonly
export CGO_ENABLED=0

# kubectl refuses to parse an unstamped version, so stamp kube-apiserver and
# kubectl the way kubernetes' release build does.
K8S_LDFLAGS="-s -w \
 -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=$K8S_MINOR \
 -X k8s.io/component-base/version.gitTreeState=clean"
ETCD_LDFLAGS="-s -w"

# ok TOOL FILE: whether FILE is a working TOOL binary of the wanted version.
ok() {
  local tool=$1 file=$2 out
  [[ -f $file && -x $file ]] || return 1
  case $tool in
    kube-apiserver|kubelet|kube-controller-manager|kube-scheduler|kube-proxy)
      out=$("$file" --version 2>/dev/null) || return 1
      [[ $out == "Kubernetes $K8S_VERSION" ]] ;;
    kubectl)
      out=$(KUBECONFIG=/dev/null "$file" version --client 2>/dev/null) || return 1
      grep -qx "Client Version: $K8S_VERSION" <<<"$out" ;;
    etcd)
      out=$("$file" --version 2>/dev/null) || return 1
      grep -qx "etcd Version: ${ETCD_VERSION#v}" <<<"$out" ;;
    *) return 1 ;;
  esac
}

mkdir -p "$BIN" 2>/dev/null ||
  die "cannot create $BIN; set PENALTYBOX_CACHE to a writable directory"

exec 9>"$BIN/.lock"
if ! flock -n 9; then
  log "waiting for another k8s-tools.sh run to release $BIN/.lock"
  flock 9
fi

missing=()
K8S_TOOLS=(kube-apiserver kubectl kubelet kube-controller-manager kube-scheduler kube-proxy)
for tool in etcd "${K8S_TOOLS[@]}"; do
  ok "$tool" "$BIN/$tool" || missing+=("$tool")
done

if ((${#missing[@]} == 0)); then
  log "cached: ${K8S_TOOLS[*]} $K8S_VERSION, etcd $ETCD_VERSION in $BIN"
  echo "$BIN"
  exit 0
fi

# We hold the lock, so any leftover build directory is from a dead run.
rm -rf "$BIN"/.build.*
TMP=$(mktemp -d "$BIN/.build.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# install TOOL: check the freshly built binary, then rename it into the cache.
install_tool() {
  ok "$1" "$TMP/$1" || die "the freshly built $1 does not report the expected version"
  mv -f "$TMP/$1" "$BIN/$1"
  log "installed $BIN/$1"
}

want() { [[ " ${missing[*]} " == *" $1 "* ]]; }

log "building ${missing[*]} into $BIN (go: $(go env GOVERSION))"

if want etcd; then
  log "building etcd $ETCD_VERSION (about 1 minute cold)"
  start=$SECONDS
  (cd "$TOOLS/etcd" &&
    go build -trimpath -ldflags "$ETCD_LDFLAGS" -o "$TMP/etcd" go.etcd.io/etcd/server/v3) >&2
  log "built etcd in $((SECONDS - start))s"
  install_tool etcd
fi

k8s_pkgs=()
for tool in "${K8S_TOOLS[@]}"; do
  if want "$tool"; then k8s_pkgs+=("k8s.io/kubernetes/cmd/$tool"); fi
done
if ((${#k8s_pkgs[@]})); then
  log "building ${k8s_pkgs[*]} $K8S_VERSION (10-20 minutes with a cold Go build cache)"
  start=$SECONDS
  (cd "$TOOLS/apiserver" &&
    go build -trimpath -ldflags "$K8S_LDFLAGS" -o "$TMP/" "${k8s_pkgs[@]}") >&2
  log "built ${k8s_pkgs[*]} in $((SECONDS - start))s"
  for tool in "${K8S_TOOLS[@]}"; do
    if want "$tool"; then install_tool "$tool"; fi
  done
fi

echo "$BIN"
