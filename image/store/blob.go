package store

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/supervisor/cas"
)

// newBlobs returns the blob store of the image store in dir:
// blobs/sha256/<hex>, world-readable and read-only, written through temp
// files in tmp/. Putting a blob again replaces it, which repairs a damaged
// copy.
func newBlobs(dir string) cas.Store {
	return cas.Store{
		Root:        filepath.Join(dir, blobDir),
		Layout:      cas.Flat,
		TempDir:     filepath.Join(dir, tmpDir),
		TempPattern: ".blob-*",
		Perm:        0o444,
		Replace:     true,
	}
}

// blobPath is where the blob of a valid digest lives.
func (s *Store) blobPath(digest string) string { return s.blobs.Path(digest) }

// PutBlob copies the regular file at src into the store and returns its
// digest and size. The copy is hashed as it is written and committed with a
// rename, so a blob file in the store is always complete. Putting the same
// content again succeeds and rewrites the blob, which also repairs a damaged
// copy. The source must not change while it is copied.
func (s *Store) PutBlob(src string) (manifest.Part, error) {
	in, err := os.Open(src)
	if err != nil {
		return manifest.Part{}, fmt.Errorf("put blob: %w", err)
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return manifest.Part{}, fmt.Errorf("put blob: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return manifest.Part{}, fmt.Errorf("put blob %s: not a regular file", src)
	}
	if fi.Size() == 0 {
		return manifest.Part{}, fmt.Errorf("put blob %s: file is empty", src)
	}

	st, err := s.blobs.Stage(in)
	if err != nil {
		return manifest.Part{}, fmt.Errorf("put blob %s: %w", src, err)
	}
	defer st.Discard() // no-op once committed
	if st.Size != fi.Size() {
		return manifest.Part{}, fmt.Errorf("put blob %s: size changed from %d to %d bytes while copying", src, fi.Size(), st.Size)
	}
	if err := st.Commit(); err != nil {
		return manifest.Part{}, fmt.Errorf("put blob %s: %w", src, err)
	}
	return manifest.Part{Digest: st.Digest, Size: st.Size}, nil
}
