package audit

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/carrel-os/carrel/supervisor/cas"
)

const (
	blobDir = "blobs"
	// blobTemp names the temp files of blobs being written, in blobs/;
	// Open removes those a crash left behind.
	blobTemp = ".put-*"
)

// blobs is the blob store of the log in dir: blobs/sha256/<2 hex>/<62 hex>,
// read-only to the owner, written through temp files in blobs/.
func blobs(dir string) *cas.Store {
	return &cas.Store{
		Root:        filepath.Join(dir, blobDir, "sha256"),
		Layout:      cas.Fanout,
		TempDir:     filepath.Join(dir, blobDir),
		TempPattern: blobTemp,
		Perm:        0o400,
	}
}

// blobPath is where a valid digest's blob lives.
func blobPath(dir, digest string) string { return blobs(dir).Path(digest) }

// BlobPath returns where the log in dir keeps the blob digest.
func BlobPath(dir, digest string) (string, error) {
	if !cas.Valid(digest) {
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
	digest, _, err := blobs(dir).Put(r)
	if err != nil {
		return "", fmt.Errorf("put blob: %w", err)
	}
	return digest, nil
}

// CreateBlob starts a blob whose writer hashes the content itself and
// names it on Commit (cas.Writer): the content is hashed once. The blob is
// durable once Commit returns nil; until then nothing may reference it.
func (l *Log) CreateBlob() (*cas.Writer, error) {
	w, err := blobs(l.dir).Create()
	if err != nil {
		return nil, fmt.Errorf("create blob: %w", err)
	}
	return w, nil
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
func checkBlob(dir, digest string) error { return blobs(dir).Check(digest) }
