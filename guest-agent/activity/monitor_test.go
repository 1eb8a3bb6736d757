//go:build linux

package activity

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// workspace mounts a tmpfs of its own for a test: fanotify's mark covers a
// whole file system, and the test's must see nothing but the test. It
// skips where the test cannot mount or fanotify is missing.
func workspace(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (CAP_SYS_ADMIN) for fanotify and a tmpfs mount")
	}
	fd, err := unix.FanotifyInit(unix.FAN_CLASS_NOTIF|unix.FAN_REPORT_DFID_NAME, unix.O_RDONLY)
	if err != nil {
		t.Skipf("no fanotify with FAN_REPORT_DFID_NAME (Linux 5.9): %v", err)
	}
	unix.Close(fd)
	dir := filepath.Join(t.TempDir(), "ws")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NODEV|unix.MS_NOSUID, "size=16m"); err != nil {
		t.Skipf("cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// collector runs Serve and gathers what it sends.
type collector struct {
	mu      sync.Mutex
	events  []*agentv1.ActivityEvent
	dropped uint64
	msgs    int
	cancel  context.CancelFunc
	done    chan error
}

func collect(t *testing.T, m *Monitor) *collector {
	ctx, cancel := context.WithCancel(context.Background())
	c := &collector{cancel: cancel, done: make(chan error, 1)}
	go func() {
		c.done <- m.Serve(ctx, func(r *agentv1.ActivityResponse) error {
			c.mu.Lock()
			defer c.mu.Unlock()
			c.events = append(c.events, r.Events...)
			c.dropped += r.Dropped
			c.msgs++
			return nil
		})
	}()
	t.Cleanup(func() { cancel(); <-c.done })
	return c
}

// lines renders the events as "op path exec_id".
func (c *collector) lines() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, e := range c.events {
		out = append(out, fmt.Sprintf("%s %s %s", strings.ToLower(strings.TrimPrefix(e.Op.String(), "ACTIVITY_OP_")), e.Path, e.ExecId))
	}
	return out
}

// waitFor waits until every line of want has been seen, in order.
func (c *collector) waitFor(t *testing.T, want []string) []string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := c.lines()
		if containsInOrder(got, want) {
			return got
		}
		if time.Now().After(deadline) {
			c.mu.Lock()
			dropped := c.dropped
			c.mu.Unlock()
			t.Fatalf("events (and %d dropped):\n%s\nwant, in order:\n%s", dropped, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitQueued waits until the monitor's queue holds an event for path: it
// happened while no stream was open.
func waitQueued(t *testing.T, m *Monitor, path string) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		m.q.mu.Lock()
		queued := slices.ContainsFunc(m.q.events, func(e Event) bool { return e.Path == path })
		notify := m.q.notify
		m.q.mu.Unlock()
		if queued {
			return
		}
		select {
		case <-notify:
		case <-deadline:
			t.Fatalf("no event for %s was queued", path)
		}
	}
}

func containsInOrder(got, want []string) bool {
	i := 0
	for _, g := range got {
		if i < len(want) && g == want[i] {
			i++
		}
	}
	return i == len(want)
}

func startMonitor(t *testing.T, root string) *Monitor {
	t.Helper()
	m, err := Start(Options{Root: root, FlushInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Error(err)
		}
	})
	return m
}

// command starts argv as a command of the monitor's, with id, and waits
// for it.
func command(t *testing.T, m *Monitor, dir, id string, argv ...string) {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = dir
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	m.Started(cmd.Process.Pid, id)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("%v: %v\n%s", argv, err, out.String())
	}
}

// TestMonitorReportsCommands runs a shell whose short-lived children
// create, write, rename and remove files and a directory, and checks that
// each step is reported with the path and the command's id, that the
// test's own writes (standing for the agent's) are not, and that repeated
// writes are merged.
func TestMonitorReportsCommands(t *testing.T) {
	ws := workspace(t)
	m := startMonitor(t, ws)
	c := collect(t, m)

	// The "agent" itself writes: never reported.
	if err := os.WriteFile(filepath.Join(ws, "mine"), []byte("agent"), 0o644); err != nil {
		t.Fatal(err)
	}
	script := `echo hi > a; mv a b; mkdir d; echo x > d/f; rm -r d; cat b >/dev/null; rm b
for i in 1 2 3 4 5 6 7 8 9 10; do echo $i >> loop; done`
	command(t, m, ws, "cmd1", "/bin/sh", "-c", script)
	w := func(op, p string) string { return op + " " + filepath.Join(ws, p) + " cmd1" }
	got := c.waitFor(t, []string{
		w("create", "a"), w("open", "a"), w("modify", "a"),
		w("move_from", "a"), w("move_to", "b"),
		w("create", "d"), w("create", "d/f"), w("modify", "d/f"),
		w("delete", "d/f"), w("delete", "d"),
		w("open", "b"), w("delete", "b"),
		w("create", "loop"), w("modify", "loop"),
	})
	t.Logf("events:\n%s", strings.Join(got, "\n"))
	for _, g := range got {
		if strings.Contains(g, "/mine ") {
			t.Errorf("the agent's own write was reported: %s", g)
		}
	}
	// Ten appends in well under 100 ms, each by the shell itself: merged.
	if n := countPrefix(got, w("modify", "loop")); n > 5 {
		t.Errorf("%d modify events for loop; repeats within the window should merge", n)
	}
}

func countPrefix(lines []string, s string) int {
	n := 0
	for _, l := range lines {
		if l == s {
			n++
		}
	}
	return n
}

// TestMonitorIgnoresOtherProcesses checks that a process the agent did not
// start (one forked before the watch began, standing for any other process
// in the guest) is not reported, while a command's events are.
func TestMonitorIgnoresOtherProcesses(t *testing.T) {
	ws := workspace(t)
	other := exec.Command("/bin/sh", "-c", "sleep 0.5; echo other > other; mv other other2")
	other.Dir = ws
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	m := startMonitor(t, ws)
	c := collect(t, m)
	if err := other.Wait(); err != nil {
		t.Fatal(err)
	}
	command(t, m, ws, "cmd2", "/bin/sh", "-c", "echo ok > ok")
	got := c.waitFor(t, []string{"create " + filepath.Join(ws, "ok") + " cmd2"})
	time.Sleep(200 * time.Millisecond)
	for _, g := range c.lines() {
		if strings.Contains(g, "other") {
			t.Errorf("a process that is no command was reported: %s (all: %v)", g, got)
		}
	}
}

// TestServeKeepsEventsForTheNextStream checks that events that occur with
// no stream open reach the next one, and that a newer stream ends the one
// before.
func TestServeKeepsEventsForTheNextStream(t *testing.T) {
	ws := workspace(t)
	m := startMonitor(t, ws)
	command(t, m, ws, "early", "/bin/sh", "-c", "echo 1 > early")
	waitQueued(t, m, filepath.Join(ws, "early"))
	first := collect(t, m)
	first.waitFor(t, []string{"create " + filepath.Join(ws, "early") + " early"})
	second := collect(t, m)
	select {
	case err := <-first.done:
		if err == nil || !strings.Contains(err.Error(), "newer stream") {
			t.Errorf("first stream ended with %v, want superseded", err)
		}
		first.done <- err // for its cleanup
	case <-time.After(5 * time.Second):
		t.Fatal("the first stream did not end when a second began")
	}
	command(t, m, ws, "late", "/bin/sh", "-c", "echo 2 > late")
	second.waitFor(t, []string{"create " + filepath.Join(ws, "late") + " late"})
	if slices.Contains(second.lines(), "create "+filepath.Join(ws, "early")+" early") {
		t.Error("an event already sent was sent again")
	}
}

// TestReaderWaitsInThePoller checks that the reader waits for the group
// parked in the Go runtime's poller, never in a system call that would
// hold the agent's one P, and that Close ends that wait without the
// reader calling it a fault.
func TestReaderWaitsInThePoller(t *testing.T) {
	ws := workspace(t)
	var logged strings.Builder
	log := slog.New(slog.NewTextHandler(&lockedWriter{w: &logged}, nil))
	m, err := Start(Options{Root: ws, FlushInterval: 20 * time.Millisecond, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	parked := 0
	for range 20 {
		time.Sleep(7 * time.Millisecond) // samples across flushes
		state := readerState(t)
		if strings.HasPrefix(state, "syscall") {
			m.Close()
			t.Fatalf("the reader waits in a system call (goroutine state %q)", state)
		}
		if strings.HasPrefix(state, "IO wait") {
			parked++
		}
	}
	if parked == 0 {
		t.Error("the reader was never seen parked in the poller")
	}
	done := make(chan error, 1)
	go func() { done <- m.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end the reader's wait")
	}
	if strings.Contains(logged.String(), "level=ERROR") {
		t.Errorf("Close made the reader log a fault:\n%s", logged.String())
	}
}

// readerState is the scheduling state of the monitor's reader goroutine,
// as runtime.Stack prints it: "IO wait", "syscall", "runnable"...
func readerState(t *testing.T) string {
	t.Helper()
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if !strings.Contains(g, "activity.(*Monitor).run(") {
			continue
		}
		header, _, _ := strings.Cut(g, "\n") // goroutine 7 [IO wait]:
		_, state, ok := strings.Cut(header, "[")
		if !ok {
			t.Fatalf("unexpected goroutine header %q", header)
		}
		return strings.TrimSuffix(state, "]:")
	}
	t.Fatal("no goroutine runs the monitor's reader")
	return ""
}

type lockedWriter struct {
	mu sync.Mutex
	w  *strings.Builder
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
