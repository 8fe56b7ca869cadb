#!/usr/bin/env bash
# Builds, once per version, Prometheus and promtool with Kubernetes service
# discovery (Debian's Prometheus is built without it: `kubernetes_sd_configs`
# is an unknown field there), and prints the directory that holds them on the
# last line of stdout (progress goes to stderr):
#
#   bin=$(scripts/prometheus-tools.sh | tail -n1)
#   "$bin/promtool" check config prometheus.yml
#
# The version comes from the wrapper module test/e2e/k8stools/prometheus. The
# binaries are cached outside the clone, keyed by version, in
#   ${PENALTYBOX_CACHE:-/var/cache/penaltybox}/prometheus-<version>/
# built under temporary names, checked with --version and renamed into place;
# concurrent runs are serialised with flock. A cold build takes about 7
# minutes on 2 cores (downloads included), a cached run under a second.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOD=$ROOT/test/e2e/k8stools/prometheus
log() { echo "prometheus-tools: $*" >&2; }
die() { log "error: $*"; exit 1; }

VERSION=$(awk '$1 == "github.com/prometheus/prometheus" && $2 ~ /^v/ { print $2; exit }' "$MOD/go.mod")
[[ $VERSION =~ ^v0\.[0-9]+\.[0-9]+$ ]] || die "no github.com/prometheus/prometheus v0.N.P in $MOD/go.mod (got '$VERSION')"
BIN=${PENALTYBOX_CACHE:-/var/cache/penaltybox}/prometheus-$VERSION

export GOTOOLCHAIN=local GOWORK=off GOFLAGS=-mod=readonly CGO_ENABLED=0
# Stamped, so --version says which module version it is.
LDFLAGS="-s -w -X github.com/prometheus/common/version.Version=$VERSION"

ok() { [[ -x $1 ]] && "$1" --version 2>&1 | grep -q "version $VERSION"; }

mkdir -p "$BIN" 2>/dev/null || die "cannot create $BIN; set PENALTYBOX_CACHE to a writable directory"
exec 9>"$BIN/.lock"
flock 9
if ok "$BIN/prometheus" && ok "$BIN/promtool"; then
  log "cached: prometheus and promtool $VERSION in $BIN"
  echo "$BIN"
  exit 0
fi
rm -rf "$BIN"/.build.*
TMP=$(mktemp -d "$BIN/.build.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
log "building prometheus and promtool $VERSION into $BIN (about 7 minutes cold)"
start=$SECONDS
(cd "$MOD" && go build -trimpath -ldflags "$LDFLAGS" -o "$TMP/" \
  github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool) >&2
log "built in $((SECONDS - start))s"
for tool in prometheus promtool; do
  ok "$TMP/$tool" || die "the freshly built $tool does not report version $VERSION"
  mv -f "$TMP/$tool" "$BIN/$tool"
done
echo "$BIN"
