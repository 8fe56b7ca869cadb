#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# xdpfrags.sh: does declaring an XDP program frags-aware (xdp.frags) spare
# a TCP stream the copy generic XDP makes of each GRO aggregate? The bulk
# part's explanation (bench/analysis.go) cites its figures. Three network
# namespaces (client, a forwarding router, server; 198.18.201.0/24 and
# 198.18.202.0/24), one stream of MB megabytes through the router (dd | nc),
# with nothing, an XDP_PASS program loaded as "xdp", or the same loaded as
# "xdp.frags" attached in generic mode to both router veths; the modes in
# rotating order, ROUNDS times. Root; everything it creates it deletes.
#
#   bench/variants/xdpfrags.sh [ROUNDS] [MB]
set -euo pipefail
rounds=${1:-3}
mb=${2:-2000}
dir=$(mktemp -d)
pins=/sys/fs/bpf/pb-xdpfrags-$$
cleanup() {
	for n in pbfa pbfr pbfb; do ip netns del "$n" 2>/dev/null || true; done
	rm -rf "$pins" "$dir"
}
trap cleanup EXIT
cat >"$dir/p.c" <<'C'
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
char LICENSE[] SEC("license") = "Dual BSD/GPL";
SEC("xdp") int plain(struct xdp_md *ctx) { return XDP_PASS; }
SEC("xdp.frags") int frags(struct xdp_md *ctx) { return XDP_PASS; }
C
clang -O2 -target bpf -I"/usr/include/$(uname -m)-linux-gnu" -c "$dir/p.c" -o "$dir/p.o"
bpftool prog loadall "$dir/p.o" "$pins" type xdp

stream() { # mode: none, plain or frags; prints Gbit/s
	local mode=$1
	for n in pbfa pbfr pbfb; do ip netns del "$n" 2>/dev/null || true; ip netns add "$n"; done
	ip link add fa netns pbfa type veth peer name ra netns pbfr
	ip link add fb netns pbfb type veth peer name rb netns pbfr
	ip -n pbfa addr add 198.18.201.2/24 dev fa
	ip -n pbfr addr add 198.18.201.1/24 dev ra
	ip -n pbfb addr add 198.18.202.2/24 dev fb
	ip -n pbfr addr add 198.18.202.1/24 dev rb
	for x in "pbfa fa" "pbfr ra" "pbfr rb" "pbfb fb"; do
		set -- $x
		ip -n "$1" link set "$2" up
	done
	ip -n pbfa route add default via 198.18.201.1
	ip -n pbfb route add default via 198.18.202.1
	ip netns exec pbfr sysctl -qw net.ipv4.ip_forward=1
	if [ "$mode" != none ]; then
		# nsenter, not ip -n: ip remounts /sys, hiding the pins.
		for d in ra rb; do
			nsenter --net=/run/netns/pbfr bpftool net attach xdpgeneric pinned "$pins/$mode" dev "$d"
		done
	fi
	ip netns exec pbfb sh -c 'nc -l -N 198.18.202.2 9000 >/dev/null' &
	local srv=$!
	sleep 0.3
	local t0 t1
	t0=$(date +%s.%N)
	ip netns exec pbfa sh -c "dd if=/dev/zero bs=1M count=$mb 2>/dev/null | nc -N 198.18.202.2 9000"
	wait "$srv"
	t1=$(date +%s.%N)
	echo "$mb * 8 * 1.048576 / ($t1 - $t0) / 1000" | bc -l | cut -c1-5
}

for ((i = 0; i < rounds; i++)); do
	case $((i % 3)) in
	0) order="none plain frags" ;;
	1) order="plain frags none" ;;
	2) order="frags none plain" ;;
	esac
	for m in $order; do echo "round $((i + 1)) $m $(stream "$m") Gbit/s"; done
done
