#!/usr/bin/env bash
# Builds the images the cluster test imports into containerd, as docker
# archives in OUTDIR, and prints OUTDIR on the last line of stdout (all
# progress goes to stderr):
#
#   out=$(scripts/cluster-images.sh /tmp/images | tail -n1)
#   ctr -n k8s.io images import "$out/agent.tar"
#
#   agent.tar   localhost/penaltybox/agent:test       Dockerfile.offline
#   pause.tar   localhost/penaltybox-test/pause:1     test/cluster/images/pause
#   server.tar  localhost/penaltybox-test/server:1    test/cluster/images/server
#   client.tar  localhost/penaltybox-test/client:1    test/cluster/images/client
#   agent       the agent's binary, as in its image
#
# No image registry is reachable from the cluster test, so every image is
# FROM scratch and holds one static Go binary. The agent is built here with
# CGO_ENABLED=0 rather than taken from bin/agent, which the Makefile links
# dynamically. buildah runs with its own throw-away storage (vfs, in a
# temporary directory), so the host's /var/lib/containers is never touched.
# Needs Go and buildah. Takes about 7 s with a warm Go build cache; a cold one
# adds about 2 minutes on 2 cores (the agent).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { echo "cluster-images: $*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -eq 1 ] || die "usage: $0 OUTDIR"
command -v buildah >/dev/null 2>&1 || die "buildah not found: apt-get install buildah"
command -v go >/dev/null 2>&1 || die "go not found"
mkdir -p "$1"
OUT=$(cd "$1" && pwd)

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
B=(buildah --root "$TMP/root" --runroot "$TMP/run" --storage-driver vfs)
# Whatever --root says, buildah (containers/image) keeps a blob-info cache in
# /var/lib/containers/cache when run as root, and has no flag to move it. So
# each buildah runs in a private mount namespace with a tmpfs there (or on
# /var/lib when /var/lib/containers does not exist, so as not to create it):
# the cache dies with the process. Hence nothing buildah touches may live
# under /var/lib, and archives are written to TMP and then moved to OUT.
if [ "$(id -u)" = 0 ]; then
  case $TMP/ in /var/lib/*) die "TMPDIR must not be under /var/lib (buildah runs with a private one)";; esac
  B=(unshare --mount --propagation private sh -c \
    'd=/var/lib/containers; [ -d $d ] || d=/var/lib; mount -t tmpfs -o mode=0755 tmpfs $d && exec "$@"' \
    sh "${B[@]}")
fi

# gobuild PKG OUTFILE builds a static, stripped binary.
gobuild() {
  (cd "$ROOT" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
    go build -trimpath -ldflags='-s -w' -o "$2" "$1")
}

# push IMAGE NAME writes IMAGE to OUT/NAME.tar, by way of TMP so that an
# interrupted run never leaves a truncated archive in OUT.
push() {
  "${B[@]}" push --quiet "$1" "docker-archive:$TMP/$2.tar:$1" >&2
  mv "$TMP/$2.tar" "$OUT/$2.tar"
}

report() { # report NAME START, START an $EPOCHREALTIME
  log "$1.tar: $(awk -v a="$2" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }') s, $(du -h "$OUT/$1.tar" | cut -f1)"
}

# The agent, from Dockerfile.offline, with a context holding only the binary.
start=$EPOCHREALTIME
log "building agent"
mkdir "$TMP/agent"
gobuild ./cmd/agent "$TMP/agent/agent"
"${B[@]}" bud --quiet -f "$ROOT/Dockerfile.offline" -t localhost/penaltybox/agent:test "$TMP/agent" >/dev/null
push localhost/penaltybox/agent:test agent
# The binary too: the test runs `agent inspect` on the node while no agent runs.
cp "$TMP/agent/agent" "$OUT/agent.tmp" && mv "$OUT/agent.tmp" "$OUT/agent"
report agent "$start"

# The test workloads: the binary at /NAME, run with no arguments by default
# (the pod spec passes flags as args).
for name in pause server client; do
  start=$EPOCHREALTIME
  image=localhost/penaltybox-test/$name:1
  log "building $name"
  gobuild "./test/cluster/images/$name" "$TMP/$name.bin"
  c=$("${B[@]}" from scratch)
  "${B[@]}" copy "$c" "$TMP/$name.bin" "/$name" >/dev/null
  "${B[@]}" config --entrypoint "[\"/$name\"]" --cmd '[]' "$c"
  "${B[@]}" commit --quiet --format docker "$c" "$image" >/dev/null
  "${B[@]}" rm "$c" >/dev/null
  push "$image" "$name"
  report "$name" "$start"
done

echo "$OUT"
