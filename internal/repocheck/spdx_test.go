// SPDX-License-Identifier: Apache-2.0

package repocheck

import (
	"bufio"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

const spdxLine = "// SPDX-License-Identifier: Apache-2.0"

// generated is Go's convention for a generated file (go help generate): a
// line "// Code generated ... DO NOT EDIT." before the package clause.
var generated = regexp.MustCompile(`^// Code generated .* DO NOT EDIT\.$`)

// root is the repository (the module root, two levels up).
func root(t *testing.T) string {
	t.Helper()
	r, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(r, "go.mod")); err != nil {
		t.Fatalf("no go.mod at %s", r)
	}
	return r
}

// Every Go file the project writes starts with the Apache-2.0 SPDX line
// (the repository's license; the BPF C sources carry their own dual
// license). Generated files (bpf2go's *_bpfel.go) are left as their
// generator writes them, so that regenerating them stays byte for byte.
func TestGoFilesHaveSPDX(t *testing.T) {
	r := root(t)
	n := 0
	err := filepath.WalkDir(r, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			switch d.Name() {
			case ".git", "testdata", "node_modules", "dist":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		first, gen, err := scan(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(r, path)
		if gen {
			return nil
		}
		n++
		if first != spdxLine {
			t.Errorf("%s: the first line is %q, want %q (then a blank line)", rel, first, spdxLine)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 100 {
		t.Fatalf("checked only %d Go files: is %s the repository?", n, r)
	}
}

// scan returns a file's first line and whether it is generated.
func scan(path string) (first string, gen bool, err error) {
	f, err := os.Open(path)
	if err != nil {
		return "", false, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for i := 0; sc.Scan(); i++ {
		line := sc.Text()
		if i == 0 {
			first = line
		}
		if generated.MatchString(line) {
			return first, true, nil
		}
		if strings.HasPrefix(line, "package ") {
			break
		}
	}
	return first, false, sc.Err()
}
