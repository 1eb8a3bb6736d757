package cas

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func newStore(t *testing.T, layout Layout, replace bool) *Store {
	t.Helper()
	dir := t.TempDir()
	root := filepath.Join(dir, "sha256")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	return &Store{Root: root, Layout: layout, TempDir: dir, TempPattern: ".put-*", Perm: 0o400, Replace: replace}
}

func digestOf(s string) string {
	sum := sha256.Sum256([]byte(s))
	return Prefix + hex.EncodeToString(sum[:])
}

// files lists every regular file below dir, relative to it.
func files(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			rel, _ := filepath.Rel(dir, p)
			out = append(out, rel)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestPutTwiceStoresOnce(t *testing.T) {
	hex := digestOf("hello")[len(Prefix):]
	for _, tc := range []struct {
		name   string
		layout Layout
		want   string // the blob's path below TempDir
	}{
		{"flat", Flat, "sha256/" + hex},
		{"fanout", Fanout, "sha256/" + hex[:2] + "/" + hex[2:]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t, tc.layout, false)
			for range 2 {
				d, n, err := s.Put(strings.NewReader("hello"))
				if err != nil {
					t.Fatal(err)
				}
				if d != digestOf("hello") || n != 5 {
					t.Fatalf("Put = %s, %d; want %s, 5", d, n, digestOf("hello"))
				}
			}
			if got := files(t, s.TempDir); len(got) != 1 || got[0] != tc.want {
				t.Fatalf("files %q, want only %q", got, tc.want)
			}
			fi, err := os.Stat(s.Path(digestOf("hello")))
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Perm() != 0o400 {
				t.Errorf("mode %v, want %v", fi.Mode().Perm(), os.FileMode(0o400))
			}
			if err := s.Check(digestOf("hello")); err != nil {
				t.Errorf("Check: %v", err)
			}
		})
	}
}

func TestValid(t *testing.T) {
	good := digestOf("x")
	for _, d := range []string{
		"",
		"sha256:",
		good[:len(good)-1],
		good + "0",
		strings.ToUpper(good),
		"sha512:" + good[len(Prefix):],
		"sha256:../../" + good[len(Prefix)+6:],
		good[:len(good)-1] + "g",
	} {
		if Valid(d) {
			t.Errorf("Valid(%q) = true", d)
		}
	}
	if !Valid(good) {
		t.Errorf("Valid(%q) = false", good)
	}
}

func corrupt(t *testing.T, path, content string) {
	t.Helper()
	if err := os.Chmod(path, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestCheckFindsCorruption(t *testing.T) {
	s := newStore(t, Fanout, false)
	d, _, err := s.Put(strings.NewReader("hello"))
	if err != nil {
		t.Fatal(err)
	}
	corrupt(t, s.Path(d), "HELLO")
	var bad *MismatchError
	if err := s.Check(d); !errors.As(err, &bad) || bad.Digest != d || bad.Got != digestOf("HELLO") {
		t.Fatalf("Check of a changed blob = %v, want a mismatch hashing to %s", err, digestOf("HELLO"))
	}
	if err := s.Check(digestOf("absent")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Check of a missing blob = %v, want fs.ErrNotExist", err)
	}
	// Without Replace the stored copy is kept, damaged or not.
	if _, _, err := s.Put(strings.NewReader("hello")); err != nil {
		t.Fatal(err)
	}
	if err := s.Check(d); !errors.As(err, &bad) {
		t.Errorf("Check after a second Put = %v, want the damage kept", err)
	}
}

func TestReplaceRepairs(t *testing.T) {
	s := newStore(t, Flat, true)
	d, _, err := s.Put(strings.NewReader("hello"))
	if err != nil {
		t.Fatal(err)
	}
	corrupt(t, s.Path(d), "HELLO")
	if _, _, err := s.Put(strings.NewReader("hello")); err != nil {
		t.Fatal(err)
	}
	if err := s.Check(d); err != nil {
		t.Errorf("Check after a repairing Put: %v", err)
	}
}

type failingReader struct{ err error }

func (r failingReader) Read([]byte) (int, error) { return 0, r.err }

func TestFailingReaderLeavesNothing(t *testing.T) {
	s := newStore(t, Fanout, false)
	boom := errors.New("boom")
	if _, _, err := s.Put(io.MultiReader(strings.NewReader("partial"), failingReader{boom})); !errors.Is(err, boom) {
		t.Fatalf("Put = %v, want %v", err, boom)
	}
	if got := files(t, s.TempDir); len(got) != 0 {
		t.Errorf("files left behind: %q", got)
	}
}

func TestStageDiscard(t *testing.T) {
	s := newStore(t, Flat, false)
	st, err := s.Stage(strings.NewReader("hello"))
	if err != nil {
		t.Fatal(err)
	}
	if st.Digest != digestOf("hello") || st.Size != 5 {
		t.Fatalf("staged %s, %d; want %s, 5", st.Digest, st.Size, digestOf("hello"))
	}
	if _, err := os.Stat(s.Path(st.Digest)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a staged blob is in place before Commit: %v", err)
	}
	if err := st.Discard(); err != nil {
		t.Fatal(err)
	}
	if err := st.Discard(); err != nil {
		t.Errorf("second Discard: %v", err)
	}
	if got := files(t, s.TempDir); len(got) != 0 {
		t.Errorf("files left behind: %q", got)
	}
}

// TestWriter: a blob written piece by piece lands under the digest its
// writer names, once; a bad name, or a Discard, leaves nothing behind.
func TestWriter(t *testing.T) {
	s := newStore(t, Fanout, false)
	write := func(parts ...string) *Writer {
		t.Helper()
		w, err := s.Create()
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range parts {
			if _, err := w.Write([]byte(p)); err != nil {
				t.Fatal(err)
			}
		}
		return w
	}
	d := digestOf("hello, world")
	if err := write("hello", ", ", "world").Commit(d); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(s.Path(d))
	if err != nil || string(got) != "hello, world" {
		t.Fatalf("blob %s = %q, %v", d, got, err)
	}
	if fi, err := os.Stat(s.Path(d)); err != nil || fi.Mode().Perm() != s.Perm {
		t.Errorf("blob mode %v, %v; want %v", fi.Mode().Perm(), err, s.Perm)
	}
	// The same content again is stored once.
	if err := write("hello, world").Commit(d); err != nil {
		t.Fatal(err)
	}
	if got := files(t, s.TempDir); len(got) != 1 {
		t.Errorf("files after a second commit: %q", got)
	}

	for _, bad := range []string{"", "sha256:" + strings.Repeat("A", 64), "md5:0"} {
		if err := write("x").Commit(bad); err == nil {
			t.Errorf("Commit(%q) succeeded", bad)
		}
	}
	dropped := write("dropped")
	if err := dropped.Discard(); err != nil {
		t.Fatal(err)
	}
	if err := dropped.Discard(); err != nil {
		t.Errorf("second Discard: %v", err)
	}
	if _, err := dropped.Write([]byte("more")); err == nil {
		t.Error("Write after Discard succeeded")
	}
	staged := write("sta", "ged")
	st, err := staged.Stage(digestOf("staged"))
	if err != nil || st.Size != 6 {
		t.Fatalf("Stage: %+v, %v", st, err)
	}
	// The writer is done with: it neither stages again nor takes the
	// staged file from under st.
	if _, err := staged.Stage(digestOf("staged")); err == nil {
		t.Error("a second Stage succeeded")
	}
	if err := staged.Discard(); err != nil {
		t.Fatal(err)
	}
	if err := st.Commit(); err != nil {
		t.Fatalf("Commit after the writer's Discard: %v", err)
	}
	if got := files(t, s.TempDir); len(got) != 2 {
		t.Errorf("files left behind: %q", got)
	}

	// The store takes the writer's word for the name; Check, which the
	// audit log's verify runs, is what finds a wrong one.
	wrong := digestOf("something else")
	if err := write("not that").Commit(wrong); err != nil {
		t.Fatal(err)
	}
	var mismatch *MismatchError
	if err := s.Check(wrong); !errors.As(err, &mismatch) || mismatch.Got != digestOf("not that") {
		t.Errorf("Check of a misnamed blob = %v", err)
	}
}
