//go:build linux

package files

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/sandbox"
)

// access is what an operation needs of the root its path lies under.
type access int

const (
	readAccess access = iota
	writeAccess
)

// fileTree is where operations take names: the whole file system (hostTree,
// names are absolute paths) or, under a sandbox, an os.Root (names are
// relative to it, and nothing resolves outside it).
type fileTree interface {
	Lstat(name string) (fs.FileInfo, error)
	Stat(name string) (fs.FileInfo, error)
	Readlink(name string) (string, error)
	OpenFile(name string, flag int, perm fs.FileMode) (*os.File, error)
	OpenRoot(name string) (*os.Root, error)
	Mkdir(name string, perm fs.FileMode) error
	MkdirAll(name string, perm fs.FileMode) error
	Remove(name string) error
	RemoveAll(name string) error
	Rename(oldname, newname string) error
	Chmod(name string, mode fs.FileMode) error
	Lchown(name string, uid, gid int) error
}

var _ fileTree = (*os.Root)(nil)

// hostTree is the whole file system, through the os package.
type hostTree struct{}

func (hostTree) Lstat(name string) (fs.FileInfo, error) { return os.Lstat(name) }
func (hostTree) Stat(name string) (fs.FileInfo, error)  { return os.Stat(name) }
func (hostTree) Readlink(name string) (string, error)   { return os.Readlink(name) }
func (hostTree) OpenFile(name string, flag int, perm fs.FileMode) (*os.File, error) {
	return os.OpenFile(name, flag, perm)
}
func (hostTree) OpenRoot(name string) (*os.Root, error)       { return os.OpenRoot(name) }
func (hostTree) Mkdir(name string, perm fs.FileMode) error    { return os.Mkdir(name, perm) }
func (hostTree) MkdirAll(name string, perm fs.FileMode) error { return os.MkdirAll(name, perm) }
func (hostTree) Remove(name string) error                     { return os.Remove(name) }
func (hostTree) RemoveAll(name string) error                  { return os.RemoveAll(name) }
func (hostTree) Rename(oldname, newname string) error         { return os.Rename(oldname, newname) }
func (hostTree) Chmod(name string, mode fs.FileMode) error    { return os.Chmod(name, mode) }
func (hostTree) Lchown(name string, uid, gid int) error       { return os.Lchown(name, uid, gid) }

// place is where an operation on one path lands.
type place struct {
	// path is the path as requested, cleaned; messages name it.
	path string
	// t is where the operation happens, under name.
	t    fileTree
	name string
	// Under a sandbox: the sandbox, the root path lies under, and t as an
	// os.Root there. Without one, sb and root are nil.
	sb       *sandbox.Sandbox
	rootPath string
	root     *os.Root
}

// resolve cleans the requested path and finds where an operation on it
// lands. Without a sandbox that is the whole file system, as always.
// Under one, the path must lie under a root (a read-write one for
// writeAccess) and not at or beneath a denied path, or the operation is
// refused with CodePermissionDenied; the operation then goes through an
// os.Root at that root, which refuses any symlink that leads out of it.
// The caller must close the place.
func (s *Service) resolve(op, raw string, acc access) (*place, error) {
	return resolveIn(s.opts.Sandbox.Current(), op, raw, acc)
}

// resolveIn is resolve under sb, the sandbox in force when the operation
// began (nil for none).
func resolveIn(sb *sandbox.Sandbox, op, raw string, acc access) (*place, error) {
	p, err := cleanPath(op, raw)
	if err != nil {
		return nil, err
	}
	if sb == nil {
		return &place{path: p, t: hostTree{}, name: p}, nil
	}
	if d, ok := sb.DeniedAt(p); ok {
		return nil, refused(op, p, "%s is a secret path", d)
	}
	r, ok := sb.RootOf(p)
	switch {
	case !ok:
		return nil, refused(op, p, "it lies outside every root")
	case acc == writeAccess && !r.Writable:
		return nil, refused(op, p, "it lies under the read-only root %s", r.Path)
	}
	root, err := os.OpenRoot(r.Path)
	if err != nil {
		return nil, fsError(op, p, err)
	}
	name := "."
	if p != r.Path {
		name = strings.TrimPrefix(p[len(r.Path):], "/")
	}
	return &place{path: p, t: root, name: name, sb: sb, rootPath: r.Path, root: root}, nil
}

func (pl *place) close() {
	if pl.root != nil {
		pl.root.Close()
	}
}

// sandboxed reports whether the place is under a sandbox.
func (pl *place) sandboxed() bool { return pl.sb != nil }

// isRoot reports whether the place is a sandbox root itself.
func (pl *place) isRoot() bool { return pl.sb != nil && pl.name == "." }

// display turns a name beneath the place (relative, as from a walk of it)
// into the path a client sees.
func (pl *place) display(rel string) string {
	if rel == "." {
		return pl.path
	}
	return filepath.Join(pl.path, rel)
}

// resolved returns where the place is in the file system as the kernel
// resolves it (its final component too when follow is set), and refuses
// the operation if that is at or beneath a denied path: a symlink inside
// a root must not lead to a secret in it. Without a sandbox it returns
// path unchecked.
func (pl *place) resolved(op string, follow bool) (string, error) {
	if !pl.sandboxed() {
		return pl.path, nil
	}
	r, err := realPath(pl.root, pl.name, follow)
	if err != nil {
		return "", fsError(op, pl.path, err)
	}
	if d, ok := pl.sb.DeniedAt(r); ok {
		return "", refused(op, pl.path, "it resolves to %s, and %s is a secret path", r, d)
	}
	return r, nil
}

// deniedBeneath refuses an operation that acts on the whole tree at the
// place (resolved being where it resolves) when a secret path lies in it.
func (pl *place) deniedBeneath(op, resolved string) error {
	if !pl.sandboxed() {
		return nil
	}
	for _, p := range []string{pl.path, resolved} {
		if d, ok := pl.sb.DeniedBeneath(p); ok {
			return refused(op, pl.path, "the secret path %s lies beneath it", d)
		}
	}
	return nil
}

// deniedIn reports whether an entry beneath the place, at rel from it, is
// a secret, by its path and by where it resolves (resolved being where the
// place resolves); walks leave such entries out.
func (pl *place) deniedIn(resolved, rel string) bool {
	if !pl.sandboxed() {
		return false
	}
	_, a := pl.sb.DeniedAt(pl.display(rel))
	_, b := pl.sb.DeniedAt(filepath.Join(resolved, rel))
	return a || b
}

// realPath returns where name, beneath root, is in the file system: its
// directory as the kernel resolved it, and its last component resolved
// too when follow is set. Components that do not exist (yet) are taken
// as they are: they cannot be symlinks.
func realPath(root *os.Root, name string, follow bool) (string, error) {
	dir, rest := name, ""
	if name != "." {
		dir, rest = filepath.Dir(name), filepath.Base(name)
	} else {
		follow = false
	}
	for {
		d, err := root.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY, 0)
		if err == nil {
			defer d.Close()
			base, err := filePath(d)
			if err != nil {
				return "", err
			}
			if follow && rest != "" && filepath.Dir(rest) == "." {
				// O_PATH opens nothing (no device side effects); the
				// kernel follows the symlink, perhaps out of the root,
				// which the operation itself then refuses.
				var fd int
				if cerr := control(d, func(dfd int) { fd, err = unix.Openat(dfd, rest, unix.O_PATH|unix.O_CLOEXEC, 0) }); cerr != nil {
					return "", cerr
				}
				if err == nil {
					defer unix.Close(fd)
					return fdPath(fd)
				}
				if !errors.Is(err, unix.ENOENT) {
					return "", &fs.PathError{Op: "openat", Path: name, Err: err}
				}
			}
			return filepath.Join(base, rest), nil
		}
		if !errors.Is(err, fs.ErrNotExist) || dir == "." {
			return "", err
		}
		dir, rest = filepath.Dir(dir), filepath.Join(filepath.Base(dir), rest)
	}
}

// filePath returns the path the kernel has for an open file.
func filePath(f *os.File) (p string, err error) {
	if cerr := control(f, func(fd int) { p, err = fdPath(fd) }); cerr != nil {
		return "", cerr
	}
	return p, err
}

// control calls fn with f's descriptor, without Fd's side effect of
// making f blocking.
func control(f *os.File, fn func(fd int)) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	return rc.Control(func(fd uintptr) { fn(int(fd)) })
}

// fdPath returns the path the kernel has for a file descriptor.
func fdPath(fd int) (string, error) {
	p, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return "", fmt.Errorf("resolve through /proc: %w", err)
	}
	return p, nil
}

// refused is the error for an operation the sandbox does not allow:
// CodePermissionDenied, naming the path and why.
func refused(op, p, format string, args ...any) error {
	return connect.NewError(connect.CodePermissionDenied,
		fmt.Errorf("%s %s: %w: %s", op, p, sandbox.ErrRefused, fmt.Sprintf(format, args...)))
}

// escapes reports whether err is os.Root refusing a path that leads out
// of the root (through "..", or a symlink that is absolute or climbs
// out). The os package does not export that error.
func escapes(err error) bool {
	for err != nil {
		if err.Error() == "path escapes from parent" {
			return true
		}
		err = errors.Unwrap(err)
	}
	return false
}
