//go:build linux

package files

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// serve serves a Service with opts on a unix socket, the way carrel-agent
// does, and returns a client for it.
func serve(t *testing.T, opts Options) agentv1connect.FileServiceClient {
	t.Helper()
	return agentv1connect.NewFileServiceClient(serveHTTP(t, opts), protocol.BaseURL, protocol.ClientOptions()...)
}

// serveHTTP serves a Service with opts on a unix socket and returns an
// HTTP client for it.
func serveHTTP(t *testing.T, opts Options) *http.Client {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "files.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewFileServiceHandler(New(opts), protocol.HandlerOptions()...))
	srv := protocol.NewHTTPServer(mux)
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	hc, tr := protocol.NewHTTPClient(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	})
	t.Cleanup(tr.CloseIdleConnections)
	return hc
}

func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// wantErr fails unless err has code and its message contains msg.
func wantErr(t *testing.T, err error, code connect.Code, msg string) {
	t.Helper()
	if connect.CodeOf(err) != code || !strings.Contains(err.Error(), msg) {
		t.Fatalf("err %v, want %v containing %q", err, code, msg)
	}
}

func mustWrite(t *testing.T, p, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustRead(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func stat(t *testing.T, c agentv1connect.FileServiceClient, p string) *agentv1.FileInfo {
	t.Helper()
	resp, err := c.Stat(callCtx(t), connect.NewRequest(&agentv1.StatRequest{Path: p}))
	if err != nil {
		t.Fatal(err)
	}
	return resp.Msg.Info
}

func header(p string, mode uint32, parents bool) *agentv1.WriteRequest {
	return &agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Header{Header: &agentv1.WriteHeader{Path: p, Mode: mode, MakeParents: parents}}}
}

func data(b []byte) *agentv1.WriteRequest {
	return &agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Data{Data: b}}
}

func commit() *agentv1.WriteRequest {
	return &agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Commit{Commit: &agentv1.WriteCommit{}}}
}

// write sends msgs, then a commit, as one Write call.
func write(ctx context.Context, c agentv1connect.FileServiceClient, msgs ...*agentv1.WriteRequest) (*agentv1.WriteResponse, error) {
	return writeRaw(ctx, c, append(msgs, commit())...)
}

// writeRaw sends exactly msgs as one Write call.
func writeRaw(ctx context.Context, c agentv1connect.FileServiceClient, msgs ...*agentv1.WriteRequest) (*agentv1.WriteResponse, error) {
	stream := c.Write(ctx)
	for _, m := range msgs {
		if err := stream.Send(m); err != nil {
			break // the response says why
		}
	}
	resp, err := stream.CloseAndReceive()
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// read returns the chunks of one Read call.
func read(ctx context.Context, c agentv1connect.FileServiceClient, req *agentv1.ReadRequest) ([][]byte, error) {
	stream, err := c.Read(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	var chunks [][]byte
	for stream.Receive() {
		chunks = append(chunks, stream.Msg().Data)
	}
	return chunks, stream.Err()
}

// list returns the messages of one List call.
func list(ctx context.Context, c agentv1connect.FileServiceClient, req *agentv1.ListRequest) ([]*agentv1.ListResponse, error) {
	stream, err := c.List(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	var msgs []*agentv1.ListResponse
	for stream.Receive() {
		msgs = append(msgs, stream.Msg())
	}
	return msgs, stream.Err()
}

// tempFiles returns Write's leftover temporary files in dir.
func tempFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, tempPattern))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestStat(t *testing.T) {
	c := serve(t, Options{})
	dir := t.TempDir()
	file := filepath.Join(dir, "f")
	mustWrite(t, file, "hello")
	if err := unix.Chmod(file, 0o4750); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Lstat(file)
	got := stat(t, c, dir+"/sub/../f")
	want := &agentv1.FileInfo{
		Path: file, Type: agentv1.FileType_FILE_TYPE_REGULAR, Mode: 0o4750, Size: 5,
		MtimeUnixNano: fi.ModTime().UnixNano(), Uid: uint32(os.Getuid()), Gid: uint32(os.Getgid()),
	}
	if got.String() != want.String() {
		t.Fatalf("stat\n got %v\nwant %v", got, want)
	}

	sticky := filepath.Join(dir, "tmp")
	if err := os.Mkdir(sticky, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Chmod(sticky, 0o1777); err != nil {
		t.Fatal(err)
	}
	if got := stat(t, c, sticky); got.Type != agentv1.FileType_FILE_TYPE_DIRECTORY || got.Mode != 0o1777 {
		t.Fatalf("dir: %v", got)
	}

	// A symlink is described, not followed, dangling or not.
	for _, target := range []string{"f", "missing"} {
		link := filepath.Join(dir, "link-"+target)
		if err := os.Symlink(target, link); err != nil {
			t.Fatal(err)
		}
		got := stat(t, c, link)
		if got.Type != agentv1.FileType_FILE_TYPE_SYMLINK || got.LinkTarget != target || got.Size != int64(len(target)) {
			t.Fatalf("symlink: %v", got)
		}
	}

	fifo := filepath.Join(dir, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	if got := stat(t, c, fifo); got.Type != agentv1.FileType_FILE_TYPE_OTHER {
		t.Fatalf("fifo: %v", got)
	}

	_, err := c.Stat(callCtx(t), connect.NewRequest(&agentv1.StatRequest{Path: dir + "/missing"}))
	wantErr(t, err, connect.CodeNotFound, "stat "+dir+"/missing: no such file or directory")
	_, err = c.Stat(callCtx(t), connect.NewRequest(&agentv1.StatRequest{Path: file + "/x"}))
	wantErr(t, err, connect.CodeFailedPrecondition, "not a directory")
}

func TestRejectsBadPaths(t *testing.T) {
	c := serve(t, Options{})
	ctx := callCtx(t)
	for _, p := range []string{"", "rel/path", "./x", "/a\x00b", "/" + strings.Repeat("a", unix.PathMax)} {
		calls := map[string]func() error{
			"stat": func() error {
				_, err := c.Stat(ctx, connect.NewRequest(&agentv1.StatRequest{Path: p}))
				return err
			},
			"list": func() error {
				_, err := list(ctx, c, &agentv1.ListRequest{Path: p})
				return err
			},
			"read": func() error {
				_, err := read(ctx, c, &agentv1.ReadRequest{Path: p})
				return err
			},
			"write": func() error {
				_, err := write(ctx, c, header(p, 0, false), data([]byte("x")))
				return err
			},
			"mkdir": func() error {
				_, err := c.MakeDir(ctx, connect.NewRequest(&agentv1.MakeDirRequest{Path: p}))
				return err
			},
			"remove": func() error {
				_, err := c.Remove(ctx, connect.NewRequest(&agentv1.RemoveRequest{Path: p}))
				return err
			},
			"rename from": func() error {
				_, err := c.Rename(ctx, connect.NewRequest(&agentv1.RenameRequest{From: p, To: "/tmp/x"}))
				return err
			},
			"rename to": func() error {
				_, err := c.Rename(ctx, connect.NewRequest(&agentv1.RenameRequest{From: "/tmp/x", To: p}))
				return err
			},
			"chmod": func() error {
				_, err := c.Chmod(ctx, connect.NewRequest(&agentv1.ChmodRequest{Path: p}))
				return err
			},
			"chown": func() error {
				_, err := c.Chown(ctx, connect.NewRequest(&agentv1.ChownRequest{Path: p, Uid: -1, Gid: -1}))
				return err
			},
		}
		for name, call := range calls {
			if err := call(); connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Errorf("%s %.20q: %v, want invalid_argument", name, p, err)
			}
		}
	}
}

// tree makes:
//
//	a/a1  a/deep/d1  b  link -> a  z/
func tree(t *testing.T) string {
	dir := t.TempDir()
	mustWrite(t, dir+"/a/a1", "1")
	mustWrite(t, dir+"/a/deep/d1", "2")
	mustWrite(t, dir+"/b", "3")
	if err := os.Symlink("a", dir+"/link"); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(dir+"/z", 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// names flattens msgs into paths relative to root, and reports whether only
// the last message (if any) says truncated.
func names(t *testing.T, root string, msgs []*agentv1.ListResponse) ([]string, bool) {
	t.Helper()
	var out []string
	truncated := false
	for i, m := range msgs {
		if m.Truncated && i != len(msgs)-1 {
			t.Fatalf("message %d of %d says truncated", i, len(msgs))
		}
		truncated = m.Truncated
		for _, e := range m.Entries {
			out = append(out, strings.TrimPrefix(e.Path, root+"/"))
		}
	}
	return out, truncated
}

func TestList(t *testing.T) {
	c := serve(t, Options{ListBatch: 2})
	dir := tree(t)
	all := []string{"a", "a/a1", "a/deep", "a/deep/d1", "b", "link", "z"}
	for _, tc := range []struct {
		name          string
		req           *agentv1.ListRequest
		want          []string
		wantTruncated bool
	}{
		{"flat", &agentv1.ListRequest{}, []string{"a", "b", "link", "z"}, false},
		{"flat ignores depth", &agentv1.ListRequest{MaxDepth: 5}, []string{"a", "b", "link", "z"}, false},
		{"recursive", &agentv1.ListRequest{Recursive: true}, all, false},
		{"depth 2", &agentv1.ListRequest{Recursive: true, MaxDepth: 2}, []string{"a", "a/a1", "a/deep", "b", "link", "z"}, true},
		{"depth 3", &agentv1.ListRequest{Recursive: true, MaxDepth: 3}, all, false},
		{"depth 1", &agentv1.ListRequest{Recursive: true, MaxDepth: 1}, []string{"a", "b", "link", "z"}, true},
		{"3 entries", &agentv1.ListRequest{Recursive: true, MaxEntries: 3}, all[:3], true},
		{"exactly all", &agentv1.ListRequest{Recursive: true, MaxEntries: 7}, all, false},
		{"flat 2 entries", &agentv1.ListRequest{MaxEntries: 2}, []string{"a", "b"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.req.Path = dir
			msgs, err := list(callCtx(t), c, tc.req)
			if err != nil {
				t.Fatal(err)
			}
			got, truncated := names(t, dir, msgs)
			if !slices.Equal(got, tc.want) || truncated != tc.wantTruncated {
				t.Fatalf("got %v truncated %v, want %v truncated %v", got, truncated, tc.want, tc.wantTruncated)
			}
			for _, m := range msgs {
				if len(m.Entries) > 2 {
					t.Fatalf("batch of %d, want at most 2", len(m.Entries))
				}
			}
		})
	}

	// Entries are described like Stat; the symlinked directory is listed,
	// not descended.
	msgs, err := list(callCtx(t), c, &agentv1.ListRequest{Path: dir, Recursive: true})
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*agentv1.FileInfo{}
	for _, m := range msgs {
		for _, e := range m.Entries {
			byName[e.Path] = e
		}
	}
	if e := byName[dir+"/link"]; e.Type != agentv1.FileType_FILE_TYPE_SYMLINK || e.LinkTarget != "a" {
		t.Fatalf("link: %v", e)
	}
	if e := byName[dir+"/a/a1"]; e.Type != agentv1.FileType_FILE_TYPE_REGULAR || e.Size != 1 || e.Mode != 0o644 {
		t.Fatalf("a1: %v", e)
	}
	if e := byName[dir+"/z"]; e.Type != agentv1.FileType_FILE_TYPE_DIRECTORY {
		t.Fatalf("z: %v", e)
	}

	// A symlink at the root itself is followed.
	msgs, err = list(callCtx(t), c, &agentv1.ListRequest{Path: dir + "/link", Recursive: true})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := names(t, dir+"/link", msgs); !slices.Equal(got, []string{"a1", "deep", "deep/d1"}) {
		t.Fatalf("through link: %v", got)
	}

	// An empty directory gives no messages.
	if msgs, err := list(callCtx(t), c, &agentv1.ListRequest{Path: dir + "/z"}); err != nil || len(msgs) != 0 {
		t.Fatalf("empty: %v %v", msgs, err)
	}

	_, err = list(callCtx(t), c, &agentv1.ListRequest{Path: dir + "/b"})
	wantErr(t, err, connect.CodeFailedPrecondition, "list "+dir+"/b: not a directory")
	_, err = list(callCtx(t), c, &agentv1.ListRequest{Path: dir + "/nope"})
	wantErr(t, err, connect.CodeNotFound, "list "+dir+"/nope: no such file or directory")
}

func TestListAgentLimits(t *testing.T) {
	c := serve(t, Options{MaxListEntries: 4, MaxDepth: 2})
	dir := tree(t)
	// The request cannot raise the agent's limits.
	msgs, err := list(callCtx(t), c, &agentv1.ListRequest{Path: dir, Recursive: true, MaxEntries: 100, MaxDepth: 100})
	if err != nil {
		t.Fatal(err)
	}
	if got, truncated := names(t, dir, msgs); !slices.Equal(got, []string{"a", "a/a1", "a/deep", "b"}) || !truncated {
		t.Fatalf("got %v truncated %v", got, truncated)
	}
	// A batch full exactly at the limit is followed by an empty, truncated one.
	c = serve(t, Options{MaxListEntries: 4, ListBatch: 2})
	msgs, err = list(callCtx(t), c, &agentv1.ListRequest{Path: dir, Recursive: true})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(msgs); n != 3 || len(msgs[2].Entries) != 0 || !msgs[2].Truncated {
		t.Fatalf("messages %v", msgs)
	}
}

func TestListDepthLimitOnDeepTree(t *testing.T) {
	c := serve(t, Options{})
	dir := t.TempDir()
	deep := dir + strings.Repeat("/d", DefaultMaxDepth+5)
	if err := os.MkdirAll(deep, 0o755); err != nil {
		t.Fatal(err)
	}
	msgs, err := list(callCtx(t), c, &agentv1.ListRequest{Path: dir, Recursive: true})
	if err != nil {
		t.Fatal(err)
	}
	got, truncated := names(t, dir, msgs)
	if len(got) != DefaultMaxDepth || !truncated {
		t.Fatalf("%d entries truncated %v, want %d truncated", len(got), truncated, DefaultMaxDepth)
	}
}

func TestRead(t *testing.T) {
	c := serve(t, Options{ReadChunk: 4})
	dir := t.TempDir()
	file := dir + "/f"
	mustWrite(t, file, "0123456789")
	if err := os.Symlink("f", dir+"/link"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path        string
		off, length int64
		want        string
	}{
		{file, 0, 0, "0123456789"},
		{file, 3, 4, "3456"},
		{file, 8, 0, "89"},
		{file, 8, 100, "89"},
		{file, 20, 0, ""},
		{dir + "/link", 0, 0, "0123456789"},
	} {
		chunks, err := read(callCtx(t), c, &agentv1.ReadRequest{Path: tc.path, Offset: tc.off, Length: tc.length})
		if err != nil {
			t.Fatal(err)
		}
		if got := string(bytes.Join(chunks, nil)); got != tc.want {
			t.Errorf("read %d+%d: %q, want %q", tc.off, tc.length, got, tc.want)
		}
		for _, ch := range chunks {
			if len(ch) == 0 || len(ch) > 4 {
				t.Errorf("chunk of %d bytes", len(ch))
			}
		}
	}

	if err := unix.Mkfifo(dir+"/fifo", 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := read(callCtx(t), c, &agentv1.ReadRequest{Path: dir + "/fifo"})
	wantErr(t, err, connect.CodeFailedPrecondition, "read "+dir+"/fifo: not a regular file")
	_, err = read(callCtx(t), c, &agentv1.ReadRequest{Path: dir})
	wantErr(t, err, connect.CodeFailedPrecondition, "read "+dir+": is a directory")
	_, err = read(callCtx(t), c, &agentv1.ReadRequest{Path: dir + "/nope"})
	wantErr(t, err, connect.CodeNotFound, "read "+dir+"/nope: no such file or directory")
	_, err = read(callCtx(t), c, &agentv1.ReadRequest{Path: file, Offset: -1})
	wantErr(t, err, connect.CodeInvalidArgument, "negative")
	_, err = read(callCtx(t), c, &agentv1.ReadRequest{Path: file, Length: -1})
	wantErr(t, err, connect.CodeInvalidArgument, "negative")
}

// TestWriteReadRoundTrip streams 64 MiB each way in messages as large as
// the protocol allows, never holding the whole file.
func TestWriteReadRoundTrip(t *testing.T) {
	const size = 64 << 20
	c := serve(t, Options{})
	dir := t.TempDir()
	file := dir + "/big"
	ctx := callCtx(t)

	gen := rand.NewChaCha8([32]byte{1})
	buf := make([]byte, protocol.MaxMessageBytes-16)
	sum := sha256.New()
	stream := c.Write(ctx)
	if err := stream.Send(header(file, 0, false)); err != nil {
		t.Fatal(err)
	}
	for left := size; left > 0; {
		chunk := buf[:min(left, len(buf))]
		gen.Read(chunk)
		sum.Write(chunk)
		if err := stream.Send(data(chunk)); err != nil {
			t.Fatal(err)
		}
		left -= len(chunk)
	}
	if err := stream.Send(commit()); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.CloseAndReceive()
	if err != nil {
		t.Fatal(err)
	}
	want := "sha256:" + hex.EncodeToString(sum.Sum(nil))
	if resp.Msg.Size != size || resp.Msg.Digest != "" {
		t.Fatalf("write: %v, want size %d and no digest (carreld computes it)", resp.Msg, size)
	}

	rs, err := c.Read(ctx, connect.NewRequest(&agentv1.ReadRequest{Path: file}))
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	sum.Reset()
	var n, msgs int
	for rs.Receive() {
		sum.Write(rs.Msg().Data)
		n += len(rs.Msg().Data)
		msgs++
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
	if got := "sha256:" + hex.EncodeToString(sum.Sum(nil)); n != size || got != want {
		t.Fatalf("read %d bytes %s, want %d %s", n, got, size, want)
	}
	if want := (size + DefaultReadChunk - 1) / DefaultReadChunk; msgs != want {
		t.Fatalf("%d messages, want %d", msgs, want)
	}
	if left := tempFiles(t, dir); len(left) != 0 {
		t.Fatalf("temporary files left: %v", left)
	}
}

func TestWriteCancelledKeepsOldFile(t *testing.T) {
	c := serve(t, Options{})
	dir := t.TempDir()
	file := dir + "/f"
	mustWrite(t, file, "old")

	ctx, cancel := context.WithCancel(callCtx(t))
	defer cancel()
	stream := c.Write(ctx)
	if err := stream.Send(header(file, 0, false)); err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(data(bytes.Repeat([]byte("new"), 100000))); err != nil {
		t.Fatal(err)
	}
	// Cancel once the server is halfway: its temporary file holds data.
	waitFor(t, "a temporary file with data", func() bool {
		for _, p := range tempFiles(t, dir) {
			if fi, err := os.Stat(p); err == nil && fi.Size() > 0 {
				return true
			}
		}
		return false
	})
	cancel()
	// Closing the send side right after cancel could race the transport's
	// reset and end the stream cleanly: a clean end is a complete file.
	waitFor(t, "no temporary file", func() bool { return len(tempFiles(t, dir)) == 0 })
	if _, err := stream.CloseAndReceive(); connect.CodeOf(err) != connect.CodeCanceled {
		t.Fatalf("err %v, want canceled", err)
	}
	if got := mustRead(t, file); got != "old" {
		t.Fatalf("file now %q", got)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func modeOf(t *testing.T, p string) uint32 {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Mode & modeBits
}

func TestWrite(t *testing.T) {
	c := serve(t, Options{})
	ctx := callCtx(t)
	dir := t.TempDir()

	// New files: 0644 unless the header says otherwise.
	resp, err := write(ctx, c, header(dir+"/new", 0, false), data([]byte("ab")), data([]byte("c")))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Size != 3 {
		t.Fatalf("response %v", resp)
	}
	if got, m := mustRead(t, dir+"/new"), modeOf(t, dir+"/new"); got != "abc" || m != 0o644 {
		t.Fatalf("new: %q %#o", got, m)
	}
	if _, err := write(ctx, c, header(dir+"/exec", 0o4750, false)); err != nil {
		t.Fatal(err)
	}
	if got, m := mustRead(t, dir+"/exec"), modeOf(t, dir+"/exec"); got != "" || m != 0o4750 {
		t.Fatalf("empty with mode: %q %#o", got, m)
	}

	// An existing file keeps its mode unless the header sets one.
	mustWrite(t, dir+"/old", "old")
	if err := os.Chmod(dir+"/old", 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := write(ctx, c, header(dir+"/old", 0, false), data([]byte("v2"))); err != nil {
		t.Fatal(err)
	}
	if got, m := mustRead(t, dir+"/old"), modeOf(t, dir+"/old"); got != "v2" || m != 0o600 {
		t.Fatalf("kept mode: %q %#o", got, m)
	}
	if _, err := write(ctx, c, header(dir+"/old", 0o755, false), data([]byte("v3"))); err != nil {
		t.Fatal(err)
	}
	if got, m := mustRead(t, dir+"/old"), modeOf(t, dir+"/old"); got != "v3" || m != 0o755 {
		t.Fatalf("set mode: %q %#o", got, m)
	}

	// A symlink at the target is replaced; what it pointed to is not touched.
	mustWrite(t, dir+"/target", "target")
	if err := os.Symlink("target", dir+"/link"); err != nil {
		t.Fatal(err)
	}
	if _, err := write(ctx, c, header(dir+"/link", 0, false), data([]byte("x"))); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Lstat(dir + "/link"); !fi.Mode().IsRegular() || mustRead(t, dir+"/target") != "target" {
		t.Fatalf("link now %v, target %q", fi.Mode(), mustRead(t, dir+"/target"))
	}

	// Parents.
	if _, err := write(ctx, c, header(dir+"/p/q/r", 0, true), data([]byte("deep"))); err != nil {
		t.Fatal(err)
	}
	if got := mustRead(t, dir+"/p/q/r"); got != "deep" {
		t.Fatalf("deep: %q", got)
	}
	_, err = write(ctx, c, header(dir+"/s/t", 0, false), data([]byte("x")))
	wantErr(t, err, connect.CodeNotFound, "write "+dir+"/s/t: no such file or directory")

	// Bad streams change nothing.
	_, err = write(ctx, c, header(dir+"/p", 0, false), data([]byte("x")))
	wantErr(t, err, connect.CodeFailedPrecondition, "write "+dir+"/p: is a directory")
	_, err = write(ctx, c, data([]byte("x")))
	wantErr(t, err, connect.CodeInvalidArgument, "not a header")
	_, err = writeRaw(ctx, c)
	wantErr(t, err, connect.CodeInvalidArgument, "no header")
	_, err = write(ctx, c, header(dir+"/old", 0, false), data([]byte("x")), header(dir+"/old", 0, false))
	wantErr(t, err, connect.CodeInvalidArgument, "neither data nor the commit")
	// A client that closes its side without a commit gave up: nothing is
	// written.
	_, err = writeRaw(ctx, c, header(dir+"/old", 0, false), data([]byte("half")))
	wantErr(t, err, connect.CodeAborted, "without a commit")
	_, err = writeRaw(ctx, c, header(dir+"/old", 0, false), data([]byte("x")), commit(), data([]byte("y")))
	wantErr(t, err, connect.CodeInvalidArgument, "after the commit")
	_, err = write(ctx, c, header(dir+"/old", 0o10000, false))
	wantErr(t, err, connect.CodeInvalidArgument, "mode")
	if got := mustRead(t, dir+"/old"); got != "v3" {
		t.Fatalf("old now %q", got)
	}
	if left := tempFiles(t, dir); len(left) != 0 {
		t.Fatalf("temporary files left: %v", left)
	}

}

func TestWriteRefusesOversizedMessage(t *testing.T) {
	// A client that does not cap what it sends.
	c := agentv1connect.NewFileServiceClient(serveHTTP(t, Options{}), protocol.BaseURL, connect.WithGRPC())
	dir := t.TempDir()
	_, err := write(callCtx(t), c, header(dir+"/huge", 0, false), data(make([]byte, protocol.MaxMessageBytes)))
	wantErr(t, err, connect.CodeResourceExhausted, "larger than configured max")
	if _, err := os.Stat(dir + "/huge"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("huge: %v", err)
	}
	waitFor(t, "no temporary file", func() bool { return len(tempFiles(t, dir)) == 0 })
}

func TestWriteKeepsOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to give a file another owner")
	}
	c := serve(t, Options{})
	file := t.TempDir() + "/f"
	mustWrite(t, file, "old")
	if err := os.Chown(file, 1234, 5678); err != nil {
		t.Fatal(err)
	}
	if _, err := write(callCtx(t), c, header(file, 0, false), data([]byte("new"))); err != nil {
		t.Fatal(err)
	}
	if got := stat(t, c, file); got.Uid != 1234 || got.Gid != 5678 {
		t.Fatalf("owner %d:%d", got.Uid, got.Gid)
	}
}

func TestMakeDir(t *testing.T) {
	c := serve(t, Options{})
	ctx := callCtx(t)
	dir := t.TempDir()
	mkdir := func(p string, parents bool, mode uint32) error {
		_, err := c.MakeDir(ctx, connect.NewRequest(&agentv1.MakeDirRequest{Path: p, Parents: parents, Mode: mode}))
		return err
	}
	if err := mkdir(dir+"/d", false, 0); err != nil {
		t.Fatal(err)
	}
	// Exactly the mode asked for: the umask does not apply.
	if err := mkdir(dir+"/shared", false, 0o1777); err != nil {
		t.Fatal(err)
	}
	if err := mkdir(dir+"/x/y/z", true, 0o700); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]uint32{"/d": 0o755, "/shared": 0o1777, "/x": 0o755, "/x/y": 0o755, "/x/y/z": 0o700} {
		if got := stat(t, c, dir+p); got.Type != agentv1.FileType_FILE_TYPE_DIRECTORY || got.Mode != want {
			t.Errorf("%s: %v, want mode %#o", p, got, want)
		}
	}
	// With parents an existing directory is fine and left alone.
	if err := mkdir(dir+"/x/y/z", true, 0o755); err != nil {
		t.Fatal(err)
	}
	if got := stat(t, c, dir+"/x/y/z"); got.Mode != 0o700 {
		t.Fatalf("existing changed to %#o", got.Mode)
	}
	wantErr(t, mkdir(dir+"/d", false, 0), connect.CodeAlreadyExists, "mkdir "+dir+"/d: file exists")
	mustWrite(t, dir+"/file", "")
	wantErr(t, mkdir(dir+"/file", true, 0), connect.CodeAlreadyExists, "file exists")
	wantErr(t, mkdir(dir+"/m/n", false, 0), connect.CodeNotFound, "mkdir "+dir+"/m/n: no such file or directory")
	wantErr(t, mkdir(dir+"/file/n", true, 0), connect.CodeFailedPrecondition, "not a directory")
	wantErr(t, mkdir(dir+"/e", false, 0o10000), connect.CodeInvalidArgument, "mode")
}

func TestRemove(t *testing.T) {
	c := serve(t, Options{})
	ctx := callCtx(t)
	dir := tree(t)
	remove := func(p string, recursive bool) error {
		_, err := c.Remove(ctx, connect.NewRequest(&agentv1.RemoveRequest{Path: p, Recursive: recursive}))
		return err
	}
	gone := func(p string) {
		t.Helper()
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("%s still there: %v", p, err)
		}
	}
	for _, p := range []string{"/b", "/link", "/z"} {
		if err := remove(dir+p, false); err != nil {
			t.Fatal(err)
		}
		gone(dir + p)
	}
	if got := mustRead(t, dir+"/a/a1"); got != "1" {
		t.Fatalf("link target changed: %q", got)
	}
	wantErr(t, remove(dir+"/a", false), connect.CodeFailedPrecondition, "remove "+dir+"/a: directory not empty")
	if err := remove(dir+"/a", true); err != nil {
		t.Fatal(err)
	}
	gone(dir + "/a")
	wantErr(t, remove(dir+"/a", false), connect.CodeNotFound, "remove "+dir+"/a: no such file or directory")
	wantErr(t, remove(dir+"/a", true), connect.CodeNotFound, "no such file or directory")
	wantErr(t, remove("/", true), connect.CodeInvalidArgument, "remove /: refused")
	wantErr(t, remove("/tmp/../", true), connect.CodeInvalidArgument, "refused")
}

func TestRename(t *testing.T) {
	c := serve(t, Options{})
	ctx := callCtx(t)
	dir := tree(t)
	rename := func(from, to string) error {
		_, err := c.Rename(ctx, connect.NewRequest(&agentv1.RenameRequest{From: dir + from, To: dir + to}))
		return err
	}
	if err := rename("/b", "/b2"); err != nil {
		t.Fatal(err)
	}
	if got := mustRead(t, dir+"/b2"); got != "3" {
		t.Fatalf("b2: %q", got)
	}
	if err := rename("/b2", "/a/a1"); err != nil {
		t.Fatal(err)
	}
	if got := mustRead(t, dir+"/a/a1"); got != "3" {
		t.Fatalf("replaced: %q", got)
	}
	if err := rename("/a", "/moved"); err != nil {
		t.Fatal(err)
	}
	wantErr(t, rename("/moved/a1", "/z"), connect.CodeAlreadyExists, "rename "+dir+"/moved/a1 to "+dir+"/z: file exists")
	wantErr(t, rename("/nope", "/x"), connect.CodeNotFound, "rename "+dir+"/nope to "+dir+"/x: no such file or directory")
	wantErr(t, rename("/moved", "/moved/inside"), connect.CodeInvalidArgument, "invalid argument")
}

func TestChmod(t *testing.T) {
	c := serve(t, Options{})
	ctx := callCtx(t)
	file := t.TempDir() + "/f"
	mustWrite(t, file, "")
	for _, m := range []uint32{0o4750, 0o2711, 0o1600, 0} {
		if _, err := c.Chmod(ctx, connect.NewRequest(&agentv1.ChmodRequest{Path: file, Mode: m})); err != nil {
			t.Fatal(err)
		}
		if got := stat(t, c, file).Mode; got != m {
			t.Fatalf("mode %#o, want %#o", got, m)
		}
	}
	_, err := c.Chmod(ctx, connect.NewRequest(&agentv1.ChmodRequest{Path: file, Mode: 0o10644}))
	wantErr(t, err, connect.CodeInvalidArgument, "mode")
	_, err = c.Chmod(ctx, connect.NewRequest(&agentv1.ChmodRequest{Path: file + "x", Mode: 0o644}))
	wantErr(t, err, connect.CodeNotFound, "chmod "+file+"x: no such file or directory")
}

func TestChown(t *testing.T) {
	c := serve(t, Options{})
	ctx := callCtx(t)
	dir := t.TempDir()
	file := dir + "/f"
	mustWrite(t, file, "")
	if err := os.Symlink("f", dir+"/link"); err != nil {
		t.Fatal(err)
	}
	chown := func(p string, uid, gid int64) error {
		_, err := c.Chown(ctx, connect.NewRequest(&agentv1.ChownRequest{Path: p, Uid: uid, Gid: gid}))
		return err
	}
	if err := chown(file, -1, -1); err != nil {
		t.Fatal(err)
	}
	if err := chown(file, int64(os.Getuid()), int64(os.Getgid())); err != nil {
		t.Fatal(err)
	}
	for _, id := range []int64{-2, math.MaxUint32, math.MaxUint32 + 1, math.MinInt64} {
		wantErr(t, chown(file, id, -1), connect.CodeInvalidArgument, "out of range")
		wantErr(t, chown(file, -1, id), connect.CodeInvalidArgument, "out of range")
	}
	wantErr(t, chown(dir+"/nope", -1, -1), connect.CodeNotFound, "chown "+dir+"/nope: no such file or directory")

	if os.Geteuid() != 0 {
		wantErr(t, chown(file, 0, -1), connect.CodePermissionDenied, "operation not permitted")
		return
	}
	// The link itself changes, not its target.
	if err := chown(dir+"/link", 1234, -1); err != nil {
		t.Fatal(err)
	}
	if l, f := stat(t, c, dir+"/link"), stat(t, c, file); l.Uid != 1234 || l.Gid != uint32(os.Getgid()) || f.Uid != uint32(os.Getuid()) {
		t.Fatalf("link %d:%d, file %d:%d", l.Uid, l.Gid, f.Uid, f.Gid)
	}
	if err := chown(file, 1234, 4294967294); err != nil {
		t.Fatal(err)
	}
	if f := stat(t, c, file); f.Uid != 1234 || f.Gid != 4294967294 {
		t.Fatalf("file %d:%d", f.Uid, f.Gid)
	}
}

func TestErrorCodes(t *testing.T) {
	for errno, want := range map[syscall.Errno]connect.Code{
		unix.ENOENT:    connect.CodeNotFound,
		unix.EEXIST:    connect.CodeAlreadyExists,
		unix.EACCES:    connect.CodePermissionDenied,
		unix.EPERM:     connect.CodePermissionDenied,
		unix.ENOTDIR:   connect.CodeFailedPrecondition,
		unix.EISDIR:    connect.CodeFailedPrecondition,
		unix.ENOTEMPTY: connect.CodeFailedPrecondition,
		unix.EXDEV:     connect.CodeFailedPrecondition,
		unix.EROFS:     connect.CodeFailedPrecondition,
		unix.ENOSPC:    connect.CodeResourceExhausted,
		unix.EIO:       connect.CodeInternal,
	} {
		err := fsError("op", "/p", &fs.PathError{Op: "lstat", Path: "/other", Err: errno})
		if connect.CodeOf(err) != want || err.Error() != fmt.Sprintf("%s: op /p: %s", want, errno) {
			t.Errorf("%v: %v, want %v", errno, err, want)
		}
	}
	if err := fsError("op", "/p", context.Canceled); connect.CodeOf(err) != connect.CodeCanceled {
		t.Errorf("canceled: %v", err)
	}
}
