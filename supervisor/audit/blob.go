package audit

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

const (
	blobDir      = "blobs"
	digestPrefix = "sha256:"
)

// validDigest: "sha256:" and 64 lower-case hex digits.
func validDigest(d string) bool {
	if len(d) != len(digestPrefix)+64 || d[:len(digestPrefix)] != digestPrefix {
		return false
	}
	for _, c := range []byte(d[len(digestPrefix):]) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// blobPath is where a valid digest's blob lives:
// blobs/sha256/<2 hex>/<62 hex>.
func blobPath(dir, digest string) string {
	h := digest[len(digestPrefix):]
	return filepath.Join(dir, blobDir, "sha256", h[:2], h[2:])
}

// BlobPath returns where the log in dir keeps the blob digest.
func BlobPath(dir, digest string) (string, error) {
	if !validDigest(digest) {
		return "", fmt.Errorf("%w: blob reference %q: want sha256:<64 hex>", ErrInvalid, digest)
	}
	return blobPath(dir, digest), nil
}

// PutBlob stores what r yields and returns its digest, "sha256:<hex>".
// The blob is durable (file and directory fsync'd) when PutBlob returns,
// so a record may then reference it. Storing the same content twice
// stores it once. A failure here does not make the log unavailable, but
// the caller must treat it as a failure to record.
func (l *Log) PutBlob(r io.Reader) (string, error) {
	return putBlob(l.dir, r)
}

func putBlob(dir string, r io.Reader) (string, error) {
	root := filepath.Join(dir, blobDir)
	f, err := os.CreateTemp(root, ".put-*")
	if err != nil {
		return "", fmt.Errorf("put blob: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op once renamed
	h := sha256.New()
	if _, err := io.Copy(io.MultiWriter(f, h), r); err != nil {
		f.Close()
		return "", fmt.Errorf("put blob: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return "", fmt.Errorf("put blob: sync: %w", err)
	}
	if err := f.Close(); err != nil {
		return "", fmt.Errorf("put blob: %w", err)
	}
	digest := digestPrefix + hex.EncodeToString(h.Sum(nil))
	path := blobPath(dir, digest)
	if _, err := os.Stat(path); err == nil {
		return digest, nil // content-addressed: already stored
	}
	shard := filepath.Dir(path)
	if _, err := os.Stat(shard); errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(shard, 0o700); err != nil {
			return "", fmt.Errorf("put blob: %w", err)
		}
		if err := atomicfile.SyncDir(filepath.Dir(shard)); err != nil {
			return "", fmt.Errorf("put blob: sync: %w", err)
		}
	}
	if err := os.Chmod(tmp, 0o400); err != nil {
		return "", fmt.Errorf("put blob: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return "", fmt.Errorf("put blob: %w", err)
	}
	if err := atomicfile.SyncDir(shard); err != nil {
		return "", fmt.Errorf("put blob: sync: %w", err)
	}
	return digest, nil
}

// OpenBlob opens a stored blob for reading.
func (l *Log) OpenBlob(digest string) (*os.File, error) {
	p, err := BlobPath(l.dir, digest)
	if err != nil {
		return nil, err
	}
	return os.Open(p)
}

// checkBlob hashes a stored blob; it returns nil when the content matches
// its name.
func checkBlob(dir, digest string) error {
	f, err := os.Open(blobPath(dir, digest))
	if err != nil {
		return err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return err
	}
	if got := digestPrefix + hex.EncodeToString(h.Sum(nil)); got != digest {
		return fmt.Errorf("content hashes to %s", got)
	}
	return nil
}
