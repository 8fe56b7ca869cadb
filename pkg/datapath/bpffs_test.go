// SPDX-License-Identifier: Apache-2.0

package datapath

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// bpfMounts counts the bpffs mounts under dir: only the test's own, as
// other packages' tests mount and unmount theirs meanwhile (go test runs
// packages side by side).
func bpfMounts(t *testing.T, dir string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		// mount ID, parent ID, major:minor, root, mount point, options,
		// optional fields, "-", type, source, super options.
		f := strings.Fields(line)
		sep := slices.Index(f, "-")
		if sep < 5 || sep+1 >= len(f) || f[sep+1] != "bpf" {
			continue
		}
		if mp := f[4]; mp == dir || strings.HasPrefix(mp, dir+"/") {
			n++
		}
	}
	return n
}

func mountFS(t *testing.T, fstype, dir string) {
	t.Helper()
	if err := unix.Mount(fstype, dir, fstype, 0, ""); err != nil {
		t.Fatalf("mount %s on %s: %v", fstype, dir, err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
}

func TestEnsureBPFFS(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount filesystems (CI runs as root)")
	}
	if err := outlivesProcess(); err != nil {
		t.Skipf("the test must run in the host's mount namespace: %v", err)
	}
	tmp := t.TempDir()
	sub := func(name string) string {
		p := filepath.Join(tmp, name)
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
		return p
	}

	t.Run("root at a bpffs mount point is used as it is", func(t *testing.T) {
		mnt := sub("at")
		mountFS(t, "bpf", mnt)
		before := bpfMounts(t, tmp)
		pr, err := ensureBPFFS(mnt)
		if err != nil {
			t.Fatal(err)
		}
		if n := bpfMounts(t, tmp); n != before {
			t.Fatalf("%d bpffs mounts after, %d before: one was mounted over the root", n, before)
		}
		if pr.Mounted || pr.Mount != mnt {
			t.Fatalf("%+v: want the existing mount %s", pr, mnt)
		}
	})

	t.Run("root under a bpffs is created", func(t *testing.T) {
		mnt := sub("under")
		mountFS(t, "bpf", mnt)
		root := filepath.Join(mnt, "a", "penaltybox")
		before := bpfMounts(t, tmp)
		pr, err := ensureBPFFS(root)
		if err != nil {
			t.Fatal(err)
		}
		if on, _ := isBPFFS(root); !on || bpfMounts(t, tmp) != before || pr.Mounted || pr.Mount != mnt {
			t.Fatalf("%+v, on bpffs %v", pr, on)
		}
	})

	t.Run("no bpffs: one is mounted on the empty root", func(t *testing.T) {
		root := filepath.Join(tmp, "fresh", "penaltybox")
		pr, err := ensureBPFFS(root)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
		if on, _ := isBPFFS(root); !on || !pr.Mounted || pr.Mount != root {
			t.Fatalf("%+v, on bpffs %v", pr, on)
		}
		if on, _ := isBPFFS(filepath.Dir(root)); on {
			t.Fatal("the bpffs went over the root's parent")
		}
	})

	t.Run("never over files", func(t *testing.T) {
		root := sub("full")
		if err := os.WriteFile(filepath.Join(root, "someones"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		before := bpfMounts(t, tmp)
		_, err := ensureBPFFS(root)
		var re *RootError
		if !errors.As(err, &re) || !strings.Contains(err.Error(), "is not empty") {
			t.Fatalf("err = %v, want a RootError saying the directory is not empty", err)
		}
		if bpfMounts(t, tmp) != before {
			t.Fatal("mounted anyway")
		}
	})

	t.Run("never over another mount", func(t *testing.T) {
		root := sub("tmpfs")
		mountFS(t, "tmpfs", root)
		before := bpfMounts(t, tmp)
		if _, err := ensureBPFFS(root); err == nil || !strings.Contains(err.Error(), "mount point") {
			t.Fatalf("err = %v, want a refusal naming the mount point", err)
		}
		if bpfMounts(t, tmp) != before {
			t.Fatal("mounted anyway")
		}
	})
}
