// Package atomicfile replaces files so that readers, and a crash, see the
// old content or the new, never a torn file.
package atomicfile

import (
	"bufio"
	"io"
	"os"
	"path/filepath"
)

// Write replaces path with what fill writes, with mode perm. The content
// goes to a temporary file in path's directory, named after path with a
// leading dot, which is synced and renamed over path; the directory is
// then synced, so the new file is durable when Write returns nil. If fill
// or any step before the rename fails, path is untouched and the temporary
// file is removed.
func Write(path string, perm os.FileMode, fill func(w io.Writer) error) error {
	return WriteVia(filepath.Dir(path), path, perm, fill)
}

// WriteVia is Write with the temporary file in tmpDir, which must be on
// path's file system: for a directory whose every entry readers take for
// a finished file (a store's tags, say).
func WriteVia(tmpDir, path string, perm os.FileMode, fill func(w io.Writer) error) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(tmpDir, "."+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op once renamed
	bw := bufio.NewWriter(f)
	err = fill(bw)
	if err == nil {
		err = bw.Flush()
	}
	if err == nil {
		err = f.Chmod(perm)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return SyncDir(dir)
}

// WriteFile is Write with data as the content.
func WriteFile(path string, data []byte, perm os.FileMode) error {
	return Write(path, perm, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// SyncDir makes dir's entries durable: a file created, renamed or removed
// in it before SyncDir returns nil survives a crash.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}
