package files

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

func TestTarRoundTrip(t *testing.T) {
	c := serve(t, Options{})
	ctx := callCtx(t)
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "proj", "sub"), 0o755)
	os.WriteFile(filepath.Join(src, "proj", "a"), bytes.Repeat([]byte("a"), 700<<10), 0o640)
	os.WriteFile(filepath.Join(src, "proj", "sub", "b"), []byte("b"), 0o755)
	os.Symlink("sub/b", filepath.Join(src, "proj", "l"))

	rd, err := c.ReadTar(ctx, connect.NewRequest(&agentv1.ReadTarRequest{Path: filepath.Join(src, "proj")}))
	if err != nil {
		t.Fatal(err)
	}
	var archive bytes.Buffer
	for rd.Receive() {
		if len(rd.Msg().Data) > DefaultReadChunk {
			t.Fatalf("chunk of %d bytes", len(rd.Msg().Data))
		}
		archive.Write(rd.Msg().Data)
	}
	if err := rd.Err(); err != nil {
		t.Fatal(err)
	}

	dst := filepath.Join(t.TempDir(), "new", "place")
	w := c.WriteTar(ctx)
	w.Send(header(dst, 0, true))
	for b := archive.Bytes(); len(b) > 0; {
		n := min(len(b), 100<<10)
		w.Send(data(b[:n]))
		b = b[n:]
	}
	w.Send(commit())
	resp, err := w.CloseAndReceive()
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.Size != int64(archive.Len()) {
		t.Errorf("size %d, want %d", resp.Msg.Size, archive.Len())
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "proj", "a")); len(b) != 700<<10 {
		t.Errorf("a has %d bytes", len(b))
	}
	if fi, _ := os.Stat(filepath.Join(dst, "proj", "sub", "b")); fi == nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("b: %v", fi)
	}
	if l, _ := os.Readlink(filepath.Join(dst, "proj", "l")); l != "sub/b" {
		t.Errorf("l -> %q", l)
	}
}

func TestWriteTarRefusesEscapes(t *testing.T) {
	c := serve(t, Options{})
	ctx := context.Background()
	parent := t.TempDir()
	os.WriteFile(filepath.Join(parent, "secret"), []byte("untouched"), 0o644)
	var archive bytes.Buffer
	tw := tar.NewWriter(&archive)
	tw.WriteHeader(&tar.Header{Name: "../secret", Typeflag: tar.TypeReg, Mode: 0o644, Size: 5})
	tw.Write([]byte("pwned"))
	tw.Close()

	w := c.WriteTar(ctx)
	w.Send(header(filepath.Join(parent, "dst"), 0, true))
	w.Send(data(archive.Bytes()))
	w.Send(commit())
	if _, err := w.CloseAndReceive(); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("escaping archive: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(parent, "secret")); string(b) != "untouched" {
		t.Fatalf("secret = %q", b)
	}

	// A stream without a commit is refused.
	w = c.WriteTar(ctx)
	w.Send(header(filepath.Join(parent, "dst2"), 0, true))
	if _, err := w.CloseAndReceive(); connect.CodeOf(err) != connect.CodeAborted {
		t.Errorf("no commit: %v", err)
	}
}
