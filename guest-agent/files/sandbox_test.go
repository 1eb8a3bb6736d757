//go:build linux

package files

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
	"github.com/carrel-os/carrel/guest-agent/watch"
)

// box is a sandboxed file service over temporary directories:
//
//	rw/         read-write root; rw/proj/.keys is a secret directory
//	rw2/        another read-write root
//	ro/         read-only root, with ro/data and the secret ro/shadow
//	out/        no root; out/f holds "outside"
type box struct {
	rw, rw2, ro, out string
	keys, shadow     string
	c                agentv1connect.FileServiceClient
}

func newBox(t *testing.T) *box {
	t.Helper()
	base := t.TempDir()
	b := &box{
		rw: filepath.Join(base, "rw"), rw2: filepath.Join(base, "rw2"),
		ro: filepath.Join(base, "ro"), out: filepath.Join(base, "out"),
	}
	b.keys = filepath.Join(b.rw, "proj", ".keys")
	b.shadow = filepath.Join(b.ro, "shadow")
	mustWrite(t, filepath.Join(b.rw, "a.txt"), "a")
	mustWrite(t, filepath.Join(b.keys, "id"), "private")
	mustWrite(t, filepath.Join(b.rw, "proj", "main.go"), "package main")
	mustWrite(t, filepath.Join(b.rw2, "b.txt"), "b")
	mustWrite(t, filepath.Join(b.ro, "data"), "data")
	mustWrite(t, b.shadow, "hashes")
	mustWrite(t, filepath.Join(b.out, "f"), "outside")
	g := &sandbox.Guard{}
	if _, err := g.Set(sandbox.Policy{
		ReadWrite: []string{b.rw, b.rw2},
		ReadOnly:  []string{b.ro},
		Denied:    []string{b.keys, b.shadow},
	}); err != nil {
		t.Fatal(err)
	}
	b.c = serve(t, Options{Sandbox: g})
	return b
}

// wantRefused fails unless err is the sandbox refusing an operation on
// path, with why in the message.
func wantRefused(t *testing.T, err error, path, why string) {
	t.Helper()
	wantErr(t, err, connect.CodePermissionDenied, path)
	if !strings.Contains(err.Error(), "refused by the guest sandbox") || !strings.Contains(err.Error(), why) {
		t.Fatalf("err %v, want the guest sandbox refusing it: %s", err, why)
	}
}

func (b *box) stat(t *testing.T, p string) error {
	_, err := b.c.Stat(callCtx(t), connect.NewRequest(&agentv1.StatRequest{Path: p}))
	return err
}

func (b *box) read(t *testing.T, p string) (string, error) {
	chunks, err := read(callCtx(t), b.c, &agentv1.ReadRequest{Path: p})
	return string(bytes.Join(chunks, nil)), err
}

func (b *box) write(t *testing.T, p, content string) error {
	_, err := write(callCtx(t), b.c, header(p, 0, true), data([]byte(content)))
	return err
}

func (b *box) mkdir(t *testing.T, p string) error {
	_, err := b.c.MakeDir(callCtx(t), connect.NewRequest(&agentv1.MakeDirRequest{Path: p, Parents: true}))
	return err
}

func (b *box) remove(t *testing.T, p string, recursive bool) error {
	_, err := b.c.Remove(callCtx(t), connect.NewRequest(&agentv1.RemoveRequest{Path: p, Recursive: recursive}))
	return err
}

func (b *box) rename(t *testing.T, from, to string) error {
	_, err := b.c.Rename(callCtx(t), connect.NewRequest(&agentv1.RenameRequest{From: from, To: to}))
	return err
}

func (b *box) chmod(t *testing.T, p string) error {
	_, err := b.c.Chmod(callCtx(t), connect.NewRequest(&agentv1.ChmodRequest{Path: p, Mode: 0o600}))
	return err
}

func (b *box) chown(t *testing.T, p string) error {
	_, err := b.c.Chown(callCtx(t), connect.NewRequest(&agentv1.ChownRequest{Path: p, Uid: -1, Gid: int64(os.Getgid())}))
	return err
}

func (b *box) list(t *testing.T, p string) ([]string, error) {
	msgs, err := list(callCtx(t), b.c, &agentv1.ListRequest{Path: p, Recursive: true})
	var paths []string
	for _, m := range msgs {
		for _, e := range m.Entries {
			paths = append(paths, e.Path)
		}
	}
	return paths, err
}

func (b *box) readTar(t *testing.T, p string) ([]string, []byte, error) {
	rd, err := b.c.ReadTar(callCtx(t), connect.NewRequest(&agentv1.ReadTarRequest{Path: p}))
	if err != nil {
		return nil, nil, err
	}
	var archive bytes.Buffer
	for rd.Receive() {
		archive.Write(rd.Msg().Data)
	}
	if err := rd.Err(); err != nil {
		return nil, nil, err
	}
	var names []string
	tr := tar.NewReader(bytes.NewReader(archive.Bytes()))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
	}
	return names, archive.Bytes(), nil
}

func (b *box) writeTar(t *testing.T, p string, archive []byte) error {
	w := b.c.WriteTar(callCtx(t))
	w.Send(header(p, 0, true))
	w.Send(data(archive))
	w.Send(commit())
	_, err := w.CloseAndReceive()
	return err
}

func (b *box) watch(t *testing.T, p string) (*connect.ServerStreamForClient[agentv1.WatchResponse], error) {
	s, err := b.c.Watch(callCtx(t), connect.NewRequest(&agentv1.WatchRequest{Path: p, Recursive: true}))
	if err != nil {
		return nil, err
	}
	if !s.Receive() {
		s.Close()
		return nil, s.Err()
	}
	return s, nil
}

func TestSandboxAllowsWorkInsideTheRoots(t *testing.T) {
	b := newBox(t)
	f := filepath.Join(b.rw, "new", "deep", "f.txt")
	if err := b.write(t, f, "hello"); err != nil {
		t.Fatal(err)
	}
	if got, err := b.read(t, f); err != nil || got != "hello" {
		t.Fatalf("read back %q, %v", got, err)
	}
	if len(tempFiles(t, filepath.Dir(f))) != 0 {
		t.Error("a temporary file was left")
	}
	for _, err := range []error{
		b.stat(t, f), b.stat(t, b.rw), b.chmod(t, f), b.chown(t, f),
		b.mkdir(t, filepath.Join(b.rw, "m", "n")),
		b.rename(t, f, filepath.Join(b.rw, "renamed.txt")),
		b.remove(t, filepath.Join(b.rw, "renamed.txt"), false),
		b.remove(t, filepath.Join(b.rw, "new"), true),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	if modeOf(t, filepath.Join(b.rw, "a.txt")) != 0o644 {
		t.Fatal("setup")
	}
	// A relative symlink that stays inside its root is fine.
	if err := os.Symlink("a.txt", filepath.Join(b.rw, "in")); err != nil {
		t.Fatal(err)
	}
	if got, err := b.read(t, filepath.Join(b.rw, "in")); err != nil || got != "a" {
		t.Fatalf("read through an inner symlink: %q, %v", got, err)
	}
	if fi := stat(t, b.c, filepath.Join(b.rw, "in")); fi.LinkTarget != "a.txt" {
		t.Fatalf("stat of the link: %v", fi)
	}
	// Reads under the read-only root.
	if got, err := b.read(t, filepath.Join(b.ro, "data")); err != nil || got != "data" {
		t.Fatalf("read under the read-only root: %q, %v", got, err)
	}
	if paths, err := b.list(t, b.ro); err != nil || !slices.Equal(paths, []string{filepath.Join(b.ro, "data")}) {
		t.Fatalf("list of the read-only root: %q, %v (the secret must be left out)", paths, err)
	}
	// A tree out and back in.
	names, archive, err := b.readTar(t, filepath.Join(b.rw, "m"))
	if err != nil || !slices.Equal(names, []string{"m/", "m/n/"}) {
		t.Fatalf("read tar: %q, %v", names, err)
	}
	if err := b.writeTar(t, filepath.Join(b.rw2, "copy"), archive); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(b.rw2, "copy", "m", "n")); err != nil || !fi.IsDir() {
		t.Fatalf("extracted: %v", err)
	}
}

func TestSandboxRefusesPathsOutsideTheRoots(t *testing.T) {
	b := newBox(t)
	outside := filepath.Join(b.out, "f")
	const why = "outside every root"
	_, err := b.read(t, outside)
	wantRefused(t, err, outside, why)
	wantRefused(t, b.stat(t, outside), outside, why)
	wantRefused(t, b.write(t, outside, "x"), outside, why)
	wantRefused(t, b.remove(t, outside, false), outside, why)
	wantRefused(t, b.chmod(t, outside), outside, why)
	_, err = b.list(t, b.out)
	wantRefused(t, err, b.out, why)
	_, err = b.watch(t, b.out)
	wantRefused(t, err, b.out, why)
	// Whole components: rwx is not under rw.
	wantRefused(t, b.write(t, b.rw+"x/f", "x"), b.rw+"x/f", why)
	wantRefused(t, b.stat(t, "/"), "/", why)
	if mustRead(t, outside) != "outside" {
		t.Fatal("the file outside changed")
	}
}

func TestSandboxReadOnlyRoot(t *testing.T) {
	b := newBox(t)
	data := filepath.Join(b.ro, "data")
	const why = "read-only root " // names the root
	wantRefused(t, b.write(t, data, "x"), data, why)
	wantRefused(t, b.write(t, filepath.Join(b.ro, "new"), "x"), filepath.Join(b.ro, "new"), why)
	wantRefused(t, b.mkdir(t, filepath.Join(b.ro, "d")), filepath.Join(b.ro, "d"), why)
	wantRefused(t, b.remove(t, data, false), data, why)
	wantRefused(t, b.chmod(t, data), data, why)
	wantRefused(t, b.chown(t, data), data, why)
	wantRefused(t, b.rename(t, data, filepath.Join(b.ro, "moved")), data, why)
	wantRefused(t, b.rename(t, filepath.Join(b.rw, "a.txt"), filepath.Join(b.ro, "a.txt")), filepath.Join(b.ro, "a.txt"), why)
	wantRefused(t, b.writeTar(t, filepath.Join(b.ro, "x"), nil), filepath.Join(b.ro, "x"), why)
	if mustRead(t, data) != "data" || modeOf(t, data) != 0o644 {
		t.Fatal("the read-only file changed")
	}
	if _, err := os.Stat(filepath.Join(b.ro, "new")); !os.IsNotExist(err) {
		t.Fatal("a file was made under the read-only root")
	}
}

func TestSandboxSymlinksCannotLeaveTheRoot(t *testing.T) {
	b := newBox(t)
	if err := os.Mkdir(filepath.Join(b.rw, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{
		"rel": "../out/f",          // climbs out
		"abs": b.out + "/f",        // absolute
		"dir": "../out",            // a directory outside
		"in2": "../rw2/b.txt",      // into another root: still out of this one
		"ind": "sub/../../out/f",   // climbs out through a directory
		"hop": "../ro/../out/f",    // out through another root
		"lop": "../rw/../out/f",    // out and back in name only
		"up":  "../../../../../..", // far out
	} {
		if err := os.Symlink(target, filepath.Join(b.rw, name)); err != nil {
			t.Fatal(err)
		}
	}
	const why = "leads out of its root"
	for _, name := range []string{"rel", "abs", "in2", "ind", "hop", "lop"} {
		p := filepath.Join(b.rw, name)
		got, err := b.read(t, p)
		if err == nil {
			t.Fatalf("read %s through a symlink out of the root: %q", p, got)
		}
		wantRefused(t, err, p, "")
		wantRefused(t, b.chmod(t, p), p, "")
	}
	dir := filepath.Join(b.rw, "dir")
	_, err := b.read(t, dir+"/f")
	wantRefused(t, err, dir+"/f", why)
	wantRefused(t, b.stat(t, dir+"/f"), dir+"/f", why)
	wantRefused(t, b.write(t, dir+"/new", "x"), dir+"/new", why)
	wantRefused(t, b.mkdir(t, dir+"/d"), dir+"/d", why)
	wantRefused(t, b.remove(t, dir+"/f", false), dir+"/f", why)
	wantRefused(t, b.rename(t, dir+"/f", b.rw+"/stolen"), dir+"/f", why)
	_, err = b.list(t, dir)
	wantRefused(t, err, dir, why)
	_, err = b.list(t, filepath.Join(b.rw, "up"))
	wantRefused(t, err, filepath.Join(b.rw, "up"), why)
	_, err = b.watch(t, dir)
	wantRefused(t, err, dir, why)
	wantRefused(t, b.writeTar(t, dir, nil), dir, why)

	// Write replaces a symlink rather than following it.
	if err := b.write(t, filepath.Join(b.rw, "rel"), "new"); err != nil {
		t.Fatal(err)
	}
	if mustRead(t, filepath.Join(b.out, "f")) != "outside" {
		t.Fatal("a write went through the symlink")
	}
	if _, err := os.Stat(filepath.Join(b.out, "new")); !os.IsNotExist(err) {
		t.Fatal("a file was made outside the root")
	}
	// Stat and read tar see the link itself.
	if err := b.stat(t, dir); err != nil {
		t.Fatal(err)
	}
	if names, _, err := b.readTar(t, dir); err != nil || !slices.Equal(names, []string{"dir"}) {
		t.Fatalf("read tar of a symlink: %q, %v", names, err)
	}
	// A listing shows links; it never follows them.
	paths, err := b.list(t, b.rw)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range paths {
		if strings.HasPrefix(p, dir+"/") {
			t.Fatalf("the listing went through a symlink: %s", p)
		}
	}
}

func TestSandboxRefusesSecretPaths(t *testing.T) {
	b := newBox(t)
	id := filepath.Join(b.keys, "id")
	const why = "is a secret path"
	_, err := b.read(t, id)
	wantRefused(t, err, id, why)
	wantRefused(t, b.stat(t, b.keys), b.keys, why)
	wantRefused(t, b.write(t, id, "x"), id, why)
	wantRefused(t, b.remove(t, id, false), id, why)
	wantRefused(t, b.rename(t, id, filepath.Join(b.rw, "id")), id, why)
	_, err = b.list(t, b.keys)
	wantRefused(t, err, b.keys, why)
	_, err = b.read(t, b.shadow)
	wantRefused(t, err, b.shadow, why)

	// Through a symlink inside the root, as the kernel resolves it.
	alias := filepath.Join(b.rw, "alias")
	if err := os.Symlink("proj/.keys", alias); err != nil {
		t.Fatal(err)
	}
	_, err = b.read(t, alias+"/id")
	wantRefused(t, err, alias+"/id", "resolves to "+id)
	wantRefused(t, b.write(t, alias+"/id", "x"), alias+"/id", "resolves to "+id)
	wantRefused(t, b.chmod(t, alias), alias, "resolves to "+b.keys)
	_, err = b.list(t, alias)
	wantRefused(t, err, alias, "resolves to")

	// Operations on a whole tree that holds a secret.
	proj := filepath.Join(b.rw, "proj")
	wantRefused(t, b.remove(t, proj, true), proj, "the secret path "+b.keys+" lies beneath it")
	wantRefused(t, b.rename(t, proj, filepath.Join(b.rw, "p2")), proj, "lies beneath it")
	wantRefused(t, b.writeTar(t, proj, nil), proj, "lies beneath it")
	wantRefused(t, b.remove(t, b.rw, true), b.rw, "is a root of the sandbox")

	// Walks leave secrets out.
	paths, err := b.list(t, b.rw)
	if err != nil {
		t.Fatal(err)
	}
	if slices.ContainsFunc(paths, func(p string) bool { return strings.Contains(p, ".keys") }) {
		t.Fatalf("the listing shows the secret: %q", paths)
	}
	if !slices.Contains(paths, filepath.Join(proj, "main.go")) {
		t.Fatalf("the listing lacks the rest: %q", paths)
	}
	names, _, err := b.readTar(t, proj)
	if err != nil || !slices.Equal(names, []string{"proj/", "proj/main.go"}) {
		t.Fatalf("read tar: %q, %v; want the secret left out", names, err)
	}
	if mustRead(t, id) != "private" {
		t.Fatal("the secret changed")
	}
}

func TestSandboxRenameStaysInOneRoot(t *testing.T) {
	b := newBox(t)
	from, to := filepath.Join(b.rw, "a.txt"), filepath.Join(b.rw2, "a.txt")
	wantRefused(t, b.rename(t, from, to), from+" to "+to, "different roots")
	wantRefused(t, b.rename(t, b.rw, filepath.Join(b.rw2, "x")), b.rw, "")
	if mustRead(t, from) != "a" {
		t.Fatal("the file moved")
	}
	if err := b.rename(t, from, filepath.Join(b.rw, "sub", "..", "b.txt")); err != nil {
		t.Fatal(err)
	}
}

func TestSandboxWatchLeavesSecretsOut(t *testing.T) {
	b := newBox(t)
	s, err := b.watch(t, b.rw)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// A full batch is sent at once: this fills at least one with secrets
	// alone, which must not be sent at all, before the visible file's.
	for i := range watch.DefaultMaxBatch {
		mustWrite(t, filepath.Join(b.keys, fmt.Sprintf("new%d", i)), "x")
	}
	mustWrite(t, filepath.Join(b.rw, "visible"), "x")
	for s.Receive() {
		m := s.Msg()
		if len(m.Events) == 0 && m.Dropped == 0 && m.UnwatchedDirs == 0 {
			t.Fatal("an empty message: a batch of secrets alone was sent")
		}
		for _, e := range m.Events {
			if strings.Contains(e.Path, ".keys") {
				t.Fatalf("an event for a secret path: %v", e)
			}
			if e.Path == filepath.Join(b.rw, "visible") {
				return
			}
		}
	}
	t.Fatalf("no event for the visible file: %v", s.Err())
}

func TestSandboxTakesEffectForTheNextCall(t *testing.T) {
	g := &sandbox.Guard{}
	c := serve(t, Options{Sandbox: g})
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	mustWrite(t, p, "x")
	if _, err := c.Stat(callCtx(t), connect.NewRequest(&agentv1.StatRequest{Path: p})); err != nil {
		t.Fatalf("before any sandbox: %v", err)
	}
	if _, err := g.Set(sandbox.Policy{ReadOnly: []string{filepath.Join(dir, "other")}}); err != nil {
		t.Fatal(err)
	}
	_, err := c.Stat(callCtx(t), connect.NewRequest(&agentv1.StatRequest{Path: p}))
	wantRefused(t, err, p, "outside every root")
}
