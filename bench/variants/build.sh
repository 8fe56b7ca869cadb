#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# build.sh builds variants of the datapath (bpf/lb.c) for the packet
# part's diagnostic section (go run ./bench --only packet --pb-variant
# NAME=OBJ ...): each variant is lb.c with named pieces of the per-packet
# path taken out, compiled with the datapath's flags, so that the bench can
# measure it with the datapath's own maps in the same rounds as the
# unmodified program. What a piece costs is the difference. Nothing here
# is shipped; bpf/ is only read.
#
#   bench/variants/build.sh OUTDIR [REV] VARIANT...
#
# REV is a git revision whose bpf/ to build (default: the work tree's);
# a VARIANT is NAME=ABLATION[+ABLATION...], or "asis" for lb.c unchanged.
# It prints the --pb-variant flags for the bench. Ablations (each checks
# that it changed exactly what it names, so it fails, rather than
# measuring something else, once lb.c has moved on; the datapath's flags,
# but a variable an ablation leaves unused is no error):
#
#   no-doomed     syn_doomed returns 0: no checksum or option checks of a SYN
#   no-guard      syn_guard_drops returns 0: no SYN guard
#   no-handover   handed_over returns 0: no dead-man's switch or drain check
#   no-event      emit_at returns at once: no ring-buffer record
#   no-clock      bpf_ktime_get_ns and bpf_ktime_get_coarse_ns are constants
#   no-gstats     gstats() is NULL: no global counters
#   no-stats      no pb_svc_stats_v2 or pb_be_stats_v2 lookups (per-service and
#                 per-backend counters)
#   no-rev-insert new_flow inserts the forward conntrack entry only
#   no-ct-insert  new_flow inserts no conntrack entry
#   no-syn-ct     a SYN (the service looked up for the guard) skips the
#                 conntrack lookup
#   no-vipslot    vip_slot_marked returns 1: no pb_vip_slots read
#   no-forward    forward() returns XDP_PASS at once: no pb_config_v2 read,
#                 no passed_after_nat count
#   no-pkt-mem    pb_run's parsed packet may live in registers again (the
#                 empty asm on its address removed)
set -euo pipefail

out=$1; shift
rev=
if [ $# -gt 0 ] && [[ $1 != *=* && $1 != asis ]]; then rev=$1; shift; fi
top=$(git rev-parse --show-toplevel)
mkdir -p "$out"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
if [ -n "$rev" ]; then
	git -C "$top" archive "$rev" bpf | tar -x -C "$src"
else
	cp -r "$top/bpf" "$src/"
fi

# once DIR PERL: apply a perl substitution that must match exactly once in
# all of DIR's lb.c and include/*.h (the program is split into headers).
once() {
	local dir=$1 expr=$2
	local n total=0 hit=
	for f in "$dir/lb.c" "$dir"/include/*.h; do
		n=$(perl -0777 -ne '$n = () = '"m{${expr%%@@*}}g"'; print $n' "$f")
		total=$((total + n))
		[ "$n" != 0 ] && hit=$f
	done
	if [ "$total" != 1 ]; then
		echo "build.sh: ablation pattern matched $total times in lb.c and its headers: ${expr%%@@*}" >&2
		exit 1
	fi
	perl -0777 -pi -e "s{${expr%%@@*}}{${expr#*@@}}" "$hit"
}

# return_first FILE FUNC VALUE: FUNC's body starts with a return.
return_first() {
	once "$1" "(static __always_inline [a-z_ 0-9]*\\**\\b$2\\([^)]*\\)\\n\\{\\n)@@\$1\\treturn $3;\\n"
}

ablate() {
	local f=$1 a=$2
	case $a in
	no-doomed) return_first "$f" syn_doomed 0 ;;
	no-guard) return_first "$f" syn_guard_drops 0 ;;
	no-handover) return_first "$f" handed_over 0 ;;
	no-event) once "$f" '(static __always_inline void emit_at\([^)]*\)\n\{\n)@@$1\treturn;\n' ;;
	no-clock) once "$f" '(#include "pb_helpers.h"\n)(?!#define bpf_ktime)@@$1#define bpf_ktime_get_ns() ((__u64)1000000000000ULL)\n#define bpf_ktime_get_coarse_ns() ((__u64)1000000000000ULL)\n' ;;
	no-gstats) return_first "$f" gstats 0 ;;
	no-stats)
		local d=$f # once's loop takes f
		return_first "$d" svc_counters 0
		return_first "$d" be_counters 0 ;;
	no-rev-insert) once "$f" 'bpf_map_update_elem\(&pb_ct_v2, fk, fv, BPF_ANY\) \|\|\n\s*bpf_map_update_elem\(&pb_ct_v2, rk, rv, BPF_ANY\)@@bpf_map_update_elem(&pb_ct_v2, fk, fv, BPF_ANY)' ;;
	no-ct-insert) once "$f" 'bpf_map_update_elem\(&pb_ct_v2, fk, fv, BPF_ANY\) \|\|\n\s*bpf_map_update_elem\(&pb_ct_v2, rk, rv, BPF_ANY\)@@0' ;;
	no-syn-ct) once "$f" '(syn_guard_drops\(&fk\)\)\n\s*return XDP_DROP;\n\s*\}\n\s*)struct ct_value \*ct = bpf_map_lookup_elem\(&pb_ct_v2, &fk\);@@$1struct ct_value *ct = svcp ? 0 : bpf_map_lookup_elem(&pb_ct_v2, &fk);' ;;
	no-vipslot) return_first "$f" vip_slot_marked 1 ;;
	no-forward) return_first "$f" forward XDP_PASS ;;
	no-pkt-mem) once "$f" '\n\s*asm volatile\(""\s*:\s*:\s*"r"\(&p\)\s*:\s*"memory"\);@@' ;;
	*) echo "build.sh: unknown ablation $a" >&2; exit 1 ;;
	esac
}

flags=()
for v in "$@"; do
	name=${v%%=*}
	abl=${v#*=}
	[ "$v" = asis ] && { name=asis; abl=; }
	work=$(mktemp -d -p "$src")
	cp -r "$src/bpf/." "$work/"
	IFS=+ read -r -a list <<<"$abl"
	for a in "${list[@]}"; do
		[ -n "$a" ] && ablate "$work" "$a"
	done
	clang -O2 -g -Wall -Wno-unused-variable -Wno-unused-but-set-variable -Werror -mcpu=v3 -target bpfel -c "$work/lb.c" -o "$out/$name.o" \
		-I"$work/include" -I/usr/include/x86_64-linux-gnu
	flags+=("--pb-variant" "$name=$out/$name.o")
done
echo "${flags[@]}"
