package debian

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
)

// runDependent are files and trees of a fresh Debian root that differ from
// one build to the next (logs, caches, backups, ids made at install time)
// or that the VM makes at boot; they are removed, globs relative to the
// root.
var runDependent = []string{
	"var/log/*",
	"var/cache/apt/*.bin",
	"var/cache/apt/archives/*.deb",
	"var/cache/apt/archives/partial/*",
	"var/lib/apt/lists/*",
	"var/cache/ldconfig/aux-cache",
	"var/cache/debconf/*-old",
	"var/cache/man/*",
	"var/lib/dpkg/*-old",
	"var/lib/dbus/machine-id",
	"etc/*-",
	"etc/.pwd.lock",
	"etc/ssh/ssh_host_*",
	"tmp/*",
	"var/tmp/*",
	"run/*",
}

// normalize removes run-dependent files and empties /etc/machine-id
// (systemd's "not yet set"; a VM that wants one makes it at boot).
func normalize(root string) error {
	var errs []error
	for _, pat := range runDependent {
		m, err := filepath.Glob(filepath.Join(root, pat))
		if err != nil {
			return err
		}
		for _, p := range m {
			if err := os.RemoveAll(p); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := os.WriteFile(filepath.Join(root, "etc/machine-id"), nil, 0o444); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, err)
	}
	// apt needs its empty download directories back, where it has them.
	for _, d := range []string{"var/lib/apt/lists/partial", "var/cache/apt/archives/partial"} {
		if _, err := os.Stat(filepath.Dir(filepath.Join(root, d))); err != nil {
			continue
		}
		if err := os.MkdirAll(filepath.Join(root, d), 0o700); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
