package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/recorder"
)

// Exec runs a command in vm for VMService.Exec, bounded by timeout: the
// guest's checked events go to send, up to and including the exit status.
// It is the same route as AgentService.Exec and Process.
func (r *Relay) Exec(ctx context.Context, vm string, req *agentv1.ExecRequest, timeout time.Duration, send func(*agentv1.ExecResponse) error) error {
	if vm == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("exec: name the vm"))
	}
	h := http.Header{}
	h.Set(protocol.VMHeader, vm)
	return r.exec(ctx, h, req, timeout, send)
}

// exec runs a command without stdin: the guest's Exec.
func (r *Relay) exec(ctx context.Context, h http.Header, req *agentv1.ExecRequest, timeout time.Duration, send func(*agentv1.ExecResponse) error) error {
	req = r.withVMEnv(h, req)
	return r.run(ctx, h, req, false, timeout, func(ctx context.Context, a agent, _ *recorder.Exec) (guestEvents, error) {
		if !a.commands.Supported() {
			return a.exec(ctx, req)
		}
		return a.command(ctx, req), nil
	}, send)
}

// exec runs req through the agent's Exec call, a stream of its own.
func (a agent) exec(ctx context.Context, req *agentv1.ExecRequest) (guestEvents, error) {
	s, err := a.client.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return serverEvents{s}, nil
}

// command starts req on the Commands stream, falling back to exec.
func (a agent) command(ctx context.Context, req *agentv1.ExecRequest) *commandEvents {
	return &commandEvents{cmd: a.commands.Start(ctx, req), client: a.client,
		exec: func() (guestEvents, error) { return a.exec(ctx, req) }}
}

// agent is the guest's agent service and commands on one connection.
type agent struct {
	client   agentv1connect.AgentServiceClient
	commands *agentlink.Commands
}

// commandEvents is a command on the link's Commands stream, or, where the
// agent lacks that call (ErrNoCommands, before anything ran), the same
// command through Exec.
type commandEvents struct {
	cmd    *agentlink.Command
	exec   func() (guestEvents, error)
	client agentv1connect.AgentServiceClient // for signals after a fall back

	mu     sync.Mutex
	alt    guestEvents
	execID string // the guest's id, once started through Exec
	early  int32  // the last signal sent before that
}

func (e *commandEvents) Receive() (*agentv1.ExecResponse, error) {
	e.mu.Lock()
	alt := e.alt
	e.mu.Unlock()
	if alt == nil {
		ev, err := e.cmd.Receive()
		if !errors.Is(err, agentlink.ErrNoCommands) {
			return ev, err
		}
		e.cmd.Close()
		if alt, err = e.exec(); err != nil {
			return nil, err
		}
		e.mu.Lock()
		e.alt = alt
		e.early = e.cmd.LastSignal() // sent while it was on the Commands stream
		e.mu.Unlock()
	}
	ev, err := alt.Receive()
	if id := ev.GetStarted().GetId(); id != "" && protocol.ValidExecID(id) {
		e.mu.Lock()
		first := e.execID == ""
		sig := e.early
		if first {
			e.execID, e.early = id, 0
		}
		e.mu.Unlock()
		if first && sig != 0 {
			go e.signalExec(id, sig) // Started goes on to the client meanwhile
		}
	}
	return ev, err
}

// signalExec signals the command with the agent's Signal call. A command
// that has just exited is no error of the client's, and the reply says
// nothing the relay acts on.
func (e *commandEvents) signalExec(id string, sig int32) {
	ctx, cancel := context.WithTimeout(context.Background(), signalTimeout)
	defer cancel()
	_, _ = e.client.Signal(ctx, connect.NewRequest(&agentv1.SignalRequest{Target: &agentv1.SignalRequest_ExecId{ExecId: id}, Signal: sig}))
}

// signalTimeout bounds a signal sent through the agent's Signal call.
const signalTimeout = 10 * time.Second

// signal sends sig to the command: on the Commands stream, or, after a
// fall back to Exec, through the agent's Signal call once the command has
// started (one sent before is kept until then).
func (e *commandEvents) signal(sig int32) error {
	if sig < 1 || sig > agentlink.MaxSignal {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("signal %d is not 1 to %d", sig, agentlink.MaxSignal))
	}
	e.mu.Lock()
	if e.alt == nil {
		// Under e.mu: a fall back under way takes the signal from cmd.
		err := e.cmd.Signal(sig)
		e.mu.Unlock()
		return err
	}
	id := e.execID
	if id == "" {
		e.early = sig
	}
	e.mu.Unlock()
	if id != "" {
		e.signalExec(id, sig)
	}
	return nil
}

func (e *commandEvents) Close() {
	e.cmd.Close()
	e.mu.Lock()
	alt := e.alt
	e.mu.Unlock()
	if alt != nil {
		alt.Close()
	}
}

// process runs (or attaches to) a command with the client's stdin,
// signals and resizes: the guest's Process. recv gives the client's
// messages after first. A start with no_stdin, no tty and no detach runs
// on the link's Commands stream (see command).
func (r *Relay) process(ctx context.Context, h http.Header, first *agentv1.ProcessInput,
	recv func() (*agentv1.ProcessInput, error), send func(*agentv1.ExecResponse) error) error {
	start := first.GetStart()
	if start != nil {
		start = r.withVMEnv(h, start)
		first = &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: start}}
	}
	// A client's misuse ends the call through ctx, as the client's own
	// going would: it is no fault of the link's.
	ctx, refuse := context.WithCancelCause(ctx)
	defer refuse(nil)
	return r.run(ctx, h, start, start.GetDetach(), 0, func(ctx context.Context, a agent, rec *recorder.Exec) (guestEvents, error) {
		if start.GetNoStdin() && !start.GetTty() && !start.GetDetach() && a.commands.Supported() {
			return command(ctx, a, start, recv, refuse), nil
		}
		ctx, cancel := context.WithCancel(ctx)
		g := a.client.Process(ctx)
		// Cancelling ctx alone does not wake a Receive while the request
		// body is open (net/http's HTTP/2 client): close the response when
		// the client goes, so the guest side ends at once.
		stop := context.AfterFunc(ctx, func() { g.CloseResponse() })
		// A failed send shows up as the guest's reply (or its absence).
		_ = g.Send(first)
		if start.GetNoStdin() {
			// An agent from before no_stdin keeps stdin open until told.
			_ = g.Send(&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_CloseStdin{CloseStdin: &agentv1.CloseStdin{}}})
		}
		go func() {
			// Client to guest. The guest checks these too; the host has
			// already capped their size.
			for {
				msg, err := recv()
				if err != nil {
					g.CloseRequest()
					return
				}
				if start.GetDetach() && start.GetDetachAtStart() {
					// The guest reads nothing after such a start: stdin
					// recorded here would never have reached it.
					refuse(connect.NewError(connect.CodeInvalidArgument, errors.New("process: nothing may follow a start with detach_at_start")))
					return
				}
				// What the guest is sent is recorded first.
				if rec.Output(ctx, recorder.Stdin, msg.GetStdin()) != nil {
					cancel()
					return
				}
				if g.Send(msg) != nil {
					return
				}
			}
		}()
		return bidiEvents{g, func() { stop(); cancel() }}, nil
	}, send)
}

// command runs start, which takes no stdin, on the link's Commands
// stream; where the agent lacks that call, through Exec. The client may
// follow the start with signals (and a close_stdin, which changes
// nothing); anything else ends the call through refuse.
func command(ctx context.Context, a agent, start *agentv1.ExecRequest,
	recv func() (*agentv1.ProcessInput, error), refuse context.CancelCauseFunc) guestEvents {
	ev := a.command(ctx, start)
	go func() {
		for {
			msg, err := recv()
			if err != nil {
				return
			}
			switch m := msg.Msg.(type) {
			case *agentv1.ProcessInput_Signal:
				err = ev.signal(m.Signal)
			case *agentv1.ProcessInput_CloseStdin:
			default:
				err = connect.NewError(connect.CodeInvalidArgument, errors.New("process: the command was started with no_stdin: only signals may follow the start"))
			}
			if err != nil {
				refuse(err)
				return
			}
		}
	}()
	return ev
}

// withVMEnv returns start with the VM's own environment under the
// command's (whose entries win, coming later). Policy decides, the log
// records and the guest gets the whole of it.
func (r *Relay) withVMEnv(h http.Header, start *agentv1.ExecRequest) *agentv1.ExecRequest {
	vm := h.Get(protocol.VMHeader)
	if r.cfg.VMs == nil || vm == "" {
		return start
	}
	env := r.cfg.VMs.EnvOf(vm)
	if len(env) == 0 {
		return start
	}
	out := proto.CloneOf(start)
	out.Env = append(slices.Clip(env), start.Env...)
	return out
}

// guestEvents is a command's stream of events from the guest.
type guestEvents interface {
	// Receive returns the next event, or io.EOF at a clean end.
	Receive() (*agentv1.ExecResponse, error)
	Close()
}

type serverEvents struct {
	s *connect.ServerStreamForClient[agentv1.ExecResponse]
}

func (e serverEvents) Receive() (*agentv1.ExecResponse, error) {
	if e.s.Receive() {
		return e.s.Msg(), nil
	}
	if err := e.s.Err(); err != nil {
		return nil, err
	}
	return nil, io.EOF
}

func (e serverEvents) Close() { e.s.Close() }

type bidiEvents struct {
	g    *connect.BidiStreamForClient[agentv1.ProcessInput, agentv1.ExecResponse]
	stop func()
}

func (e bidiEvents) Receive() (*agentv1.ExecResponse, error) { return e.g.Receive() }

func (e bidiEvents) Close() {
	e.g.CloseResponse()
	e.stop()
}

// run is the one route of a command through the host, whichever call
// brought it. A start (nil for an attach, which starts nothing) is
// decided by the VM's policy and its intent recorded before anything else,
// so that an attempt on a stopped VM is on record too; then open asks the
// guest, and every event the guest sends is checked, its output recorded,
// and only then passed to send, up to the exit status. The outcome is
// recorded when the call ends, however it ends, with the error the client
// gets. A timeout (0: none) bounds the command from its start.
func (r *Relay) run(ctx context.Context, h http.Header, start *agentv1.ExecRequest, detach bool, timeout time.Duration,
	open func(context.Context, agent, *recorder.Exec) (guestEvents, error),
	send func(*agentv1.ExecResponse) error) (err error) {
	vm, err := vmOf(h)
	if err != nil {
		return err
	}
	var rec *recorder.Exec
	if start != nil {
		if err := r.allowExec(ctx, vm, start); err != nil {
			return err
		}
		// The intent carries the call's decisions into the log with it.
		if rec, err = r.call(ctx, vm).BeginExec(ctx, start, detach); err != nil {
			return err
		}
	} else if err := r.cfg.Recorder.Flush(ctx); err != nil {
		return err // an attach: its decision is durable before it goes on
	}
	chk := eventCheck{atStart: start.GetDetach() && start.GetDetachAtStart()}
	defer func() {
		outcome := err
		if chk.leftRunning() && ctx.Err() != nil {
			// The client went once it had the id, perhaps before the
			// guest's end came: either way the command was left running.
			outcome = nil
		}
		rec.Finish(ctx, chk.result(), outcome)
	}()
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
		defer func() {
			if err != nil && ctx.Err() == context.DeadlineExceeded {
				err = connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("exec: command timed out after %s", timeout))
			}
		}()
	}
	// With the VM's environment added, a request the API took may be over
	// the link's cap; sent, it would read as the link breaking.
	if n := proto.Size(start); n+64 > protocol.MaxMessageBytes {
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("exec: the request is %d bytes with the vm's environment, over the link's %d", n, protocol.MaxMessageBytes))
	}
	link, err := r.cfg.VMs.Link(vm)
	if err != nil {
		return err
	}
	c, cmds, done := link.AgentCommands()
	g, err := open(ctx, agent{c, cmds}, rec)
	if err != nil {
		return relayErr(ctx, done, err)
	}
	defer g.Close()
	for {
		ev, err := g.Receive()
		if err != nil {
			return chk.end(relayErr(ctx, done, ignoreEOF(err)))
		}
		if err := chk.check(ev); err != nil {
			return err
		}
		if err := rec.Event(ctx, ev); err != nil {
			return err
		}
		if err := send(ev); err != nil {
			return err
		}
		if chk.exited {
			return nil
		}
	}
}

// eventCheck enforces the shape of an exec event stream from the guest:
// known events only, the start at most once and first, an exit status in
// range, and nothing after it.
type eventCheck struct {
	atStart bool // the start asked to detach at once: it may end after Started
	events  int
	started bool
	id      string // the guest's exec id (its file.activity records name it)
	exited  bool
	// What the audit record of the command's end says.
	exit           *agentv1.ExitStatus
	stdout, stderr int64
}

func (c *eventCheck) check(ev *agentv1.ExecResponse) error {
	c.events++
	if c.exited {
		return errGuest("an event after the exit status")
	}
	switch e := ev.Event.(type) {
	case *agentv1.ExecResponse_Started:
		// The id goes to the client as it is (carrel exec -d prints it):
		// only the agent's own alphabet passes.
		if c.started || c.events != 1 || e.Started == nil || e.Started.Pid <= 0 || !protocol.ValidExecID(e.Started.Id) {
			return errGuest("an invalid start event")
		}
		c.started, c.id = true, e.Started.Id
	case *agentv1.ExecResponse_Exit:
		x := e.Exit
		if x == nil || x.Code < 0 || x.Code > 255 || !validSignalName(x.Signal) {
			return connect.NewError(connect.CodeDataLoss, errors.New("exec: guest agent sent an invalid exit status"))
		}
		c.exited, c.exit = true, x
	case *agentv1.ExecResponse_Stdout:
		c.stdout += int64(len(e.Stdout))
	case *agentv1.ExecResponse_Stderr:
		c.stderr += int64(len(e.Stderr))
	default:
		return connect.NewError(connect.CodeDataLoss, errors.New("exec: guest agent sent an unknown event"))
	}
	return nil
}

// result is what the stream showed, for the command's outcome record.
func (c *eventCheck) result() recorder.Result {
	return recorder.Result{ID: c.id, Exit: c.exit, Stdout: c.stdout, Stderr: c.stderr}
}

// end turns a stream's end into the call's error: a stream may end without
// an exit status only with an error, or, for a start with detach_at_start,
// right after Started.
func (c *eventCheck) end(err error) error {
	if err == nil && !c.exited && !c.leftRunning() {
		return connect.NewError(connect.CodeDataLoss, errors.New("guest agent ended the stream without an exit status"))
	}
	return err
}

// leftRunning reports whether the stream so far is a start with
// detach_at_start answered as it should be: Started, and nothing else.
func (c *eventCheck) leftRunning() bool {
	return c.atStart && c.started && c.events == 1
}

// validSignalName reports whether s can name the signal that ended a
// command: empty, or up to 16 of [A-Z0-9+-] (SIGTERM, SIGRTMIN+3).
func validSignalName(s string) bool {
	if len(s) > 16 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '+' || c == '-') {
			return false
		}
	}
	return true
}

func ignoreEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}
