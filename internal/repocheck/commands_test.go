// SPDX-License-Identifier: Apache-2.0

package repocheck

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// A command block in the docs says whether a test runs what it shows,
// and which, or why none does: an HTML comment on the line before it,
//
//	<!-- run by: TestName, make target or script; how, in words -->
//	<!-- not run: the reason -->
//
// A test named must exist (a func TestName in the repository's Go
// files), and a make target in the Makefile, so that a claim cannot
// outlive what it names.
var (
	runBy  = regexp.MustCompile(`^\s*<!-- run by: (.+?) -->\s*$`)
	notRun = regexp.MustCompile(`^\s*<!-- not run: (.+?) -->\s*$`)
	// commandStart: the first word of a line that is a command to type.
	commandStart = regexp.MustCompile(`^(?:\$ )?(?:sudo |make\b|kubectl |helm |agent |bpftool |skopeo |docker |kustomize |scripts/|cd |go |git |curl |promtool |ip |bin/agent)`)
)

// block is a code block of a Markdown file: its first line (1-based) and
// its lines.
type block struct {
	line  int
	lines []string
}

// codeBlocks returns the fenced blocks (any language but yaml and json,
// which are files, not commands) and the top-level indented ones.
func codeBlocks(text string) []block {
	lines := strings.Split(text, "\n")
	var out []block
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if t := strings.TrimSpace(l); strings.HasPrefix(t, "```") {
			lang := strings.TrimPrefix(t, "```")
			j := i + 1
			for j < len(lines) && !strings.HasPrefix(strings.TrimSpace(lines[j]), "```") {
				j++
			}
			if lang != "yaml" && lang != "json" {
				out = append(out, block{line: i + 1, lines: lines[i+1 : min(j, len(lines))]})
			}
			i = j
			continue
		}
		// An indented block: four spaces after a blank line (not a list
		// item's continuation, which follows its text without one).
		if strings.HasPrefix(l, "    ") && strings.TrimSpace(l) != "" && i > 0 && strings.TrimSpace(lines[i-1]) == "" {
			j := i
			for j < len(lines) && (strings.HasPrefix(lines[j], "    ") || strings.TrimSpace(lines[j]) == "") {
				j++
			}
			out = append(out, block{line: i + 1, lines: lines[i:j]})
			i = j - 1
		}
	}
	return out
}

func (b block) hasCommand() bool {
	for _, l := range b.lines {
		if commandStart.MatchString(strings.TrimPrefix(l, "    ")) {
			return true
		}
	}
	return false
}

// annotation is the comment on the last non-blank line before the block.
func annotation(lines []string, blockLine int) string {
	for i := blockLine - 2; i >= 0; i-- {
		if strings.TrimSpace(lines[i]) == "" {
			continue
		}
		// The fence itself is on blockLine for fenced blocks.
		return lines[i]
	}
	return ""
}

func TestDocCommandsRunOrSayWhyNot(t *testing.T) {
	r := root(t)
	tests := testNames(t, r)
	makefile, err := os.ReadFile(filepath.Join(r, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	files = append(files, filepath.Join(r, "README.md"))
	err = filepath.WalkDir(filepath.Join(r, "docs"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".md") {
			files = append(files, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(b), "\n")
		rel, _ := filepath.Rel(r, f)
		for _, blk := range codeBlocks(string(b)) {
			if !blk.hasCommand() {
				continue
			}
			checked++
			a := annotation(lines, blk.line)
			if m := notRun.FindStringSubmatch(a); m != nil {
				continue
			}
			m := runBy.FindStringSubmatch(a)
			if m == nil {
				t.Errorf("%s:%d: a command block with neither <!-- run by: ... --> nor <!-- not run: ... --> before it", rel, blk.line)
				continue
			}
			names, _, _ := strings.Cut(m[1], ";") // after a semicolon: how
			for _, who := range strings.Split(names, ",") {
				who = strings.TrimSpace(who)
				switch {
				case strings.HasPrefix(who, "Test"):
					if !tests[who] {
						t.Errorf("%s:%d: run by %s: no such test", rel, blk.line, who)
					}
				case strings.HasPrefix(who, "make "):
					target := strings.TrimPrefix(who, "make ")
					if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(target) + `:`).Match(makefile) {
						t.Errorf("%s:%d: run by %s: no such make target", rel, blk.line, who)
					}
				case strings.HasPrefix(who, "scripts/") || strings.HasPrefix(who, ".ci/"):
					if _, err := os.Stat(filepath.Join(r, who)); err != nil {
						t.Errorf("%s:%d: run by %s: %v", rel, blk.line, who, err)
					}
				default:
					t.Errorf("%s:%d: run by %q: name a test (TestX), a make target (make x) or a script", rel, blk.line, who)
				}
			}
		}
	}
	if checked == 0 {
		t.Fatal("no command block found: the scan is broken")
	}
}

// testNames are the names of every Test function of the repository.
func testNames(t *testing.T, r string) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	decl := regexp.MustCompile(`(?m)^func (Test\w+)\(`)
	err := filepath.WalkDir(r, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "dist") {
			return filepath.SkipDir
		}
		if !strings.HasSuffix(p, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range decl.FindAllStringSubmatch(string(b), -1) {
			names[m[1]] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return names
}
