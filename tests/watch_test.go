package tests

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/tests/harness"
)

// watcher is a `carrel watch` running in the background.
type watcher struct {
	t     *testing.T
	cmd   *exec.Cmd
	lines chan string
	mu    sync.Mutex
	notes bytes.Buffer // stderr
	done  chan error
	seen  []string
}

// startWatch runs `carrel watch ARGS...` and returns once it says the
// watch is in place.
func startWatch(t *testing.T, d *harness.Daemon, args ...string) *watcher {
	t.Helper()
	w := &watcher{t: t, lines: make(chan string, 1000), done: make(chan error, 1)}
	w.cmd = exec.Command(filepath.Join(d.Bin, "carrel"), append([]string{"watch"}, args...)...)
	w.cmd.Env = append(os.Environ(), "CARREL_SOCKET="+d.Socket)
	stdout, err := w.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr, err := w.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := w.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		once := sync.Once{}
		for sc.Scan() {
			w.mu.Lock()
			fmt.Fprintln(&w.notes, sc.Text())
			w.mu.Unlock()
			if strings.HasPrefix(sc.Text(), "# watching ") {
				once.Do(func() { close(ready) })
			}
		}
	}()
	var readers sync.WaitGroup
	readers.Add(1)
	go func() {
		defer readers.Done()
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			w.lines <- sc.Text()
		}
	}()
	go func() {
		readers.Wait() // all of stdout read before Wait closes the pipe
		w.done <- w.cmd.Wait()
		close(w.lines)
	}()
	t.Cleanup(func() { w.cmd.Process.Kill() })
	select {
	case <-ready:
	case err := <-w.done:
		t.Fatalf("carrel watch %v ended: %v\n%s", args, err, w.stderr())
	case <-time.After(2 * time.Minute):
		t.Fatalf("carrel watch %v never said it was watching\n%s", args, w.stderr())
	}
	return w
}

func (w *watcher) stderr() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.notes.String()
}

// expect reads lines, each passed through conv, until it has seen want in
// order (other lines may come between).
func (w *watcher) expect(conv func(string) string, want ...string) {
	w.t.Helper()
	deadline := time.After(2 * time.Minute)
	for len(want) > 0 {
		select {
		case l, ok := <-w.lines:
			if !ok {
				w.t.Fatalf("carrel watch ended still waiting for %q; saw %q\n%s", want, w.seen, w.stderr())
			}
			l = conv(l)
			w.seen = append(w.seen, l)
			if l == want[0] {
				want = want[1:]
			}
		case <-deadline:
			w.t.Fatalf("still waiting for %q; saw %q\n%s", want, w.seen, w.stderr())
		}
	}
}

// saw fails unless each of want has been read (by expect), in any order.
func (w *watcher) saw(want ...string) {
	w.t.Helper()
	for _, l := range want {
		if !slices.Contains(w.seen, l) {
			w.t.Errorf("never saw %q; saw %q", l, w.seen)
		}
	}
}

// wait waits for carrel watch to end and returns its exit code.
func (w *watcher) wait() int {
	w.t.Helper()
	select {
	case err := <-w.done:
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode()
		} else if err != nil {
			w.t.Fatal(err)
		}
		return 0
	case <-time.After(time.Minute):
		w.t.Fatal("carrel watch did not end")
	}
	return -1
}

// TestWatch watches a directory in a real guest through the real relay and
// agent, while commands in the guest change it.
func TestWatch(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "watch")
	d.Must("exec", "watch", "--", "mkdir", "-p", "/workspace/w", "/workspace/t")

	t.Run("json", func(t *testing.T) {
		w := startWatch(t, d, "--output", "json", "watch", "/workspace/w")
		// Each JSON line, as "OP path" with "/" after a directory, relative
		// to the watched directory.
		conv := func(l string) string {
			var e agentv1.WatchEvent
			if err := protojson.Unmarshal([]byte(l), &e); err != nil {
				t.Fatalf("line %q: %v", l, err)
			}
			if e.TimeUnixNano == 0 {
				t.Errorf("no time in %q", l)
			}
			rel := func(p string) string {
				p = strings.TrimPrefix(strings.TrimPrefix(p, "/workspace/w"), "/")
				if e.IsDir {
					p += "/"
				}
				return p
			}
			op := strings.TrimPrefix(e.Op.String(), "WATCH_OP_")
			if e.Op == agentv1.WatchOp_WATCH_OP_RENAME {
				return fmt.Sprintf("%s %s -> %s", op, rel(e.OldPath), rel(e.Path))
			}
			return op + " " + rel(e.Path)
		}
		d.Must("exec", "watch", "--cwd", "/workspace/w", "--", "sh", "-c",
			"echo hi > a.txt && echo more >> a.txt && mv a.txt b.txt && mkdir -p sub/deeper && echo x > sub/deeper/f && rm b.txt")
		w.expect(conv, "CREATE a.txt", "MODIFY a.txt", "RENAME a.txt -> b.txt",
			"CREATE sub/", "CREATE sub/deeper/", "CREATE sub/deeper/f", "DELETE b.txt")
		// The new subdirectories are watched now.
		d.Must("exec", "watch", "--", "sh", "-c", "echo y > /workspace/w/sub/deeper/g && mv /workspace/w/sub /workspace/w/moved && rm -r /workspace/w/moved")
		w.expect(conv, "CREATE sub/deeper/g", "MODIFY sub/deeper/g", "RENAME sub/ -> moved/", "DELETE moved/deeper/", "DELETE moved/")
		w.saw("DELETE moved/deeper/f", "DELETE moved/deeper/g")
		// ^C ends it cleanly.
		w.cmd.Process.Signal(syscall.SIGINT)
		if code := w.wait(); code != 0 {
			t.Errorf("carrel watch exited %d after SIGINT\n%s", code, w.stderr())
		}
	})

	t.Run("text", func(t *testing.T) {
		w := startWatch(t, d, "watch", "/workspace/t")
		same := func(l string) string { return l }
		d.Must("exec", "watch", "--", "sh", "-c", "touch /workspace/t/x && mv /workspace/t/x /workspace/t/y && mkdir /workspace/t/d")
		w.expect(same, "CREATE /workspace/t/x", "RENAME /workspace/t/x -> /workspace/t/y", "CREATE /workspace/t/d/")
		// Removing the watched directory reports it and ends the watch.
		d.Must("exec", "watch", "--", "rm", "-r", "/workspace/t")
		w.expect(same, "DELETE /workspace/t/")
		w.saw("DELETE /workspace/t/y", "DELETE /workspace/t/d/")
		if code := w.wait(); code != 0 {
			t.Errorf("carrel watch exited %d when its directory went\n%s", code, w.stderr())
		}
	})

	for _, c := range []struct{ path, want string }{
		{"/workspace/nope", "no such file"},
		{"/srv", "carrel.fs.default_deny"},
		{"/etc/passwd", "not a directory"},
		{"relative", "absolute"},
	} {
		r := d.CarrelTimeout(time.Minute, "watch", "watch", c.path)
		if r.Code == 0 || !strings.Contains(r.Stderr, c.want) {
			t.Errorf("carrel watch %s: exit %d, stderr %q; want an error with %q", c.path, r.Code, r.Stderr, c.want)
		}
	}
	if r := d.Carrel("watch", "--output", "yaml", "watch", "/workspace"); r.Code == 0 || !strings.Contains(r.Stderr, "--output") {
		t.Errorf("bad --output: %+v", r)
	}
	d.Must("vm", "rm", "--force", "watch")
}
