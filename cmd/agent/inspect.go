package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"time"

	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/pkg/admin"
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
	adminAddr := fs.String("admin-addr", "127.0.0.1:9465", "the node's agent's admin listener (its --admin-addr), asked for the services' names and why each is served; empty: not asked")
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
	var mono unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &mono); err != nil {
		fmt.Fprintln(stderr, "agent inspect:", err)
		return 1
	}
	rep, err := inspect.Read(m, time.Now(), uint64(mono.Nano()))
	if err != nil {
		fmt.Fprintln(stderr, "agent inspect:", err)
		return 1
	}
	if *adminAddr != "" {
		rep.AddAgentView(agentServices(*adminAddr))
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

// agentServices asks the agent at addr for its /admin/services view. The
// pinned maps do not hold the services' names, nor why each is served.
func agentServices(addr string) (admin.ServicesView, error) {
	var v admin.ServicesView
	c := http.Client{Timeout: 3 * time.Second}
	resp, err := c.Get("http://" + addr + "/admin/services")
	if err != nil {
		return v, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return v, fmt.Errorf("/admin/services: %s", resp.Status)
	}
	return v, json.NewDecoder(resp.Body).Decode(&v)
}
