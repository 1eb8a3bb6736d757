package tarfs

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
)

type entry struct {
	name, link string
	typ        byte
	body       string
}

func archive(t testing.TB, entries ...entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		hdr := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: 0o644, Size: int64(len(e.body))}
		if e.typ == tar.TypeDir {
			hdr.Mode = 0o755
		}
		if e.typ != tar.TypeReg {
			hdr.Size = 0
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if e.typ == tar.TypeReg {
			tw.Write([]byte(e.body))
		}
	}
	tw.Close()
	return buf.Bytes()
}

// sandbox returns an open root inside a parent directory that also holds
// a file an escaping archive would want to overwrite.
func sandbox(t *testing.T) (*os.Root, string, string) {
	t.Helper()
	parent, err := os.MkdirTemp("", "tarfs-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(parent) })
	outside := filepath.Join(parent, "outside")
	os.Mkdir(outside, 0o755)
	os.WriteFile(filepath.Join(outside, "secret"), []byte("untouched"), 0o644)
	dst := filepath.Join(parent, "dst")
	os.Mkdir(dst, 0o755)
	root, err := os.OpenRoot(dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { root.Close() })
	return root, dst, outside
}

func TestPackExtractRoundTrip(t *testing.T) {
	src := t.TempDir()
	tree := filepath.Join(src, "proj")
	os.MkdirAll(filepath.Join(tree, "sub", "deep"), 0o755)
	os.WriteFile(filepath.Join(tree, "a.txt"), []byte("alpha"), 0o600)
	os.WriteFile(filepath.Join(tree, "sub", "deep", "b.sh"), []byte("#!/bin/sh\n"), 0o755)
	os.Symlink("sub/deep/b.sh", filepath.Join(tree, "link"))
	var buf bytes.Buffer
	if err := Pack(&buf, tree, nil); err != nil {
		t.Fatal(err)
	}
	root, dst, _ := sandbox(t)
	st, err := Extract(&buf, root, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if st.Entries != 6 || st.Bytes != int64(len("alpha")+len("#!/bin/sh\n")) {
		t.Errorf("stats = %+v", st)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "proj", "a.txt")); string(b) != "alpha" {
		t.Errorf("a.txt = %q", b)
	}
	if fi, _ := os.Stat(filepath.Join(dst, "proj", "sub", "deep", "b.sh")); fi == nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("b.sh mode = %v", fi)
	}
	if fi, _ := os.Stat(filepath.Join(dst, "proj", "a.txt")); fi == nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("a.txt mode = %v", fi)
	}
	if l, _ := os.Readlink(filepath.Join(dst, "proj", "link")); l != "sub/deep/b.sh" {
		t.Errorf("link = %q", l)
	}
}

func TestExtractRefusesEscapes(t *testing.T) {
	cases := map[string][]entry{
		"dot-dot":           {{name: "../outside/secret", typ: tar.TypeReg, body: "pwned"}},
		"nested dot-dot":    {{name: "a/../../outside/secret", typ: tar.TypeReg, body: "pwned"}},
		"absolute":          {{name: "/etc/passwd", typ: tar.TypeReg, body: "pwned"}},
		"through a symlink": {{name: "out", link: "../outside", typ: tar.TypeSymlink}, {name: "out/secret", typ: tar.TypeReg, body: "pwned"}},
		"absolute symlink":  {{name: "out", link: "/", typ: tar.TypeSymlink}, {name: "out/tmp/pwned", typ: tar.TypeReg, body: "pwned"}},
		"swapped parent":    {{name: "d", typ: tar.TypeDir}, {name: "d", link: "..", typ: tar.TypeSymlink}, {name: "d/outside/secret", typ: tar.TypeReg, body: "pwned"}},
		"hardlink out":      {{name: "h", link: "../outside/secret", typ: tar.TypeLink}},
	}
	for name, entries := range cases {
		t.Run(name, func(t *testing.T) {
			root, _, outside := sandbox(t)
			_, err := Extract(bytes.NewReader(archive(t, entries...)), root, Options{})
			if err == nil {
				t.Error("extracted an escaping archive without error")
			}
			if b, _ := os.ReadFile(filepath.Join(outside, "secret")); string(b) != "untouched" {
				t.Fatalf("outside file now %q", b)
			}
			if _, err := os.Stat("/tmp/pwned"); err == nil {
				t.Fatal("wrote /tmp/pwned")
			}
		})
	}
}

func TestPlantedSymlinkIsReplacedNotFollowed(t *testing.T) {
	root, dst, outside := sandbox(t)
	target := filepath.Join(outside, "secret")
	a := archive(t, entry{name: "f", link: target, typ: tar.TypeSymlink}, entry{name: "f", typ: tar.TypeReg, body: "inside"})
	if _, err := Extract(bytes.NewReader(a), root, Options{}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(target); string(b) != "untouched" {
		t.Fatalf("wrote through the symlink: %q", b)
	}
	if fi, _ := os.Lstat(filepath.Join(dst, "f")); fi == nil || !fi.Mode().IsRegular() {
		t.Errorf("f is %v, want a regular file", fi)
	}
}

func TestLimitsAndSpecialBits(t *testing.T) {
	root, dst, _ := sandbox(t)
	many := archive(t, entry{name: "a", typ: tar.TypeReg}, entry{name: "b", typ: tar.TypeReg}, entry{name: "c", typ: tar.TypeReg})
	if _, err := Extract(bytes.NewReader(many), root, Options{Limits: Limits{MaxEntries: 2}}); !errors.Is(err, ErrTooLarge) {
		t.Errorf("entry limit: %v", err)
	}
	big := archive(t, entry{name: "big", typ: tar.TypeReg, body: "0123456789"})
	if _, err := Extract(bytes.NewReader(big), root, Options{Limits: Limits{MaxBytes: 5}}); !errors.Is(err, ErrTooLarge) {
		t.Errorf("byte limit: %v", err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "suid", Typeflag: tar.TypeReg, Mode: 0o4755})
	tw.WriteHeader(&tar.Header{Name: "fifo", Typeflag: tar.TypeFifo, Mode: 0o644})
	tw.Close()
	var skipped []string
	if _, err := Extract(&buf, root, Options{Skipped: func(n, _ string) { skipped = append(skipped, n) }}); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(filepath.Join(dst, "suid")); fi == nil || fi.Mode()&fs.ModeSetuid != 0 || fi.Mode().Perm() != 0o755 {
		t.Errorf("suid file mode = %v", fi.Mode())
	}
	if len(skipped) != 1 || skipped[0] != "fifo" {
		t.Errorf("skipped = %v", skipped)
	}
}

// FuzzExtract extracts arbitrary bytes as an archive: whatever happens,
// nothing outside the destination may change.
func FuzzExtract(f *testing.F) {
	f.Add(archive(f, entry{name: "a", typ: tar.TypeReg, body: "x"}))
	f.Add(archive(f, entry{name: "../outside/secret", typ: tar.TypeReg, body: "pwned"}))
	f.Add(archive(f, entry{name: "l", link: "../outside", typ: tar.TypeSymlink}, entry{name: "l/secret", typ: tar.TypeReg, body: "p"}))
	f.Add(archive(f, entry{name: "d", typ: tar.TypeDir}, entry{name: "d", link: "..", typ: tar.TypeSymlink}, entry{name: "d/outside/x", typ: tar.TypeReg}))
	f.Fuzz(func(t *testing.T, b []byte) {
		root, _, outside := sandbox(t)
		Extract(bytes.NewReader(b), root, Options{Limits: Limits{MaxEntries: 64, MaxBytes: 1 << 20}})
		ents, _ := os.ReadDir(outside)
		if len(ents) != 1 {
			t.Fatalf("outside dir now has %d entries", len(ents))
		}
		if b, _ := os.ReadFile(filepath.Join(outside, "secret")); string(b) != "untouched" {
			t.Fatalf("outside file now %q", b)
		}
		parent := filepath.Dir(outside)
		if ents, _ := os.ReadDir(parent); len(ents) != 2 {
			t.Fatalf("parent dir now has %d entries", len(ents))
		}
	})
}

func TestExtractOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("chown needs root")
	}
	root, dst, _ := sandbox(t)
	a := archive(t, entry{name: "d", typ: tar.TypeDir}, entry{name: "d/f", typ: tar.TypeReg, body: "x"}, entry{name: "d/l", link: "f", typ: tar.TypeSymlink})
	if _, err := Extract(bytes.NewReader(a), root, Options{Owner: &Owner{UID: 65534, GID: 65534}}); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"d", "d/f", "d/l"} {
		fi, err := os.Lstat(filepath.Join(dst, n))
		if err != nil {
			t.Fatal(err)
		}
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != 65534 || st.Gid != 65534 {
			t.Errorf("%s owned by %d:%d", n, st.Uid, st.Gid)
		}
	}
}

// names lists the entries of an archive, "name -> link" for symlinks.
func names(t *testing.T, b []byte) []string {
	t.Helper()
	var out []string
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		hdr, err := tr.Next()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				t.Fatal(err)
			}
			return out
		}
		if hdr.Linkname != "" {
			out = append(out, hdr.Name+" -> "+hdr.Linkname)
		} else {
			out = append(out, hdr.Name)
		}
	}
}

func TestPackRootStaysInTheRoot(t *testing.T) {
	base := t.TempDir()
	dir := filepath.Join(base, "root")
	os.MkdirAll(filepath.Join(dir, "proj", "sub"), 0o755)
	os.MkdirAll(filepath.Join(dir, "proj", "secret"), 0o755)
	os.WriteFile(filepath.Join(dir, "proj", "a"), []byte("a"), 0o644)
	os.WriteFile(filepath.Join(dir, "proj", "secret", "k"), []byte("k"), 0o600)
	os.WriteFile(filepath.Join(base, "outside"), []byte("o"), 0o644)
	os.Symlink("../../outside", filepath.Join(dir, "proj", "out"))
	os.Symlink("../../..", filepath.Join(dir, "proj", "sub", "up"))
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()

	var buf bytes.Buffer
	err = PackRoot(&buf, root, "proj", PackOptions{Name: "p", Exclude: func(rel string) bool { return rel == "secret" }})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"p/", "p/a", "p/out -> ../../outside", "p/sub/", "p/sub/up -> ../../.."}
	if got := names(t, buf.Bytes()); !slices.Equal(got, want) {
		t.Errorf("entries %q, want %q", got, want)
	}

	// A file, named after its last element by default.
	buf.Reset()
	if err := PackRoot(&buf, root, "proj/a", PackOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := names(t, buf.Bytes()); !slices.Equal(got, []string{"a"}) {
		t.Errorf("entries %q", got)
	}
	// A path through a symlink that leads out is refused.
	if err := PackRoot(io.Discard, root, "proj/sub/up/outside", PackOptions{}); err == nil || errors.Is(err, fs.ErrNotExist) {
		t.Errorf("packing through a symlink out of the root: %v, want refused", err)
	}
}
