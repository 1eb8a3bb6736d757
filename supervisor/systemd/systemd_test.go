package systemd

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// listenNotify binds a datagram socket like systemd's and points
// NOTIFY_SOCKET at it.
func listenNotify(t *testing.T) *net.UnixConn {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify.sock")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	t.Setenv("NOTIFY_SOCKET", path)
	return c
}

func read(t *testing.T, c *net.UnixConn) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 4096)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	return string(buf[:n])
}

func TestReadyAndStatus(t *testing.T) {
	c := listenNotify(t)
	Ready("0 vms running")
	if got := read(t, c); !strings.Contains(got, "READY=1") || !strings.Contains(got, "STATUS=0 vms running") {
		t.Errorf("ready datagram = %q", got)
	}
	Status("2 vms running")
	if got := read(t, c); got != "STATUS=2 vms running" {
		t.Errorf("status datagram = %q", got)
	}
}

func TestWatchdogPings(t *testing.T) {
	c := listenNotify(t)
	t.Setenv("WATCHDOG_USEC", "100000")
	t.Setenv("WATCHDOG_PID", "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go Watchdog(ctx, func() bool { return true })
	if got := read(t, c); got != "WATCHDOG=1" {
		t.Errorf("watchdog datagram = %q", got)
	}
}

func TestNoSocketActivation(t *testing.T) {
	t.Setenv("LISTEN_PID", "")
	t.Setenv("LISTEN_FDS", "")
	l, err := Listener()
	if err != nil || l != nil {
		t.Errorf("Listener() = %v, %v; want nil, nil", l, err)
	}
}
