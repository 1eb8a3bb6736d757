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

// TestLastLineWith finds the guest's own account of a failed boot among
// later lines, and bounds and cleans it: the guest writes it.
func TestLastLineWith(t *testing.T) {
	host, guest := net.Pipe()
	r, err := Record(context.Background(), func(context.Context) (net.Conn, error) { return host, nil }, filepath.Join(t.TempDir(), "c.log"))
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		guest.Write([]byte("MARK: first\n[ 1.0] booting\nMARK: second \x1b[1m" + strings.Repeat("y", 2*maxLine) + "\n"))
		for i := 0; i < 40; i++ {
			guest.Write([]byte("[ 3.1] panic trace line\n"))
		}
		guest.Close()
	}()
	<-r.Done()
	got := r.LastLineWith("MARK:")
	if !strings.HasPrefix(got, "MARK: second [1myyy") || len(got) > maxLine+3 || strings.ContainsRune(got, 0x1b) {
		t.Errorf("LastLineWith = %q (%d bytes)", got, len(got))
	}
	if got := r.LastLineWith("absent"); got != "" {
		t.Errorf("LastLineWith(absent) = %q", got)
	}
}
