// SPDX-License-Identifier: Apache-2.0

// Package version says which build of penaltybox this is. The release
// build stamps it (scripts/version.sh computes the values, the Makefile and
// scripts/release.sh pass them with -ldflags -X); an unstamped build (go
// build, go test) says "0.0.0-unstamped".
package version

import (
	"fmt"
	"runtime"
)

// Set at link time:
//
//	-X github.com/penaltybox/penaltybox/internal/version.version=0.1.0
//	-X github.com/penaltybox/penaltybox/internal/version.revision=9f29218c0a1b
var (
	version  = "0.0.0-unstamped"
	revision = "unknown"
)

// Version is the semantic version without a leading v: "0.1.0" for a
// tagged build, "0.1.0-dev+9f29218c0a1b" for one between releases.
func Version() string { return version }

// Revision is the git commit the build was made from (12 hex digits), or
// "unknown".
func Revision() string { return revision }

// GoVersion is the Go toolchain that built the binary ("go1.26.8").
func GoVersion() string { return runtime.Version() }

// UserAgent is what the agent calls itself to the API server:
// "penaltybox-agent/0.1.0 (9f29218c0a1b)", so audit logs and API
// priority-and-fairness rules can tell versions apart.
func UserAgent() string { return fmt.Sprintf("penaltybox-agent/%s (%s)", version, revision) }

// String is the three lines `agent version` prints.
func String() string {
	return fmt.Sprintf("version: %s\nrevision: %s\ngo: %s\n", version, revision, runtime.Version())
}

// LDFlags returns the -X flags that stamp v and rev into this package, for
// tests that build the agent.
func LDFlags(v, rev string) string {
	const pkg = "github.com/penaltybox/penaltybox/internal/version"
	return fmt.Sprintf("-X %s.version=%s -X %s.revision=%s", pkg, v, pkg, rev)
}
