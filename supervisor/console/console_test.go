package console

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestRecordTailAndRotate(t *testing.T) {
	host, guest := net.Pipe()
	path := filepath.Join(t.TempDir(), "console.log")
	r, err := Record(context.Background(), func(context.Context) (net.Conn, error) { return host, nil }, path)
	if err != nil {
		t.Fatal(err)
	}
	// A hostile guest prints more than the cap, with control bytes.
	line := strings.Repeat("x", 99) + "\n"
	for i := 0; i < (MaxFileBytes/len(line))+100; i++ {
		if _, err := guest.Write([]byte(line)); err != nil {
			t.Fatal(err)
		}
	}
	guest.Write([]byte("\x1b[0mKernel panic - not syncing\x00\n"))
	guest.Close()
	<-r.Done()
	tail := r.Tail(2)
	if !strings.HasSuffix(tail, "[0mKernel panic - not syncing") || strings.ContainsAny(tail, "\x00\x1b") {
		t.Errorf("tail = %q", tail)
	}
	if got := strings.Count(tail, "\n"); got != 1 {
		t.Errorf("tail has %d newlines", got)
	}
	st, err := os.Stat(path)
	if err != nil || st.Size() > MaxFileBytes {
		t.Errorf("log size %v, err %v", st.Size(), err)
	}
	old, err := os.ReadFile(path + ".1")
	if err != nil || len(old) == 0 || len(old) > MaxFileBytes || !bytes.HasPrefix(old, []byte("xxx")) {
		t.Errorf("rotated log: %d bytes, err %v", len(old), err)
	}
}

func TestCancelStopsRecording(t *testing.T) {
	host, _ := net.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	r, err := Record(ctx, func(context.Context) (net.Conn, error) { return host, nil }, filepath.Join(t.TempDir(), "c.log"))
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	<-r.Done()
}
