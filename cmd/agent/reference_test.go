// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/penaltybox/penaltybox/internal/repocheck"
)

// docs/reference/flags.md lists every flag the agent takes, with its
// default and help, as the code defines them (the table is generated:
// `make docs` rewrites it; this test fails when it is stale).
func TestFlagsReference(t *testing.T) {
	// Defaults that come from the environment, as the DaemonSet sets it:
	// documented as they are without it.
	t.Setenv("POD_NAMESPACE", "")
	t.Setenv("POD_NAME", "")
	usage := captureUsage(t)
	type fl struct{ name, typ, def, help string }
	var flags []fl
	var cur *fl
	head := regexp.MustCompile(`^  -(\S+)(?: (\S+))?$`)
	for _, line := range strings.Split(usage, "\n") {
		if m := head.FindStringSubmatch(line); m != nil {
			flags = append(flags, fl{name: m[1], typ: m[2]})
			cur = &flags[len(flags)-1]
			continue
		}
		if cur != nil && strings.HasPrefix(line, "    \t") {
			cur.help = strings.TrimSpace(cur.help + " " + strings.TrimPrefix(line, "    \t"))
		}
	}
	if len(flags) < 30 {
		t.Fatalf("parsed %d flags from the usage:\n%s", len(flags), usage)
	}
	def := regexp.MustCompile(`\s*\(default (.*)\)$`)
	var b strings.Builder
	b.WriteString("| flag | default | meaning |\n| --- | --- | --- |\n")
	for _, f := range flags {
		d := ""
		if m := def.FindStringSubmatchIndex(f.help); m != nil {
			d = f.help[m[2]:m[3]]
			f.help = f.help[:m[0]]
		}
		name := "--" + f.name
		if f.typ != "" {
			name += " " + f.typ
		}
		if d != "" {
			d = "`" + d + "`"
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", name, repocheck.Cell(d), repocheck.Cell(f.help))
	}
	repocheck.CheckRegion(t, "../../docs/reference/flags.md", "flags", b.String())
}

// captureUsage is what `agent -h` prints.
func captureUsage(t *testing.T) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := os.Stderr
	os.Stderr = w
	done := make(chan []byte)
	go func() { b, _ := io.ReadAll(r); done <- b }()
	_, perr := parseFlags([]string{"-h"})
	os.Stderr = stderr
	w.Close()
	out := <-done
	if !errors.Is(perr, flag.ErrHelp) {
		t.Fatalf("parseFlags(-h): %v", perr)
	}
	return string(bytes.TrimSpace(out)) + "\n"
}
