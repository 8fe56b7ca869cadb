// SPDX-License-Identifier: Apache-2.0

package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"

	"time"

	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/inspect"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// inspectCmd is `agent inspect`: the pinned maps in human terms, read-only,
// whether an agent runs or not.
func inspectCmd(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("agent inspect", flag.ContinueOnError)
	fs.SetOutput(stderr)
	root := fs.String("bpffs-root", datapath.DefaultRoot, "directory holding the pins")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "agent inspect: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	pinned, err := datapath.OpenPinned(*root)
	if err != nil {
		fmt.Fprintln(stderr, "agent inspect:", err)
		return 1
	}
	defer pinned.Close()
	m, err := maps.OpenReadOnly(pinned)
	if err != nil {
		fmt.Fprintln(stderr, "agent inspect:", err)
		return 1
	}
	defer m.Close()
	rep, err := inspect.Read(m, time.Now())
	if err != nil {
		fmt.Fprintln(stderr, "agent inspect:", err)
		return 1
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		err = enc.Encode(rep)
	} else {
		err = rep.Text(stdout)
	}
	if err != nil {
		fmt.Fprintln(stderr, "agent inspect:", err)
		return 1
	}
	return 0
}
