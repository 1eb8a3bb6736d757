// Package tests holds carrel's end-to-end tests: a real carreld, the real
// carrel CLI and real VMs under QEMU (TCG on machines without usable KVM).
//
// They need qemu-system-x86_64 and apt access for the dev image (make deps).
// Without QEMU they skip, unless CARREL_REQUIRE_VM=1 (set by make test) makes
// that a failure.
package tests

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// requireVM skips (or fails, under CARREL_REQUIRE_VM=1) when the host cannot
// run the end-to-end tier.
func requireVM(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		if os.Getenv("CARREL_REQUIRE_VM") == "1" {
			t.Fatal("qemu-system-x86_64 is missing and CARREL_REQUIRE_VM=1: run `make deps`")
		}
		t.Skip("qemu-system-x86_64 is missing: skipping real-VM tests (run `make deps`)")
	}
}

func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(filepath.Dir(file))
}

var (
	binOnce sync.Once
	binDir  string
	binErr  error
)

// bins returns a directory with carreld, carrel and carrel-agent: the ones
// `make` built (CARREL_BIN_DIR), else freshly built ones.
func bins(t testing.TB) string {
	t.Helper()
	binOnce.Do(func() {
		if d := os.Getenv("CARREL_BIN_DIR"); d != "" {
			binDir = d
			return
		}
		binDir, binErr = os.MkdirTemp("", "carrel-bin-")
		if binErr != nil {
			return
		}
		cmd := exec.Command("go", "build", "-o", binDir+"/", "./cmd/carreld", "./cmd/carrel", "./cmd/carrel-agent")
		cmd.Dir = repoRoot()
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binDir
}

func cacheDir() string {
	if d := os.Getenv("CARREL_CACHE_DIR"); d != "" {
		return d
	}
	return filepath.Join(repoRoot(), ".cache", "carrel")
}

// daemon is one carreld under test.
type daemon struct {
	t        testing.TB
	bin      string
	dir      string // short, so socket paths fit in sun_path
	state    string
	socket   string
	args     []string
	cmd      *exec.Cmd
	log      *bytes.Buffer
	logMu    sync.Mutex
	exited   chan struct{}
}

type lockedBuffer struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (w lockedBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// newDaemon prepares a carreld with its own state dir; extra flags are
// appended to its command line.
func newDaemon(t testing.TB, extra ...string) *daemon {
	t.Helper()
	requireVM(t)
	dir, err := os.MkdirTemp("/tmp", "ce2e-")
	if err != nil {
		t.Fatal(err)
	}
	d := &daemon{t: t, bin: bins(t), dir: dir, state: filepath.Join(dir, "s"), socket: filepath.Join(dir, "api.sock"), args: extra, log: &bytes.Buffer{}}
	t.Cleanup(func() {
		d.killAllVMs()
		d.stop()
		if t.Failed() {
			t.Logf("carreld log:\n%s", d.logs())
		}
		os.RemoveAll(dir)
	})
	return d
}

func (d *daemon) logs() string {
	d.logMu.Lock()
	defer d.logMu.Unlock()
	return d.log.String()
}

// start runs carreld and returns once it has told systemd (a datagram
// socket standing in for it, via NOTIFY_SOCKET) READY=1.
func (d *daemon) start() {
	d.t.Helper()
	notifyPath := filepath.Join(d.dir, "notify.sock")
	os.Remove(notifyPath)
	nc, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: notifyPath, Net: "unixgram"})
	if err != nil {
		d.t.Fatal(err)
	}
	defer nc.Close()
	args := append([]string{"--state-dir", d.state, "--socket", d.socket, "--cache-dir", cacheDir(),
		"--agent", filepath.Join(d.bin, "carrel-agent"), "--log-level", "debug"}, d.args...)
	d.cmd = exec.Command(filepath.Join(d.bin, "carreld"), args...)
	d.cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+notifyPath)
	w := lockedBuffer{&d.logMu, d.log}
	d.cmd.Stdout, d.cmd.Stderr = w, w
	if err := d.cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
	d.exited = make(chan struct{})
	go func(c *exec.Cmd, ch chan struct{}) { c.Wait(); close(ch) }(d.cmd, d.exited)
	nc.SetReadDeadline(time.Now().Add(60 * time.Second))
	buf := make([]byte, 4096)
	for {
		n, err := nc.Read(buf)
		if err != nil {
			d.t.Fatalf("carreld never sent READY=1: %v\n%s", err, d.logs())
		}
		if strings.Contains(string(buf[:n]), "READY=1") {
			return
		}
	}
}

// kill ends carreld with SIGKILL, as a crash would.
func (d *daemon) kill() {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	d.cmd.Process.Signal(syscall.SIGKILL)
	<-d.exited
	d.cmd = nil
}

// stop ends carreld with SIGTERM.
func (d *daemon) stop() {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(20 * time.Second):
		d.cmd.Process.Kill()
		<-d.exited
	}
	d.cmd = nil
}

// killAllVMs kills any QEMU whose VM lives under this daemon's state dir,
// so a failed test leaves nothing running.
func (d *daemon) killAllVMs() {
	for _, pid := range qemuPids(d.state) {
		syscall.Kill(pid, syscall.SIGKILL)
	}
}

// qemuPids lists QEMU processes whose command line mentions dir.
func qemuPids(dir string) []int {
	ents, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		s := string(b)
		if strings.Contains(s, "qemu-system") && strings.Contains(s, dir) {
			if st, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil && strings.Contains(string(st), ") Z ") {
				continue
			}
			pids = append(pids, pid)
		}
	}
	return pids
}

// result is what one carrel invocation did.
type result struct {
	stdout, stderr string
	code           int
}

// carrel runs the CLI against this daemon.
func (d *daemon) carrel(args ...string) result {
	d.t.Helper()
	return d.carrelTimeout(3*time.Minute, args...)
}

func (d *daemon) carrelTimeout(timeout time.Duration, args ...string) result {
	d.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(d.bin, "carrel"), args...)
	cmd.Env = append(os.Environ(), "CARREL_SOCKET="+d.socket)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	default:
		d.t.Fatalf("carrel %v: %v", args, err)
	}
	return r
}

// must runs the CLI and fails the test unless it exits 0.
func (d *daemon) must(args ...string) string {
	d.t.Helper()
	r := d.carrel(args...)
	if r.code != 0 {
		d.t.Fatalf("carrel %s: exit %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	}
	return r.stdout
}

// buildImage builds the dev image in this daemon's store.
func (d *daemon) buildImage() string {
	d.t.Helper()
	out := strings.TrimSpace(d.must("image", "build", "--dev"))
	if !strings.HasPrefix(out, "sha256:") {
		d.t.Fatalf("image build printed %q, want a digest", out)
	}
	return out
}
