// SPDX-License-Identifier: Apache-2.0

package repocheck

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// UpdateEnv, set to 1, makes CheckRegion write the generated text instead
// of comparing it (`make docs`).
const UpdateEnv = "PENALTYBOX_UPDATE_DOCS"

// CheckRegion checks that the text between the lines
//
//	<!-- BEGIN GENERATED name: ... -->
//	<!-- END GENERATED name -->
//
// of file is content, and fails t naming `make docs` when it is not (the
// code changed, the doc did not). With PENALTYBOX_UPDATE_DOCS=1 it writes
// content there instead.
func CheckRegion(t testing.TB, file, name, content string) {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	begin := "<!-- BEGIN GENERATED " + name
	end := "<!-- END GENERATED " + name + " -->"
	i := strings.Index(s, begin)
	j := strings.Index(s, end)
	if i < 0 || j < i {
		t.Fatalf("%s: no %q ... %q region", file, begin, end)
	}
	i += strings.Index(s[i:], "\n") + 1
	if s[i:j] == content {
		return
	}
	if os.Getenv(UpdateEnv) == "1" {
		if err := os.WriteFile(file, []byte(s[:i]+content+s[j:]), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: wrote the generated %s", file, name)
		return
	}
	t.Errorf("%s: the generated %s differs from what the code says; run `make docs` and commit it.\n%s", file, name, diffLines(s[i:j], content))
}

// diffLines lists the lines only one side has.
func diffLines(old, new string) string {
	have := map[string]bool{}
	for _, l := range strings.Split(old, "\n") {
		have[l] = true
	}
	want := map[string]bool{}
	for _, l := range strings.Split(new, "\n") {
		want[l] = true
	}
	var out []string
	for _, l := range strings.Split(old, "\n") {
		if !want[l] {
			out = append(out, "- "+l)
		}
	}
	for _, l := range strings.Split(new, "\n") {
		if !have[l] {
			out = append(out, "+ "+l)
		}
	}
	if len(out) > 40 {
		out = append(out[:40], fmt.Sprintf("... %d more", len(out)-40))
	}
	return strings.Join(out, "\n")
}

// Cell escapes s for a Markdown table cell.
func Cell(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(s)
}
