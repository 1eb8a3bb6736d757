package daemon

import (
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestStateDirLockIsExclusive(t *testing.T) {
	dir := t.TempDir()
	unlock, err := lockStateDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lockStateDir(dir); err == nil || !strings.Contains(err.Error(), "another carreld") {
		t.Errorf("second lock: %v", err)
	}
	unlock()
	again, err := lockStateDir(dir)
	if err != nil {
		t.Fatalf("lock after unlock: %v", err)
	}
	again()
}

func TestListenReplacesStaleSocketOnly(t *testing.T) {
	t.Setenv("LISTEN_PID", "")
	t.Setenv("LISTEN_FDS", "")
	path := filepath.Join(t.TempDir(), "run", "carrel.sock")
	l, err := listen(path, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o660 {
		t.Errorf("socket mode: %v %v", st.Mode(), err)
	}
	// A live socket belongs to another carreld.
	if _, err := listen(path, slog.Default()); err == nil || !strings.Contains(err.Error(), "another carreld") {
		t.Errorf("listen over a live socket: %v", err)
	}
	// A stale one (nobody accepting) is replaced.
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	l2, err := listen(path, slog.Default())
	if err != nil {
		t.Fatalf("listen over a stale socket: %v", err)
	}
	l2.Close()
}
