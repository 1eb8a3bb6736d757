//go:build linux

// Package proctable serves the interactive Process stream: it feeds a
// command's stdin, signals and terminal size from the client, and keeps
// detached commands, with their latest output, for a later attach. It also
// signals commands by id for the Signal call.
package proctable

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/exec"
	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/pty"
)

const (
	// MaxDetached caps the detached commands kept, running or exited.
	MaxDetached = 256
	// OutputBytes caps the output kept for each detached command: the
	// newest bytes, which every attach replays.
	OutputBytes = 1 << 20
	// KeepExited is how long an exited detached command waits for a client
	// to collect its output and exit status.
	KeepExited = 10 * time.Minute
	// MaxSignal is the highest signal number (SIGRTMAX).
	MaxSignal = 64
	// AttachWait is how long an attach waits for the client attached
	// before it to go: one that ended its call, or whose connection went
	// (a VM resumed from a snapshot), may not have been noticed yet.
	AttachWait = 2 * time.Second

	// DroppedHeader, in the response headers of a Process call that
	// follows a detached command, counts the bytes of its output (stdout
	// and stderr together) that were dropped, oldest first, before the
	// replayed part: the replay starts at that byte of the output.
	DroppedHeader = "Carrel-Output-Dropped"
)

// Stream is the server side of a Process call
// (connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]).
type Stream interface {
	Receive() (*agentv1.ProcessInput, error)
	Send(*agentv1.ExecResponse) error
	ResponseHeader() http.Header
}

// Table runs Process calls and holds the detached commands.
type Table struct {
	runner     *exec.Runner
	keep       time.Duration
	max        int
	attachWait time.Duration

	mu       sync.Mutex
	detached map[string]*entry // by id
}

// entry is a detached command.
type entry struct {
	proc     *exec.Proc
	out      *outbuf
	exitedAt time.Time   // zero while running; guarded by Table.mu
	expiry   *time.Timer // likewise
}

// New returns a table whose commands run through r.
func New(r *exec.Runner) *Table {
	return &Table{runner: r, keep: KeepExited, max: MaxDetached, attachWait: AttachWait, detached: make(map[string]*entry)}
}

// Process serves one Process call; see the AgentService contract.
//
// The first message starts a command or attaches to a detached one. The
// replies are Started{pid, id}, output, then the exit status. A command
// started without detach is killed (its process group, with SIGKILL) when
// the call ends before it exits.
//
// A detached command's output is kept, the newest OutputBytes of it, from
// its start: each attach (and the starting call) first gets all of that,
// then live output, then the exit status. Ending the call is how a client
// detaches; the command keeps running. A start with detach_at_start is
// answered with Started alone, and the call ends there, no client attached.
// One client is attached at a time: an attach waits up to AttachWait for
// the one before it to go, then fails with CodeFailedPrecondition. While a client is attached, the
// command's output waits for the client rather than overwrite what it has
// yet to read. Once a client has been sent the exit status, the command is
// forgotten; one nobody collects is forgotten KeepExited after its exit,
// or sooner when MaxDetached are kept and room is needed. Starting one more
// while MaxDetached are running fails with CodeResourceExhausted.
//
// The end of the client's messages (a half-close) changes nothing: stdin
// stays open until close_stdin, and a detached command stays attached until
// the call ends. Note that net/http's HTTP/2 client resets a stream whose
// request body is still open only once the body or the response is closed,
// not when its context ends.
//
// The client's messages are applied in order, so stdin the command does
// not read holds back the signals and resizes behind it (and, through flow
// control, the client); the Signal call, by id, is not held back.
//
// A malformed message ends the call with CodeInvalidArgument (stdin after
// close_stdin: CodeFailedPrecondition), which, like any end of the call,
// kills a command that is not detached. Resizing a command without a
// terminal is ignored, as is signalling one that has exited.
func (t *Table) Process(ctx context.Context, s Stream) error {
	first, err := s.Receive()
	if errors.Is(err, io.EOF) {
		return invalid("process: no start or attach message")
	} else if err != nil {
		return err
	}
	ctx, fail := context.WithCancelCause(ctx)
	defer fail(nil)
	switch m := first.Msg.(type) {
	case *agentv1.ProcessInput_Start:
		if m.Start.GetDetach() {
			return t.startDetached(ctx, fail, s, m.Start)
		}
		return t.run(ctx, fail, s, m.Start)
	case *agentv1.ProcessInput_Attach:
		return t.attach(ctx, fail, s, m.Attach.GetId())
	}
	return invalid("process: the first message must be start or attach")
}

// run runs a command that lives as long as the call.
func (t *Table) run(ctx context.Context, fail context.CancelCauseFunc, s Stream, req *agentv1.ExecRequest) error {
	p, err := t.runner.Start(req, true)
	if err != nil {
		return err
	}
	if err := s.Send(p.Started()); err != nil {
		p.Abort(err)
	}
	p.Stream(s.Send)
	go input(ctx, fail, s, p)
	exit, err := p.Wait(ctx)
	if err != nil {
		return err
	}
	return s.Send(exec.ExitEvent(exit))
}

func (t *Table) startDetached(ctx context.Context, fail context.CancelCauseFunc, s Stream, req *agentv1.ExecRequest) error {
	t.mu.Lock()
	if err := t.makeRoomLocked(); err != nil {
		t.mu.Unlock()
		return err
	}
	p, err := t.runner.Start(req, true)
	if err != nil {
		t.mu.Unlock()
		return err
	}
	e := &entry{proc: p, out: newOutbuf(OutputBytes)}
	atStart := req.GetDetachAtStart()
	if !atStart {
		e.out.attach(ctx, 0)
	}
	t.detached[p.ID] = e
	t.mu.Unlock()
	p.Stream(e.out.write)
	go t.watch(e)
	if atStart {
		// Kept and unattached before the client learns the id, so that
		// its attach cannot find the command still held by this call.
		return s.Send(p.Started())
	}
	return t.follow(ctx, fail, s, e, 0)
}

// makeRoomLocked makes room for one more detached command by forgetting
// the one that exited first, if it must and can.
func (t *Table) makeRoomLocked() error {
	if len(t.detached) < t.max {
		return nil
	}
	var oldest *entry
	for _, e := range t.detached {
		if !e.exitedAt.IsZero() && !e.out.isAttached() && (oldest == nil || e.exitedAt.Before(oldest.exitedAt)) {
			oldest = e
		}
	}
	if oldest == nil {
		return connect.NewError(connect.CodeResourceExhausted,
			fmt.Errorf("process: %d detached commands are running, the most there may be", len(t.detached)))
	}
	t.removeLocked(oldest)
	return nil
}

// watch hands the exit status to the buffer and starts the clock on
// forgetting the command.
func (t *Table) watch(e *entry) {
	<-e.proc.Done()
	e.out.finish(e.proc.Exit())
	t.mu.Lock()
	defer t.mu.Unlock()
	e.exitedAt = time.Now()
	e.expiry = time.AfterFunc(t.keep, func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		if !e.out.isAttached() { // else the client's detach sees it expired
			t.removeLocked(e)
		}
	})
}

func (t *Table) attach(ctx context.Context, fail context.CancelCauseFunc, s Stream, id string) error {
	t.mu.Lock()
	e := t.detached[id]
	t.mu.Unlock()
	var dropped uint64
	ok := false
	if e != nil {
		// Forgotten meanwhile (expired, or room made), it is still whole:
		// this client gets its output and exit status.
		dropped, ok = e.out.attach(ctx, t.attachWait)
	}
	switch {
	case e == nil && t.runner.Lookup(id) != nil:
		// A command started without detach belongs to its call.
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process: command %s is already attached", id))
	case e == nil:
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("process: no detached command %q", truncate(id)))
	case !ok:
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process: command %s is already attached", id))
	}
	return t.follow(ctx, fail, s, e, dropped)
}

// follow streams a detached command's buffered and live output, then its
// exit status, to the attached client s.
func (t *Table) follow(ctx context.Context, fail context.CancelCauseFunc, s Stream, e *entry, dropped uint64) error {
	s.ResponseHeader().Set(DroppedHeader, strconv.FormatUint(dropped, 10))
	if err := s.Send(e.proc.Started()); err != nil {
		t.detach(e)
		return err
	}
	go input(ctx, fail, s, e.proc)
	for {
		c, exit, err := e.out.next(ctx)
		if err != nil {
			t.detach(e)
			return callError(ctx)
		}
		if exit != nil {
			if err := s.Send(exec.ExitEvent(exit)); err != nil {
				t.detach(e)
				return err
			}
			t.remove(e)
			return nil
		}
		if err := s.Send(c.event()); err != nil {
			t.detach(e)
			return err
		}
		e.out.consume(len(c.data))
	}
}

// detach lets the next client attach, and forgets an exited command whose
// time is up.
func (t *Table) detach(e *entry) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e.out.detach()
	if !e.exitedAt.IsZero() && time.Since(e.exitedAt) >= t.keep {
		t.removeLocked(e)
	}
}

func (t *Table) remove(e *entry) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.removeLocked(e)
}

func (t *Table) removeLocked(e *entry) {
	if t.detached[e.proc.ID] == e {
		delete(t.detached, e.proc.ID)
	}
	if e.expiry != nil {
		e.expiry.Stop()
	}
}

// Detached returns how many detached commands are kept.
func (t *Table) Detached() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.detached)
}

// callError is what a call that ended early returns: the error that ended
// it, or CodeCanceled / CodeDeadlineExceeded.
func callError(ctx context.Context) error {
	cause := context.Cause(ctx)
	if ce, ok := errors.AsType[*connect.Error](cause); ok {
		return ce
	}
	if errors.Is(cause, context.DeadlineExceeded) {
		return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("process: detached: %w", cause))
	}
	return connect.NewError(connect.CodeCanceled, fmt.Errorf("process: detached: %w", cause))
}

// input applies the client's messages to p until the client stops sending
// or the call ends; a bad message ends the call through fail.
func input(ctx context.Context, fail context.CancelCauseFunc, s Stream, p *exec.Proc) {
	for {
		m, err := s.Receive()
		if err != nil || ctx.Err() != nil {
			return
		}
		if err := apply(p, m); err != nil {
			fail(err)
			return
		}
	}
}

func apply(p *exec.Proc, m *agentv1.ProcessInput) error {
	switch m := m.Msg.(type) {
	case *agentv1.ProcessInput_Stdin:
		err := p.WriteStdin(m.Stdin)
		if errors.Is(err, exec.ErrStdinClosed) {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process: stdin after close_stdin: %w", err))
		}
		return internal(err)
	case *agentv1.ProcessInput_CloseStdin:
		return internal(p.CloseStdin())
	case *agentv1.ProcessInput_Signal:
		sig, err := Signal(m.Signal)
		if err != nil || m.Signal == 0 {
			return invalid("process: signal %d is not 1 to %d", m.Signal, MaxSignal)
		}
		if err := p.Signal(sig); !errors.Is(err, os.ErrProcessDone) {
			return internal(err)
		}
		return nil
	case *agentv1.ProcessInput_Resize:
		if !p.TTY() {
			return nil
		}
		err := p.Resize(m.Resize.GetRows(), m.Resize.GetCols())
		if errors.Is(err, pty.ErrBadSize) {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("process: resize: %w", err))
		}
		return internal(err)
	case *agentv1.ProcessInput_Start, *agentv1.ProcessInput_Attach:
		return invalid("process: start and attach may only come first")
	}
	return invalid("process: empty message")
}

// Signal converts a signal number from a request: 1 to MaxSignal, with 0
// meaning SIGTERM.
func Signal(n int32) (unix.Signal, error) {
	switch {
	case n == 0:
		return unix.SIGTERM, nil
	case n < 0 || n > MaxSignal:
		return 0, invalid("signal %d is not 1 to %d", n, MaxSignal)
	}
	return unix.Signal(n), nil
}

// SignalCommand sends sig to the process group of the command with the id:
// CodeNotFound if there is none, CodeFailedPrecondition if it has exited.
func (t *Table) SignalCommand(id string, sig unix.Signal) error {
	p := t.runner.Lookup(id)
	if p != nil {
		if err := p.Signal(sig); !errors.Is(err, os.ErrProcessDone) {
			return internal(err)
		}
	}
	return t.notRunning("signal", id, p != nil)
}

// Input applies one message of a Process call's kind (stdin, close_stdin
// or resize) to the running command with the id, attached or not:
// CodeNotFound if there is none, CodeFailedPrecondition if it has exited.
func (t *Table) Input(id string, m *agentv1.ProcessInput) error {
	switch m.Msg.(type) {
	case *agentv1.ProcessInput_Stdin, *agentv1.ProcessInput_CloseStdin, *agentv1.ProcessInput_Resize:
	default:
		return invalid("input: stdin, close_stdin or resize is required")
	}
	p := t.runner.Lookup(id)
	if p == nil {
		return t.notRunning("input", id, false)
	}
	return apply(p, m)
}

// notRunning is op's error for a command id with no running command:
// CodeFailedPrecondition for one that has exited (known, or a detached
// command still kept), CodeNotFound for one the agent does not have.
func (t *Table) notRunning(op, id string, known bool) error {
	if !known {
		t.mu.Lock()
		_, known = t.detached[id]
		t.mu.Unlock()
	}
	if !known {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("%s: no command %q", op, truncate(id)))
	}
	return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("%s: command %s has exited", op, id))
}

// internal wraps an unexpected error; nil stays nil.
func internal(err error) error {
	if err == nil {
		return nil
	}
	return connect.NewError(connect.CodeInternal, err)
}

func invalid(format string, args ...any) error {
	return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf(format, args...))
}

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
