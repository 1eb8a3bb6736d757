package store

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// createTemp makes a file in the store's tmp directory, on the same file
// system as its final home, so that commit can rename it into place.
func (s *Store) createTemp(pattern string) (*os.File, error) {
	f, err := os.CreateTemp(filepath.Join(s.dir, tmpDir), pattern)
	if err != nil {
		return nil, fmt.Errorf("create temp file: %w", err)
	}
	return f, nil
}

// writeAtomic writes data to dst through a synced temp file in the
// store's tmp directory and a rename, so readers see either the old
// content or the new, never a torn file.
func (s *Store) writeAtomic(dst string, data []byte, perm os.FileMode) error {
	return atomicfile.WriteVia(filepath.Join(s.dir, tmpDir), dst, perm, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// readLimited reads at most limit bytes of path; a longer file is an error.
func readLimited(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s exceeds %d bytes", path, limit)
	}
	return b, nil
}
