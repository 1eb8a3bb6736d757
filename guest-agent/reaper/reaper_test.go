//go:build linux

package reaper

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func start(t *testing.T, script string, stdout *os.File) *Process {
	t.Helper()
	files := []*os.File{nil, stdout, os.Stderr}
	p, err := Default().Start("/bin/sh", []string{"sh", "-c", script}, &os.ProcAttr{Files: files})
	if err != nil {
		t.Fatalf("start %q: %v", script, err)
	}
	return p
}

func waitCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestConcurrentExitCodes(t *testing.T) {
	const n = 64
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			p := start(t, fmt.Sprintf("exit %d", i), nil)
			ws, err := p.Wait(waitCtx(t))
			if err != nil {
				t.Errorf("child %d: wait: %v", i, err)
				return
			}
			if !ws.Exited() || ws.ExitStatus() != i {
				t.Errorf("child %d: status %#x, want exit %d", i, ws, i)
			}
		})
	}
	wg.Wait()
}

func TestSignal(t *testing.T) {
	p := start(t, "exec sleep 30", nil)
	if err := p.Signal(unix.SIGTERM); err != nil {
		t.Fatalf("signal: %v", err)
	}
	ws, err := p.Wait(waitCtx(t))
	if err != nil {
		t.Fatalf("wait: %v", err)
	}
	if !ws.Signaled() || ws.Signal() != unix.SIGTERM {
		t.Fatalf("status %#x, want killed by SIGTERM", ws)
	}
	if err := p.Signal(unix.SIGTERM); !errors.Is(err, os.ErrProcessDone) {
		t.Fatalf("signal after exit: %v, want os.ErrProcessDone", err)
	}
}

func TestWaitContext(t *testing.T) {
	p := start(t, "exec sleep 30", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := p.Wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait: %v, want deadline exceeded", err)
	}
	if err := p.Signal(unix.SIGKILL); err != nil {
		t.Fatalf("kill: %v", err)
	}
	if _, err := p.Wait(waitCtx(t)); err != nil {
		t.Fatalf("wait after kill: %v", err)
	}
}

// TestOrphanReaped makes this test process a subreaper, so that the
// grandchild left behind by sh is reparented to us, and checks that it does
// not linger as a zombie.
func TestOrphanReaped(t *testing.T) {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		t.Skipf("needs PR_SET_CHILD_SUBREAPER: %v", err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	before := Default().Orphans()
	p := start(t, "sleep 0.2 >/dev/null & echo $!", w)
	w.Close()
	if _, err := p.Wait(waitCtx(t)); err != nil {
		t.Fatalf("wait: %v", err)
	}
	out := make([]byte, 64)
	n, _ := r.Read(out)
	pid, err := strconv.Atoi(strings.TrimSpace(string(out[:n])))
	if err != nil {
		t.Fatalf("orphan pid %q: %v", out[:n], err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("orphan %d not reaped: %s", pid, stat)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if Default().Orphans() == before {
		t.Fatalf("orphan count did not increase")
	}
}
