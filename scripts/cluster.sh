#!/usr/bin/env bash
# A one-node Kubernetes cluster from real components, for the cluster test
# (test/cluster) and `make cluster-demo`: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kube-proxy (nftables mode), a
# kubelet, containerd 2 with runc, and the reference CNI `bridge` plugin with
# host-local IPAM. docs/cluster-rig.md says why each setting is what it is.
#
#   scripts/cluster.sh up                 start it (about 7 s)
#   scripts/cluster.sh kubectl ARGS...    kubectl as cluster-admin
#   scripts/cluster.sh import FILE.tar... load docker-archives into containerd
#   scripts/cluster.sh exec CMD...        run CMD on the node (its namespaces)
#   scripts/cluster.sh down               stop everything, remove all it made
#
# Everything runs inside one network namespace (the node, $CLUSTER_NETNS),
# whose only way out is a veth to a second namespace (its uplink router), and
# one private mount namespace held by a `sleep` that every component joins:
# the host's interfaces, routes, firewall, sysctls and /sys/fs/bpf are never
# touched, and what the kubelet and CNI insist on writing at fixed paths
# (/var/lib/kubelet, /var/lib/cni, /var/log/containers) goes to tmpfs mounts
# of the node's own. On the host: the kubelet's cgroups (cgroupfs driver),
# under penaltybox-$CLUSTER_NETNS/ in each hierarchy, and the empty mount
# points above when they were missing; `down` removes them all, and the
# state directory.
#
# State lives in $CLUSTER_DIR (default /tmp/$CLUSTER_NETNS; at most 25
# characters: containerd's shim socket directory must fit in 38). Binaries
# come from scripts/k8s-tools.sh and scripts/containerd-tools.sh (cached).
# Needs root, runc, containernetworking-plugins, nftables, iptables, openssl.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NETNS=${CLUSTER_NETNS:-pb-cluster}
DIR=${CLUSTER_DIR:-/tmp/$NETNS}
UPLINK_NETNS=$NETNS-uplink
# The kubelet's cgroup root, in every hierarchy.
CGROUP_ROOT=penaltybox-$NETNS
# A directory `down` may delete is one `up` made: it holds this file.
MARKER=.penaltybox-cluster
NODE=pb-node
# Addresses, all in 198.18.0.0/15: the node's uplink, the pods' bridge, the
# Services.
NODE_IP=198.18.210.2
ROUTER_IP=198.18.210.1
POD_CIDR=198.18.211.0/24
POD_GW=198.18.211.1
SERVICE_CIDR=198.19.240.0/20
DNS_IP=198.19.240.10

ETC=$DIR/etc
RUN=$DIR/run
log() { echo "cluster: $(date +%T) $*" >&2; }
die() { log "error: $*"; exit 1; }

# tools: where the binaries are; `up` finds (or builds) them, the other
# commands read what it found.
tools() {
  if [[ -f $RUN/tools.env ]]; then
    . "$RUN/tools.env"
  else
    K8S=$("$ROOT/scripts/k8s-tools.sh" | tail -n1)
    CTRD=$("$ROOT/scripts/containerd-tools.sh" | tail -n1)
    mkdir -p "$RUN"
    printf 'K8S=%q\nCTRD=%q\n' "$K8S" "$CTRD" >"$RUN/tools.env"
  fi
  KUBECTL=(env "KUBECACHEDIR=$DIR/kube-cache" "$K8S/kubectl" --kubeconfig "$ETC/admin.kubeconfig")
}

holder() { cat "$RUN/holder.pid"; }
inns() { nsenter -t "$(holder)" -m -n -- "$@"; }
# run NAME CMD...: start CMD on the node, in the background, logging to run/NAME.log.
run() {
  local n=$1
  shift
  nsenter -t "$(holder)" -m -n -- "$@" >"$RUN/$n.log" 2>&1 &
  echo $! >"$RUN/$n.pid"
  log "started $n (pid $!)"
}
# kubectl (KUBECTL, set by tools) as the cluster's admin, with its
# discovery cache in the cluster's directory, not ~/.kube; ctr on the
# cluster's containerd.
kc() { inns "${KUBECTL[@]}" "$@"; }
ctr() { inns "$CTRD/ctr" -a "$DIR/containerd/containerd.sock" -n k8s.io "$@"; }
# waitfor WHAT SECONDS CMD...: poll CMD until it succeeds.
waitfor() {
  local what=$1 limit=$2 start=$SECONDS
  shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS - start < limit)) || die "no $what after ${limit}s (logs in $RUN)"
    sleep 0.2
  done
  log "$what after $((SECONDS - start))s"
}

write_config() {
  mkdir -p "$ETC/cni" "$ETC/sysctl" "$RUN" "$DIR/pod-logs" "$DIR/cni-ipam" "$DIR/kubelet" "$DIR/containerd"
  local token
  token=$(openssl rand -hex 16)
  echo "$token,admin,admin,system:masters" >"$ETC/tokens.csv"
  openssl genrsa -out "$ETC/sa.key" 2048 2>/dev/null
  openssl rsa -in "$ETC/sa.key" -pubout -out "$ETC/sa.pub" 2>/dev/null
  cat >"$ETC/admin.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: penaltybox
  cluster:
    server: https://$NODE_IP:6443
    certificate-authority: $DIR/apiserver-certs/apiserver.crt
users:
- name: admin
  user:
    token: $token
contexts:
- name: penaltybox
  context: {cluster: penaltybox, user: admin}
current-context: penaltybox
EOF
  # The values the kubelet wants (protectKernelDefaults makes it check them
  # rather than write them host-wide), bind-mounted over /proc/sys in the
  # node's mount namespace only.
  echo 1 >"$ETC/sysctl/vm.overcommit_memory"
  echo 0 >"$ETC/sysctl/vm.panic_on_oom"
  echo 10 >"$ETC/sysctl/kernel.panic"
  echo 1 >"$ETC/sysctl/kernel.panic_on_oops"
  echo 1000000 >"$ETC/sysctl/kernel.keys.root_maxkeys"
  echo 25000000 >"$ETC/sysctl/kernel.keys.root_maxbytes"
  echo "nameserver $DNS_IP" >"$ETC/resolv.conf"
  cat >"$ETC/cni/10-bridge.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "penaltybox-cluster",
  "plugins": [{
    "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
    "ipam": {"type": "host-local", "dataDir": "$DIR/cni-ipam",
             "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$POD_GW"}]],
             "routes": [{"dst": "0.0.0.0/0"}]}
  }]
}
EOF
  cat >"$ETC/containerd.toml" <<EOF
version = 4
root = '$DIR/containerd/root'
state = '$DIR/containerd/state'
disabled_plugins = ['io.containerd.snapshotter.v1.devmapper', 'io.containerd.snapshotter.v1.zfs',
  'io.containerd.snapshotter.v1.blockfile', 'io.containerd.snapshotter.v1.erofs',
  'io.containerd.internal.v1.opt', 'io.containerd.nri.v1.nri']
[plugins.'io.containerd.server.v1.grpc']
  address = '$DIR/containerd/containerd.sock'
[plugins.'io.containerd.server.v1.ttrpc']
  address = '$DIR/containerd/containerd.sock.ttrpc'
[plugins.'io.containerd.server.v1.debug']
  address = '$DIR/containerd/debug.sock'
[plugins.'io.containerd.shim.v1.manager']
  socket_dir = '$DIR/containerd/s'
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = 'localhost/penaltybox-test/pause:1'
[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  # Root here lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = '/usr/sbin/runc'
        Root = '$DIR/containerd/runc'
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['/usr/lib/cni']
    conf_dir = '$ETC/cni'
    max_conf_num = 1
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
EOF
  cat >"$ETC/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$CGROUP_ROOT
containerRuntimeEndpoint: unix://$DIR/containerd/containerd.sock
failSwapOn: false
protectKernelDefaults: true
address: $NODE_IP
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
podLogsDir: $DIR/pod-logs
resolvConf: $ETC/resolv.conf
clusterDNS: [$DNS_IP]
clusterDomain: cluster.local
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%, imagefs.inodesFree: 1%}
maxPods: 30
EOF
  cat >"$ETC/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
hostnameOverride: $NODE
clusterCIDR: $POD_CIDR
clientConnection: {kubeconfig: $ETC/admin.kubeconfig}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# The conntrack sysctls are the host's: leave them alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
}

# The node's namespaces: a network namespace with an uplink to a router
# namespace (the default route the agent's --node-interfaces=auto finds), and
# a private mount namespace with its own bpffs, kubelet and CNI state, and
# the sysctl files above.
node_up() {
  ip netns add "$NETNS"
  ip netns add "$UPLINK_NETNS"
  ip -n "$NETNS" link add eth0 type veth peer name uplink0 netns "$UPLINK_NETNS"
  ip -n "$NETNS" link set lo up
  ip -n "$NETNS" addr add "$NODE_IP/24" dev eth0
  ip -n "$NETNS" link set eth0 up
  ip -n "$UPLINK_NETNS" addr add "$ROUTER_IP/24" dev uplink0
  ip -n "$UPLINK_NETNS" link set uplink0 up
  ip -n "$NETNS" route add default via "$ROUTER_IP"
  ip netns exec "$NETNS" sysctl -qw net.ipv4.ip_forward=1
  : >"$RUN/created-dirs"
  local d
  for d in /var/lib/kubelet /var/lib/cni /var/log/containers; do
    [[ -d $d ]] || { mkdir -p "$d" && echo "$d" >>"$RUN/created-dirs"; }
  done
  # The kubelet's cgroup root must exist in every hierarchy it uses.
  for d in $(cgroup_hierarchies); do
    mkdir -p "$d/$CGROUP_ROOT"
  done
  # The kubelet always puts its device-plugin socket in /var/lib/kubelet and
  # symlinks container logs in /var/log/containers (and garbage-collects
  # links there it does not know), the CNI library keeps its cache in
  # /var/lib/cni: each gets a tmpfs of the node's own. The holder says it is
  # ready only after its last mount.
  nsenter --net="/run/netns/$NETNS" unshare --mount --propagation private -- /bin/sh -c '
    set -e
    for f in "$1"/*; do mount --bind "$f" /proc/sys/$(basename "$f" | tr . /); done
    mount -t bpf bpffs /sys/fs/bpf
    mount -t tmpfs -o size=64m,mode=0700 pb-kubelet /var/lib/kubelet
    mount -t tmpfs -o size=16m,mode=0700 pb-cni /var/lib/cni
    mount -t tmpfs -o size=16m,mode=0755 pb-logs /var/log/containers
    touch "$2"
    exec sleep infinity' sh "$ETC/sysctl" "$RUN/holder.ready" >"$RUN/holder.log" 2>&1 &
  echo $! >"$RUN/holder.pid"
  waitfor "node mount namespace" 10 test -f "$RUN/holder.ready"
}

# cgroup_hierarchies lists the mounted cgroup hierarchies: the unified one
# alone on a cgroup v2 host, else each v1 controller's and the unified
# mount beside them.
cgroup_hierarchies() {
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    echo /sys/fs/cgroup
    return
  fi
  local d
  for d in /sys/fs/cgroup/*/; do
    [[ -f ${d}cgroup.procs ]] && echo "${d%/}"
  done
}

# ours PID: whether PID runs in the node's network namespace, so a stale
# PID file (a reboot, a reused PID) never gets another process signalled.
ours() {
  local want
  want=$(stat -Lc %i "/run/netns/$NETNS" 2>/dev/null) || return 1
  [[ $(readlink "/proc/$1/ns/net" 2>/dev/null) == "net:[$want]" ]]
}

up() {
  [[ $(id -u) == 0 ]] || die "needs root"
  [[ ! -e /run/netns/$NETNS ]] || die "netns $NETNS exists: a cluster is up (or was not torn down); run: CLUSTER_DIR=$DIR CLUSTER_NETNS=$NETNS $0 down"
  ((${#DIR} <= 25)) || die "CLUSTER_DIR $DIR is longer than 25 characters: containerd's shim sockets would not fit under it"
  if [[ -e $DIR && ! -e $DIR/$MARKER ]] && [[ -n $(ls -A "$DIR") ]]; then
    die "$DIR is not empty and not a cluster's directory: refusing to replace it"
  fi
  for b in /usr/sbin/runc /usr/lib/cni/bridge /usr/lib/cni/host-local /usr/sbin/nft; do
    [[ -x $b ]] || die "missing $b (apt-get install runc containernetworking-plugins nftables)"
  done
  local start=$SECONDS
  rm -rf "$DIR"
  mkdir -p "$DIR"
  touch "$DIR/$MARKER"
  tools
  write_config
  node_up
  run etcd "$K8S/etcd" --data-dir "$DIR/etcd" --name node \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster node=http://127.0.0.1:2380 --listen-metrics-urls http://127.0.0.1:2381
  PATH=$CTRD:$PATH run containerd "$CTRD/containerd" --config "$ETC/containerd.toml"
  # --advertise-address is the node's: the `kubernetes` Service's endpoint,
  # which kube-proxy gives the agent's pod at the ClusterIP.
  run kube-apiserver "$K8S/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --bind-address=0.0.0.0 --advertise-address="$NODE_IP" --secure-port=6443 \
    --cert-dir="$DIR/apiserver-certs" --token-auth-file="$ETC/tokens.csv" --authorization-mode=Node,RBAC \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$ETC/sa.pub" --service-account-signing-key-file="$ETC/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --allow-privileged=true \
    --kubelet-preferred-address-types=InternalIP
  waitfor "containerd socket" 30 test -S "$DIR/containerd/containerd.sock"
  waitfor "API server /readyz" 90 kc get --raw /readyz
  run kube-controller-manager "$K8S/kube-controller-manager" --kubeconfig "$ETC/admin.kubeconfig" \
    --authentication-kubeconfig "$ETC/admin.kubeconfig" --authorization-kubeconfig "$ETC/admin.kubeconfig" \
    --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=false \
    --service-account-private-key-file="$ETC/sa.key" --root-ca-file="$DIR/apiserver-certs/apiserver.crt" \
    --controllers='*,-csrsigning,-csrapproving,-nodeipam' --cluster-name=penaltybox
  run kube-scheduler "$K8S/kube-scheduler" --kubeconfig "$ETC/admin.kubeconfig" \
    --authentication-kubeconfig "$ETC/admin.kubeconfig" --authorization-kubeconfig "$ETC/admin.kubeconfig" \
    --bind-address=127.0.0.1 --leader-elect=false
  run kube-proxy "$K8S/kube-proxy" --config "$ETC/kube-proxy.yaml"
  run kubelet "$K8S/kubelet" --config "$ETC/kubelet.yaml" --kubeconfig "$ETC/admin.kubeconfig" \
    --root-dir "$DIR/kubelet" --cert-dir "$DIR/kubelet/pki" --hostname-override "$NODE" --node-ip "$NODE_IP"
  waitfor "node Ready" 120 node_ready
  waitfor "default ServiceAccount" 60 kc get serviceaccount default -n default
  log "up in $((SECONDS - start))s; kubectl: CLUSTER_DIR=$DIR $0 kubectl ..."
}

node_ready() {
  [[ $(kc get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == True ]]
}

import() {
  local f
  for f in "$@"; do
    ctr images import --no-unpack=false "$f" >&2
  done
}

# stop NAME...: SIGTERM each, then wait (SIGKILL after 30 s).
stop() {
  local n p pids=()
  for n in "$@"; do
    [[ -f $RUN/$n.pid ]] || continue
    p=$(cat "$RUN/$n.pid")
    if ! ours "$p"; then
      log "$n: pid $p is not on the node (gone, or reused): not signalled"
      continue
    fi
    kill -TERM "$p" 2>/dev/null && pids+=("$n:$p")
  done
  local i
  for i in $(seq 300); do
    local alive=0 e
    for e in "${pids[@]}"; do kill -0 "${e#*:}" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for e in "${pids[@]}"; do
    if kill -0 "${e#*:}" 2>/dev/null; then
      log "${e%%:*} (${e#*:}) still running after 30s: SIGKILL"
      kill -KILL "${e#*:}" 2>/dev/null || true
    fi
  done
  for n in "$@"; do rm -f "$RUN/$n.pid"; done
}

running() { [[ -f $RUN/$1.pid ]] && ours "$(cat "$RUN/$1.pid")"; }

down() {
  if [[ ! -f $DIR/$MARKER ]]; then
    # Without the state, nothing here can be stopped safely: the namespace
    # (if any) belongs to a run whose directory is elsewhere.
    if [[ -e /run/netns/$NETNS ]]; then
      die "netns $NETNS exists but $DIR holds no cluster: run down with that cluster's CLUSTER_DIR"
    fi
    log "nothing to stop in $DIR"
    return 0
  fi
  tools
  # Workloads first, so the kubelet and containerd tear down what they made
  # (veths, network namespaces, mounts, cgroups).
  if running kubelet && running kube-apiserver; then
    kc delete --all-namespaces --all daemonsets,deployments,replicasets,pods --wait=true --timeout=60s >/dev/null 2>&1 || log "workloads not all deleted"
  fi
  stop kubelet
  stop kube-proxy kube-scheduler kube-controller-manager
  # Containers the kubelet did not get to: kill their tasks, then containerd.
  if running containerd; then
    local c
    for c in $(ctr tasks ls -q 2>/dev/null); do
      ctr tasks kill -s KILL "$c" >/dev/null 2>&1 || true
    done
  fi
  stop containerd
  # Containers that outlived containerd (it died, or its tasks did not stop):
  # runc's state for them is under our directory.
  local c p
  for c in $(runc --root "$DIR/containerd/runc/k8s.io" list -q 2>/dev/null || true); do
    log "killing leftover container $c"
    runc --root "$DIR/containerd/runc/k8s.io" kill --all "$c" KILL 2>/dev/null || true
  done
  # Shims of those containers (their command line names our directory).
  for p in $(pgrep -f containerd-shim-runc-v2 || true); do
    grep -qaF -- "$DIR/containerd" "/proc/$p/cmdline" 2>/dev/null && { log "killing leftover shim $p"; kill -KILL "$p" || true; }
  done
  # The API server before etcd: without etcd it cannot finish shutting down.
  stop kube-apiserver
  stop etcd
  # What `exec` started and is still running (by the PIDs it recorded).
  if [[ -f $RUN/exec.pids ]]; then
    for p in $(sort -u "$RUN/exec.pids"); do
      ours "$p" || continue
      log "stopping $(tr '\0' ' ' <"/proc/$p/cmdline" | cut -c1-60)(pid $p), started with exec"
      kill -KILL "$p" 2>/dev/null || true
    done
    rm -f "$RUN/exec.pids"
  fi
  # The last process in the node's mount namespace: its mounts go with it.
  stop holder
  ip netns del "$NETNS" 2>/dev/null || true
  ip netns del "$UPLINK_NETNS" 2>/dev/null || true
  if [[ -f $RUN/created-dirs ]]; then
    xargs -r rmdir <"$RUN/created-dirs" 2>/dev/null || true
    rm -f "$RUN/created-dirs"
  fi
  local h
  for h in $(cgroup_hierarchies); do
    [[ -d $h/$CGROUP_ROOT ]] || continue
    find "$h/$CGROUP_ROOT" -depth -type d -exec rmdir {} \; 2>/dev/null || log "could not remove all of $h/$CGROUP_ROOT"
  done
  if grep -qF " $DIR" /proc/self/mountinfo; then
    log "mounts left under $DIR: keeping it"
  else
    rm -rf "$DIR"
  fi
  log "down"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  # kubectl and exec replace this script (nsenter execs the command in
  # turn), so whoever started them can signal them; `down` ends what exec
  # started by the PIDs it recorded.
  kubectl) shift; tools; exec nsenter -t "$(holder)" -m -n -- "${KUBECTL[@]}" "$@" ;;
  import) shift; tools; import "$@" ;;
  exec) shift; echo $$ >>"$RUN/exec.pids"; exec nsenter -t "$(holder)" -m -n -- "$@" ;;
  *) echo "usage: $0 up | down | kubectl ARGS... | import FILE.tar... | exec CMD..." >&2; exit 2 ;;
esac
