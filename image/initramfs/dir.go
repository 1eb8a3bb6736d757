package initramfs

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"

	"golang.org/x/sys/unix"
)

// WriteDir lays the archive's tree out under dir, which must be empty or
// missing, with the entries' modes and owners (so the caller must be root
// when any owner is not the caller), for a file system builder such as
// mkfs.erofs to take. Parents come before their contents, and each
// directory's mode is set once its contents are written.
func (a *Archive) WriteDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	names := make([]string, 0, len(a.entries))
	for n := range a.entries {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if err := writeDirEntry(dir, a.entries[n]); err != nil {
			return fmt.Errorf("lay out %s: %w", n, err)
		}
	}
	// Directory modes last, deepest first, so that a read-only directory
	// does not stop its own contents being written.
	for i := len(names) - 1; i >= 0; i-- {
		e := a.entries[names[i]]
		if !e.Mode.IsDir() {
			continue
		}
		p := filepath.Join(dir, e.Name)
		mode := e.Mode.Perm() | e.Mode&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky)
		if e.UID == 0 {
			if err := os.Chmod(p, mode); err != nil {
				return err
			}
			continue
		}
		// Without CAP_FOWNER (carreld's unit) only a file's owner may
		// chmod it: root's for the chmod, then its owner's again.
		if err := os.Lchown(p, 0, 0); err != nil {
			return err
		}
		if err := os.Chmod(p, mode); err != nil {
			return err
		}
		if err := os.Lchown(p, int(e.UID), int(e.GID)); err != nil {
			return err
		}
	}
	return nil
}

func writeDirEntry(dir string, e *Entry) error {
	p := filepath.Join(dir, filepath.FromSlash(e.Name))
	switch e.Mode.Type() {
	case fs.ModeDir:
		if err := os.Mkdir(p, 0o700); err != nil {
			return err
		}
	case 0:
		if err := writeFile(p, e); err != nil {
			return err
		}
		if err := os.Chmod(p, e.Mode.Perm()|e.Mode&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky)); err != nil {
			return err
		}
	case fs.ModeSymlink:
		if err := os.Symlink(e.Linkname, p); err != nil {
			return err
		}
	case fs.ModeDevice | fs.ModeCharDevice, fs.ModeDevice:
		if err := unix.Mknod(p, unixMode(e.Mode), int(unix.Mkdev(e.Major, e.Minor))); err != nil {
			return err
		}
		// mknod applies the umask; the archive's mode is what the guest sees.
		if err := os.Chmod(p, e.Mode.Perm()|e.Mode&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky)); err != nil {
			return err
		}
	default:
		return fmt.Errorf("unsupported file type %v", e.Mode.Type())
	}
	// Owners last: chown clears set-id bits, so they are set again after.
	if err := os.Lchown(p, int(e.UID), int(e.GID)); err != nil {
		return err
	}
	if e.Mode.Type() == 0 && e.Mode&(fs.ModeSetuid|fs.ModeSetgid) != 0 {
		return os.Chmod(p, e.Mode.Perm()|e.Mode&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky))
	}
	return nil
}

func writeFile(p string, e *Entry) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if e.Source != "" {
		err = copySource(f, e.Source, e.size)
	} else {
		_, err = f.Write(e.Data)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
