// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"io"

	"github.com/penaltybox/penaltybox/internal/version"
)

// versionCmd prints the build's version, git revision and Go version
// (`agent version`), as internal/version has them stamped.
func versionCmd(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 {
		fmt.Fprintln(stderr, "usage: agent version")
		return 2
	}
	fmt.Fprint(stdout, version.String())
	return 0
}
