#!/usr/bin/env bash
# Builds, once per version, containerd 2 (containerd, its runc shim and ctr)
# for the cluster test, and prints the directory that holds them on the last
# line of stdout:
#
#   bin=$(scripts/containerd-tools.sh | tail -n1)
#   "$bin/containerd" --version
#
# Debian 12's containerd is 1.6: its default seccomp profile denies bpf(2) to
# a container that has CAP_BPF without CAP_SYS_ADMIN (1.7 allows it), so the
# DaemonSet's `seccompProfile: RuntimeDefault` could not load the datapath
# there, and kubelet 1.37 already warns that 1.6 lacks the RuntimeConfig call
# it will need from 1.38. The version comes from the wrapper module
# test/e2e/k8stools/containerd; the cache is described in
# scripts/lib/module-tools.sh. A cold build takes about 3 minutes on 2 cores.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib/module-tools.sh"
module_tools containerd "$ROOT/test/e2e/k8stools/containerd" \
  github.com/containerd/containerd/v2 github.com/containerd/containerd/v2/version.Version 3 \
  github.com/containerd/containerd/v2/cmd/containerd \
  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
  github.com/containerd/containerd/v2/cmd/ctr
