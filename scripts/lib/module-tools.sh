# Sourced by prometheus-tools.sh and containerd-tools.sh: builds, once per
# version, the tools of one wrapper module in test/e2e/k8stools/ and prints
# the directory that holds them on the last line of stdout (progress goes to
# stderr). The binaries are cached outside the clone, keyed by version, in
#   ${PENALTYBOX_CACHE:-/var/cache/penaltybox}/<name>-<version>/
# built under temporary names, checked against the version and renamed into
# place, so an interrupted build never leaves a broken binary in the cache;
# concurrent runs are serialised with flock.
#
#   module_tools NAME WRAPPER MAIN_MODULE VERSION_VAR MINUTES PKG...
#
# NAME names the cache directory and the log lines, WRAPPER is the wrapper
# module's directory, MAIN_MODULE the module whose version (as the wrapper
# requires it) keys the cache, VERSION_VAR the Go variable -X stamps with it
# (so each binary's version output says which it is), MINUTES the cold build
# time to warn about, and each PKG a main package of MAIN_MODULE.
module_tools() {
  local name=$1 mod=$2 main=$3 var=$4 minutes=$5
  shift 5
  local pkgs=("$@") version bin tmp tool start missing=()
  log() { echo "$name-tools: $*" >&2; }
  die() { log "error: $*"; exit 1; }

  version=$(awk -v m="$main" '$1 == m && $2 ~ /^v/ { print $2; exit }' "$mod/go.mod")
  [[ $version =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "no $main vN.N.N in $mod/go.mod (got '$version')"
  bin=${PENALTYBOX_CACHE:-/var/cache/penaltybox}/$name-$version

  export GOTOOLCHAIN=local GOWORK=off GOFLAGS=-mod=readonly CGO_ENABLED=0
  # ok FILE: a binary that runs and reports the wanted version.
  local -a vargs
  read -r -a vargs <<<"${MODULE_TOOLS_VERSION_ARGS:---version}"
  # (Output captured, not piped to grep -q: under pipefail grep's early exit
  # can kill a tool still writing with SIGPIPE, which read as "wrong version".)
  ok() {
    local out
    [[ -x $1 ]] && out=$("$1" "${vargs[@]}" 2>&1) && [[ $out == *"$version"* ]]
  }

  mkdir -p "$bin" 2>/dev/null || die "cannot create $bin; set PENALTYBOX_CACHE to a writable directory"
  exec 9>"$bin/.lock"
  flock 9
  for p in "${pkgs[@]}"; do ok "$bin/${p##*/}" || missing+=("$p"); done
  if ((${#missing[@]} == 0)); then
    log "cached: ${pkgs[*]##*/} $version in $bin"
    echo "$bin"
    return 0
  fi
  rm -rf "$bin"/.build.*
  tmp=$(mktemp -d "$bin/.build.XXXXXX")
  trap 'rm -rf "'"$tmp"'"' EXIT
  log "building ${missing[*]##*/} $version into $bin (about $minutes minutes cold)"
  start=$SECONDS
  (cd "$mod" && go build -trimpath -ldflags "-s -w -X $var=$version" -o "$tmp/" "${missing[@]}") >&2
  log "built in $((SECONDS - start))s"
  for p in "${missing[@]}"; do
    tool=${p##*/}
    ok "$tmp/$tool" || die "the freshly built $tool does not report version $version"
    mv -f "$tmp/$tool" "$bin/$tool"
  done
  echo "$bin"
}
