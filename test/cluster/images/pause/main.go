// SPDX-License-Identifier: Apache-2.0

// Command pause is the pod sandbox's process for the cluster test, used in
// place of registry.k8s.io/pause because no image registry is reachable there.
//
// It is PID 1 of the sandbox's PID namespace, so it does nothing but hold the
// namespaces open until the kubelet stops the sandbox (SIGTERM, or SIGINT by
// hand), and then exits 0. As PID 1 it also inherits orphaned processes when
// the pod shares its PID namespace, so it reaps zombies on SIGCHLD.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	// Caught so that a stop is a clean exit 0 (Go's own handling of SIGTERM
	// would exit with status 2), and SIGCHLD to reap.
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		reap()
	}
}

// reap collects every exited child. Signals coalesce, so one SIGCHLD may
// stand for several children: loop until none is left to wait for.
func reap() {
	for {
		var status syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
	}
}
