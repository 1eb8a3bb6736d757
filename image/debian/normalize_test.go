package debian

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestNormalize(t *testing.T) {
	root := t.TempDir()
	// Files that differ from one build to the next, which go, and the
	// image's own, which stay.
	runFiles := []string{
		"var/log/dpkg.log",
		"var/log/apt/history.log",
		"var/cache/apt/pkgcache.bin",
		"var/cache/apt/srcpkgcache.bin",
		"var/cache/apt/archives/x.deb",
		"var/cache/apt/archives/partial/y",
		"var/lib/apt/lists/z_InRelease",
		"var/cache/ldconfig/aux-cache",
		"var/cache/debconf/config.dat-old",
		"var/cache/man/index.db",
		"var/lib/dpkg/status-old",
		"var/lib/dbus/machine-id",
		"etc/passwd-",
		"etc/shadow-",
		"etc/.pwd.lock",
		"etc/ssh/ssh_host_ed25519_key",
		"tmp/x",
		"var/tmp/w",
		"run/y",
	}
	imageFiles := []string{
		"var/lib/dpkg/status",
		"var/cache/debconf/config.dat",
		"etc/passwd",
		"etc/ssh/sshd_config",
		"usr/bin/x",
	}
	gone := append(slices.Clone(runFiles), "var/log/apt")
	files := append(slices.Clone(runFiles), imageFiles...)
	for _, f := range files {
		writeTestFile(t, filepath.Join(root, f), "run-dependent "+f+"\n", 0o644)
	}
	// Debian's is read-only, which only root may write past.
	idMode := os.FileMode(0o444)
	if os.Geteuid() != 0 {
		idMode = 0o644
	}
	writeTestFile(t, filepath.Join(root, "etc/machine-id"), "0123456789abcdef0123456789abcdef\n", idMode)
	kept := append(slices.Clone(imageFiles),
		"var/cache/apt/archives",
		"var/cache/apt/archives/partial",
		"var/lib/apt/lists",
		"var/log",
		"tmp",
		"var/tmp",
		"run",
		"etc/machine-id",
	)
	for run := range 2 {
		if err := normalize(root); err != nil {
			t.Fatalf("normalize (run %d): %v", run+1, err)
		}
		for _, p := range gone {
			if _, err := os.Lstat(filepath.Join(root, p)); !os.IsNotExist(err) {
				t.Errorf("run %d: %s still there (%v)", run+1, p, err)
			}
		}
		for _, p := range kept {
			if _, err := os.Lstat(filepath.Join(root, p)); err != nil {
				t.Errorf("run %d: %s removed: %v", run+1, p, err)
			}
		}
		b, err := os.ReadFile(filepath.Join(root, "etc/machine-id"))
		if err != nil || len(b) != 0 {
			t.Errorf("run %d: etc/machine-id = %q, %v; want empty", run+1, b, err)
		}
		if got := readTestFile(t, filepath.Join(root, "var/lib/dpkg/status")); got != "run-dependent var/lib/dpkg/status\n" {
			t.Errorf("run %d: var/lib/dpkg/status changed: %q", run+1, got)
		}
	}
}

// TestNormalizeEmptyRoot checks that a root lacking what normalize
// removes or empties is not an error.
func TestNormalizeEmptyRoot(t *testing.T) {
	if err := normalize(t.TempDir()); err != nil {
		t.Fatalf("normalize: %v", err)
	}
}
