// SPDX-License-Identifier: Apache-2.0

// Package xdpbase holds the baseline XDP programs the per-packet benchmark
// measures beside the datapath in the same run: one that only returns
// XDP_PASS, a minimal DNAT (parse, one hash lookup, rewrite, incremental
// checksums), and the conntracking floor (lb_new: a VIP lookup, a Maglev
// array read, one LRU insert, the rewrite; lb_known: one LRU lookup, the
// rewrite), the least a load balancer that keeps flows pays. The generated base_bpfel.go and base_bpfel.o are committed,
// like the datapath's, so running the benchmarks needs no clang.
package xdpbase

//go:generate go tool bpf2go -tags linux -target bpfel -cc clang -cflags "-O2 -g -Wall -Werror -mcpu=v3" -type dnat_key -type dnat_value -type lb_vip_key -type lb_vip -type lb_flow_key -type lb_wide_key -type lb_backend Base base.c -- -I/usr/include/x86_64-linux-gnu
