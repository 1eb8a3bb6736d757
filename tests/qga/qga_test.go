package qga

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// qemuGA finds a qemu-ga binary: $QEMU_GA, one on PATH, or the one the
// qemu-guest-agent dev image variant unpacked into the package cache
// (make test and make bench build it). Without one the test skips, or
// fails under CARREL_REQUIRE_VM=1.
func qemuGA(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("QEMU_GA"); p != "" {
		return p
	}
	if p, err := exec.LookPath("qemu-ga"); err == nil {
		return p
	}
	got, _ := filepath.Glob(filepath.Join(harness.CacheDir(), "trees", "qemu-guest-agent_*", "usr", "sbin", "qemu-ga"))
	if len(got) == 0 {
		harness.Unavailable(t, "no qemu-ga on PATH or under "+filepath.Join(harness.CacheDir(), "trees")+": set QEMU_GA, install qemu-guest-agent, or build the dev image's qemu-guest-agent variant (make test and make bench do)")
	}
	return got[len(got)-1]
}

// startQemuGA runs a real qemu-ga on this host, listening on a unix socket
// instead of a virtio-serial port, and returns the socket's path.
func startQemuGA(t *testing.T) string {
	t.Helper()
	bin := qemuGA(t)
	dir := t.TempDir()
	sock := filepath.Join(dir, "qga.sock")
	cmd := exec.Command(bin, "-m", "unix-listen", "-p", sock, "-t", dir, "-l", filepath.Join(dir, "qga.log"))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(dir, "qga.log"))
			t.Logf("qemu-ga log:\n%s", b)
		}
	})
	for deadline := time.Now().Add(10 * time.Second); ; {
		if _, err := os.Stat(sock); err == nil {
			return sock
		}
		if time.Now().After(deadline) {
			t.Fatal("qemu-ga did not create its socket")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestRealQemuGA(t *testing.T) {
	sock := startQemuGA(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	// Garbage and a half-written command before the first sync: the sync
	// must see past both.
	conn.Write([]byte("{\"execute\": \"guest-ping\"}\n{\"execute\": \"guest-in"))
	c := New(conn)
	defer c.Close()
	if err := c.Call(ctx, "guest-ping", nil, nil); err != nil {
		t.Fatal(err)
	}

	st, polls, err := c.Run(ctx, "/bin/sh", "-c", "echo out; echo err >&2; exit 3")
	if err != nil {
		t.Fatal(err)
	}
	if !st.Exited || st.ExitCode == nil || *st.ExitCode != 3 || string(st.OutData) != "out\n" || string(st.ErrData) != "err\n" {
		t.Errorf("status %+v after %d polls", st, polls)
	}
	var qe *Error
	if _, err := c.Exec(ctx, "/nonexistent", nil, true); !errors.As(err, &qe) {
		t.Errorf("exec of a missing file: %v", err)
	}

	dir := t.TempDir()
	data := make([]byte, 3<<20+123)
	rand.Read(data)
	p := filepath.Join(dir, "f")
	n, err := c.WriteFile(ctx, p, bytes.NewReader(data), 1<<20)
	if err != nil || n != int64(len(data)) {
		t.Fatalf("write: %d bytes, %v", n, err)
	}
	if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("file on disk differs: %v", err)
	}
	var back bytes.Buffer
	if n, err := c.ReadFile(ctx, p, &back, 1<<20); err != nil || n != int64(len(data)) || !bytes.Equal(back.Bytes(), data) {
		t.Fatalf("read: %d bytes, %v", n, err)
	}
	if _, err := c.FileOpen(ctx, filepath.Join(dir, "missing"), "r"); !errors.As(err, &qe) {
		t.Errorf("open of a missing file: %v", err)
	}
	if _, _, err := c.FileRead(ctx, 1, MaxReadCount+1); err == nil {
		t.Error("read count over the cap accepted")
	}

	// A call cut off by its deadline leaves a stale reply behind; the
	// next call resyncs past it.
	short, cancelShort := context.WithTimeout(ctx, time.Nanosecond)
	defer cancelShort()
	<-short.Done()
	if err := c.Call(short, "guest-info", nil, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("expired call: %v", err)
	}
	var info struct {
		Version string `json:"version"`
	}
	if err := c.Call(ctx, "guest-info", nil, &info); err != nil || info.Version == "" {
		t.Errorf("guest-info after a timeout: %+v, %v", info, err)
	}
}

// fakeAgent answers each command with the next of replies, after the
// delimited sync reply it always gets right.
func fakeAgent(t *testing.T, conn net.Conn, replies ...string) {
	t.Helper()
	go func() {
		defer conn.Close()
		r := bufio.NewReader(conn)
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				return
			}
			line = strings.TrimLeft(line, "\xff")
			if strings.Contains(line, "guest-sync-delimited") {
				i := strings.Index(line, `"id":`)
				id := strings.TrimRight(line[i+5:], "}\n")
				conn.Write([]byte("stale junk\xff{\"return\": 1}\n\xff{\"return\": " + id + "}\n"))
				continue
			}
			if len(replies) == 0 {
				return
			}
			conn.Write([]byte(replies[0]))
			replies = replies[1:]
		}
	}()
}

func TestHostileReplies(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	a, b := net.Pipe()
	fakeAgent(t, b,
		`{"return": {"count": 10, "buf-b64": "aGk=", "eof": false}}`+"\n",
		`{"error": {"class": "GenericError", "desc": "nope"}}`+"\n",
		`{"return": {"pid": 7}}`+"\n",
		`{"nothing": 1}`+"\n",
		`{"return": {"count": 99}}`+"\n",
		`{"return": "`+strings.Repeat("A", MaxReply)+`"}`+"\n",
	)
	c := New(a)
	defer c.Close()
	if _, _, err := c.FileRead(ctx, 1, 4); err == nil || !strings.Contains(err.Error(), "reply says 10") {
		t.Errorf("count mismatch: %v", err)
	}
	var qe *Error
	if _, err := c.Exec(ctx, "/bin/true", nil, true); !errors.As(err, &qe) || qe.Desc != "nope" {
		t.Errorf("error reply: %v", err)
	}
	if pid, err := c.Exec(ctx, "/bin/true", nil, true); err != nil || pid != 7 {
		t.Errorf("exec: %d, %v", pid, err)
	}
	if err := c.Call(ctx, "guest-ping", nil, nil); err == nil {
		t.Error("reply with neither return nor error accepted")
	}
	if _, err := c.FileWrite(ctx, 1, []byte("hi")); err == nil {
		t.Error("write count over the data accepted")
	}
	if err := c.Call(ctx, "guest-info", nil, nil); !errors.Is(err, ErrReplyTooLarge) {
		t.Errorf("oversized reply: %v", err)
	}
}
