// SPDX-License-Identifier: Apache-2.0

// Package bpf holds the XDP datapath's C sources and the Go bindings that
// bpf2go generates from them. The generated lb_bpfel.go and lb_bpfel.o are
// committed, so building the agent needs no clang; `make generate` rebuilds
// them and `make check-generated` fails when they are stale.
package bpf

//go:generate go tool bpf2go -tags linux -target bpfel -cc clang -cflags "-O2 -g -Wall -Werror -mcpu=v3" -type svc_key -type svc_value -type backend -type ct_key -type ct_value -type event -type config -type global_stats -type svc_stats -type be_stats -type svc_stats_block -type be_stats_block -type stats_reset -type stats_reset_args -type endpoint_health -type flow_value -type inflight -type svc_backend_key -type pb_backend_state -type pb_event_type -type pb_event_flag -type pb_svc_flag -type svc_trip -type be_trip -type pb_trip_kind -type syn_copy -type syn_guard -type syn_guard_cpu -type src_key -type iface -type pb_nf_why -type affinity_key -type affinity_value -type ct_expire -type ct_expire_args -type ct_sweep_args -type ct_inuse -type vip_use_key -type pb_ct_expire_result Lb lb.c -- -I./include -I/usr/include/x86_64-linux-gnu
