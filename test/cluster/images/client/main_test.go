// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"
)

// timeoutError is a net.Error that timed out, like a dial past its deadline.
type timeoutError struct{}

func (timeoutError) Error() string   { return "i/o timeout" }
func (timeoutError) Timeout() bool   { return true }
func (timeoutError) Temporary() bool { return true }

func TestClassify(t *testing.T) {
	for _, tc := range []struct {
		name  string
		err   error
		reply string
		want  string
	}{
		{"reply", nil, "pod-a\n", "ok"},
		{"empty reply, clean EOF", nil, "", "other"},
		{"refused", &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}, "", "refused"},
		{"refused, wrapped", fmt.Errorf("attempt: %w", syscall.ECONNREFUSED), "", "refused"},
		{"reset", &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ECONNRESET)}, "", "reset"},
		{"reset after part of a reply", os.NewSyscallError("read", syscall.ECONNRESET), "po", "reset"},
		{"dial timeout", &net.OpError{Op: "dial", Net: "tcp", Err: timeoutError{}}, "", "timeout"},
		{"read deadline", os.ErrDeadlineExceeded, "", "timeout"},
		{"unknown", errors.New("no route"), "", "other"},
		{"unreachable", os.NewSyscallError("connect", syscall.EHOSTUNREACH), "", "other"},
	} {
		if got := classify(tc.err, tc.reply); got != tc.want {
			t.Errorf("%s: classify(%v, %q) = %q, want %q", tc.name, tc.err, tc.reply, got, tc.want)
		}
	}
}
