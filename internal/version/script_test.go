// SPDX-License-Identifier: Apache-2.0

package version

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// scripts/version.sh in a throw-away repository: the CHANGELOG's release
// before any tag, the tag on a tagged commit, the next patch's pre-release
// after it, .dirty with uncommitted changes.
func TestVersionScript(t *testing.T) {
	dir := t.TempDir()
	script, err := os.ReadFile("../../scripts/version.sh")
	if err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(dir, "scripts"), 0o755))
	must(os.WriteFile(filepath.Join(dir, "scripts/version.sh"), script, 0o755))
	must(os.WriteFile(filepath.Join(dir, "CHANGELOG.md"), []byte("# Changelog\n\n## [Unreleased]\n\n## [0.3.0] - 2026-12-04\n\n## [0.2.0] - 2026-11-01\n"), 0o644))
	git := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false"}, args...)...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	run := func() (string, string) {
		t.Helper()
		cmd := exec.Command("bash", "scripts/version.sh")
		cmd.Dir = dir
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("version.sh: %v", err)
		}
		v, rev, _ := strings.Cut(strings.TrimSpace(string(out)), " ")
		return v, rev
	}
	git("init", "-q")
	git("add", ".")
	git("commit", "-qm", "one")
	sha := git("rev-parse", "--short=12", "HEAD")
	if v, rev := run(); v != "0.3.0-dev+"+sha || rev != sha {
		t.Errorf("untagged: %s %s, want 0.3.0-dev+%s %s", v, rev, sha, sha)
	}
	git("tag", "v0.3.0")
	if v, _ := run(); v != "0.3.0" {
		t.Errorf("tagged: %s, want 0.3.0", v)
	}
	must(os.WriteFile(filepath.Join(dir, "x"), []byte("x"), 0o644))
	git("add", "x")
	git("commit", "-qm", "two")
	git("commit", "-q", "--allow-empty", "-m", "three")
	sha = git("rev-parse", "--short=12", "HEAD")
	if v, _ := run(); v != "0.3.1-dev.2+"+sha {
		t.Errorf("after the tag: %s, want 0.3.1-dev.2+%s", v, sha)
	}
	must(os.WriteFile(filepath.Join(dir, "x"), []byte("y"), 0o644))
	if v, _ := run(); v != "0.3.1-dev.2+"+sha+".dirty" {
		t.Errorf("dirty: %s", v)
	}
	// Every form is a semantic version (semver.org's regular expression).
	semver := regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$`)
	for _, v := range []string{"0.3.0", "0.3.0-dev+" + sha, "0.3.1-dev.2+" + sha + ".dirty"} {
		if !semver.MatchString(v) {
			t.Errorf("%s is not a semantic version", v)
		}
	}
}
