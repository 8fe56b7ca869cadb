#!/usr/bin/env bash
# Builds, once per version, Prometheus and promtool with Kubernetes service
# discovery (Debian's Prometheus is built without it: `kubernetes_sd_configs`
# is an unknown field there), and prints the directory that holds them on the
# last line of stdout:
#
#   bin=$(scripts/prometheus-tools.sh | tail -n1)
#   "$bin/promtool" check config prometheus.yml
#
# The version comes from the wrapper module test/e2e/k8stools/prometheus; the
# cache is described in scripts/lib/module-tools.sh. A cold build takes about
# 7 minutes on 2 cores (downloads included), a cached run under a second.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib/module-tools.sh"
module_tools prometheus "$ROOT/test/e2e/k8stools/prometheus" \
  github.com/prometheus/prometheus github.com/prometheus/common/version.Version 7 \
  github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool
