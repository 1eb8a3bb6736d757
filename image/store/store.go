// Package store keeps boot images in a content-addressed directory tree:
//
//	blobs/sha256/<hex>            kernel and initrd files, read-only
//	manifests/sha256/<hex>.json   canonical manifest bytes; <hex> is their sha256
//	tags/<name>                   "sha256:<hex>\n", the manifest a tag points at
//	tmp/                          temp files, renamed into place when complete
//
// Every write goes through a synced temp file and a rename, and blobs are
// committed before the manifest that names them, and manifests before the tags
// that name them. A crash therefore leaves at worst an unreferenced blob or a
// stale temp file, never a tag or manifest that points at something missing.
// Several processes may write one store at once.
package store

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/supervisor/atomicfile"
	"github.com/carrel-os/carrel/supervisor/cas"
)

const (
	blobDir     = "blobs/sha256"
	manifestDir = "manifests/sha256"
	tagDir      = "tags"
	tmpDir      = "tmp"

	// staleTemp is how old a temp file must be before Open deletes it; it is
	// far longer than any write, so a concurrent writer's file is never hit.
	staleTemp = 24 * time.Hour

	maxTagFile = 256
)

var (
	// ErrNotFound means no image, or no blob, answers to the reference.
	ErrNotFound = errors.New("image not found")
	// ErrCorrupt means the store holds an entry whose content does not match
	// its name or whose parts are missing or the wrong size.
	ErrCorrupt = errors.New("image store entry corrupt")
	// ErrInvalidRef means a tag name or digest is malformed.
	ErrInvalidRef = errors.New("invalid image reference")
)

// Store is a content-addressed image store rooted at one directory. Its
// methods are safe for concurrent use, also by several processes.
type Store struct {
	dir   string
	blobs cas.Store
}

// Open returns the store rooted at dir, creating its layout if needed, and
// removes temp files left behind by crashed writers.
func Open(dir string) (*Store, error) {
	if dir == "" {
		return nil, errors.New("open image store: no directory given")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("open image store %q: %w", dir, err)
	}
	for _, d := range []string{blobDir, manifestDir, tagDir, tmpDir} {
		if err := os.MkdirAll(filepath.Join(abs, d), 0o755); err != nil {
			return nil, fmt.Errorf("open image store: %w", err)
		}
	}
	s := &Store{dir: abs, blobs: newBlobs(abs)}
	s.removeStaleTemps(time.Now().Add(-staleTemp))
	return s, nil
}

// Dir returns the store's absolute root directory.
func (s *Store) Dir() string { return s.dir }

// removeStaleTemps is best effort: a leftover temp file wastes space but
// never affects what the store serves.
func (s *Store) removeStaleTemps(before time.Time) {
	entries, err := os.ReadDir(filepath.Join(s.dir, tmpDir))
	if err != nil {
		return
	}
	for _, e := range entries {
		info, err := e.Info()
		if err == nil && info.ModTime().Before(before) {
			_ = os.RemoveAll(filepath.Join(s.dir, tmpDir, e.Name()))
		}
	}
}

func hexOf(digest string) string { return strings.TrimPrefix(digest, manifest.DigestPrefix) }

func (s *Store) manifestPath(digest string) string {
	return filepath.Join(s.dir, manifestDir, hexOf(digest)+".json")
}

// ValidTagName reports whether name may be used as a tag:
// [a-z0-9][a-z0-9._-]{0,62}.
func ValidTagName(name string) bool { return manifest.ValidName(name) }

// PutManifest stores m and returns its digest. Its parts must already be in
// the store with the sizes m states; otherwise the error wraps ErrNotFound or
// ErrCorrupt. Storing the same manifest again is a no-op that succeeds.
func (s *Store) PutManifest(m *manifest.Manifest) (string, error) {
	b, err := m.Marshal()
	if err != nil {
		return "", fmt.Errorf("put manifest: %w", err)
	}
	for _, p := range m.Parts() {
		if err := s.checkBlob(p.Part); err != nil {
			return "", fmt.Errorf("put manifest: %s: %w", p.Name, err)
		}
	}
	digest := manifest.DigestBytes(b)
	if old, err := readLimited(s.manifestPath(digest), manifest.MaxSize); err == nil && string(old) == string(b) {
		return digest, nil // keep the file, and so its mtime, which List reports as Created
	}
	if err := s.writeAtomic(s.manifestPath(digest), b, 0o444); err != nil {
		return "", fmt.Errorf("put manifest %s: %w", digest, err)
	}
	return digest, nil
}

// checkBlob returns nil if the blob p names exists as a regular file of p's
// size. Its content is not hashed; see Verify.
func (s *Store) checkBlob(p manifest.Part) error {
	fi, err := os.Stat(s.blobPath(p.Digest))
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("blob %s: %w", p.Digest, ErrNotFound)
	case err != nil:
		return fmt.Errorf("blob %s: %w", p.Digest, err)
	case !fi.Mode().IsRegular():
		return fmt.Errorf("blob %s is not a regular file: %w", p.Digest, ErrCorrupt)
	case fi.Size() != p.Size:
		return fmt.Errorf("blob %s is %d bytes, manifest says %d: %w", p.Digest, fi.Size(), p.Size, ErrCorrupt)
	}
	return nil
}

// Tag points name at the manifest digest, replacing any earlier target. The
// manifest must be in the store, or the error wraps ErrNotFound.
func (s *Store) Tag(name, digest string) error {
	if !ValidTagName(name) {
		return fmt.Errorf("tag %q: want [a-z0-9][a-z0-9._-]{0,62}: %w", name, ErrInvalidRef)
	}
	if err := manifest.ValidateDigest(digest); err != nil {
		return fmt.Errorf("tag %q: %w: %w", name, ErrInvalidRef, err)
	}
	if _, err := os.Stat(s.manifestPath(digest)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("tag %q: manifest %s: %w", name, digest, ErrNotFound)
		}
		return fmt.Errorf("tag %q: %w", name, err)
	}
	if err := s.writeAtomic(filepath.Join(s.dir, tagDir, name), []byte(digest+"\n"), 0o644); err != nil {
		return fmt.Errorf("tag %q: %w", name, err)
	}
	return nil
}

// Untag removes tag name; the error wraps ErrNotFound if there is none. The
// manifest and blobs stay in the store.
func (s *Store) Untag(name string) error {
	if !ValidTagName(name) {
		return fmt.Errorf("untag %q: %w", name, ErrInvalidRef)
	}
	p := filepath.Join(s.dir, tagDir, name)
	if err := os.Remove(p); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("untag %q: %w", name, ErrNotFound)
		}
		return fmt.Errorf("untag %q: %w", name, err)
	}
	return atomicfile.SyncDir(filepath.Dir(p))
}

// readTag returns the digest tag name points at.
func (s *Store) readTag(name string) (string, error) {
	b, err := readLimited(filepath.Join(s.dir, tagDir, name), maxTagFile)
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("tag %q: %w", name, ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("tag %q: %w", name, err)
	}
	digest := strings.TrimSpace(string(b))
	if err := manifest.ValidateDigest(digest); err != nil {
		return "", fmt.Errorf("tag %q: %w: %w", name, ErrCorrupt, err)
	}
	return digest, nil
}
