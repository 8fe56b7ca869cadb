// SPDX-License-Identifier: Apache-2.0

// Package repocheck holds tests over the repository itself rather than
// over a package: every Go file's license line (spdx_test.go), and the
// relative links and anchors of every Markdown file (links_test.go).
package repocheck
