// SPDX-License-Identifier: Apache-2.0

package repocheck

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

var (
	fence    = regexp.MustCompile("(?ms)^\\s*```.*?^\\s*```")
	codeSpan = regexp.MustCompile("`[^`\n]*`")
	mdLink   = regexp.MustCompile(`!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	heading  = regexp.MustCompile(`(?m)^#{1,6}\s+(.*?)\s*#*\s*$`)
	htmlID   = regexp.MustCompile(`<a\s+(?:id|name)="([^"]+)"`)
)

// Every relative link in every Markdown file of the repository points at
// a file or directory that exists, and every #anchor at a heading (as
// GitHub slugs it) or an <a id> of its target. External links (http:,
// https:, mailto:) are not followed: the tests have no network.
func TestMarkdownLinks(t *testing.T) {
	r := root(t)
	anchors := map[string]map[string]bool{}
	anchorsOf := func(path string) map[string]bool {
		if a, ok := anchors[path]; ok {
			return a
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return nil
		}
		a := slugs(string(b))
		anchors[path] = a
		return a
	}
	files, links := 0, 0
	err := filepath.WalkDir(r, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			switch d.Name() {
			case ".git", "node_modules", "dist", "out":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".md") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		files++
		rel, _ := filepath.Rel(r, path)
		text := codeSpan.ReplaceAllString(fence.ReplaceAllString(string(b), ""), "")
		for _, m := range mdLink.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`).MatchString(target) {
				continue
			}
			links++
			file, anchor, _ := strings.Cut(target, "#")
			dest := path
			if file != "" {
				dest = filepath.Join(filepath.Dir(path), file)
				st, err := os.Stat(dest)
				if err != nil {
					t.Errorf("%s: link %q: %s does not exist", rel, target, file)
					continue
				}
				if st.IsDir() || !strings.HasSuffix(dest, ".md") {
					continue // a directory, or a source file: no anchors checked
				}
			}
			if anchor != "" && !anchorsOf(dest)[anchor] {
				t.Errorf("%s: link %q: no heading or <a id> %q in %s", rel, target, anchor, filepath.Base(dest))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 20 || links < 100 {
		t.Fatalf("checked %d links in %d Markdown files: too few to be the repository", links, files)
	}
	t.Logf("%d relative links in %d Markdown files", links, files)
}

// slugs are the anchors of a Markdown file: each heading as GitHub slugs
// it (lower case, punctuation but - and _ dropped, spaces to -, a repeat
// numbered -1, -2, ...), and every <a id> or <a name>.
func slugs(doc string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, m := range heading.FindAllStringSubmatch(fence.ReplaceAllString(doc, ""), -1) {
		var b strings.Builder
		for _, c := range strings.ToLower(regexp.MustCompile(`<[^>]+>`).ReplaceAllString(m[1], "")) {
			switch {
			case unicode.IsLetter(c) || unicode.IsNumber(c) || c == '-' || c == '_':
				b.WriteRune(c)
			case c == ' ':
				b.WriteRune('-')
			}
		}
		s := b.String()
		if n, ok := seen[s]; ok {
			seen[s] = n + 1
			s += "-" + strconv.Itoa(n+1)
		} else {
			seen[s] = 0
		}
		out[s] = true
	}
	for _, m := range htmlID.FindAllStringSubmatch(doc, -1) {
		out[m[1]] = true
	}
	return out
}

// The slugs of a few headings, as GitHub renders them.
func TestSlugs(t *testing.T) {
	s := slugs("# penaltybox\n## Metrics (`/metrics`, prefix `penaltybox_`)\n### `agent inspect`\n## Fleet evidence (many nodes)\n## Install\n## Install\n```\n# not a heading\n```\n<a id=\"pin-root\"></a>")
	for _, want := range []string{"penaltybox", "metrics-metrics-prefix-penaltybox_", "agent-inspect", "fleet-evidence-many-nodes", "install", "install-1", "pin-root"} {
		if !s[want] {
			t.Errorf("no anchor %q in %v", want, s)
		}
	}
	if s["not-a-heading"] {
		t.Error("a comment in a code block taken for a heading")
	}
}
