// Package tarfs packs a tree into a tar archive and extracts an archive
// beneath a directory, and nowhere else. Both carreld (extracting what a
// guest sends, which is hostile) and carrel-agent (extracting what the host
// sends) use it.
//
// Extraction goes through an os.Root: every path is resolved beneath the
// destination by the kernel, so an archive cannot climb out with "..", an
// absolute name, a symlink that points out, or a symlink swapped in while
// it is being extracted. Names that try are refused outright. PackRoot
// packs through an os.Root in the same way.
package tarfs

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"
)

// ErrUnsafe is returned for an entry that names a path outside the
// destination.
var ErrUnsafe = errors.New("unsafe path in archive")

// ErrTooLarge is returned when an archive exceeds a limit.
var ErrTooLarge = errors.New("archive exceeds a limit")

// Limits bound what one extraction may create.
type Limits struct {
	// MaxEntries caps the number of entries; 0 means 1,000,000.
	MaxEntries int
	// MaxBytes caps the total size of regular files; 0 means no cap.
	MaxBytes int64
}

// Options configure Extract.
type Options struct {
	Limits
	// KeepSpecialBits keeps setuid, setgid and sticky bits; otherwise only
	// the rwx bits are applied.
	KeepSpecialBits bool
	// Skipped is told about entries that are not extracted (devices,
	// fifos); nil ignores them.
	Skipped func(name, why string)
	// Owner, if set, owns every entry extracted; otherwise they belong to
	// the caller. Owners recorded in the archive are never applied.
	Owner *Owner
}

// Owner is a uid and gid.
type Owner struct {
	UID, GID int
}

// Stats counts what Extract created.
type Stats struct {
	Entries int
	Bytes   int64
}

// cleanName turns an archive name into a path relative to the root, or
// fails with ErrUnsafe.
func cleanName(name string) (string, error) {
	if name == "" || strings.ContainsRune(name, 0) || strings.HasPrefix(name, "/") {
		return "", fmt.Errorf("%w: %q", ErrUnsafe, name)
	}
	p := path.Clean(name)
	if p == ".." || strings.HasPrefix(p, "../") {
		return "", fmt.Errorf("%w: %q", ErrUnsafe, name)
	}
	return p, nil
}

// Extract reads an archive from r and creates its entries beneath root.
// An entry that already exists is replaced (a directory is kept and its
// mode updated). The archive's owners are not applied: what is extracted
// belongs to the caller, or to opts.Owner.
func Extract(r io.Reader, root *os.Root, opts Options) (Stats, error) {
	var st Stats
	max := opts.MaxEntries
	if max == 0 {
		max = 1_000_000
	}
	permMask := fs.FileMode(0o777)
	if opts.KeepSpecialBits {
		permMask = 0o777 | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky
	}
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return st, nil
		}
		if err != nil {
			return st, fmt.Errorf("read archive: %w", err)
		}
		if st.Entries++; st.Entries > max {
			return st, fmt.Errorf("%w: more than %d entries", ErrTooLarge, max)
		}
		name, err := cleanName(hdr.Name)
		if err != nil {
			return st, err
		}
		mode := hdr.FileInfo().Mode() & permMask
		switch hdr.Typeflag {
		case tar.TypeDir:
			if name == "." {
				continue
			}
			if err := root.MkdirAll(name, 0o755); err != nil {
				return st, fmt.Errorf("extract %s: %w", name, err)
			}
			if err := root.Chmod(name, mode|0o700); err != nil { // keep it writable while we fill it
				return st, fmt.Errorf("extract %s: %w", name, err)
			}
		case tar.TypeReg:
			if isSparse(hdr) {
				// A few bytes of sparse map could stand for terabytes of
				// zeros on our disk; Pack never makes them.
				return st, fmt.Errorf("extract %s: sparse files are not supported", name)
			}
			if opts.MaxBytes > 0 && st.Bytes+hdr.Size > opts.MaxBytes {
				return st, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, opts.MaxBytes)
			}
			n, err := writeFile(root, name, tr, mode)
			st.Bytes += n
			if err != nil {
				return st, fmt.Errorf("extract %s: %w", name, err)
			}
		case tar.TypeSymlink:
			if err := replace(root, name); err != nil {
				return st, fmt.Errorf("extract %s: %w", name, err)
			}
			// The link itself may point anywhere; it is never followed
			// while extracting, since os.Root refuses paths that leave it.
			if err := root.Symlink(hdr.Linkname, name); err != nil {
				return st, fmt.Errorf("extract %s: %w", name, err)
			}
		case tar.TypeLink:
			target, err := cleanName(hdr.Linkname)
			if err != nil {
				return st, err
			}
			if err := replace(root, name); err != nil {
				return st, fmt.Errorf("extract %s: %w", name, err)
			}
			if err := root.Link(target, name); err != nil {
				return st, fmt.Errorf("extract %s: %w", name, err)
			}
		default:
			if opts.Skipped != nil {
				opts.Skipped(name, fmt.Sprintf("type %q is not extracted", hdr.Typeflag))
			}
			continue
		}
		if o := opts.Owner; o != nil && hdr.Typeflag != tar.TypeLink {
			if err := root.Lchown(name, o.UID, o.GID); err != nil {
				return st, fmt.Errorf("extract %s: %w", name, err)
			}
		}
		if !hdr.ModTime.IsZero() && hdr.Typeflag != tar.TypeSymlink {
			_ = root.Chtimes(name, hdr.ModTime, hdr.ModTime)
		}
	}
}

func isSparse(hdr *tar.Header) bool {
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}

// replace removes name if it exists and is not a directory, so that a new
// entry never writes through whatever stood there (a planted symlink).
func replace(root *os.Root, name string) error {
	if dir := path.Dir(name); dir != "." {
		if err := root.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	fi, err := root.Lstat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return fmt.Errorf("a directory stands there")
	}
	return root.Remove(name)
}

func writeFile(root *os.Root, name string, r io.Reader, mode fs.FileMode) (int64, error) {
	if err := replace(root, name); err != nil {
		return 0, err
	}
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return 0, err
	}
	n, err := io.Copy(f, r)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = root.Chmod(name, mode) // the umask narrowed it at create
	}
	return n, err
}

// Pack writes the file or tree at p to w as a PAX tar archive. Entry names
// start with p's last element. Symlinks are stored, not followed; sockets
// and devices are skipped (skipped is told, if not nil).
func Pack(w io.Writer, p string, skipped func(name, why string)) error {
	p = filepath.Clean(p)
	base := filepath.Dir(p)
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(p, func(file string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(base, file)
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		return packEntry(tw, rel, fi, skipped,
			func() (string, error) { return os.Readlink(file) },
			func() (*os.File, error) { return os.Open(file) })
	})
	if err != nil {
		return fmt.Errorf("pack %s: %w", p, err)
	}
	return tw.Close()
}

// PackOptions configure PackRoot.
type PackOptions struct {
	// Name is the archive name of the packed file or directory, which
	// starts every entry's name; empty means the last element of the name
	// given to PackRoot.
	Name string
	// Skipped is told about entries left out because of their type
	// (sockets, devices); nil ignores them.
	Skipped func(name, why string)
	// Exclude, if set, is asked about each entry below the packed one, by
	// its archive name (slash-separated, without Name and without a
	// trailing slash); true leaves it out, and everything beneath it.
	Exclude func(rel string) bool
}

// PackRoot is Pack for the file or tree at name beneath root. Every file is
// reached through root, so nothing outside it is packed, even through a
// symlink or a directory swapped for one while packing.
func PackRoot(w io.Writer, root *os.Root, name string, opts PackOptions) error {
	as := opts.Name
	if as == "" {
		as = filepath.Base(name)
	}
	tw := tar.NewWriter(w)
	err := func() error {
		fi, err := root.Lstat(name)
		if err != nil {
			return err
		}
		if !fi.IsDir() {
			return packEntry(tw, as, fi, opts.Skipped,
				func() (string, error) { return root.Readlink(name) },
				func() (*os.File, error) { return root.Open(name) })
		}
		sub, err := root.OpenRoot(name)
		if err != nil {
			return err
		}
		defer sub.Close()
		return fs.WalkDir(sub.FS(), ".", func(rel string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if rel != "." && opts.Exclude != nil && opts.Exclude(filepath.ToSlash(rel)) {
				if d.IsDir() {
					return fs.SkipDir
				}
				return nil
			}
			fi, err := d.Info()
			if err != nil {
				return err
			}
			return packEntry(tw, filepath.Join(as, rel), fi, opts.Skipped,
				func() (string, error) { return sub.Readlink(rel) },
				func() (*os.File, error) { return sub.Open(rel) })
		})
	}()
	if err != nil {
		return fmt.Errorf("pack %s: %w", name, err)
	}
	return tw.Close()
}

// packEntry writes one entry named rel, described by fi (an Lstat), to tw:
// a directory, a symlink (through readlink) or a regular file's content
// (through open). Other types are skipped.
func packEntry(tw *tar.Writer, rel string, fi fs.FileInfo, skipped func(name, why string),
	readlink func() (string, error), open func() (*os.File, error)) error {
	link := ""
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		var err error
		if link, err = readlink(); err != nil {
			return err
		}
	case fi.Mode().IsRegular(), fi.IsDir():
	default:
		if skipped != nil {
			skipped(rel, "not a regular file, directory or symlink")
		}
		return nil
	}
	hdr, err := tar.FileInfoHeader(fi, link)
	if err != nil {
		return err
	}
	hdr.Name = filepath.ToSlash(rel)
	if fi.IsDir() {
		hdr.Name += "/"
	}
	hdr.Format = tar.FormatPAX
	hdr.ModTime = hdr.ModTime.Truncate(time.Second)
	hdr.AccessTime, hdr.ChangeTime = time.Time{}, time.Time{}
	hdr.Uname, hdr.Gname = "", ""
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return nil
	}
	f, err := open()
	if err != nil {
		return err
	}
	defer f.Close()
	// A file that grows while packed is cut at its header's size; one
	// that shrinks fails the archive rather than padding it silently.
	_, err = io.Copy(tw, io.LimitReader(f, hdr.Size))
	return err
}
