package store

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/carrel-os/carrel/image/manifest"
)

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

	tmp, err := s.createTemp(".blob-*")
	if err != nil {
		return manifest.Part{}, fmt.Errorf("put blob %s: %w", src, err)
	}
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(tmp, h), in)
	if err == nil && n != fi.Size() {
		err = fmt.Errorf("size changed from %d to %d bytes while copying", fi.Size(), n)
	}
	if err != nil {
		tmp.Close()
		return manifest.Part{}, errors.Join(fmt.Errorf("put blob %s: %w", src, err), os.Remove(tmp.Name()))
	}
	p := manifest.Part{Digest: manifest.DigestPrefix + hex.EncodeToString(h.Sum(nil)), Size: n}
	if err := commit(tmp, 0o444, s.blobPath(p.Digest)); err != nil {
		return manifest.Part{}, fmt.Errorf("put blob %s: %w", src, err)
	}
	return p, nil
}
