#!/usr/bin/env bash
# Proves `make release` reproducible: builds the release twice, into two
# fresh directories, and fails unless both SHA256SUMS are the same (and
# list the four artifacts). Part of `make test`: about 40 s with warm Go
# and Helm caches on 2 cores.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for run in 1 2; do
  start=$SECONDS
  "$ROOT/scripts/release.sh" "$TMP/$run" >/dev/null 2>"$TMP/$run.log" ||
    { cat "$TMP/$run.log" >&2; echo "release-check: run $run failed" >&2; exit 1; }
  echo "release-check: run $run in $((SECONDS - start)) s" >&2
done
if ! diff -u "$TMP/1/SHA256SUMS" "$TMP/2/SHA256SUMS" >&2; then
  echo "release-check: FAIL: two releases of the same commit differ" >&2
  exit 1
fi
n=$(wc -l <"$TMP/1/SHA256SUMS")
[ "$n" -eq 4 ] || { echo "release-check: FAIL: $n artifacts, want 4" >&2; exit 1; }
cat "$TMP/1/SHA256SUMS"
echo "release-check: ok: two releases, the same $n digests" >&2
