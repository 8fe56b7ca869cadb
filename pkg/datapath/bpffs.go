package datapath

import (
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// isBPFFS reports whether dir lives on a bpf filesystem.
func isBPFFS(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, err
	}
	return st.Type == unix.BPF_FS_MAGIC, nil
}

// ensureBPFFS makes root a directory on a bpf filesystem. When root's parent
// is not on one, a bpffs is mounted there: with the default root that is
// /sys/fs/bpf, the conventional mount point.
func ensureBPFFS(root string) error {
	parent := filepath.Dir(filepath.Clean(root))
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fmt.Errorf("bpffs: %w", err)
	}
	ok, err := isBPFFS(parent)
	if err != nil {
		return fmt.Errorf("bpffs: statfs %s: %w", parent, err)
	}
	if !ok {
		if err := unix.Mount("bpf", parent, "bpf", 0, "mode=0700"); err != nil {
			return fmt.Errorf("bpffs: mount bpf on %s: %w", parent, err)
		}
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return fmt.Errorf("bpffs: %w", err)
	}
	return nil
}
