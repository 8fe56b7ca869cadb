// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/penaltybox/penaltybox/internal/version"
)

func TestVersionCmd(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := versionCmd(nil, &out, &errOut); code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	want := "version: " + version.Version() + "\nrevision: " + version.Revision() + "\ngo: " + runtime.Version() + "\n"
	if out.String() != want {
		t.Errorf("got %q, want %q", out.String(), want)
	}
	if code := versionCmd([]string{"extra"}, &out, &errOut); code != 2 {
		t.Errorf("extra argument: exit %d, want 2", code)
	}
}

// The stamping the Makefile and scripts/release.sh do: a binary built with
// version.LDFlags says that version and revision, and so does the
// User-Agent it would send.
func TestVersionStamped(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "agent")
	ldflags := version.LDFlags("1.2.3-dev+0123456789ab", "0123456789ab")
	build := exec.Command("go", "build", "-trimpath", "-ldflags", ldflags, "-o", bin, ".")
	build.Env = append(build.Environ(), "CGO_ENABLED=0", "GOFLAGS=-buildvcs=false")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "version").Output()
	if err != nil {
		t.Fatal(err)
	}
	want := "version: 1.2.3-dev+0123456789ab\nrevision: 0123456789ab\ngo: " + runtime.Version() + "\n"
	if string(out) != want {
		t.Errorf("agent version: got %q, want %q", out, want)
	}
}
