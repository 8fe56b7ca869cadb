#!/usr/bin/env bash
# Regenerates the wrapper modules in this directory (apiserver/, etcd/,
# e2etest/, coredns/) that pin the Kubernetes binaries (kube-apiserver, kubectl,
# and the node's kubelet, kube-controller-manager, kube-scheduler, kube-proxy),
# etcd, Kubernetes' e2e.test and agnhost, and CoreDNS used by the end-to-end
# and conformance tests.
# scripts/k8s-tools.sh builds them; this script is only for bumping versions.
#
#   test/e2e/k8stools/update.sh [K8S_VERSION] [ETCD_VERSION]
#
# k8s.io/kubernetes cannot be `go install`ed because its go.mod requires its
# staging modules (k8s.io/api, k8s.io/client-go, ...) at v0.0.0 and points
# them at ./staging with replace directives, which only apply inside that
# module. The apiserver wrapper therefore replaces every k8s.io/* module that
# kubernetes' own go.mod requires at v0.0.0 with the published v0.<minor>.<patch>
# tag. The list is read from kubernetes' go.mod, never typed by hand.
#
# Each wrapper is its own Go module, so the project's module never sees it
# (go build ./... stops at a directory with its own go.mod), and the etcd
# server is kept apart from kubernetes so that neither changes the other's
# dependency versions.
set -euo pipefail

K8S_VERSION=${1:-v1.37.2}
ETCD_VERSION=${2:-v3.7.3}

case $K8S_VERSION in
  v1.*.*) ;;
  *) echo "K8S_VERSION must look like v1.N.P, got $K8S_VERSION" >&2; exit 2 ;;
esac
case $ETCD_VERSION in
  v3.*.*) ;;
  *) echo "ETCD_VERSION must look like v3.N.P, got $ETCD_VERSION" >&2; exit 2 ;;
esac
STAGING_VERSION=v0.${K8S_VERSION#v1.}

# Start each go.mod at the oldest go line that has tool directives; go get
# raises it to the newest that the dependencies declare (go 1.26.0 for
# kubernetes v1.37 and etcd v3.7), so any Go 1.26.x builds them.
MIN_GO=1.24

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODULE_BASE=github.com/penaltybox/penaltybox/test/e2e/k8stools

export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
export GOWORK=off
export GOFLAGS=-mod=mod
export CGO_ENABLED=0

log() { echo "update.sh: $*" >&2; }

# --- apiserver + kubectl ---------------------------------------------------
dir=$HERE/apiserver
mkdir -p "$dir"
rm -f "$dir/go.mod" "$dir/go.sum"
cd "$dir"
go mod init "$MODULE_BASE/apiserver" >&2
go mod edit -go="$MIN_GO"

k8s_gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
  sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
[ -f "$k8s_gomod" ] || { log "could not download the go.mod of k8s.io/kubernetes@$K8S_VERSION"; exit 1; }

# Every k8s.io/* module required at v0.0.0 is a staging module.
staging=$(go mod edit -json "$k8s_gomod" | awk '
  /"Require":/ { inreq = 1 }
  /"Replace":|"Exclude":|"Retract":|"Tool":|"Godebug":/ { inreq = 0 }
  inreq && /"Path":/    { gsub(/[",]/, "", $2); path = $2 }
  inreq && /"Version":/ { gsub(/[",]/, "", $2); if ($2 == "v0.0.0" && path ~ /^k8s\.io\//) print path }
' | sort -u)
[ -n "$staging" ] || { log "found no staging modules in $k8s_gomod"; exit 1; }
log "replacing $(echo "$staging" | wc -l) staging modules with $STAGING_VERSION"

args=()
for m in $staging; do
  args+=("-replace=$m=$m@$STAGING_VERSION")
done
go mod edit "${args[@]}"
go get -tool \
  "k8s.io/kubernetes/cmd/kube-apiserver@$K8S_VERSION" \
  "k8s.io/kubernetes/cmd/kubectl@$K8S_VERSION" \
  "k8s.io/kubernetes/cmd/kubelet@$K8S_VERSION" \
  "k8s.io/kubernetes/cmd/kube-controller-manager@$K8S_VERSION" \
  "k8s.io/kubernetes/cmd/kube-scheduler@$K8S_VERSION" \
  "k8s.io/kubernetes/cmd/kube-proxy@$K8S_VERSION" >&2
go mod tidy >&2

# --- etcd ------------------------------------------------------------------
dir=$HERE/etcd
mkdir -p "$dir"
rm -f "$dir/go.mod" "$dir/go.sum"
cd "$dir"
go mod init "$MODULE_BASE/etcd" >&2
go mod edit -go="$MIN_GO"
go get -tool "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
go mod tidy >&2

# --- e2e.test and agnhost (scripts/e2e-tools.sh) ----------------------------
# The same kubernetes and replace list as apiserver/; no tool directive (e2e.test
# is a test binary, `go test -c`), so the go.sum entries come from listing
# every package (tests included) the two builds load.
dir=$HERE/e2etest
mkdir -p "$dir"
rm -f "$dir/go.mod" "$dir/go.sum"
cd "$dir"
go mod init "$MODULE_BASE/e2etest" >&2
go mod edit -go="$MIN_GO"
go mod edit "${args[@]}"
go get "k8s.io/kubernetes@$K8S_VERSION" >&2
go list -deps -test k8s.io/kubernetes/test/e2e k8s.io/kubernetes/test/images/agnhost >/dev/null

# --- CoreDNS, the cluster rig's DNS in the conformance run ------------------
# At the version kubeadm of this Kubernetes release installs.
COREDNS_VERSION=$(sed -n 's/^[[:space:]]*CoreDNSVersion = "\(v[0-9.]*\)"$/\1/p' \
  "$(go list -m -f '{{.Dir}}' k8s.io/kubernetes)/cmd/kubeadm/app/constants/constants.go")
[ -n "$COREDNS_VERSION" ] || { log "no CoreDNSVersion in kubeadm's constants"; exit 1; }
dir=$HERE/coredns
rm -f "$dir/go.mod" "$dir/go.sum"
cd "$dir"
go mod init "$MODULE_BASE/coredns" >&2
go mod edit -go="$MIN_GO"
go get "github.com/coredns/coredns@$COREDNS_VERSION" >&2
go mod tidy >&2

log "done: kubernetes $K8S_VERSION (staging $STAGING_VERSION), etcd $ETCD_VERSION, coredns $COREDNS_VERSION"
log "the binary cache key in scripts/k8s-tools.sh follows these go.mod files"
