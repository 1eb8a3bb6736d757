//go:build linux

package requests

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// TestSocketToHostAndBack: a program's request reaches the host's stream
// with the asker's uid, and the host's answer reaches the program; bad
// requests are answered at once without reaching the host.
func TestSocketToHostAndBack(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := New(nil)
	sock := filepath.Join(t.TempDir(), "request.sock")
	go b.Listen(ctx, sock)
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no socket")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The host: allows what it is asked, once.
	got := make(chan *agentv1.GuestRequest, 4)
	go b.Serve(ctx, func(r *agentv1.GuestRequest) error {
		got <- r
		go b.Answer(&agentv1.GuestAnswer{Id: r.Id, Allowed: true, Done: true, Reason: "checkpoint \"green\" taken"})
		return nil
	})
	a, err := Send(ctx, sock, Request{Kind: KindCheckpoint, Name: "green", Note: "tests pass"})
	if err != nil || !a.Allowed || !a.Done || !strings.Contains(a.Reason, "green") {
		t.Fatalf("answer %+v, %v", a, err)
	}
	r := <-got
	if r.Kind != KindCheckpoint || r.Name != "green" || r.Note != "tests pass" || r.Uid != uint32(os.Getuid()) || r.Pid != int32(os.Getpid()) {
		t.Errorf("the host got %v", r)
	}
	if a, err := Send(ctx, sock, Request{Kind: "format-disk"}); err != nil || a.Error == "" || a.Allowed {
		t.Errorf("an unknown request: %+v, %v", a, err)
	}
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte(strings.Repeat("x", maxLine+10) + "\n"))
	buf := make([]byte, 512)
	n, _ := c.Read(buf)
	c.Close()
	if !strings.Contains(string(buf[:n]), "error") {
		t.Errorf("an over-long line: %q", buf[:n])
	}
	select {
	case r := <-got:
		t.Errorf("a bad request reached the host: %v", r)
	default:
	}
	if err := b.Answer(&agentv1.GuestAnswer{Id: 999}); err == nil {
		t.Error("an answer to no request was taken")
	}
}

// TestNoHostTimesOut: with no host listening, a request fails when its
// context ends, and a full queue refuses at once.
func TestNoHostTimesOut(t *testing.T) {
	b := New(nil)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := b.Ask(ctx, &agentv1.GuestRequest{Kind: KindCheckpoint, Name: "x"}); err == nil || !strings.Contains(err.Error(), "no answer") {
		t.Errorf("unanswered: %v", err)
	}
}

// TestExposeSelf: an agent that runs from a file of the image gets a link
// to it, made once.
func TestExposeSelf(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bin", "carrel-agent")
	for i := 0; i < 2; i++ {
		if err := ExposeSelf(path); err != nil {
			t.Fatal(err)
		}
	}
	exe, _ := os.Executable()
	if got, err := os.Readlink(path); err != nil || got != exe {
		t.Errorf("link %q, %v; want %q", got, err, exe)
	}
}

// TestSameBytes: the copy is kept only when it holds exactly the running
// executable's bytes.
func TestSameBytes(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a := write("a", strings.Repeat("agent", 30000))
	for _, c := range []struct {
		other string
		want  bool
	}{
		{strings.Repeat("agent", 30000), true},
		{strings.Repeat("agent", 29999) + "agenT", false},
		{strings.Repeat("agent", 29999), false},
	} {
		f, err := os.Open(a)
		if err != nil {
			t.Fatal(err)
		}
		got, err := sameBytes(f, write("b", c.other))
		f.Close()
		if err != nil || got != c.want {
			t.Errorf("sameBytes of %d bytes: %v %v, want %v", len(c.other), got, err, c.want)
		}
	}
}
