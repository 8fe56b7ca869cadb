// SPDX-License-Identifier: Apache-2.0

// Package synackdelay holds a test-only tc program that delays a
// namespace's outgoing TCP SYN-ACKs (see delay.c and testnet's
// Backend.DelayHandshakes). The generated files are committed, like the
// datapath's, so the tests need no clang.
package synackdelay

//go:generate go tool bpf2go -tags linux -target bpfel -cc clang -cflags "-O2 -g -Wall -Werror -mcpu=v3" Delay delay.c -- -I/usr/include/x86_64-linux-gnu
