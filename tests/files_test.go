package tests

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestCopyFiles copies files both ways with `carrel cp` and checks them
// byte for byte, through the real relay and the real agent.
func TestCopyFiles(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "files")
	dir := t.TempDir()

	blob := make([]byte, 32<<20)
	rand.Read(blob)
	local := filepath.Join(dir, "blob")
	if err := os.WriteFile(local, blob, 0o640); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(blob)
	want := hex.EncodeToString(sum[:])

	d.Must("cp", local, "files:/workspace/blob")
	if out := d.Must("exec", "files", "--", "sha256sum", "/workspace/blob"); !strings.HasPrefix(out, want) {
		t.Fatalf("guest sha256 %q, want %s", out, want)
	}
	if out := d.Must("exec", "files", "--", "stat", "-c", "%a", "/workspace/blob"); out != "640\n" {
		t.Errorf("mode in the guest = %q, want 640", out)
	}

	back := filepath.Join(dir, "back")
	os.Mkdir(back, 0o755)
	d.Must("cp", "files:/workspace/blob", back)
	got, err := os.ReadFile(filepath.Join(back, "blob"))
	if err != nil || !bytes.Equal(got, blob) {
		t.Fatalf("copied back %d bytes, err %v; want the %d bytes sent", len(got), err, len(blob))
	}

	// Into an existing guest directory, and through stdin and stdout.
	d.Must("cp", local, "files:/tmp/")
	if out := d.Must("exec", "files", "--", "sha256sum", "/tmp/blob"); !strings.HasPrefix(out, want) {
		t.Errorf("cp into a directory: %q", out)
	}
	if r := d.CarrelStdin("hello\n", "cp", "-", "files:/tmp/hello"); r.Code != 0 {
		t.Fatalf("cp from stdin: %+v", r)
	}
	if out := d.Must("cp", "files:/tmp/hello", "-"); out != "hello\n" {
		t.Errorf("cp to stdout = %q", out)
	}

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"cp", "files:/workspace/nope", filepath.Join(dir, "x")}, "no such file"},
		{[]string{"cp", local, "files:/workspace/no/such/dir/x"}, "no such file"},
		{[]string{"cp", local, "files:/srv/x"}, "carrel.fs.default_deny"},
		{[]string{"cp", "files:/dev/null", dir}, "not a regular file"},
		{[]string{"cp", local, filepath.Join(dir, "y")}, "one side must be"},
		{[]string{"cp", local, "ghost:/tmp/x"}, "ghost"},
	} {
		r := d.Carrel(c.args...)
		if r.Code == 0 || !strings.Contains(r.Stderr, c.want) {
			t.Errorf("carrel %v: exit %d, stderr %q; want an error with %q", c.args, r.Code, r.Stderr, c.want)
		}
	}
	// A failed download leaves nothing half-written on the host.
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.Contains(e.Name(), "carrel-cp") || e.Name() == "x" {
			t.Errorf("left behind on the host: %s", e.Name())
		}
	}
	d.Must("vm", "rm", "--force", "files")
}

// TestCopyDirectories copies trees both ways as tar streams, and shows that
// an archive from the guest cannot write outside the destination.
func TestCopyDirectories(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "trees")
	dir := t.TempDir()
	proj := filepath.Join(dir, "proj")
	os.MkdirAll(filepath.Join(proj, "src", "deep"), 0o755)
	os.WriteFile(filepath.Join(proj, "README"), []byte("readme\n"), 0o644)
	os.WriteFile(filepath.Join(proj, "src", "deep", "run.sh"), []byte("#!/bin/sh\necho ran\n"), 0o755)
	os.Symlink("src/deep/run.sh", filepath.Join(proj, "run"))

	d.Must("cp", proj, "trees:/workspace/")
	if out := d.Must("exec", "trees", "--", "sh", "-c", "cat /workspace/proj/README; /workspace/proj/run; readlink /workspace/proj/run"); out != "readme\nran\nsrc/deep/run.sh\n" {
		t.Errorf("tree in the guest: %q", out)
	}

	// The guest changes the tree, including a symlink that points out and
	// an absolute one, then the tree comes back.
	d.Must("exec", "trees", "--", "sh", "-c", "echo new > /workspace/proj/src/new.txt; ln -s /etc/passwd /workspace/proj/abs; ln -s ../../../.. /workspace/proj/up")
	back := filepath.Join(dir, "back")
	d.Must("cp", "trees:/workspace/proj", back)
	if b, _ := os.ReadFile(filepath.Join(back, "proj", "src", "new.txt")); string(b) != "new\n" {
		t.Errorf("new.txt = %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(back, "proj", "src", "deep", "run.sh")); !strings.Contains(string(b), "echo ran") {
		t.Errorf("run.sh = %q", b)
	}
	if fi, _ := os.Stat(filepath.Join(back, "proj", "src", "deep", "run.sh")); fi == nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("run.sh mode %v", fi)
	}
	// Links are kept as links; extraction never followed them.
	if l, _ := os.Readlink(filepath.Join(back, "proj", "up")); l != "../../../.." {
		t.Errorf("up -> %q", l)
	}

	// A guest tree with a link to a host path comes back as that link,
	// never as what it points to. Archives crafted to climb out (.., /,
	// writes through such links, swapped links) are refused by tarfs,
	// which its unit tests and fuzz target show.
	d.Must("exec", "trees", "--", "sh", "-c", "mkdir -p /workspace/evil && ln -s "+dir+" /workspace/evil/out")
	d.Must("cp", "trees:/workspace/evil", filepath.Join(dir, "x"))
	if l, _ := os.Readlink(filepath.Join(dir, "x", "evil", "out")); l != dir {
		t.Errorf("link out = %q", l)
	}
	d.Must("vm", "rm", "--force", "trees")
}
