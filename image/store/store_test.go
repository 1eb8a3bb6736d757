package store

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
)

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// putImage stores a kernel and initrd with the given contents and returns
// the manifest digest.
func putImage(t *testing.T, s *Store, kernel, initrd string) (string, *manifest.Manifest) {
	t.Helper()
	kp, err := s.PutBlob(writeFile(t, "vmlinuz", kernel))
	if err != nil {
		t.Fatal(err)
	}
	ip, err := s.PutBlob(writeFile(t, "initrd", initrd))
	if err != nil {
		t.Fatal(err)
	}
	m := &manifest.Manifest{
		SchemaVersion: manifest.SchemaVersion,
		Name:          "test",
		Arch:          "amd64",
		KernelVersion: "6.1.0-test",
		Kernel:        kp,
		Initrd:        ip,
		Cmdline:       "console=ttyS0",
	}
	d, err := s.PutManifest(m)
	if err != nil {
		t.Fatal(err)
	}
	return d, m
}

func open(t *testing.T) *Store {
	t.Helper()
	s, err := Open(filepath.Join(t.TempDir(), "images"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestPutResolveByTagAndDigest(t *testing.T) {
	s := open(t)
	d, m := putImage(t, s, "kernel bytes", "initrd bytes")
	if want, _ := m.Digest(); d != want {
		t.Fatalf("PutManifest digest %s, want %s", d, want)
	}
	if m.Kernel.Digest != manifest.DigestBytes([]byte("kernel bytes")) || m.Kernel.Size != 12 {
		t.Fatalf("kernel part %+v", m.Kernel)
	}
	if err := s.Tag("dev", d); err != nil {
		t.Fatal(err)
	}
	for _, ref := range []string{"dev", d} {
		r, err := s.Resolve(ref)
		if err != nil {
			t.Fatalf("Resolve(%q): %v", ref, err)
		}
		if r.Digest != d || !reflect.DeepEqual(r.Manifest, m) {
			t.Fatalf("Resolve(%q) = %+v", ref, r)
		}
		if b, err := os.ReadFile(r.KernelPath); err != nil || string(b) != "kernel bytes" {
			t.Fatalf("kernel file: %q, %v", b, err)
		}
		if b, err := os.ReadFile(r.InitrdPath); err != nil || string(b) != "initrd bytes" {
			t.Fatalf("initrd file: %q, %v", b, err)
		}
	}
	fi, err := os.Stat(filepath.Join(s.Dir(), blobDir, hexOf(m.Kernel.Digest)))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o444 {
		t.Errorf("blob mode %v, want 0444", fi.Mode().Perm())
	}
	if _, err := s.Verify("dev"); err != nil {
		t.Fatalf("Verify: %v", err)
	}
}

func TestIdempotentPuts(t *testing.T) {
	s := open(t)
	d1, _ := putImage(t, s, "k", "i")
	before, err := os.Stat(s.manifestPath(d1))
	if err != nil {
		t.Fatal(err)
	}
	d2, _ := putImage(t, s, "k", "i")
	if d1 != d2 {
		t.Fatalf("digests differ: %s %s", d1, d2)
	}
	after, err := os.Stat(s.manifestPath(d1))
	if err != nil {
		t.Fatal(err)
	}
	if !before.ModTime().Equal(after.ModTime()) {
		t.Errorf("re-putting a manifest changed its mtime")
	}
	tmp, err := os.ReadDir(filepath.Join(s.Dir(), tmpDir))
	if err != nil || len(tmp) != 0 {
		t.Fatalf("tmp dir not empty: %v %v", tmp, err)
	}
}

func TestResolveErrors(t *testing.T) {
	s := open(t)
	d, _ := putImage(t, s, "k", "i")
	unknown := manifest.DigestBytes([]byte("nothing"))
	for ref, want := range map[string]error{
		"nosuchtag":      ErrNotFound,
		unknown:          ErrNotFound,
		"":               ErrInvalidRef,
		"../etc/passwd":  ErrInvalidRef,
		"Upper":          ErrInvalidRef,
		"sha256:abc":     ErrInvalidRef,
		"sha256:" + "zz": ErrInvalidRef,
	} {
		if _, err := s.Resolve(ref); !errors.Is(err, want) {
			t.Errorf("Resolve(%q) = %v, want %v", ref, err, want)
		}
	}
	if _, err := s.Resolve(d); err != nil {
		t.Fatal(err)
	}
}

func TestTagErrors(t *testing.T) {
	s := open(t)
	d, _ := putImage(t, s, "k", "i")
	for _, name := range []string{"", "-x", ".x", "a/b", "A", "x y", strings.Repeat("a", 64), "..", "tag\n"} {
		if err := s.Tag(name, d); !errors.Is(err, ErrInvalidRef) {
			t.Errorf("Tag(%q) = %v, want ErrInvalidRef", name, err)
		}
	}
	if err := s.Tag(strings.Repeat("a", 63), d); err != nil {
		t.Errorf("63-char tag: %v", err)
	}
	if err := s.Tag("ok", "sha256:nothex"); !errors.Is(err, ErrInvalidRef) {
		t.Errorf("Tag with bad digest = %v", err)
	}
	if err := s.Tag("ok", manifest.DigestBytes([]byte("absent"))); !errors.Is(err, ErrNotFound) {
		t.Errorf("Tag to absent manifest = %v, want ErrNotFound", err)
	}
	if err := s.Untag("ok"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Untag absent = %v", err)
	}
}

func TestRetagMovesTag(t *testing.T) {
	s := open(t)
	d1, _ := putImage(t, s, "k1", "i1")
	d2, _ := putImage(t, s, "k2", "i2")
	if err := s.Tag("dev", d1); err != nil {
		t.Fatal(err)
	}
	if err := s.Tag("dev", d2); err != nil {
		t.Fatal(err)
	}
	r, err := s.Resolve("dev")
	if err != nil || r.Digest != d2 {
		t.Fatalf("Resolve(dev) = %v, %v; want %s", r, err, d2)
	}
	if err := s.Untag("dev"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Resolve("dev"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("after Untag: %v", err)
	}
	if _, err := s.Resolve(d1); err != nil {
		t.Fatalf("untagged image still resolvable by digest: %v", err)
	}
}

func TestPutManifestNeedsBlobs(t *testing.T) {
	s := open(t)
	m := &manifest.Manifest{
		SchemaVersion: 1, Name: "x", Arch: "amd64", KernelVersion: "6.1",
		Kernel: manifest.Part{Digest: manifest.DigestBytes([]byte("k")), Size: 1},
		Initrd: manifest.Part{Digest: manifest.DigestBytes([]byte("i")), Size: 1},
	}
	if _, err := s.PutManifest(m); !errors.Is(err, ErrNotFound) {
		t.Fatalf("PutManifest without blobs = %v, want ErrNotFound", err)
	}
	kp, err := s.PutBlob(writeFile(t, "k", "k"))
	if err != nil {
		t.Fatal(err)
	}
	ip, err := s.PutBlob(writeFile(t, "i", "i"))
	if err != nil {
		t.Fatal(err)
	}
	m.Kernel, m.Initrd = kp, ip
	m.Initrd.Size = 2
	if _, err := s.PutManifest(m); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("PutManifest with wrong size = %v, want ErrCorrupt", err)
	}
	m.Name = "Bad Name"
	if _, err := s.PutManifest(m); !errors.Is(err, manifest.ErrInvalid) {
		t.Fatalf("PutManifest invalid = %v", err)
	}
}

func TestPutBlobRejects(t *testing.T) {
	s := open(t)
	if _, err := s.PutBlob(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Error("PutBlob of missing file succeeded")
	}
	if _, err := s.PutBlob(t.TempDir()); err == nil {
		t.Error("PutBlob of a directory succeeded")
	}
	if _, err := s.PutBlob(writeFile(t, "empty", "")); err == nil {
		t.Error("PutBlob of empty file succeeded")
	}
}

// corrupt replaces a read-only blob's content.
func corrupt(t *testing.T, path, content string) {
	t.Helper()
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCorruptionDetected(t *testing.T) {
	s := open(t)
	d, m := putImage(t, s, "kernel", "initrd")
	if err := s.Tag("dev", d); err != nil {
		t.Fatal(err)
	}

	// Same size, different content: only Verify sees it.
	corrupt(t, s.blobPath(m.Kernel.Digest), "KERNEL")
	if _, err := s.Resolve("dev"); err != nil {
		t.Fatalf("Resolve: %v", err)
	}
	if _, err := s.Verify("dev"); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Verify of altered blob = %v, want ErrCorrupt", err)
	}
	// Putting the right content again repairs it.
	if _, err := s.PutBlob(writeFile(t, "k", "kernel")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Verify("dev"); err != nil {
		t.Fatalf("Verify after repair: %v", err)
	}

	// Size mismatch: Resolve sees it.
	corrupt(t, s.blobPath(m.Initrd.Digest), "short")
	if _, err := s.Resolve("dev"); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Resolve with truncated initrd = %v, want ErrCorrupt", err)
	}
	// Missing blob is corruption, not an unknown image.
	if err := os.Remove(s.blobPath(m.Initrd.Digest)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Resolve(d); !errors.Is(err, ErrCorrupt) || errors.Is(err, ErrNotFound) {
		t.Fatalf("Resolve with missing initrd = %v, want ErrCorrupt only", err)
	}
	entries, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries[0].Error == "" || entries[0].Manifest != nil {
		t.Fatalf("List of damaged store = %+v", entries)
	}
}

func TestCorruptManifestAndTag(t *testing.T) {
	s := open(t)
	d, _ := putImage(t, s, "k", "i")
	if err := s.Tag("dev", d); err != nil {
		t.Fatal(err)
	}
	mp := s.manifestPath(d)
	if err := os.Chmod(mp, 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(mp)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(mp, append(b, ' '), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Resolve("dev"); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Resolve of altered manifest = %v, want ErrCorrupt", err)
	}
	if err := os.WriteFile(filepath.Join(s.Dir(), tagDir, "bad"), []byte("garbage\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Resolve("bad"); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Resolve of garbage tag = %v, want ErrCorrupt", err)
	}
}

func TestList(t *testing.T) {
	s := open(t)
	if entries, err := s.List(); err != nil || len(entries) != 0 {
		t.Fatalf("empty store: %v %v", entries, err)
	}
	d1, m1 := putImage(t, s, "k1", "i1")
	d2, _ := putImage(t, s, "k2", "i22")
	for _, tag := range []string{"b", "a"} {
		if err := s.Tag(tag, d1); err != nil {
			t.Fatal(err)
		}
	}
	entries, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 2 {
		t.Fatalf("got %d entries", len(entries))
	}
	byDigest := map[string]Entry{}
	for _, e := range entries {
		byDigest[e.Digest] = e
	}
	e1, e2 := byDigest[d1], byDigest[d2]
	if strings.Join(e1.Tags, ",") != "a,b" || len(e2.Tags) != 0 {
		t.Errorf("tags: %v %v", e1.Tags, e2.Tags)
	}
	if e1.Size != 4 || e2.Size != 5 || e1.Created.IsZero() || !reflect.DeepEqual(e1.Manifest, m1) || e1.Error != "" {
		t.Errorf("entries: %+v %+v", e1, e2)
	}
}

func TestOpenRemovesStaleTemps(t *testing.T) {
	s := open(t)
	stale := filepath.Join(s.Dir(), tmpDir, ".blob-stale")
	fresh := filepath.Join(s.Dir(), tmpDir, ".blob-fresh")
	for _, p := range []string{stale, fresh} {
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	old := mustTime(t, "2000-01-01T00:00:00Z")
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(s.Dir()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("stale temp survived: %v", err)
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Errorf("fresh temp removed: %v", err)
	}
}

func mustTime(t *testing.T, s string) time.Time {
	t.Helper()
	tm, err := time.Parse(time.RFC3339, s)
	if err != nil {
		t.Fatal(err)
	}
	return tm
}

func TestWorkspaceTemplatePart(t *testing.T) {
	s := open(t)
	_, m := putImage(t, s, "k", "i")
	wp, err := s.PutBlob(writeFile(t, "workspace.img", "ext4 template"))
	if err != nil {
		t.Fatal(err)
	}
	m.Workspace = &wp
	d, err := s.PutManifest(m)
	if err != nil {
		t.Fatal(err)
	}
	r, err := s.Verify(d)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(r.WorkspacePath); err != nil || string(b) != "ext4 template" {
		t.Errorf("workspace path %q: %q, %v", r.WorkspacePath, b, err)
	}
	entries, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Digest == d && e.Size != 1+1+int64(len("ext4 template")) {
			t.Errorf("listed size %d", e.Size)
		}
	}
	// A template that is gone is damage; a manifest naming an unknown one
	// is refused.
	if err := os.Remove(r.WorkspacePath); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Resolve(d); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "workspace") {
		t.Errorf("resolve without its template: %v", err)
	}
	m.Name = "other"
	if _, err := s.PutManifest(m); !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "workspace") {
		t.Errorf("put manifest without its template: %v", err)
	}
}
