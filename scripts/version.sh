#!/usr/bin/env bash
# Prints the version and the revision of this checkout, for the build to
# stamp into internal/version (and the image and chart to carry):
#
#   read -r VERSION REVISION < <(scripts/version.sh)
#   scripts/version.sh --ldflags     # the -X flags for go build
#
# VERSION, semantic, without a leading v:
#   - HEAD carries a tag vX.Y.Z:                X.Y.Z
#   - the newest tag vX.Y.Z is N commits back:  X.Y.(Z+1)-dev.N+<sha>
#     (a build after a release sorts after it and before the next one)
#   - no tag yet:                                the top release entry of
#     CHANGELOG.md ("## [X.Y.Z] - date"), -dev+<sha>: the release being
#     prepared, which a pre-release sorts before
#   - a tree with uncommitted changes to tracked files adds ".dirty" to
#     the build metadata; not a git checkout: <changelog version>-dev
# REVISION: the commit, 12 hex digits ("unknown" outside git).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

changelog=$(sed -n 's/^## \[\([0-9][0-9]*\.[0-9][0-9]*\.[0-9][0-9]*\)\].*/\1/p' CHANGELOG.md | head -n1)
[[ -n $changelog ]] || { echo "version.sh: no '## [X.Y.Z]' entry in CHANGELOG.md" >&2; exit 1; }

if git rev-parse --git-dir >/dev/null 2>&1; then
  rev=$(git rev-parse --short=12 HEAD)
  dirty=""
  git diff --quiet HEAD -- 2>/dev/null || dirty=".dirty"
  if desc=$(git describe --tags --match 'v[0-9]*' --long 2>/dev/null) &&
    [[ $desc =~ ^v([0-9]+)\.([0-9]+)\.([0-9]+)-([0-9]+)-g[0-9a-f]+$ ]]; then
    major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]} patch=${BASH_REMATCH[3]} n=${BASH_REMATCH[4]}
    if ((n == 0)); then
      version=$major.$minor.$patch${dirty:++${dirty#.}}
    else
      version=$major.$minor.$((patch + 1))-dev.$n+$rev$dirty
    fi
  else
    version=$changelog-dev+$rev$dirty
  fi
else
  rev=unknown
  version=$changelog-dev
fi

if [[ ${1:-} == --ldflags ]]; then
  pkg=github.com/penaltybox/penaltybox/internal/version
  echo "-X $pkg.version=$version -X $pkg.revision=$rev"
else
  echo "$version $rev"
fi
