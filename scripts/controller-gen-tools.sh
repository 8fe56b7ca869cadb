#!/usr/bin/env bash
# Builds, once per version, controller-gen, which generates the BackendPolicy
# CRD and its deep-copy functions from pkg/apis/policy/v1alpha1 (`make
# generate-crds`, checked by `make check-generated`), and prints the directory
# that holds it on the last line of stdout:
#
#   bin=$(scripts/controller-gen-tools.sh | tail -n1)
#   "$bin/controller-gen" --version
#
# The version comes from the wrapper module test/e2e/k8stools/controller-tools
# (bump it with `go get -tool sigs.k8s.io/controller-tools/cmd/controller-gen@vX`
# there); the cache is described in scripts/lib/module-tools.sh. A cold build
# takes about 2 minutes on 2 cores, a cached run under a second.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib/module-tools.sh"
module_tools controller-gen "$ROOT/test/e2e/k8stools/controller-tools" \
  sigs.k8s.io/controller-tools sigs.k8s.io/controller-tools/pkg/version.version 2 \
  sigs.k8s.io/controller-tools/cmd/controller-gen
