//go:build linux

package pty

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func open(t *testing.T) (master, slave *os.File) {
	t.Helper()
	master, slave, err := Open()
	if errors.Is(err, os.ErrNotExist) {
		t.Skipf("no pseudo-terminals here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { master.Close(); slave.Close() })
	return master, slave
}

func TestSizeAndEOF(t *testing.T) {
	master, slave := open(t)
	if err := SetSize(master, 30, 100); err != nil {
		t.Fatal(err)
	}
	if rows, cols, err := Size(slave); err != nil || rows != 30 || cols != 100 {
		t.Fatalf("size %dx%d %v", rows, cols, err)
	}
	for _, s := range [][2]uint32{{0, 80}, {24, 0}, {1 << 16, 80}} {
		if err := SetSize(master, s[0], s[1]); !errors.Is(err, ErrBadSize) {
			t.Errorf("%v: %v", s, err)
		}
	}
	if EOF(master) != 4 {
		t.Fatalf("EOF %d, want ^D", EOF(master))
	}
}

// TestRoundTrip: bytes written to the master arrive at the slave (echoed
// back to the master), and the master still honours read deadlines.
func TestRoundTrip(t *testing.T) {
	master, slave := open(t)
	if _, err := master.Write([]byte("hi\n")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, err := slave.Read(buf)
	if err != nil || string(buf[:n]) != "hi\n" {
		t.Fatalf("slave read %q %v", buf[:n], err)
	}
	master.SetReadDeadline(time.Now().Add(2 * time.Second))
	var echo strings.Builder
	for !strings.Contains(echo.String(), "hi\r\n") {
		n, err := master.Read(buf)
		if err != nil {
			t.Fatalf("echo %q: %v", echo.String(), err)
		}
		echo.Write(buf[:n])
	}
	master.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := master.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past deadline: %v", err)
	}
	// With the slave closed, the master reads EIO.
	slave.Close()
	master.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := master.Read(buf); !errors.Is(err, unix.EIO) {
		t.Fatalf("read after hangup: %v, want EIO", err)
	}
}
