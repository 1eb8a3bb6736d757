//go:build linux

// Package exec runs one ExecRequest: it validates the request, starts the
// command in its own process group through the reaper, streams its output as
// it arrives, and reports how it ended.
package exec

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/reaper"
)

const (
	// MaxArgs caps the number of argv entries, and separately of env entries.
	MaxArgs = 4096
	// MaxArgBytes caps the total size of argv, env and cwd.
	MaxArgBytes = 1 << 20
	// DefaultDir is the working directory when the request names none.
	DefaultDir = "/workspace"
	// DefaultWaitDelay is how long output is still read after the command
	// exits; see Runner.WaitDelay.
	DefaultWaitDelay = time.Second
)

// DefaultEnv is the environment every command starts with; the request's
// entries override it key by key.
var DefaultEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"HOME=/root",
	"TERM=dumb",
}

// Runner runs commands. The zero value is not usable: Reaper must be set.
type Runner struct {
	// Reaper starts and waits for every command.
	Reaper *reaper.Reaper
	// Dir replaces DefaultDir when set (tests).
	Dir string
	// WaitDelay matters when a background child still holds stdout or
	// stderr open after the command exits: output is then read until both
	// pipes have been quiet for WaitDelay, after which our read ends are
	// closed and the child is left running. Output already in a pipe is
	// never dropped, however slowly the client reads it. Zero means
	// DefaultWaitDelay.
	WaitDelay time.Duration
}

// Run runs req and sends, in order: one Started, stdout and stderr chunks of
// at most protocol.ExecChunkBytes each as they arrive, then one Exit once the
// command has exited and both pipes are drained. send is never called
// concurrently.
//
// Errors are *connect.Error: CodeInvalidArgument for a malformed request,
// CodeNotFound when the program is not found (message like os/exec's:
// exec: "foo": executable file not found in $PATH), CodeFailedPrecondition
// when the default working directory is missing. If ctx ends first, or a
// send fails, Run kills the whole process group with SIGKILL, waits for it,
// and returns CodeCanceled or CodeDeadlineExceeded (or the send error).
func (r *Runner) Run(ctx context.Context, req *agentv1.ExecRequest, send func(*agentv1.ExecResponse) error) error {
	c, err := r.prepare(req)
	if err != nil {
		return err
	}
	return r.run(ctx, c, send)
}

// command is a validated request.
type command struct {
	path string // resolved program
	argv []string
	env  []string
	dir  string
}

func (r *Runner) prepare(req *agentv1.ExecRequest) (*command, error) {
	if err := validate(req); err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	env := mergeEnv(DefaultEnv, req.GetEnv())
	dir := req.GetCwd()
	if dir == "" {
		dir = r.Dir
		if dir == "" {
			dir = DefaultDir
		}
		if err := checkDir(dir); err != nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition, err)
		}
	} else if err := checkDir(dir); err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	path, err := lookPath(req.Argv[0], getenv(env, "PATH"), dir)
	if err != nil {
		return nil, startError(err)
	}
	return &command{path: path, argv: req.Argv, env: env, dir: dir}, nil
}

func validate(req *agentv1.ExecRequest) error {
	argv, env := req.GetArgv(), req.GetEnv()
	switch {
	case len(argv) == 0:
		return errors.New("exec: empty argv")
	case argv[0] == "":
		return errors.New("exec: empty program name")
	case len(argv) > MaxArgs:
		return fmt.Errorf("exec: %d arguments, more than %d", len(argv), MaxArgs)
	case len(env) > MaxArgs:
		return fmt.Errorf("exec: %d environment entries, more than %d", len(env), MaxArgs)
	}
	total := len(req.GetCwd())
	for _, a := range argv {
		total += len(a) + 1
		if strings.IndexByte(a, 0) >= 0 {
			return errors.New("exec: argument contains NUL")
		}
	}
	for _, kv := range env {
		total += len(kv) + 1
		k, _, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return fmt.Errorf("exec: environment entry %q is not KEY=VALUE", truncate(kv))
		}
		if strings.IndexByte(kv, 0) >= 0 {
			return fmt.Errorf("exec: environment entry %q contains NUL", truncate(k))
		}
	}
	if total > MaxArgBytes {
		return fmt.Errorf("exec: arguments and environment are %d bytes, more than %d", total, MaxArgBytes)
	}
	if cwd := req.GetCwd(); cwd != "" && (!filepath.IsAbs(cwd) || strings.IndexByte(cwd, 0) >= 0) {
		return fmt.Errorf("exec: working directory %q is not an absolute path", truncate(cwd))
	}
	return nil
}

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

// mergeEnv returns base with extra applied in order; a later entry replaces
// an earlier one with the same key, keeping the earlier position.
func mergeEnv(base, extra []string) []string {
	out := make([]string, 0, len(base)+len(extra))
	index := make(map[string]int)
	for _, kv := range append(base[:len(base):len(base)], extra...) {
		k, _, _ := strings.Cut(kv, "=")
		if i, ok := index[k]; ok {
			out[i] = kv
			continue
		}
		index[k] = len(out)
		out = append(out, kv)
	}
	return out
}

func getenv(env []string, key string) string {
	for _, kv := range env {
		if k, v, _ := strings.Cut(kv, "="); k == key {
			return v
		}
	}
	return ""
}

func checkDir(dir string) error {
	fi, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("exec: working directory: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("exec: working directory %q is not a directory", dir)
	}
	return nil
}

// errNotFound is returned by lookPath when no PATH entry has the program.
var errNotFound = errors.New("executable file not found in $PATH")

// lookPath resolves name the way execvp does, but against the command's
// own PATH rather than the agent's. A name with a slash is used as is
// (relative to dir).
func lookPath(name, path, dir string) (string, error) {
	if strings.Contains(name, "/") {
		p := name
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if err := executable(p); err != nil {
			return "", &os.PathError{Op: "exec", Path: name, Err: err}
		}
		return p, nil
	}
	for _, d := range filepath.SplitList(path) {
		if d == "" {
			d = "."
		}
		p := filepath.Join(d, name)
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if executable(p) == nil {
			return p, nil
		}
	}
	return "", &os.PathError{Op: "exec", Path: name, Err: errNotFound}
}

func executable(p string) error {
	fi, err := os.Stat(p)
	if pe, ok := errors.AsType[*os.PathError](err); ok {
		return pe.Err
	} else if err != nil {
		return err
	}
	if fi.IsDir() {
		return syscall.EISDIR
	}
	if fi.Mode()&0o111 == 0 {
		return os.ErrPermission
	}
	return nil
}

// startError maps a failure to find or start the program to a connect code.
func startError(err error) error {
	msg := err.Error()
	if pe, ok := errors.AsType[*os.PathError](err); ok {
		// exec: "foo": executable file not found in $PATH
		msg = fmt.Sprintf("exec: %q: %v", pe.Path, pe.Err)
	}
	code := connect.CodeInternal
	switch {
	case errors.Is(err, errNotFound), errors.Is(err, os.ErrNotExist):
		code = connect.CodeNotFound
	case errors.Is(err, os.ErrPermission), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ENOEXEC):
		code = connect.CodePermissionDenied
	}
	return connect.NewError(code, errors.New(msg))
}

func (r *Runner) run(ctx context.Context, c *command, send func(*agentv1.ExecResponse) error) error {
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		return connect.NewError(connect.CodeInternal, fmt.Errorf("exec: open stdin: %w", err))
	}
	defer devNull.Close()
	outR, outW, err := os.Pipe()
	if err != nil {
		return connect.NewError(connect.CodeInternal, fmt.Errorf("exec: stdout pipe: %w", err))
	}
	defer outR.Close()
	errR, errW, err := os.Pipe()
	if err != nil {
		outW.Close()
		return connect.NewError(connect.CodeInternal, fmt.Errorf("exec: stderr pipe: %w", err))
	}
	defer errR.Close()

	p, err := r.Reaper.Start(c.path, c.argv, &os.ProcAttr{
		Dir:   c.dir,
		Env:   c.env,
		Files: []*os.File{devNull, outW, errW},
		Sys:   &syscall.SysProcAttr{Setpgid: true},
	})
	// Our copies of the write ends must go, or the pipes never reach EOF.
	outW.Close()
	errW.Close()
	if err != nil {
		if pe, ok := errors.AsType[*os.PathError](err); ok {
			err = pe.Err
		}
		return startError(&os.PathError{Op: "exec", Path: c.argv[0], Err: err})
	}

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var mu sync.Mutex
	sendLocked := func(m *agentv1.ExecResponse) error {
		mu.Lock()
		defer mu.Unlock()
		if err := send(m); err != nil {
			cancel(fmt.Errorf("exec: send: %w", err))
			return err
		}
		return nil
	}

	var wg sync.WaitGroup
	var exited atomic.Bool
	if sendLocked(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: int32(p.Pid)}}}) == nil {
		for _, o := range []struct {
			f     *os.File
			event func([]byte) *agentv1.ExecResponse
		}{{outR, stdoutEvent}, {errR, stderrEvent}} {
			wg.Go(func() { pump(ctx, o.f, &exited, r.waitDelay(), sendLocked, o.event) })
		}
	}

	ws, err := p.Wait(ctx)
	if err != nil {
		_ = p.SignalGroup(unix.SIGKILL)
		ws, _ = p.Wait(context.Background()) // SIGKILL cannot be ignored
	}
	exited.Store(true)
	quiet := time.Now().Add(r.waitDelay())
	outR.SetReadDeadline(quiet)
	errR.SetReadDeadline(quiet)
	stop := context.AfterFunc(ctx, func() { // nobody is listening any more
		outR.SetReadDeadline(time.Now())
		errR.SetReadDeadline(time.Now())
	})
	wg.Wait()
	stop()

	if err := context.Cause(ctx); err != nil {
		switch {
		case errors.Is(err, context.DeadlineExceeded):
			return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("exec %q: killed: %w", c.argv[0], err))
		case errors.Is(err, context.Canceled):
			return connect.NewError(connect.CodeCanceled, fmt.Errorf("exec %q: killed: %w", c.argv[0], err))
		}
		return err
	}
	return sendLocked(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: ExitStatus(ws)}})
}

func (r *Runner) waitDelay() time.Duration {
	if r.WaitDelay > 0 {
		return r.WaitDelay
	}
	return DefaultWaitDelay
}

func stdoutEvent(b []byte) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: b}}
}

func stderrEvent(b []byte) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stderr{Stderr: b}}
}

// pump sends what it reads from f until EOF, a failed send, or ctx's end.
// Once the command has exited, each read may wait at most delay for data.
// Each chunk is sent before the buffer is reused; send marshals
// synchronously.
func pump(ctx context.Context, f *os.File, exited *atomic.Bool, delay time.Duration,
	send func(*agentv1.ExecResponse) error, event func([]byte) *agentv1.ExecResponse) {
	buf := make([]byte, protocol.ExecChunkBytes)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			if send(event(buf[:n])) != nil {
				return
			}
		}
		if err != nil || ctx.Err() != nil {
			return
		}
		if exited.Load() {
			f.SetReadDeadline(time.Now().Add(delay))
		}
	}
}

// ExitStatus converts a wait status: the exit code, or 128+signal number and
// the signal's name when a signal ended the process.
func ExitStatus(ws unix.WaitStatus) *agentv1.ExitStatus {
	if ws.Signaled() {
		return &agentv1.ExitStatus{Code: 128 + int32(ws.Signal()), Signal: unix.SignalName(ws.Signal())}
	}
	return &agentv1.ExitStatus{Code: int32(ws.ExitStatus())}
}
