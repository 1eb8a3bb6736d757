//go:build linux

// Package exec runs the commands of ExecRequests: it validates a request,
// resolves the user to run as, starts the command in its own process group
// (or session, on a terminal) through the reaper, streams its output as it
// arrives, feeds its stdin, and reports how it ended. It keeps a registry of
// the commands still running, by id, for signals and process listings.
//
// Every command starts with no_new_privs (setuid programs such as sudo do
// not raise its privileges) and, once the host has set a sandbox and the
// kernel has Landlock, inside the sandbox's Landlock domain: see
// sandbox.Guard.Spawn.
package exec

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/cgroups"
	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/pty"
	"github.com/carrel-os/carrel/guest-agent/reaper"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
	"github.com/carrel-os/carrel/guest-agent/user"
)

const (
	// MaxArgs caps the number of argv entries, and separately of env entries.
	MaxArgs = 4096
	// MaxArgBytes caps the total size of argv, env and cwd.
	MaxArgBytes = 1 << 20
	// DefaultDir is the working directory when the request names none.
	DefaultDir = "/workspace"
	// DefaultUser runs commands whose request names no user.
	DefaultUser = "agent"
	// DefaultWaitDelay is how long output is still read after the command
	// exits; see Runner.WaitDelay.
	DefaultWaitDelay = time.Second
	// DefaultRows and DefaultCols size a terminal whose request gives no
	// size.
	DefaultRows, DefaultCols = 24, 80
	// TTYTerm is TERM on a terminal unless the request sets it.
	TTYTerm = "xterm-256color"
)

// DefaultEnv is the environment every command starts with, before the
// user's HOME, USER, LOGNAME and SHELL; the request's entries override it
// key by key.
var DefaultEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"TERM=dumb",
}

// Runner runs commands and keeps track of those still running. The zero
// value is not usable: Reaper must be set. A Runner must not be copied.
type Runner struct {
	// Reaper starts and waits for every command.
	Reaper *reaper.Reaper
	// Sandbox confines every command as it starts: no_new_privs, and the
	// Landlock domain of the sandbox in force, if any. nil gives
	// no_new_privs only.
	Sandbox *sandbox.Guard
	// Dir replaces DefaultDir when set (tests).
	Dir string
	// User replaces DefaultUser when set (tests).
	User string
	// Users is where user names are looked up; the zero value means
	// /etc/passwd and /etc/group.
	Users user.Files
	// WaitDelay matters when a background child still holds stdout or
	// stderr open after the command exits: output is then read until both
	// pipes have been quiet for WaitDelay, after which our read ends are
	// closed and the child is left running. Output already in a pipe is
	// never dropped, however slowly the client reads it. Zero means
	// DefaultWaitDelay.
	WaitDelay time.Duration
	// Cgroups, when set, starts every command in a cgroup of its own (one
	// made for it and named by its id, or one an earlier command left
	// empty), which every process it starts inherits. A command that can
	// have no group starts without one.
	Cgroups *cgroups.Dir
	// Env is added to DefaultEnv for every command (carrel-agent puts the
	// egress proxies' HTTP_PROXY and the like here); the request's
	// entries override it key by key.
	Env []string
	// OnStart, when set, is told each command's pid and id as it starts,
	// before Start returns (package activity uses it to attribute what
	// the command does).
	OnStart func(pid int, id string)

	users   user.Cache // lookups in Users
	mu      sync.Mutex
	running map[string]*Proc // by id
	spare   *cgroups.Group   // the next command's cgroup, made ahead
	null    *os.File         // see devNull
}

// Run runs req for the Exec call, with no input (stdin is /dev/null, or
// the terminal with tty, which nothing writes to). It sends, in order: one
// Started, stdout and stderr chunks of at most protocol.ExecChunkBytes each
// as they arrive, then one Exit once the command has exited and its output
// is drained. send is never called concurrently, and an output event's
// bytes are valid only until send returns (the buffer is reused).
//
// Errors are *connect.Error: CodeInvalidArgument for a malformed request
// (detach included: only the Process call can detach) or an unknown user,
// CodePermissionDenied when the agent cannot switch to the user (it is not
// root), CodeNotFound when the program is not found (message like os/exec's:
// exec: "foo": executable file not found in $PATH), CodeFailedPrecondition
// when the default working directory is missing. If ctx ends first, or a
// send fails, Run kills the whole process group with SIGKILL, waits for it,
// and returns CodeCanceled or CodeDeadlineExceeded (or the send error).
func (r *Runner) Run(ctx context.Context, req *agentv1.ExecRequest, send func(*agentv1.ExecResponse) error) error {
	if req.GetDetach() {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("exec: detach needs the Process call"))
	}
	p, err := r.Start(req, false)
	if err != nil {
		return err
	}
	if err := send(p.Started()); err != nil {
		p.Abort(fmt.Errorf("exec: send: %w", err))
	}
	p.Stream(send)
	exit, err := p.Wait(ctx)
	if err != nil {
		return err
	}
	return send(ExitEvent(exit))
}

// command is a validated request.
type command struct {
	path       string // resolved program
	argv       []string
	env        []string
	dir        string
	cred       *syscall.Credential // nil: run as the agent's own user
	tty        bool
	rows, cols uint32
}

func (r *Runner) prepare(req *agentv1.ExecRequest) (*command, error) {
	if err := validate(req); err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	u, cred, err := r.resolveUser(req.GetUser())
	if err != nil {
		return nil, err
	}
	c := &command{argv: req.Argv, cred: cred, tty: req.GetTty(), rows: req.GetRows(), cols: req.GetCols()}
	var term []string
	if c.tty {
		term = []string{"TERM=" + TTYTerm}
		if c.rows == 0 {
			c.rows = DefaultRows
		}
		if c.cols == 0 {
			c.cols = DefaultCols
		}
	}
	c.env = mergeEnv(DefaultEnv, r.Env, u.Env(), term, req.GetEnv())
	c.dir = req.GetCwd()
	if c.dir == "" {
		c.dir = r.Dir
		if c.dir == "" {
			c.dir = DefaultDir
		}
		if err := checkDir(c.dir); err != nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition, err)
		}
	} else if err := checkDir(c.dir); err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	if c.path, err = lookPath(req.Argv[0], getenv(c.env, "PATH"), c.dir); err != nil {
		return nil, startError(err)
	}
	return c, nil
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
	case req.GetTty() && (req.GetRows() > pty.MaxSize || req.GetCols() > pty.MaxSize):
		return fmt.Errorf("exec: terminal size %dx%d: %w", req.GetRows(), req.GetCols(), pty.ErrBadSize)
	case req.GetDetachAtStart() && !req.GetDetach():
		return errors.New("exec: detach_at_start needs detach")
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

// mergeEnv returns the layers applied in order: a later entry replaces an
// earlier one with the same key, keeping the earlier position. A command's
// environment is its layers merged in one pass, not two at a time.
func mergeEnv(layers ...[]string) []string {
	n := 0
	for _, l := range layers {
		n += len(l)
	}
	out := make([]string, 0, n)
	index := make(map[string]int, n)
	for _, l := range layers {
		for _, kv := range l {
			k, _, _ := strings.Cut(kv, "=")
			if i, ok := index[k]; ok {
				out[i] = kv
				continue
			}
			index[k] = len(out)
			out = append(out, kv)
		}
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

// ExitStatus converts a wait status: the exit code, or 128+signal number and
// the signal's name when a signal ended the process.
func ExitStatus(ws unix.WaitStatus) *agentv1.ExitStatus {
	if ws.Signaled() {
		return &agentv1.ExitStatus{Code: 128 + int32(ws.Signal()), Signal: unix.SignalName(ws.Signal())}
	}
	return &agentv1.ExitStatus{Code: int32(ws.ExitStatus())}
}

// ExitEvent wraps an exit status in a response.
func ExitEvent(e *agentv1.ExitStatus) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: e}}
}
