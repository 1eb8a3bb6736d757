// Package initramfs builds Linux initramfs archives: cpio in the "newc"
// (070701) format the kernel unpacks at boot. The same tree of entries can
// be laid out as a directory instead (WriteDir), for mkfs.erofs to make an
// image's read-only root of.
//
// Output is deterministic: entries are written in sorted path order with
// inode numbers assigned in that order, modification times of zero and only
// the owners the caller sets, so the same entries always give the same bytes.
package initramfs

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"sort"
	"strings"
)

// maxName is the longest entry name (PATH_MAX less the NUL).
const maxName = 4095

// maxFileSize is the most newc's 32-bit size field can hold.
const maxFileSize = 1<<32 - 1

// Entry is one file in an archive.
type Entry struct {
	// Name is a slash-separated path relative to the archive root, e.g.
	// "bin/sh"; a leading "/" is dropped.
	Name string
	// Mode holds the type (0 for a regular file, fs.ModeDir, fs.ModeSymlink,
	// fs.ModeDevice|fs.ModeCharDevice, fs.ModeDevice) and the permission bits,
	// including fs.ModeSetuid, fs.ModeSetgid and fs.ModeSticky.
	Mode fs.FileMode
	// UID and GID own the entry; zero means root.
	UID, GID uint32
	// Data is a regular file's content, unless Source is set.
	Data []byte
	// Source names a host file whose content is read when the archive is
	// written; it must still have the size it had when added.
	Source string
	// Linkname is a symlink's target.
	Linkname string
	// Major and Minor number a device node.
	Major, Minor uint32

	size     int64
	implicit bool // a parent directory nobody added explicitly
}

// Archive collects entries and writes them as one newc archive. The zero
// value is not usable; call New.
type Archive struct {
	entries map[string]*Entry
}

// New returns an empty archive.
func New() *Archive { return &Archive{entries: map[string]*Entry{}} }

func cleanName(name string) (string, error) {
	n := strings.TrimPrefix(name, "/")
	switch {
	case n == "" || n == ".":
		return "", fmt.Errorf("entry name %q: empty", name)
	case len(n) > maxName:
		return "", fmt.Errorf("entry name %.40q...: longer than %d bytes", name, maxName)
	case strings.ContainsRune(n, 0):
		return "", fmt.Errorf("entry name %q: contains NUL", name)
	case path.Clean(n) != n || n == ".." || strings.HasPrefix(n, "../"):
		return "", fmt.Errorf("entry name %q: not a clean relative path", name)
	}
	return n, nil
}

// Add adds e, first adding any missing parent directories as root-owned
// 0755 directories. Adding a directory that exists only as such an implied
// parent sets its mode and owner; any other repeated name is an error.
func (a *Archive) Add(e Entry) error {
	name, err := cleanName(e.Name)
	if err != nil {
		return fmt.Errorf("add to initramfs: %w", err)
	}
	e.Name = name
	if err := a.prepare(&e); err != nil {
		return fmt.Errorf("add %s to initramfs: %w", name, err)
	}
	for p := path.Dir(name); p != "."; p = path.Dir(p) {
		if pe, ok := a.entries[p]; ok {
			if !pe.Mode.IsDir() {
				return fmt.Errorf("add %s to initramfs: parent %s is not a directory", name, p)
			}
			continue
		}
		a.entries[p] = &Entry{Name: p, Mode: fs.ModeDir | 0o755, implicit: true}
	}
	if prev, ok := a.entries[name]; ok && !(prev.implicit && e.Mode.IsDir()) {
		return fmt.Errorf("add %s to initramfs: duplicate entry", name)
	}
	a.entries[name] = &e
	return nil
}

// prepare checks e's fields against its type and records its size.
func (a *Archive) prepare(e *Entry) error {
	if e.Mode&^(fs.ModeType|fs.ModePerm|fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky) != 0 {
		return fmt.Errorf("unsupported mode %v", e.Mode)
	}
	switch t := e.Mode.Type(); t {
	case 0:
		if e.Source != "" {
			if e.Data != nil {
				return errors.New("both data and source set")
			}
			fi, err := os.Stat(e.Source)
			if err != nil {
				return err
			}
			if !fi.Mode().IsRegular() {
				return fmt.Errorf("source %s is not a regular file", e.Source)
			}
			e.size = fi.Size()
		} else {
			e.size = int64(len(e.Data))
		}
		if e.size > maxFileSize {
			return fmt.Errorf("%d bytes is too large for newc", e.size)
		}
	case fs.ModeSymlink:
		if e.Linkname == "" || len(e.Linkname) > maxName || strings.ContainsRune(e.Linkname, 0) {
			return fmt.Errorf("bad symlink target %q", e.Linkname)
		}
		e.size = int64(len(e.Linkname))
	case fs.ModeDir, fs.ModeDevice | fs.ModeCharDevice, fs.ModeDevice:
	default:
		return fmt.Errorf("unsupported file type %v", t)
	}
	if e.Mode.Type() != 0 && (e.Data != nil || e.Source != "") {
		return errors.New("content set on a non-regular entry")
	}
	return nil
}

// Dir adds a root-owned directory.
func (a *Archive) Dir(name string, perm fs.FileMode) error {
	return a.Add(Entry{Name: name, Mode: fs.ModeDir | perm})
}

// File adds a root-owned regular file holding data.
func (a *Archive) File(name string, perm fs.FileMode, data []byte) error {
	return a.Add(Entry{Name: name, Mode: perm, Data: data})
}

// FileFrom adds a root-owned regular file whose content is read from the
// host file src when the archive is written.
func (a *Archive) FileFrom(name string, perm fs.FileMode, src string) error {
	return a.Add(Entry{Name: name, Mode: perm, Source: src})
}

// Symlink adds a symbolic link to target.
func (a *Archive) Symlink(name, target string) error {
	return a.Add(Entry{Name: name, Mode: fs.ModeSymlink | 0o777, Linkname: target})
}

// CharDev adds a root-owned character device node.
func (a *Archive) CharDev(name string, perm fs.FileMode, major, minor uint32) error {
	return a.Add(Entry{Name: name, Mode: fs.ModeDevice | fs.ModeCharDevice | perm, Major: major, Minor: minor})
}

// Has reports whether name was added, explicitly or as a parent.
func (a *Archive) Has(name string) bool {
	n, err := cleanName(name)
	if err != nil {
		return false
	}
	_, ok := a.entries[n]
	return ok
}

// Unix mode bits, as newc stores them.
const (
	sIFREG  = 0o100000
	sIFDIR  = 0o040000
	sIFLNK  = 0o120000
	sIFCHR  = 0o020000
	sIFBLK  = 0o060000
	sISUID  = 0o4000
	sISGID  = 0o2000
	sISVTX  = 0o1000
	trailer = "TRAILER!!!"
)

func unixMode(m fs.FileMode) uint32 {
	u := uint32(m.Perm())
	switch m.Type() {
	case 0:
		u |= sIFREG
	case fs.ModeDir:
		u |= sIFDIR
	case fs.ModeSymlink:
		u |= sIFLNK
	case fs.ModeDevice | fs.ModeCharDevice:
		u |= sIFCHR
	case fs.ModeDevice:
		u |= sIFBLK
	}
	if m&fs.ModeSetuid != 0 {
		u |= sISUID
	}
	if m&fs.ModeSetgid != 0 {
		u |= sISGID
	}
	if m&fs.ModeSticky != 0 {
		u |= sISVTX
	}
	return u
}

// WriteTo writes the archive, entries in sorted name order followed by the
// trailer. Since a parent's name is a prefix of its children's, sorting puts
// every directory before its contents, as the kernel needs.
func (a *Archive) WriteTo(w io.Writer) (int64, error) {
	names := make([]string, 0, len(a.entries))
	for n := range a.entries {
		names = append(names, n)
	}
	sort.Strings(names)
	cw := &countWriter{w: w}
	for i, n := range names {
		if err := writeEntry(cw, uint32(i+1), a.entries[n]); err != nil {
			return cw.n, fmt.Errorf("write initramfs entry %s: %w", n, err)
		}
	}
	if err := writeHeader(cw, header{name: trailer, nlink: 1}); err != nil {
		return cw.n, fmt.Errorf("write initramfs trailer: %w", err)
	}
	return cw.n, nil
}

type header struct {
	name                       string
	ino, mode, uid, gid, nlink uint32
	size                       int64
	rdevMajor, rdevMinor       uint32
}

func writeHeader(w io.Writer, h header) error {
	// Fields: magic, ino, mode, uid, gid, nlink, mtime, filesize, devmajor,
	// devminor, rdevmajor, rdevminor, namesize, check.
	s := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		h.ino, h.mode, h.uid, h.gid, h.nlink, 0, uint32(h.size), 0, 0, h.rdevMajor, h.rdevMinor, len(h.name)+1, 0)
	s += h.name + "\x00"
	s += strings.Repeat("\x00", pad4(int64(len(s))))
	_, err := io.WriteString(w, s)
	return err
}

func pad4(n int64) int { return int((4 - n%4) % 4) }

func writeEntry(w io.Writer, ino uint32, e *Entry) error {
	h := header{name: e.Name, ino: ino, mode: unixMode(e.Mode), uid: e.UID, gid: e.GID, nlink: 1, size: e.size}
	if e.Mode.IsDir() {
		h.nlink = 2
	}
	if e.Mode&fs.ModeDevice != 0 {
		h.rdevMajor, h.rdevMinor = e.Major, e.Minor
	}
	if err := writeHeader(w, h); err != nil {
		return err
	}
	switch {
	case e.Mode.Type() == fs.ModeSymlink:
		if _, err := io.WriteString(w, e.Linkname); err != nil {
			return err
		}
	case e.Mode.IsRegular() && e.Source != "":
		if err := copySource(w, e.Source, e.size); err != nil {
			return err
		}
	case e.Mode.IsRegular():
		if _, err := w.Write(e.Data); err != nil {
			return err
		}
	}
	_, err := w.Write(make([]byte, pad4(e.size)))
	return err
}

func copySource(w io.Writer, src string, size int64) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() != size {
		return fmt.Errorf("source %s changed size from %d to %d bytes", src, size, fi.Size())
	}
	n, err := io.Copy(w, io.LimitReader(f, size))
	if err != nil {
		return fmt.Errorf("copy %s: %w", src, err)
	}
	if n != size {
		return fmt.Errorf("source %s shrank to %d bytes while copying", src, n)
	}
	return nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
