package store

import (
	"errors"
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

// commit makes f durable with mode perm and renames it to dst, replacing any
// file there, then syncs dst's directory. f is closed; on error it is
// removed.
func commit(f *os.File, perm os.FileMode, dst string) (err error) {
	tmp := f.Name()
	defer func() {
		if err != nil {
			err = errors.Join(err, os.Remove(tmp))
		}
	}()
	if err := f.Chmod(perm); err != nil {
		f.Close()
		return fmt.Errorf("chmod %s: %w", tmp, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("sync %s: %w", tmp, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, dst); err != nil {
		return fmt.Errorf("rename into place: %w", err)
	}
	if err := atomicfile.SyncDir(filepath.Dir(dst)); err != nil {
		return err
	}
	return nil
}

// writeAtomic writes data to dst through a synced temp file and a rename, so
// readers see either the old content or the new, never a torn file.
func (s *Store) writeAtomic(dst string, data []byte, perm os.FileMode) error {
	f, err := s.createTemp(".write-*")
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return errors.Join(fmt.Errorf("write %s: %w", f.Name(), err), os.Remove(f.Name()))
	}
	return commit(f, perm, dst)
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
