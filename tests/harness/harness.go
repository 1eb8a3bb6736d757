// Package harness runs a real carreld and the real carrel CLI for the
// end-to-end tests and the benchmarks in tests/.
package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/console"
)

// TB is the part of testing.TB the harness uses, so that the benchmark
// program can drive it too.
type TB interface {
	Helper()
	Fatal(args ...any)
	Fatalf(format string, args ...any)
	Logf(format string, args ...any)
	Skip(args ...any)
	Cleanup(func())
	Failed() bool
}

// RequireVM skips (or fails, under CARREL_REQUIRE_VM=1) when the host cannot
// run the end-to-end tier.
func RequireVM(t TB) {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		Unavailable(t, "qemu-system-x86_64 is missing: run `make deps`")
	}
}

// Unavailable skips the test because the host lacks something: why says
// what, and how to get it. Under CARREL_REQUIRE_VM=1, which make test sets
// once it has provided everything, it fails the test instead.
func Unavailable(t TB, why string) {
	t.Helper()
	if os.Getenv("CARREL_REQUIRE_VM") == "1" {
		t.Fatal(why + " (CARREL_REQUIRE_VM=1 makes that a failure)")
	}
	t.Skip(why)
}

// Node is the node binary the npm-based tests run (make's pinned one,
// $CARREL_NODE), or "node" from PATH.
func Node() string {
	if n := os.Getenv("CARREL_NODE"); n != "" {
		return n
	}
	return "node"
}

// RepoRoot is the repository's top directory.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(filepath.Dir(filepath.Dir(file)))
}

var (
	binOnce sync.Once
	binDir  string
	binErr  error
)

// Bins returns a directory with carreld, carrel, carrel-policy and
// carrel-agent: the ones
// `make` built (CARREL_BIN_DIR), else freshly built ones.
func Bins(t TB) string {
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
		cmd := exec.Command("go", "build", "-o", binDir+"/", "./cmd/carreld", "./cmd/carrel", "./cmd/carrel-policy", "./cmd/carrel-agent")
		cmd.Dir = RepoRoot()
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

// CacheDir is where downloaded packages for image builds are kept.
func CacheDir() string {
	if d := os.Getenv("CARREL_CACHE_DIR"); d != "" {
		return d
	}
	return filepath.Join(RepoRoot(), ".cache", "carrel")
}

// Daemon is one carreld under test.
type Daemon struct {
	t      TB
	Bin    string
	dir    string // short, so socket paths fit in sun_path
	State  string
	Socket string
	args   []string
	prefix []string // StartUnder's
	cmd    *exec.Cmd
	log    *bytes.Buffer
	logMu  sync.Mutex
	exited chan struct{}
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

// DriverEnv is the environment variable that picks the driver new VMs
// get in the end-to-end tests: qemu (the default) or libvirt, for which
// New starts libvirtd if need be (StartLibvirt).
const DriverEnv = "CARREL_TEST_DRIVER"

// Driver is the driver the end-to-end tests run VMs with (DriverEnv).
func Driver() string {
	if v := os.Getenv(DriverEnv); v != "" {
		return v
	}
	return "qemu"
}

// RequireDriver skips a test of one driver's own behaviour when the suite
// runs with another.
func RequireDriver(t TB, name string) {
	t.Helper()
	if d := Driver(); d != name {
		t.Skip("tests the " + name + " driver; this run uses " + d + " (" + DriverEnv + ")")
	}
}

// New prepares a carreld with its own state dir, running VMs with Driver();
// extra flags are appended to its command line.
func New(t TB, extra ...string) *Daemon {
	t.Helper()
	RequireVM(t)
	switch drv := Driver(); drv {
	case "qemu":
	case "libvirt":
		StartLibvirt(t)
		extra = append([]string{"--driver", "libvirt", "--libvirt-uri", LibvirtURI}, extra...)
	default:
		t.Fatalf("%s=%q: want qemu or libvirt", DriverEnv, drv)
	}
	dir, err := os.MkdirTemp("/tmp", "ce2e-")
	if err != nil {
		t.Fatal(err)
	}
	d := &Daemon{t: t, Bin: Bins(t), dir: dir, State: filepath.Join(dir, "s"), Socket: filepath.Join(dir, "api.sock"), args: extra, log: &bytes.Buffer{}}
	t.Cleanup(func() {
		d.KillAllVMs()
		d.Stop()
		if t.Failed() {
			t.Logf("carreld log:\n%s", d.Logs())
			d.logConsoles()
		}
		os.RemoveAll(dir)
	})
	return d
}

// consoleTail is how much of each VM's console a failed test logs: enough
// for a guest's panic or the agent's last words.
const consoleTail = 16 << 10

// logConsoles logs the end of each VM's console log, which says what the
// guest did when carreld's log only says the link went quiet.
func (d *Daemon) logConsoles() {
	logs, _ := filepath.Glob(filepath.Join(d.State, "vms", "*", console.LogName))
	for _, p := range logs {
		b, _, err := console.ReadTail(p, consoleTail)
		if err != nil {
			continue
		}
		d.t.Logf("console of vm %s (its last %d bytes):\n%s", filepath.Base(filepath.Dir(p)), len(b), b)
	}
}

func (d *Daemon) Logs() string {
	d.logMu.Lock()
	defer d.logMu.Unlock()
	return d.log.String()
}

// Start runs carreld and returns once it has told systemd (a datagram
// socket standing in for it, via NOTIFY_SOCKET) READY=1.
func (d *Daemon) Start() {
	d.t.Helper()
	d.start(nil)
}

// StartSocketActivated runs carreld the way systemd's socket activation
// does, through systemd-socket-activate: the wrapper listens on the API
// socket and starts carreld, with the socket as fd 3, on the first
// connection. It returns once the wrapper listens; the first carrel
// command starts carreld.
func (d *Daemon) StartSocketActivated() {
	d.t.Helper()
	d.start([]string{"systemd-socket-activate", "-l", d.Socket})
}

// StartUnder runs carreld through prefix, a command that then executes
// it (setpriv, say, to give it only a unit's capabilities), and returns
// as Start does.
func (d *Daemon) StartUnder(prefix ...string) {
	d.t.Helper()
	d.prefix = prefix
	d.start(nil)
}

func (d *Daemon) start(wrap []string) {
	d.t.Helper()
	notifyPath := filepath.Join(d.dir, "notify.sock")
	os.Remove(notifyPath)
	nc, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: notifyPath, Net: "unixgram"})
	if err != nil {
		d.t.Fatal(err)
	}
	args := append([]string{"--state-dir", d.State, "--socket", d.Socket, "--cache-dir", CacheDir(),
		"--agent", filepath.Join(d.Bin, "carrel-agent"), "--log-level", "debug"}, d.args...)
	argv := append(append(append([]string{}, d.prefix...), filepath.Join(d.Bin, "carreld")), args...)
	env := append(os.Environ(), "NOTIFY_SOCKET="+notifyPath)
	if wrap != nil {
		// The wrapper passes on only the environment it is told to.
		argv = append(append(append([]string{}, wrap...), "-E", "NOTIFY_SOCKET="+notifyPath), argv...)
	}
	d.cmd = exec.Command(argv[0], argv[1:]...)
	d.cmd.Env = env
	w := lockedBuffer{&d.logMu, d.log}
	d.cmd.Stdout, d.cmd.Stderr = w, w
	if err := d.cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
	d.exited = make(chan struct{})
	go func(c *exec.Cmd, ch chan struct{}) { c.Wait(); close(ch) }(d.cmd, d.exited)
	if wrap != nil {
		nc.Close()
		deadline := time.Now().Add(10 * time.Second)
		for !strings.Contains(d.Logs(), "Listening on") {
			if time.Now().After(deadline) {
				d.t.Fatalf("systemd-socket-activate did not listen:\n%s", d.Logs())
			}
			time.Sleep(10 * time.Millisecond)
		}
		return
	}
	defer nc.Close()
	nc.SetReadDeadline(time.Now().Add(60 * time.Second))
	buf := make([]byte, 4096)
	for {
		n, err := nc.Read(buf)
		if err != nil {
			d.t.Fatalf("carreld never sent READY=1: %v\n%s", err, d.Logs())
		}
		if strings.Contains(string(buf[:n]), "READY=1") {
			// A suite meant for libvirt must not pass on the qemu driver.
			if Driver() == "libvirt" && !strings.Contains(d.Logs(), `msg="driver chosen" driver=libvirt`) {
				d.t.Fatalf("%s=libvirt, but carreld did not choose the libvirt driver:\n%s", DriverEnv, d.Logs())
			}
			return
		}
	}
}

// Pid is carreld's process id.
func (d *Daemon) Pid() int {
	if d.cmd == nil || d.cmd.Process == nil {
		return 0
	}
	return d.cmd.Process.Pid
}

// Kill ends carreld with SIGKILL, as a crash would.
func (d *Daemon) Kill() {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	d.cmd.Process.Signal(syscall.SIGKILL)
	<-d.exited
	d.cmd = nil
}

// Stop ends carreld with SIGTERM.
func (d *Daemon) Stop() {
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

// KillAllVMs kills any QEMU whose VM lives under this daemon's state dir,
// so a failed test leaves nothing running.
func (d *Daemon) KillAllVMs() {
	for _, pid := range QEMUPids(d.State) {
		syscall.Kill(pid, syscall.SIGKILL)
	}
}

// QEMUPids lists QEMU processes whose command line mentions dir.
func QEMUPids(dir string) []int {
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

// Result is what one carrel invocation did.
type Result struct {
	Stdout, Stderr string
	Code           int
}

// Carrel runs the CLI against this daemon.
func (d *Daemon) Carrel(args ...string) Result {
	d.t.Helper()
	return d.CarrelTimeout(3*time.Minute, args...)
}

func (d *Daemon) CarrelTimeout(timeout time.Duration, args ...string) Result {
	d.t.Helper()
	return d.run(timeout, nil, args...)
}

// CarrelStdin runs the CLI with stdin as its standard input.
func (d *Daemon) CarrelStdin(stdin string, args ...string) Result {
	d.t.Helper()
	return d.run(3*time.Minute, strings.NewReader(stdin), args...)
}

func (d *Daemon) run(timeout time.Duration, stdin io.Reader, args ...string) Result {
	d.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(d.Bin, "carrel"), args...)
	cmd.Stdin = stdin
	cmd.Env = append(os.Environ(), "CARREL_SOCKET="+d.Socket)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := Result{Stdout: out.String(), Stderr: errb.String()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		r.Code = ee.ExitCode()
	default:
		d.t.Fatalf("carrel %v: %v", args, err)
	}
	return r
}

// Must runs the CLI and fails the test unless it exits 0.
func (d *Daemon) Must(args ...string) string {
	d.t.Helper()
	r := d.Carrel(args...)
	if r.Code != 0 {
		d.t.Fatalf("carrel %s: exit %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.Code, r.Stdout, r.Stderr)
	}
	return r.Stdout
}

// BuildImage builds the dev image in this daemon's store.
func (d *Daemon) BuildImage() string {
	d.t.Helper()
	out := strings.TrimSpace(d.Must("image", "build", "--dev"))
	if !strings.HasPrefix(out, "sha256:") {
		d.t.Fatalf("image build printed %q, want a digest", out)
	}
	return out
}

// ApplyPolicy applies, as name, the default policy's data changed by
// edit (which gets data.json's "settings" object), and returns name.
// extra are more arguments for carrel policy apply (--vm NAME binds it).
func (d *Daemon) ApplyPolicy(name string, edit func(settings map[string]any), extra ...string) string {
	d.t.Helper()
	b, err := policy.Builtin(policy.DefaultName)
	if err != nil {
		d.t.Fatal(err)
	}
	var doc map[string]map[string]any
	if err := json.Unmarshal(b.Files[policy.DataFile], &doc); err != nil {
		d.t.Fatal(err)
	}
	edit(doc["settings"])
	out, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		d.t.Fatal(err)
	}
	dir := filepath.Join(d.dir, "policy-"+name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		d.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, policy.DataFile), out, 0o644); err != nil {
		d.t.Fatal(err)
	}
	// A bundle must bring tests: one that holds whatever the edit did.
	test := "package carrel.harness_test\n\ntest_compiles if {\n\tdata.carrel.fs.sandbox\n}\n"
	if err := os.WriteFile(filepath.Join(dir, "harness_test.rego"), []byte(test), 0o644); err != nil {
		d.t.Fatal(err)
	}
	d.Must(append([]string{"policy", "apply", name, dir}, extra...)...)
	return name
}

// AllowRoot is ApplyPolicy's edit for a policy that lets commands run as
// root in the guest (the default denies it).
func AllowRoot(s map[string]any) { s["exec"].(map[string]any)["allow_root"] = true }
