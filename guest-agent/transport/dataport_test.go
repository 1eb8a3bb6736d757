//go:build linux

package transport

import (
	"bytes"
	"context"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
)

func frames(fs ...any) []byte {
	var b []byte
	for i := 0; i < len(fs); i += 2 {
		p := fs[i+1].(string)
		f := fs[i].(protocol.Frame)
		f.Length = uint32(len(p))
		b = append(protocol.AppendFrame(b, f), p...)
	}
	return b
}

// portPair returns the host's end of a socket pair and a DataPort on the
// other.
func portPair(t *testing.T) (*os.File, *DataPort) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	host := os.NewFile(uintptr(fds[0]), "host")
	p := NewDataPort(os.NewFile(uintptr(fds[1]), "guest"))
	t.Cleanup(func() { host.Close(); p.Close() })
	return host, p
}

// A transfer whose last frame never came (the host's connection dropped)
// ends at the next transfer's first frame, which its own receiver gets.
func TestReceiveLeavesTheNextTransfer(t *testing.T) {
	host, p := portPair(t)
	host.Write(frames(
		protocol.Frame{ID: 1, Seq: 0}, "first half",
		protocol.Frame{ID: 2, Seq: 0}, "second ",
		protocol.Frame{ID: 2, Seq: 1, Flags: protocol.FrameEnd}, "transfer",
	))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var a, b bytes.Buffer
	if _, err := p.Receive(ctx, 1, &a); err == nil {
		t.Fatal("a transfer without its last frame succeeded")
	}
	if _, err := p.Receive(ctx, 2, &b); err != nil || b.String() != "second transfer" {
		t.Fatalf("the next transfer: %q, %v", b.String(), err)
	}
}

// A receiver waiting for the port gives up when its call ends.
func TestReceiveWaitHonoursContext(t *testing.T) {
	_, p := portPair(t)
	long, stopLong := context.WithCancel(context.Background())
	defer stopLong()
	go p.Receive(long, 1, &bytes.Buffer{}) // holds the port, waiting
	time.Sleep(50 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := p.Receive(ctx, 2, &bytes.Buffer{}); err != context.DeadlineExceeded {
		t.Fatalf("got %v, want the call's deadline", err)
	}
}
