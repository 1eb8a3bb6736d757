//go:build linux

package exec

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/reaper"
)

func TestMain(m *testing.M) {
	// Orphans of killed process groups come back to us and get reaped, so
	// tests can see them vanish from /proc.
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	os.Exit(m.Run())
}

// result collects what Run sent.
type result struct {
	mu             sync.Mutex
	events         []*agentv1.ExecResponse
	stdout, stderr bytes.Buffer
	onStdout       func(b []byte)
}

func (r *result) send(m *agentv1.ExecResponse) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, m)
	switch e := m.Event.(type) {
	case *agentv1.ExecResponse_Stdout:
		if len(e.Stdout) > protocol.ExecChunkBytes {
			return fmt.Errorf("chunk of %d bytes", len(e.Stdout))
		}
		r.stdout.Write(e.Stdout)
		if r.onStdout != nil {
			r.onStdout(e.Stdout)
		}
		e.Stdout = nil // the buffer is reused
	case *agentv1.ExecResponse_Stderr:
		r.stderr.Write(e.Stderr)
		e.Stderr = nil
	}
	return nil
}

func (r *result) exit(t *testing.T) *agentv1.ExitStatus {
	t.Helper()
	if len(r.events) < 2 {
		t.Fatalf("got %d events, want Started ... Exit", len(r.events))
	}
	if r.events[0].GetStarted().GetPid() <= 0 {
		t.Fatalf("first event %v, want Started", r.events[0])
	}
	last := r.events[len(r.events)-1].GetExit()
	if last == nil {
		t.Fatalf("last event %v, want Exit", r.events[len(r.events)-1])
	}
	return last
}

func runner(t *testing.T) *Runner {
	return &Runner{Reaper: reaper.Default(), Dir: t.TempDir(), User: testUser(), WaitDelay: 200 * time.Millisecond}
}

// testUser is who tests run commands as: root when the tests run as root
// (as in CI), else the tests' own user, the only one a non-root agent can
// run commands as.
func testUser() string {
	if os.Geteuid() == 0 {
		return "root"
	}
	return ""
}

func run(t *testing.T, r *Runner, req *agentv1.ExecRequest) (*result, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res := &result{}
	err := r.Run(ctx, req, res.send)
	return res, err
}

func sh(script string) *agentv1.ExecRequest {
	return &agentv1.ExecRequest{Argv: []string{"sh", "-c", script}}
}

func TestOutputAndExitCode(t *testing.T) {
	res, err := run(t, runner(t), sh("echo out; echo err >&2; exit 3"))
	if err != nil {
		t.Fatal(err)
	}
	if got := res.exit(t); got.Code != 3 || got.Signal != "" {
		t.Errorf("exit %v, want code 3", got)
	}
	if res.stdout.String() != "out\n" || res.stderr.String() != "err\n" {
		t.Errorf("stdout %q stderr %q", res.stdout.String(), res.stderr.String())
	}
}

func TestKilledBySignal(t *testing.T) {
	res, err := run(t, runner(t), sh("kill -KILL $$"))
	if err != nil {
		t.Fatal(err)
	}
	if got := res.exit(t); got.Code != 128+9 || got.Signal != "SIGKILL" {
		t.Errorf("exit %v, want 137 SIGKILL", got)
	}
}

func TestEnvAndDir(t *testing.T) {
	r := runner(t)
	req := sh(`echo "$FOO|$TERM|$HOME|$PATH|$(pwd)"`)
	req.Env = []string{"FOO=a=b", "TERM=xterm"}
	res, err := run(t, r, req)
	if err != nil {
		t.Fatal(err)
	}
	home := "/root"
	if u, err := r.Users.Lookup(strconv.Itoa(os.Geteuid())); os.Geteuid() != 0 && err == nil {
		home = u.Home
	}
	want := "a=b|xterm|" + home + "|/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin|" + r.Dir + "\n"
	if res.stdout.String() != want {
		t.Errorf("got %q, want %q", res.stdout.String(), want)
	}

	dir := t.TempDir()
	req = &agentv1.ExecRequest{Argv: []string{"pwd"}, Cwd: dir}
	if res, err = run(t, r, req); err != nil {
		t.Fatal(err)
	}
	if res.stdout.String() != dir+"\n" {
		t.Errorf("pwd %q, want %q", res.stdout.String(), dir)
	}
}

// TestRunnerEnv: the Runner's Env reaches every command, and the
// request's entries override it key by key.
func TestRunnerEnv(t *testing.T) {
	r := runner(t)
	r.Env = []string{"HTTP_PROXY=http://127.0.0.1:3128", "ALL_PROXY=socks5h://127.0.0.1:1080"}
	req := sh(`echo "$HTTP_PROXY|$ALL_PROXY"`)
	req.Env = []string{"ALL_PROXY=mine"}
	res, err := run(t, r, req)
	if err != nil {
		t.Fatal(err)
	}
	if got := res.stdout.String(); got != "http://127.0.0.1:3128|mine\n" {
		t.Errorf("got %q", got)
	}
}

func TestPathFromRequestEnv(t *testing.T) {
	bin := t.TempDir()
	if err := os.WriteFile(bin+"/hello-carrel", []byte("#!/bin/sh\necho hi\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	req := &agentv1.ExecRequest{Argv: []string{"hello-carrel"}, Env: []string{"PATH=" + bin}}
	res, err := run(t, runner(t), req)
	if err != nil {
		t.Fatal(err)
	}
	if res.stdout.String() != "hi\n" {
		t.Errorf("stdout %q", res.stdout.String())
	}
}

func TestLargeOutputChunks(t *testing.T) {
	const n = 3<<20 + 17
	res, err := run(t, runner(t), sh(fmt.Sprintf("head -c %d /dev/zero", n)))
	if err != nil {
		t.Fatal(err)
	}
	if res.exit(t).Code != 0 || res.stdout.Len() != n {
		t.Errorf("exit %v, %d bytes, want %d", res.exit(t), res.stdout.Len(), n)
	}
}

func TestRequestErrors(t *testing.T) {
	r := runner(t)
	many := make([]string, MaxArgs+1)
	for i := range many {
		many[i] = "x"
	}
	big := strings.Repeat("x", MaxArgBytes)
	tests := []struct {
		name string
		req  *agentv1.ExecRequest
		code connect.Code
		msg  string
	}{
		{"empty argv", &agentv1.ExecRequest{}, connect.CodeInvalidArgument, "empty argv"},
		{"too many args", &agentv1.ExecRequest{Argv: many}, connect.CodeInvalidArgument, "more than 4096"},
		{"too large", &agentv1.ExecRequest{Argv: []string{"echo", big}}, connect.CodeInvalidArgument, "bytes, more than"},
		{"NUL in arg", &agentv1.ExecRequest{Argv: []string{"echo", "a\x00b"}}, connect.CodeInvalidArgument, "NUL"},
		{"env no =", &agentv1.ExecRequest{Argv: []string{"true"}, Env: []string{"FOO"}}, connect.CodeInvalidArgument, "KEY=VALUE"},
		{"env no key", &agentv1.ExecRequest{Argv: []string{"true"}, Env: []string{"=x"}}, connect.CodeInvalidArgument, "KEY=VALUE"},
		{"relative cwd", &agentv1.ExecRequest{Argv: []string{"true"}, Cwd: "tmp"}, connect.CodeInvalidArgument, "absolute"},
		{"missing cwd", &agentv1.ExecRequest{Argv: []string{"true"}, Cwd: "/nonexistent-carrel"}, connect.CodeInvalidArgument, "no such file"},
		{"not found", &agentv1.ExecRequest{Argv: []string{"carrel-no-such-cmd"}}, connect.CodeNotFound,
			`exec: "carrel-no-such-cmd": executable file not found in $PATH`},
		{"not found with slash", &agentv1.ExecRequest{Argv: []string{"/nonexistent/foo"}}, connect.CodeNotFound,
			`exec: "/nonexistent/foo": no such file or directory`},
		{"not executable", &agentv1.ExecRequest{Argv: []string{"/etc/passwd"}}, connect.CodePermissionDenied, "permission denied"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res, err := run(t, r, tt.req)
			if connect.CodeOf(err) != tt.code || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("err %v, want %v containing %q", err, tt.code, tt.msg)
			}
			if len(res.events) != 0 {
				t.Fatalf("sent %d events for a rejected request", len(res.events))
			}
		})
	}

	missing := &Runner{Reaper: reaper.Default(), Dir: "/nonexistent-carrel", User: testUser()}
	if _, err := run(t, missing, sh("true")); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("missing default dir: %v, want failed_precondition", err)
	}
}

// TestSlowClientLosesNothing: output still in the pipe when the command
// exits is delivered even if sending it takes far longer than WaitDelay.
func TestSlowClientLosesNothing(t *testing.T) {
	r := runner(t)
	r.WaitDelay = 10 * time.Millisecond
	const n = 1 << 20
	res := &result{onStdout: func([]byte) { time.Sleep(20 * time.Millisecond) }}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := r.Run(ctx, sh(fmt.Sprintf("head -c %d /dev/zero", n)), res.send); err != nil {
		t.Fatal(err)
	}
	if res.stdout.Len() != n {
		t.Fatalf("got %d bytes, want %d", res.stdout.Len(), n)
	}
}

// TestBackgroundChildHoldsPipe: the command exits while a background child
// keeps stdout open; Run must still return after WaitDelay.
func TestBackgroundChildHoldsPipe(t *testing.T) {
	start := time.Now()
	res, err := run(t, runner(t), sh("sleep 30 & echo $!"))
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("took %v", d)
	}
	if res.exit(t).Code != 0 {
		t.Fatalf("exit %v", res.exit(t))
	}
	if pid, err := strconv.Atoi(strings.TrimSpace(res.stdout.String())); err == nil {
		unix.Kill(pid, unix.SIGKILL)
	}
}

// TestCancelKillsGroup: cancelling ctx kills the command and its children.
func TestCancelKillsGroup(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pidc := make(chan int, 1)
	res := &result{onStdout: func(b []byte) {
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			pidc <- pid
		}
	}}
	errc := make(chan error, 1)
	go func() { errc <- runner(t).Run(ctx, sh("sleep 300 & echo $!; wait"), res.send) }()

	var pid int
	select {
	case pid = <-pidc:
	case <-time.After(10 * time.Second):
		t.Fatal("no pid from the command")
	}
	cancel()
	select {
	case err := <-errc:
		if connect.CodeOf(err) != connect.CodeCanceled {
			t.Fatalf("err %v, want canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	waitGone(t, pid)
}

// waitGone waits until pid has exited (and, since we are a subreaper, been
// reaped).
func waitGone(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
		if errors.Is(err, os.ErrNotExist) {
			return
		}
		if time.Now().After(deadline) {
			stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
			t.Fatalf("pid %d still there: %s", pid, stat)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestMergeEnv(t *testing.T) {
	got := mergeEnv([]string{"A=1", "B=2"}, []string{"B=3", "C=4", "A=5"})
	want := []string{"A=5", "B=3", "C=4"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	// Layers in one pass give what merging them two at a time gave: the
	// first position of each key, its last value. A nil layer adds nothing.
	got = mergeEnv([]string{"PATH=/bin", "HOME=/"}, nil, []string{"HOME=/home/agent", "USER=agent"},
		[]string{"TERM=xterm"}, []string{"PATH=/opt/bin", "X=1", "USER=root"})
	want = []string{"PATH=/opt/bin", "HOME=/home/agent", "USER=root", "TERM=xterm", "X=1"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("layers: got %v, want %v", got, want)
	}
}

func TestExitStatus(t *testing.T) {
	// Layout as wait(2) encodes it: exit code in bits 8-15, signal in 0-6.
	if got := ExitStatus(unix.WaitStatus(3 << 8)); got.Code != 3 || got.Signal != "" {
		t.Errorf("exit 3: %v", got)
	}
	if got := ExitStatus(unix.WaitStatus(unix.SIGTERM)); got.Code != 143 || got.Signal != "SIGTERM" {
		t.Errorf("SIGTERM: %v", got)
	}
}

// TestCommandsGetBlockingStdio: a command's stdin, stdout and stderr are
// blocking and the agent's ends of the pipes nonblocking (in the
// runtime's poller), with stdin a pipe, which carries what the agent
// writes, or /dev/null; and /dev/null, which every command without stdin
// shares, stays open for the next one.
func TestCommandsGetBlockingStdio(t *testing.T) {
	const script = `for f in 0 1 2; do sed -n 's/^flags:[[:space:]]*//p' /proc/self/fdinfo/$f; done; readlink /proc/self/fd/0; read -r line; echo "$line"`
	nonblocking := func(f *os.File) bool {
		c, err := f.SyscallConn() // not Fd, which makes the file blocking
		if err != nil {
			t.Fatal(err)
		}
		var flags int
		c.Control(func(fd uintptr) { flags, _ = unix.FcntlInt(fd, unix.F_GETFL, 0) })
		return flags&unix.O_NONBLOCK != 0
	}
	r := runner(t)
	for _, withStdin := range []bool{false, true, false} {
		p, err := r.Start(sh(script), withStdin)
		if err != nil {
			t.Fatal(err)
		}
		for i, f := range append(p.outs, p.stdin) {
			if f != nil && !nonblocking(f) {
				t.Errorf("stdin %v: the agent's end %d is blocking", withStdin, i)
			}
		}
		var res result
		p.Stream(res.send)
		if withStdin {
			if err := p.WriteStdin([]byte("typed\n")); err != nil {
				t.Fatal(err)
			}
			if err := p.CloseStdin(); err != nil {
				t.Fatal(err)
			}
		}
		st, err := p.Wait(context.Background())
		if err != nil || st.Code != 0 {
			t.Fatalf("stdin %v: exit %v, %v: %s", withStdin, st, err, res.stderr.String())
		}
		lines := strings.Fields(res.stdout.String())
		if want := map[bool]int{false: 4, true: 5}[withStdin]; len(lines) != want || withStdin && lines[4] != "typed" {
			t.Fatalf("stdin %v: output %q", withStdin, res.stdout.String())
		}
		for i, l := range lines[:3] {
			flags, err := strconv.ParseUint(l, 8, 64)
			if err != nil {
				t.Fatal(err)
			}
			if flags&unix.O_NONBLOCK != 0 {
				t.Errorf("stdin %v: fd %d of the command is nonblocking (flags %o)", withStdin, i, flags)
			}
		}
		if wantNull := !withStdin; (lines[3] == os.DevNull) != wantNull {
			t.Errorf("stdin %v: stdin is %s", withStdin, lines[3])
		}
	}
}
