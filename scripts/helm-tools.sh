#!/usr/bin/env bash
# Builds, once per version, helm (v4) for the chart's tests and `make
# release` (lint, template, package), and prints the directory that holds it
# on the last line of stdout:
#
#   bin=$(scripts/helm-tools.sh | tail -n1)
#   "$bin/helm" lint charts/penaltybox
#
# The version comes from the wrapper module test/e2e/k8stools/helm (bump it
# with `go get -tool helm.sh/helm/v4/cmd/helm@vX` there); the cache is
# described in scripts/lib/module-tools.sh. A cold build takes about 4
# minutes on 2 cores (downloads included), a cached run under a second.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib/module-tools.sh"
MODULE_TOOLS_VERSION_ARGS="version --short" module_tools helm "$ROOT/test/e2e/k8stools/helm" \
  helm.sh/helm/v4 helm.sh/helm/v4/internal/version.version 4 \
  helm.sh/helm/v4/cmd/helm
