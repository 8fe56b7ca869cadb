#!/usr/bin/env bash
# Builds a release of this checkout into OUTDIR (default dist/), with no
# container engine and no registry (`make release`):
#
#   agent-linux-amd64, agent-linux-arm64
#       static agents (CGO_ENABLED=0, -trimpath, -buildvcs=false), stamped
#       with the version and revision (scripts/version.sh)
#   penaltybox-agent-<version>.oci.tar
#       an OCI image archive (an OCI layout in a tar) holding one image
#       index, tagged <image tag>, with the agent image for both
#       architectures: Dockerfile.offline (FROM scratch, so building the
#       arm64 image runs nothing and needs no emulation) built with buildah
#       once per architecture. Load it with e.g.
#         skopeo copy --all oci-archive:penaltybox-agent-<version>.oci.tar docker://REGISTRY/penaltybox/agent:<image tag>
#   penaltybox-<version>.tgz
#       the Helm chart, its version <version>, its appVersion <image tag>
#   SHA256SUMS
#       sha256sum of every file above
#
# <image tag> is the version with "+" written "_" (a tag may not hold a
# "+"; Helm writes OCI chart tags the same way).
#
# Reproducible: two runs on the same commit give the same bytes. Every
# time in the artifacts is the commit's (SOURCE_DATE_EPOCH, from git):
# buildah --timestamp for the images, tar --mtime and gzip -n for the
# archives; the image layout and the chart are repacked with sorted names,
# numeric owner 0 and that time, because the tools that write them use the
# time of the run. scripts/release-check.sh builds twice and compares.
#
# Needs Go, buildah and helm (scripts/helm-tools.sh builds it). About a
# minute with warm Go and Helm caches on 2 cores; cold, the two agents take
# a few minutes more.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "release: $*" >&2; }
die() { log "error: $*"; exit 1; }

OUT=${1:-$ROOT/dist}
command -v buildah >/dev/null 2>&1 || die "buildah not found: apt-get install buildah"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

cd "$ROOT"
read -r VERSION REVISION < <(scripts/version.sh)
TAG=${VERSION//+/_}
LDFLAGS=$(scripts/version.sh --ldflags)
if git rev-parse --git-dir >/dev/null 2>&1; then
  SOURCE_DATE_EPOCH=$(git log -1 --format=%ct)
else
  SOURCE_DATE_EPOCH=$(stat -c %Y CHANGELOG.md)
fi
export SOURCE_DATE_EPOCH
HELM=$(scripts/helm-tools.sh | tail -n1)/helm
log "penaltybox $VERSION (revision $REVISION, image tag $TAG, time $(date -u -d "@$SOURCE_DATE_EPOCH" +%FT%TZ)) into $OUT"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# Only what this run makes goes into OUT.
rm -f "$OUT"/agent-linux-* "$OUT"/penaltybox-agent-*.oci.tar "$OUT"/penaltybox-*.tgz "$OUT"/SHA256SUMS

# deterministic_tar DIR FILE NAME...: DIR's NAMEs as a tar with sorted
# names, owner 0 and every mtime SOURCE_DATE_EPOCH.
deterministic_tar() {
  local dir=$1 file=$2
  shift 2
  tar -C "$dir" --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
    --format=gnu -cf "$file" "$@"
}

# The agents.
ARCHES=(amd64 arm64)
for arch in "${ARCHES[@]}"; do
  start=$SECONDS
  CGO_ENABLED=0 GOOS=linux GOARCH=$arch GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
    go build -trimpath -ldflags "-s -w $LDFLAGS" -o "$TMP/agent-linux-$arch" ./cmd/agent
  mv "$TMP/agent-linux-$arch" "$OUT/agent-linux-$arch"
  log "agent-linux-$arch: $((SECONDS - start)) s"
done

# The image: buildah in throw-away storage, in a private mount namespace
# with a tmpfs on /var/lib/containers as scripts/cluster-images.sh explains
# (its blob-info cache cannot be moved elsewhere).
B=(buildah --root "$TMP/root" --runroot "$TMP/run" --storage-driver vfs)
if [ "$(id -u)" = 0 ]; then
  case $TMP/ in /var/lib/*) die "TMPDIR must not be under /var/lib (buildah runs with a private one)";; esac
  B=(unshare --mount --propagation private sh -c \
    'd=/var/lib/containers; [ -d $d ] || d=/var/lib; mount -t tmpfs -o mode=0755 tmpfs $d && exec "$@"' \
    sh "${B[@]}")
fi
start=$SECONDS
list=localhost/penaltybox/agent:$TAG
"${B[@]}" manifest create "$list" >/dev/null
for arch in "${ARCHES[@]}"; do
  ctx=$TMP/ctx-$arch
  mkdir "$ctx"
  cp "$OUT/agent-linux-$arch" "$ctx/agent"
  touch -d "@$SOURCE_DATE_EPOCH" "$ctx/agent"
  "${B[@]}" bud --quiet --platform "linux/$arch" --timestamp "$SOURCE_DATE_EPOCH" --format oci \
    --label "org.opencontainers.image.version=$VERSION" \
    --label "org.opencontainers.image.revision=$REVISION" \
    --label "org.opencontainers.image.licenses=Apache-2.0" \
    --label "org.opencontainers.image.source=https://github.com/penaltybox/penaltybox" \
    -f "$ROOT/Dockerfile.offline" -t "localhost/penaltybox/agent:$TAG-$arch" "$ctx" >/dev/null
  "${B[@]}" manifest add --arch "$arch" --os linux "$list" "localhost/penaltybox/agent:$TAG-$arch" >/dev/null
done
"${B[@]}" manifest push --quiet --all --format oci "$list" "oci:$TMP/layout:$TAG" >&2
deterministic_tar "$TMP/layout" "$TMP/image.oci.tar" oci-layout index.json blobs
mv "$TMP/image.oci.tar" "$OUT/penaltybox-agent-$VERSION.oci.tar"
log "penaltybox-agent-$VERSION.oci.tar: $((SECONDS - start)) s, $(du -h "$OUT/penaltybox-agent-$VERSION.oci.tar" | cut -f1)"

# The chart: helm package (which follows crds/' and files/' links into
# deploy/ and checks values.schema.json), then the same files repacked.
start=$SECONDS
HELM_HOME=$TMP/helm
HELM_CONFIG_HOME=$HELM_HOME HELM_CACHE_HOME=$HELM_HOME HELM_DATA_HOME=$HELM_HOME \
  "$HELM" package charts/penaltybox --version "$VERSION" --app-version "$TAG" -d "$TMP/chart" 2>&1 |
  grep -v 'found symbolic link' >&2 || true
pkg=$TMP/chart/penaltybox-$VERSION.tgz
[ -f "$pkg" ] || die "helm package made no $pkg"
mkdir "$TMP/chart/x"
tar -C "$TMP/chart/x" -xzf "$pkg"
deterministic_tar "$TMP/chart/x" - penaltybox | gzip -n -9 >"$TMP/chart.tgz"
mv "$TMP/chart.tgz" "$OUT/penaltybox-$VERSION.tgz"
log "penaltybox-$VERSION.tgz: $((SECONDS - start)) s"

(cd "$OUT" && sha256sum agent-linux-amd64 agent-linux-arm64 "penaltybox-agent-$VERSION.oci.tar" "penaltybox-$VERSION.tgz" >SHA256SUMS)
cat "$OUT/SHA256SUMS" >&2
echo "$OUT"
