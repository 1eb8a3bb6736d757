package atomicfile

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(path, []byte("new"), 0o640); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil || string(b) != "new" {
		t.Fatalf("content %q, %v; want %q", b, err, "new")
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o640 {
		t.Errorf("mode %v, want %v", fi.Mode().Perm(), os.FileMode(0o640))
	}
	assertOnly(t, dir, "f")
}

func TestWriteFillError(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	err := Write(path, 0o644, func(w io.Writer) error {
		if _, err := w.Write([]byte("partial")); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("Write: %v, want %v", err, boom)
	}
	b, err := os.ReadFile(path)
	if err != nil || string(b) != "old" {
		t.Fatalf("content %q, %v; want the old file intact", b, err)
	}
	assertOnly(t, dir, "f")
}

func TestWriteMissingDir(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "missing", "f")
	if err := WriteFile(path, []byte("x"), 0o644); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("WriteFile into a missing directory: %v, want ErrNotExist", err)
	}
	assertOnly(t, dir)
	if err := SyncDir(filepath.Dir(path)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("SyncDir of a missing directory: %v, want ErrNotExist", err)
	}
}

// assertOnly fails unless dir holds exactly names: no temporary file left.
func assertOnly(t *testing.T, dir string, names ...string) {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, de := range des {
		got = append(got, de.Name())
	}
	if !slices.Equal(got, names) {
		t.Fatalf("%s holds %q, want %q", dir, got, names)
	}
}

// TestWriteVia: the temporary file lives in tmpDir, never beside path,
// and is gone afterwards, whether the write worked or not.
func TestWriteVia(t *testing.T) {
	dir, tmp := t.TempDir(), t.TempDir()
	path := filepath.Join(dir, "tag")
	var seen []string
	fill := func(fail error) func(io.Writer) error {
		return func(w io.Writer) error {
			for _, d := range []string{dir, tmp} {
				es, _ := os.ReadDir(d)
				for _, e := range es {
					seen = append(seen, filepath.Join(d, e.Name()))
				}
			}
			w.Write([]byte("v1"))
			return fail
		}
	}
	if err := WriteVia(tmp, path, 0o644, fill(nil)); err != nil {
		t.Fatal(err)
	}
	if len(seen) != 1 || filepath.Dir(seen[0]) != tmp {
		t.Errorf("while writing: %v, want one temp file in %s", seen, tmp)
	}
	if err := WriteVia(tmp, path, 0o644, fill(errors.New("boom"))); err == nil {
		t.Fatal("a failed fill reported success")
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != "v1" {
		t.Errorf("after a failed write: %q %v", b, err)
	}
	if es, _ := os.ReadDir(tmp); len(es) != 0 {
		t.Errorf("temp files left: %v", es)
	}
}
