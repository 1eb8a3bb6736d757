//go:build linux

package exec

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/cgroups"
	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/pty"
	"github.com/carrel-os/carrel/guest-agent/reaper"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
)

var (
	// ErrNoStdin is returned by WriteStdin and CloseStdin for a command
	// started without stdin.
	ErrNoStdin = errors.New("exec: the command has no stdin")
	// ErrStdinClosed is returned by WriteStdin after CloseStdin.
	ErrStdinClosed = errors.New("exec: stdin is closed")
	// ErrNoTTY is returned by Resize for a command without a terminal.
	ErrNoTTY = errors.New("exec: the command has no terminal")
)

// errFinished marks a Proc's lifetime context once it has finished
// normally, so that a later Abort changes nothing.
var errFinished = errors.New("exec: finished")

// Proc is a command started by Runner.Start.
type Proc struct {
	// ID names the command for attach and signal: 16 hex digits.
	ID string
	// Pid is the command's pid, and the id of its process group.
	Pid int

	r  *Runner
	rp *reaper.Process
	// group names the command's cgroup ("" for none), which it may leave
	// for a later command (keepGroup) once its processes are gone.
	group     string
	keepGroup bool
	argv0     string
	tty       *os.File   // pty master; nil without a terminal
	outs      []*os.File // what the pumps read: stdout and stderr, or the master

	stdinMu     sync.Mutex
	stdin       *os.File // pipe write end, or the master; nil for none
	stdinClosed bool     // by CloseStdin

	ctx   context.Context // ends when the command is aborted
	abort context.CancelCauseFunc

	streamed atomic.Bool
	sendMu   sync.Mutex
	send     func(*agentv1.ExecResponse) error
	exited   atomic.Bool

	done chan struct{}
	exit *agentv1.ExitStatus // set before done is closed
	err  error               // likewise: why it was aborted, or nil
}

// Start validates req and starts the command: in its own process group, or,
// with tty, as the leader of a new session whose controlling terminal is a
// new pty. Without a tty, stdin is a pipe that WriteStdin feeds when stdin
// is true, and /dev/null otherwise; on a terminal, WriteStdin always types
// into it. The command is registered under its ID until it has been reaped.
//
// Nothing is read from the command's output until Stream, which the caller
// must call exactly once (even if it then aborts), or the command is never
// reaped. Errors are as for Run.
func (r *Runner) Start(req *agentv1.ExecRequest, stdin bool) (*Proc, error) {
	c, err := r.prepare(req)
	if err != nil {
		return nil, err
	}
	id, group := r.newGroup()
	p, err := r.start(c, stdin, id, group)
	if err != nil {
		if group != nil {
			r.Cgroups.Release(group.Name, true) // nothing ran in it
		}
		return nil, err
	}
	// Only a command run as an unprivileged user leaves its group as it
	// found it: the group's files belong to root.
	if group != nil {
		p.group, p.keepGroup = group.Name, c.cred != nil && c.cred.Uid != 0
	}
	r.register(p)
	if r.OnStart != nil {
		r.OnStart(p.Pid, p.ID)
	}
	return p, nil
}

// newGroup picks the id of a command about to start and, with Cgroups,
// its group: one an earlier command left empty (Cgroups.Take), else the
// one made ahead for it, else a new one, named by the id. When a group is
// made, the next command's group is made ahead, off this command's path:
// making a cgroup costs an emulated guest over a millisecond. Without
// Cgroups (or if no group can be had) the id is "", for register to
// pick, and the group nil.
func (r *Runner) newGroup() (id string, g *cgroups.Group) {
	if r.Cgroups == nil {
		return "", nil
	}
	id = r.freshID()
	if g, ok := r.Cgroups.Take(id); ok {
		return id, g
	}
	r.mu.Lock()
	g = r.spare
	r.spare = nil
	r.mu.Unlock()
	if g != nil && !g.Empty() { // changed by root in the guest meanwhile
		r.Cgroups.Discard(g.Name)
		g = nil
	}
	if g == nil {
		if g = r.makeGroup(); g == nil {
			return "", nil
		}
	}
	go r.makeSpare()
	return g.Name, g
}

// freshID is a command id that no running command has.
func (r *Runner) freshID() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		if id := NewID(); r.running[id] == nil {
			return id
		}
	}
}

func (r *Runner) makeGroup() *cgroups.Group {
	for range 4 { // a taken id (os.ErrExist) is all but impossible
		g, err := r.Cgroups.Create(NewID())
		if err == nil {
			return g
		}
		if !errors.Is(err, os.ErrExist) {
			break
		}
	}
	return nil
}

// makeSpare makes the next command's group, unless one is ready.
func (r *Runner) makeSpare() {
	r.mu.Lock()
	ready := r.spare != nil
	r.mu.Unlock()
	if ready {
		return
	}
	g := r.makeGroup()
	if g == nil {
		return
	}
	r.mu.Lock()
	if r.spare == nil {
		r.spare, g = g, nil
	}
	r.mu.Unlock()
	if g != nil { // another was made meanwhile
		r.Cgroups.Remove(g.Name)
	}
}

// start starts the command with the given id ("" for register to pick),
// in group when that is not nil.
func (r *Runner) start(c *command, withStdin bool, id string, group *cgroups.Group) (_ *Proc, err error) {
	p := &Proc{ID: id, r: r, argv0: c.argv[0], done: make(chan struct{})}
	var childFiles []*os.File // the child's ends, closed here once it has them
	defer func() {
		for _, f := range childFiles {
			f.Close()
		}
		if err != nil {
			for _, f := range append(p.outs, p.stdin) {
				if f != nil {
					f.Close()
				}
			}
		}
	}()
	internal := func(what string, err error) error {
		return connect.NewError(connect.CodeInternal, fmt.Errorf("exec: %s: %w", what, err))
	}
	sys := &syscall.SysProcAttr{Credential: c.cred}
	if group != nil {
		sys.UseCgroupFD, sys.CgroupFD = true, group.FD()
	}
	var files []*os.File
	if c.tty {
		master, slave, err := pty.Open()
		if err != nil {
			return nil, internal("terminal", err)
		}
		p.tty, p.stdin, p.outs = master, master, []*os.File{master}
		childFiles = append(childFiles, slave)
		if err := pty.SetSize(master, c.rows, c.cols); err != nil {
			return nil, internal("terminal size", err)
		}
		if c.cred != nil { // as login does: the terminal belongs to its user
			if err := errors.Join(slave.Chown(int(c.cred.Uid), int(c.cred.Gid)), slave.Chmod(0o620)); err != nil {
				return nil, internal("terminal owner", err)
			}
		}
		files = []*os.File{slave, slave, slave}
		// A session leader is its own process group; Setpgid would fail.
		sys.Setsid, sys.Setctty, sys.Ctty = true, true, 0
	} else {
		var in *os.File
		if withStdin {
			inW, inR, err := pipe(true)
			if err != nil {
				return nil, internal("stdin pipe", err)
			}
			p.stdin, in = inW, inR
			childFiles = append(childFiles, in)
		} else if in, err = r.devNull(); err != nil {
			return nil, internal("open stdin", err)
		}
		outR, outW, err := pipe(false)
		if err != nil {
			return nil, internal("stdout pipe", err)
		}
		p.outs = append(p.outs, outR)
		childFiles = append(childFiles, outW)
		errR, errW, err := pipe(false)
		if err != nil {
			return nil, internal("stderr pipe", err)
		}
		p.outs = append(p.outs, errR)
		childFiles = append(childFiles, errW)
		files = []*os.File{in, outW, errW}
		sys.Setpgid = true
	}

	// The child is forked from a thread confined for it; sys must not set
	// Pdeathsig, which would fire when that thread exits.
	var rp *reaper.Process
	landlocked, err := r.Sandbox.Spawn(func() (err error) {
		rp, err = r.Reaper.Start(c.path, c.argv, &os.ProcAttr{Dir: c.dir, Env: c.env, Files: files, Sys: sys})
		return err
	})
	if err != nil {
		if errors.Is(err, sandbox.ErrConfine) {
			return nil, internal("start", err)
		}
		if pe, ok := errors.AsType[*os.PathError](err); ok {
			err = pe.Err
		}
		if errors.Is(err, syscall.EACCES) && landlocked {
			return nil, connect.NewError(connect.CodePermissionDenied, fmt.Errorf(
				"exec: %q: permission denied, by the guest sandbox or by file permissions (the program, or the working directory %q)", c.argv[0], c.dir))
		}
		if errors.Is(err, syscall.EACCES) && c.cred != nil && c.cred.Uid != 0 {
			// The child cannot say which step failed; name both suspects.
			return nil, connect.NewError(connect.CodePermissionDenied, fmt.Errorf(
				"exec: %q: permission denied to uid %d (the program, or the working directory %q)", c.argv[0], c.cred.Uid, c.dir))
		}
		return nil, startError(&os.PathError{Op: "exec", Path: c.argv[0], Err: err})
	}
	p.rp, p.Pid = rp, rp.Pid
	p.ctx, p.abort = context.WithCancelCause(context.Background())
	return p, nil
}

// pipe makes a pipe for a command's stdin (in: the agent writes) or its
// stdout or stderr, and returns the agent's end, nonblocking and in the
// runtime's poller, then the command's, blocking and not in the poller.
// os.Pipe would make both ends nonblocking and put both in the poller,
// and StartProcess then make the command's blocking again: a dozen
// system calls more per command.
func pipe(in bool) (ours, theirs *os.File, err error) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return nil, nil, os.NewSyscallError("pipe2", err)
	}
	o, t := p[0], p[1]
	if in {
		o, t = t, o
	}
	// A new pipe's end has no status flag to keep: set O_NONBLOCK alone,
	// without reading them first.
	if _, err := unix.FcntlInt(uintptr(o), unix.F_SETFL, unix.O_NONBLOCK); err != nil {
		unix.Close(o)
		unix.Close(t)
		return nil, nil, os.NewSyscallError("fcntl", err)
	}
	return os.NewFile(uintptr(o), "|agent"), os.NewFile(uintptr(t), "|command"), nil
}

// devNull is /dev/null, open for reading, for every command started
// without stdin; it stays open for the Runner's life.
func (r *Runner) devNull() (*os.File, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.null == nil {
		f, err := os.Open(os.DevNull)
		if err != nil {
			return nil, err
		}
		r.null = f
	}
	return r.null, nil
}

// NewID returns a fresh command id: 16 random hex digits.
func NewID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func (r *Runner) register(p *Proc) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running == nil {
		r.running = make(map[string]*Proc)
	}
	for p.ID == "" || r.running[p.ID] != nil {
		p.ID = NewID()
	}
	r.running[p.ID] = p
}

func (r *Runner) unregister(p *Proc) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.running, p.ID)
}

// Lookup returns the running command with the id, or nil.
func (r *Runner) Lookup(id string) *Proc {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.running[id]
}

// Running returns the ids of the running commands by pid.
func (r *Runner) Running() map[int]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	ids := make(map[int]string, len(r.running))
	for id, p := range r.running {
		ids[p.Pid] = id
	}
	return ids
}

// TTY reports whether the command runs on a terminal.
func (p *Proc) TTY() bool { return p.tty != nil }

// Started returns the Started event for the command.
func (p *Proc) Started() *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: int32(p.Pid), Id: p.ID}}}
}

// Stream starts sending the command's output to send, as stdout and stderr
// chunks of at most protocol.ExecChunkBytes (only stdout on a terminal),
// and returns. send is never called concurrently, and may keep no reference
// to a chunk's bytes once it returns. If send fails, the command is aborted.
// Once the command has exited and its output is drained (see
// Runner.WaitDelay), Done is closed. Stream panics if called twice.
func (p *Proc) Stream(send func(*agentv1.ExecResponse) error) {
	if p.streamed.Swap(true) {
		panic("exec: Stream called twice")
	}
	p.send = send
	var wg sync.WaitGroup
	for i, f := range p.outs {
		event := stdoutEvent
		if i == 1 {
			event = stderrEvent
		}
		wg.Go(func() { p.pump(f, event) })
	}
	go p.supervise(&wg)
}

// supervise waits for the command to exit, or kills its group once it is
// aborted, then waits for the pumps and releases everything.
func (p *Proc) supervise(pumps *sync.WaitGroup) {
	ws, err := p.rp.Wait(p.ctx)
	if err != nil {
		_ = p.rp.SignalGroup(unix.SIGKILL)
		ws, _ = p.rp.Wait(context.Background()) // SIGKILL cannot be ignored
	}
	p.r.unregister(p)
	if p.r.Cgroups != nil && p.group != "" {
		p.r.Cgroups.Release(p.group, p.keepGroup)
	}
	p.exited.Store(true)
	quiet := time.Now().Add(p.r.waitDelay())
	for _, f := range p.outs {
		f.SetReadDeadline(quiet)
	}
	stop := context.AfterFunc(p.ctx, func() { // nobody is listening any more
		for _, f := range p.outs {
			f.SetReadDeadline(time.Now())
		}
	})
	pumps.Wait()
	stop()
	p.err = context.Cause(p.ctx)
	p.abort(errFinished)
	p.stdinMu.Lock()
	if p.stdin != nil && p.stdin != p.tty {
		p.stdin.Close()
	}
	p.stdinMu.Unlock()
	for _, f := range p.outs {
		f.Close() // the master too: the terminal hangs up
	}
	p.exit = ExitStatus(ws)
	close(p.done)
}

// chunkPool holds the pumps' read buffers: two per command, which would
// otherwise be 64 KiB for the allocator to clear and the collector to
// find for each command, whatever its output. send keeps no reference to
// a chunk once it returns (see Stream).
var chunkPool = sync.Pool{New: func() any { return new([protocol.ExecChunkBytes]byte) }}

// pump sends what it reads from f until EOF (EIO for a hung-up terminal), a
// failed send, or an abort. Once the command has exited, each read may wait
// at most WaitDelay for data. Each chunk is sent before the buffer is
// reused.
func (p *Proc) pump(f *os.File, event func([]byte) *agentv1.ExecResponse) {
	bp := chunkPool.Get().(*[protocol.ExecChunkBytes]byte)
	defer chunkPool.Put(bp)
	buf := bp[:]
	for {
		n, err := f.Read(buf)
		if n > 0 {
			p.sendMu.Lock()
			serr := p.send(event(buf[:n]))
			p.sendMu.Unlock()
			if serr != nil {
				p.Abort(fmt.Errorf("exec: send: %w", serr))
				return
			}
		}
		if err != nil || p.ctx.Err() != nil {
			return
		}
		if p.exited.Load() {
			f.SetReadDeadline(time.Now().Add(p.r.waitDelay()))
		}
	}
}

// Abort kills the command's process group with SIGKILL and stops reading
// its output; Wait then returns an error built from cause. It does nothing
// once the command has finished.
func (p *Proc) Abort(cause error) { p.abort(cause) }

// Done is closed once the command has been reaped and its output drained.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Exit returns how the command ended, once Done is closed.
func (p *Proc) Exit() *agentv1.ExitStatus { return p.exit }

// Wait waits until Done and returns the exit status. If ctx ends first, it
// aborts the command. If the command was aborted, the error is
// CodeCanceled or CodeDeadlineExceeded for a context's end, and otherwise
// the cause given to Abort.
func (p *Proc) Wait(ctx context.Context) (*agentv1.ExitStatus, error) {
	stop := context.AfterFunc(ctx, func() { p.Abort(context.Cause(ctx)) })
	<-p.done
	stop()
	if p.err != nil {
		switch {
		case errors.Is(p.err, context.DeadlineExceeded):
			return nil, connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("exec %q: killed: %w", p.argv0, p.err))
		case errors.Is(p.err, context.Canceled):
			return nil, connect.NewError(connect.CodeCanceled, fmt.Errorf("exec %q: killed: %w", p.argv0, p.err))
		}
		return nil, p.err
	}
	return p.exit, nil
}

// WriteStdin writes b to the command's stdin, blocking while the pipe or
// terminal is full. Input the command can no longer read (it closed stdin
// or exited) is dropped without error.
func (p *Proc) WriteStdin(b []byte) error {
	p.stdinMu.Lock()
	f, closed := p.stdin, p.stdinClosed
	p.stdinMu.Unlock()
	switch {
	case f == nil:
		return ErrNoStdin
	case closed:
		return ErrStdinClosed
	}
	if _, err := f.Write(b); err != nil && !errors.Is(err, syscall.EPIPE) && !errors.Is(err, os.ErrClosed) &&
		!errors.Is(err, syscall.EIO) {
		return fmt.Errorf("exec: write stdin: %w", err)
	}
	return nil
}

// CloseStdin ends the command's input: it closes the pipe, or, on a
// terminal, types the terminal's EOF character (^D), which ends a read at
// the start of a line. Closing twice is not an error.
func (p *Proc) CloseStdin() error {
	if p.tty != nil {
		return p.WriteStdin([]byte{pty.EOF(p.tty)})
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin == nil {
		return ErrNoStdin
	}
	if !p.stdinClosed {
		p.stdinClosed = true
		p.stdin.Close()
	}
	return nil
}

// Signal sends sig to the command's process group. It returns
// os.ErrProcessDone once the command has been reaped.
func (p *Proc) Signal(sig unix.Signal) error { return p.rp.SignalGroup(sig) }

// Resize sets the terminal's size; see pty.SetSize. Once the command has
// exited, it does nothing.
func (p *Proc) Resize(rows, cols uint32) error {
	if p.tty == nil {
		return ErrNoTTY
	}
	err := pty.SetSize(p.tty, rows, cols)
	if err != nil && !errors.Is(err, pty.ErrBadSize) && p.exited.Load() {
		return nil // the terminal is closing
	}
	return err
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
