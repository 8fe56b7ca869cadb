#!/usr/bin/env bash
# Builds the images Kubernetes' e2e Services tests run, for the conformance
# run on the cluster rig (test/conformance), as docker archives in OUTDIR
# tagged with the exact references the e2e framework of this Kubernetes
# version asks for (test/utils/image/manifest.go), so the kubelet finds them
# in containerd and never pulls (the framework's pods use IfNotPresent):
#
#   out=$(scripts/e2e-images.sh /tmp/e2e-images | tail -n1)
#   CLUSTER_DIR=... scripts/cluster.sh import "$out"/*.tar
#
#   agnhost.tar  registry.k8s.io/e2e-test-images/agnhost:<VERSION>   agnhost built from
#                k8s.io/kubernetes/test/images/agnhost at the cluster's version
#                (scripts/e2e-tools.sh), on a root filesystem with the tools the
#                tests run in it: dash as sh, busybox's applets, bash, curl,
#                wget, netcat-openbsd, iproute2's ip and ss (upstream: alpine with
#                the same packages); the porter's certificate, /uploads, agnhost-2
#   busybox.tar  registry.k8s.io/e2e-test-images/busybox:<tag>       Debian's busybox-static
#   nginx.tar    registry.k8s.io/e2e-test-images/nginx:<tag>         Debian's nginx, serving on 80
#   pause.tar    registry.k8s.io/pause:<tag>                         the rig's pause (test/cluster/images/pause)
#   coredns.tar  localhost/penaltybox-test/coredns:<version>         CoreDNS (scripts/e2e-tools.sh),
#                the rig's cluster DNS (test/conformance/testdata/coredns.yaml)
#
# There is no registry here, so the upstream images (alpine-, debian- and
# distroless-based) cannot be pulled; what the tests run in them is the same
# (agnhost is built from the same sources at the same version), the
# distribution around it is this host's Debian. The tags are read from the
# framework's manifest, never typed. buildah runs with throw-away storage in
# a private mount namespace, as in scripts/cluster-images.sh. Needs buildah,
# busybox-static, curl, netcat-openbsd, iproute2, bash, nginx and Go. A few
# seconds once scripts/e2e-tools.sh has its binaries cached. Needs dash too.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOLS=$ROOT/test/e2e/k8stools

log() { echo "e2e-images: $*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -eq 1 ] || die "usage: $0 OUTDIR"
for c in buildah go curl wget nc.openbsd dash ip ss bash nginx; do
  command -v "$c" >/dev/null 2>&1 || [ -x "/usr/sbin/$c" ] || die "$c not found (make conformance installs what is missing)"
done
BUSYBOX=/bin/busybox
file -L "$BUSYBOX" 2>/dev/null | grep -q 'statically linked' || die "$BUSYBOX is not busybox-static: apt-get install busybox-static"
mkdir -p "$1"
OUT=$(cd "$1" && pwd)

BIN=$("$ROOT/scripts/e2e-tools.sh" | tail -n1)
K8S_SRC=$(cd "$TOOLS/e2etest" && GOWORK=off GOFLAGS=-mod=readonly go list -m -f '{{.Dir}}' k8s.io/kubernetes)
MANIFEST=$K8S_SRC/test/utils/image/manifest.go
# tag KEY NAME: the tag manifest.go gives image NAME under configs[KEY].
tag() {
  local t
  t=$(sed -n "s/^[[:space:]]*configs\[$1\] = Config{list\.[A-Za-z0-9]*, \"$2\", \"\([^\"]*\)\"}.*/\1/p" "$MANIFEST")
  [[ $t =~ ^[A-Za-z0-9._-]+$ ]] || die "no image $2 under configs[$1] in $MANIFEST"
  echo "$t"
}
# registry VAR: the default of the registry list field VAR (e.g. PromoterE2eRegistry).
registry() {
  local r
  r=$(sed -n "s/^[[:space:]]*$1:[[:space:]]*\"\([^\"]*\)\",/\1/p" "$MANIFEST" | head -n1)
  [[ -n $r ]] || die "no registry $1 in $MANIFEST"
  echo "$r"
}
E2E_REG=$(registry PromoterE2eRegistry)
GC_REG=$(registry GcRegistry)
AGNHOST=$E2E_REG/agnhost:$(tag Agnhost agnhost)
[[ "app version ${AGNHOST##*:}" == $("$BIN/agnhost" --version) ]] || die "$BIN/agnhost is not version ${AGNHOST##*:}"
BUSYBOX_IMAGE=$E2E_REG/busybox:$(tag BusyBox busybox)
NGINX=$E2E_REG/nginx:$(tag Nginx nginx)
PAUSE=$GC_REG/pause:$(tag Pause pause)
COREDNS=localhost/penaltybox-test/coredns:$(awk '$1 == "github.com/coredns/coredns" { print $2 } $1 == "require" && $2 == "github.com/coredns/coredns" { print $3 }' "$TOOLS/coredns/go.mod")

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
B=(buildah --root "$TMP/root" --runroot "$TMP/run" --storage-driver vfs)
if [ "$(id -u)" = 0 ]; then
  case $TMP/ in /var/lib/*) die "TMPDIR must not be under /var/lib (buildah runs with a private one)";; esac
  B=(unshare --mount --propagation private sh -c \
    'd=/var/lib/containers; [ -d $d ] || d=/var/lib; mount -t tmpfs -o mode=0755 tmpfs $d && exec "$@"' \
    sh "${B[@]}")
fi

# add ROOTFS FILE [DEST]: FILE (followed through links) at DEST (default:
# its own path) in ROOTFS, with every shared library it loads.
add() {
  local rootfs=$1 file=$2 dest=${3:-$2} lib
  mkdir -p "$rootfs$(dirname "$dest")"
  cp -L "$file" "$rootfs$dest"
  for lib in $(ldd "$file" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
    [[ -e $rootfs$lib ]] && continue
    mkdir -p "$rootfs$(dirname "$lib")"
    cp -L "$lib" "$rootfs$lib"
  done
}

# busybox_root ROOTFS: busybox-static with a link for each of its applets
# in /bin, and the files a container's tools expect in /etc.
busybox_root() {
  local rootfs=$1 applet
  mkdir -p "$rootfs"/{bin,etc,tmp,usr/bin,usr/sbin,sbin}
  chmod 1777 "$rootfs/tmp"
  cp "$BUSYBOX" "$rootfs/bin/busybox"
  for applet in $("$BUSYBOX" --list); do
    [[ -e $rootfs/bin/$applet ]] || ln -s busybox "$rootfs/bin/$applet"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$rootfs/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$rootfs/etc/group"
  printf 'hosts: files dns\n' >"$rootfs/etc/nsswitch.conf"
}

# image NAME REF ROOTFS ENTRYPOINT CMD: commit ROOTFS as REF and write OUT/NAME.tar.
image() {
  local name=$1 ref=$2 rootfs=$3 entrypoint=$4 cmd=$5 c start=$EPOCHREALTIME
  c=$("${B[@]}" from scratch)
  "${B[@]}" copy "$c" "$rootfs" / >/dev/null
  # The PATH containerd would give an image without one, spelled out:
  # /usr/bin's curl and nc and /usr/sbin's ip come before busybox's in /bin.
  "${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --entrypoint "$entrypoint" --cmd "$cmd" "$c"
  "${B[@]}" commit --quiet --format docker "$c" "$ref" >/dev/null
  "${B[@]}" rm "$c" >/dev/null
  "${B[@]}" push --quiet "$ref" "docker-archive:$TMP/$name.tar:$ref" >&2
  mv "$TMP/$name.tar" "$OUT/$name.tar"
  log "$name.tar ($ref): $(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }') s, $(du -h "$OUT/$name.tar" | cut -f1)"
}

# agnhost: the binary at /agnhost (and /agnhost-2), as upstream's Dockerfile has it.
R=$TMP/agnhost-root
busybox_root "$R"
# GNU wget too: busybox-static's wget segfaults in getaddrinfo (a static
# glibc loading NSS modules), even for an IP address.
for f in /usr/bin/bash /usr/bin/curl /usr/bin/wget /usr/sbin/ip /usr/bin/ss; do add "$R" "$f"; done
add "$R" /bin/nc.openbsd /usr/bin/nc
ln -sf /usr/bin/bash "$R/bin/bash"
# /bin/sh is dash, not busybox: Debian's busybox-static is built with the
# standalone shell, whose sh runs its own applets before any in PATH, and
# its nc knows neither -v nor -t nor -u (alpine's busybox sh goes by PATH).
add "$R" /bin/dash
ln -sf dash "$R/bin/sh"
printf 'user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n' >>"$R/etc/passwd"
printf 'user-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\n' >>"$R/etc/group"
mkdir -p "$R/uploads"
cp "$K8S_SRC/test/images/agnhost/porter/localhost.crt" "$K8S_SRC/test/images/agnhost/porter/localhost.key" "$R/"
cp "$BIN/agnhost" "$R/agnhost"
ln -s agnhost "$R/agnhost-2"
image agnhost "$AGNHOST" "$R" '["/agnhost"]' '["pause"]'

R=$TMP/busybox-root
busybox_root "$R"
image busybox "$BUSYBOX_IMAGE" "$R" '[]' '["sh"]'

# nginx: the default server answers on port 80, as nginx's image does.
R=$TMP/nginx-root
busybox_root "$R"
add "$R" /usr/sbin/nginx
mkdir -p "$R/etc/nginx" "$R/var/lib/nginx" "$R/var/log/nginx" "$R/usr/share/nginx/html"
echo '<h1>Welcome to nginx!</h1>' >"$R/usr/share/nginx/html/index.html"
cat >"$R/etc/nginx/nginx.conf" <<'EOF'
daemon off;
user nobody nogroup;
pid /tmp/nginx.pid;
error_log stderr;
events {}
http {
  access_log /dev/stdout;
  client_body_temp_path /tmp/nginx-body;
  proxy_temp_path /tmp/nginx-proxy;
  fastcgi_temp_path /tmp/nginx-fastcgi;
  uwsgi_temp_path /tmp/nginx-uwsgi;
  scgi_temp_path /tmp/nginx-scgi;
  server {
    listen 80;
    root /usr/share/nginx/html;
  }
}
EOF
image nginx "$NGINX" "$R" '["/usr/sbin/nginx"]' '["-c", "/etc/nginx/nginx.conf"]'

R=$TMP/pause-root
mkdir -p "$R"
(cd "$ROOT" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
  go build -trimpath -ldflags='-s -w' -o "$R/pause" ./test/cluster/images/pause)
image pause "$PAUSE" "$R" '["/pause"]' '[]'

R=$TMP/coredns-root
mkdir -p "$R/etc/coredns"
cp "$BIN/coredns" "$R/coredns"
image coredns "$COREDNS" "$R" '["/coredns"]' '[]'

echo "$OUT"
