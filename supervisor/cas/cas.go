// Package cas is content-addressed storage: a directory of read-only files
// ("blobs"), each named by the sha256 of its content. The audit log and the
// image store each keep one, with layouts of their own; this package writes,
// names and checks the blobs for both.
//
// A blob is written to a temp file in the store, hashed as it is copied
// (or, through a Writer, by the caller that wrote it), synced, and renamed
// into place, and the directory that received it is synced; so a blob in
// the store is always complete and durable, and a crash leaves at worst a
// temp file behind.
package cas

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// Prefix starts every digest: a digest is Prefix and 64 lower-case hex
// digits.
const Prefix = "sha256:"

// Valid reports whether d is Prefix and 64 lower-case hex digits.
func Valid(d string) bool {
	if len(d) != len(Prefix)+2*sha256.Size || d[:len(Prefix)] != Prefix {
		return false
	}
	for _, c := range []byte(d[len(Prefix):]) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// Layout is how a store names a blob's file below its Root.
type Layout int

const (
	// Flat keeps every blob in Root: Root/<64 hex>.
	Flat Layout = iota
	// Fanout keeps a blob in a directory named after its first two hex
	// digits: Root/<2 hex>/<62 hex>. Put creates that directory, mode
	// 0700, when it is missing.
	Fanout
)

// Store is a directory of blobs. Its fields are set once; a Store is safe
// for concurrent use, also by several processes, when they use the same
// fields.
type Store struct {
	Root   string
	Layout Layout
	// TempDir is where blobs are written before they are renamed into
	// place; it must be on Root's file system. TempPattern names the temp
	// files, as os.CreateTemp takes it.
	TempDir     string
	TempPattern string
	// Perm is the mode of every stored blob.
	Perm os.FileMode
	// Replace makes Commit rename over a blob already stored, which
	// repairs a damaged copy. Without it Commit keeps the stored blob and
	// drops the new copy, so the same content is written once.
	Replace bool
}

// Path returns where the blob digest lives. digest must be Valid.
func (s *Store) Path(digest string) string {
	h := digest[len(Prefix):]
	if s.Layout == Fanout {
		return filepath.Join(s.Root, h[:2], h[2:])
	}
	return filepath.Join(s.Root, h)
}

// Put stores what r yields and returns its digest and size. The blob is
// durable when Put returns nil; on error no temp file is left behind.
func (s *Store) Put(r io.Reader) (digest string, size int64, err error) {
	st, err := s.Stage(r)
	if err != nil {
		return "", 0, err
	}
	if err := st.commitOrDiscard(); err != nil {
		return "", 0, err
	}
	return st.Digest, st.Size, nil
}

// Staged is content written to a synced temp file of the store's Perm but
// not yet in place, for the caller to check before it commits it.
type Staged struct {
	Digest string
	Size   int64
	// Temp is the temp file's path; "" once committed or discarded.
	Temp  string
	store *Store
}

// Stage copies what r yields to a temp file in the store, hashing it as it
// goes, and syncs it. On error the temp file is removed.
func (s *Store) Stage(r io.Reader) (*Staged, error) {
	w, err := s.Create()
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	if _, err := io.Copy(io.MultiWriter(w, h), r); err != nil {
		return nil, errors.Join(err, w.Discard())
	}
	return w.Stage(Prefix + hex.EncodeToString(h.Sum(nil)))
}

// Writer is a blob written piece by piece by a caller that hashes the
// content itself, as carreld's file relay does with every byte it
// forwards: the caller names the blob when it is done, and the store does
// not hash the content a second time. Check, which the audit log's verify
// runs, finds a blob whose content does not match its name; and as a
// stored blob is kept, not replaced, unless the store Replaces, a wrong
// name would stand until then.
type Writer struct {
	f     *os.File // nil once staged or discarded
	size  int64
	store *Store
}

var errWriterDone = errors.New("blob writer already staged or discarded")

// Create starts a blob in a temp file of the store. The caller writes the
// content, then Stages or Commits it under its digest, or Discards it.
func (s *Store) Create() (*Writer, error) {
	f, err := os.CreateTemp(s.TempDir, s.TempPattern)
	if err != nil {
		return nil, fmt.Errorf("create temp file: %w", err)
	}
	return &Writer{f: f, store: s}, nil
}

// Write adds p to the content.
func (w *Writer) Write(p []byte) (int, error) {
	if w.f == nil {
		return 0, errWriterDone
	}
	n, err := w.f.Write(p)
	w.size += int64(n)
	return n, err
}

// Stage syncs what was written and names it digest, which must be the
// Valid sha256 of exactly that content; the blob is not yet in place. On
// error the temp file is removed.
func (w *Writer) Stage(digest string) (*Staged, error) {
	if w.f == nil {
		return nil, errWriterDone
	}
	f := w.f
	w.f = nil
	var err error
	if !Valid(digest) {
		err = fmt.Errorf("blob name %q: want %s<64 hex>", digest, Prefix)
	}
	if err == nil {
		err = f.Chmod(w.store.Perm)
	}
	if err == nil {
		if err = f.Sync(); err != nil {
			err = fmt.Errorf("sync %s: %w", f.Name(), err)
		}
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, errors.Join(err, os.Remove(f.Name()))
	}
	return &Staged{Digest: digest, Size: w.size, Temp: f.Name(), store: w.store}, nil
}

// Commit stages what was written as digest (see Stage) and commits it:
// the blob is durable when Commit returns nil, and on error no temp file
// is left behind.
func (w *Writer) Commit(digest string) error {
	st, err := w.Stage(digest)
	if err != nil {
		return err
	}
	return st.commitOrDiscard()
}

// Discard drops what was written and removes the temp file. After Stage
// or Commit it does nothing: a Staged is discarded through its own method.
func (w *Writer) Discard() error {
	if w.f == nil {
		return nil
	}
	f := w.f
	w.f = nil
	f.Close()
	if err := os.Remove(f.Name()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// Commit renames the staged file into place and syncs the directory that
// received it, or, when the blob is already stored and the store does not
// Replace, removes the staged file.
func (st *Staged) Commit() error {
	s := st.store
	path := s.Path(st.Digest)
	dir := filepath.Dir(path)
	if !s.Replace {
		if _, err := os.Stat(path); err == nil {
			// Another writer may have renamed it in and not yet synced
			// the directories that name it: the caller may rely on the
			// blob once Commit returns, so sync them here too.
			if err := s.syncDirs(dir); err != nil {
				return err
			}
			return st.Discard()
		}
	}
	if s.Layout == Fanout {
		if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
			if err := os.MkdirAll(dir, 0o700); err != nil {
				return err
			}
			if err := atomicfile.SyncDir(s.Root); err != nil {
				return fmt.Errorf("sync %s: %w", s.Root, err)
			}
		}
	}
	if err := os.Rename(st.Temp, path); err != nil {
		return fmt.Errorf("rename into place: %w", err)
	}
	st.Temp = ""
	if err := atomicfile.SyncDir(dir); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}

// syncDirs syncs dir, a blob's directory, and for Fanout the root that
// names it.
func (s *Store) syncDirs(dir string) error {
	if err := atomicfile.SyncDir(dir); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	if s.Layout == Fanout {
		if err := atomicfile.SyncDir(s.Root); err != nil {
			return fmt.Errorf("sync %s: %w", s.Root, err)
		}
	}
	return nil
}

// commitOrDiscard commits st, and removes the staged file if that fails.
func (st *Staged) commitOrDiscard() error {
	if err := st.Commit(); err != nil {
		return errors.Join(err, st.Discard())
	}
	return nil
}

// Discard removes the staged file; it returns nil if there is none.
func (st *Staged) Discard() error {
	if st.Temp == "" {
		return nil
	}
	err := os.Remove(st.Temp)
	st.Temp = ""
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

// MismatchError is Check's answer for a blob whose content does not hash
// to its name.
type MismatchError struct {
	Digest string // the blob's name
	Got    string // what its content hashes to
}

func (e *MismatchError) Error() string { return "content hashes to " + e.Got }

// Check hashes the stored blob digest, which must be Valid, and returns nil
// when its content matches its name, a *MismatchError when it does not, and
// an error wrapping fs.ErrNotExist when the blob is missing.
func (s *Store) Check(digest string) error {
	f, err := os.Open(s.Path(digest))
	if err != nil {
		return err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return fmt.Errorf("hash %s: %w", f.Name(), err)
	}
	if got := Prefix + hex.EncodeToString(h.Sum(nil)); got != digest {
		return &MismatchError{Digest: digest, Got: got}
	}
	return nil
}
