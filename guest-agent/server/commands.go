//go:build linux

package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/proctable"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// Commands serves many Exec calls on one stream: each command runs as Exec
// runs it, and its events go out tagged with the host's number for it,
// paced by the credit the host grants it (protocol.CommandCredit).
func (s *service) Commands(ctx context.Context, stream *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
	m := newCommandServer(ctx, s.cfg.Runner.Run, stream.Send, s.cfg.Log)
	m.signal = s.sessions.SignalCommand
	if stream.RequestHeader().Get(protocol.HoldEventsHeader) == "1" {
		m.hold = protocol.EventHold
	}
	return m.serve(stream.Receive)
}

// maxEndMessage caps the error text a command's end carries.
const maxEndMessage = 1024

// commandServer is one Commands stream's commands.
type commandServer struct {
	ctx context.Context
	run func(context.Context, *agentv1.ExecRequest, func(*agentv1.ExecResponse) error) error
	log *slog.Logger
	// signal signals the process group of the command with the agent's
	// exec id (Table.SignalCommand).
	signal func(execID string, sig unix.Signal) error

	sendMu sync.Mutex // the stream's Send is not safe for concurrent use
	send   func(*agentv1.CommandsOutput) error
	// hold is how long a command's first events may be held back to go
	// out together (protocol.EventHold); 0 for a host that does not read
	// CommandsOutput.held.
	hold time.Duration

	mu      sync.Mutex
	running map[uint64]*runningCommand
	last    uint64 // the highest id started: ids only increase
	wg      sync.WaitGroup
}

// runningCommand is one command's cancellation, output credit and
// signals.
type runningCommand struct {
	cancel context.CancelFunc
	mu     sync.Mutex
	credit int64
	more   chan struct{} // signalled when credit is added
	execID string        // once started
	early  unix.Signal   // the last signal sent before it started

	// holdMu orders the command's messages while some of its events are
	// held back (commandServer.hold).
	holdMu    sync.Mutex
	holding   bool                    // the hold has not ended
	held      []*agentv1.ExecResponse // events not yet sent, in order
	heldUnits int
}

func newCommandServer(ctx context.Context, run func(context.Context, *agentv1.ExecRequest, func(*agentv1.ExecResponse) error) error,
	send func(*agentv1.CommandsOutput) error, log *slog.Logger) *commandServer {
	if log == nil {
		log = slog.Default()
	}
	return &commandServer{ctx: ctx, run: run, send: send, log: log, running: map[uint64]*runningCommand{}}
}

// serve reads the host's messages until the stream ends, then ends every
// command still running and waits for them.
func (m *commandServer) serve(recv func() (*agentv1.CommandsInput, error)) error {
	defer func() {
		m.mu.Lock()
		for _, c := range m.running {
			c.cancel()
		}
		m.mu.Unlock()
		m.wg.Wait()
	}()
	for {
		in, err := recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := m.handle(in); err != nil {
			return err
		}
	}
}

// handle acts on one message. It never blocks: a start runs in a goroutine
// of its own, so a command waiting for credit holds up no other.
func (m *commandServer) handle(in *agentv1.CommandsInput) error {
	id := in.GetId()
	m.mu.Lock()
	defer m.mu.Unlock()
	if id == 0 {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("commands: command 0"))
	}
	c := m.running[id]
	switch msg := in.Msg.(type) {
	case *agentv1.CommandsInput_Start:
		if id <= m.last || msg.Start == nil {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("commands: command %d started twice, out of order or empty", id))
		}
		m.last = id
		if len(m.running) >= protocol.MaxCommands {
			end := &agentv1.CommandEnd{Code: uint32(connect.CodeResourceExhausted), Message: fmt.Sprintf("exec: %d commands are running", len(m.running))}
			m.wg.Add(1)
			go func() { // handle must not wait on the stream
				defer m.wg.Done()
				_ = m.out(&agentv1.CommandsOutput{Id: id, Msg: &agentv1.CommandsOutput_End{End: end}})
			}()
			return nil
		}
		ctx, cancel := context.WithCancel(m.ctx)
		c = &runningCommand{cancel: cancel, credit: protocol.CommandCredit, more: make(chan struct{}, 1)}
		m.running[id] = c
		m.wg.Add(1)
		go m.exec(ctx, id, c, msg.Start)
	case *agentv1.CommandsInput_Credit:
		if id > m.last {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("commands: credit for command %d, never started", id))
		}
		if c != nil { // else it has ended, and the credit was on its way
			c.grant(int64(msg.Credit))
		}
	case *agentv1.CommandsInput_Cancel:
		if id > m.last {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("commands: cancel of command %d, never started", id))
		}
		if c != nil {
			c.cancel()
		}
	case *agentv1.CommandsInput_Signal:
		sig, err := proctable.Signal(msg.Signal)
		if err != nil || msg.Signal == 0 || id > m.last {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("commands: signal %d for command %d", msg.Signal, id))
		}
		if c != nil {
			m.signalCommand(c, sig)
		}
	default:
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("commands: unknown message for command %d", id))
	}
	return nil
}

// exec runs one command and sends its end.
func (m *commandServer) exec(ctx context.Context, id uint64, c *runningCommand, req *agentv1.ExecRequest) {
	defer m.wg.Done()
	exited := false
	if m.hold > 0 {
		c.holding = true
		t := time.AfterFunc(m.hold, func() { _ = m.endHold(id, c) })
		defer t.Stop()
	}
	err := m.run(ctx, req, func(ev *agentv1.ExecResponse) error {
		size := proto.Size(ev)
		if err := c.take(ctx, int64(size)+protocol.CommandEventOverhead); err != nil {
			return err
		}
		if st := ev.GetStarted(); st != nil {
			m.started(c, st.Id)
		}
		err := m.event(id, c, ev, size+protocol.CommandEventOverhead)
		if err == nil && ev.GetExit() != nil {
			exited = true
		}
		return err
	})
	c.cancel()
	m.mu.Lock()
	delete(m.running, id)
	m.mu.Unlock()
	if exited && err == nil {
		return // the exit status ended it
	}
	end := &agentv1.CommandEnd{}
	if err != nil {
		end.Code = uint32(connect.CodeOf(err))
		end.Message = err.Error()
		if ce := new(connect.Error); errors.As(err, &ce) {
			end.Message = ce.Message()
		}
		// A proto string must be UTF-8, or the end could not be sent.
		end.Message = protocol.CleanText(end.Message, maxEndMessage)
		if level := callLevel(err); m.log.Enabled(m.ctx, level) {
			m.log.Log(m.ctx, level, "command failed", "rpc", "Commands", "argv0", firstArg(req.GetArgv()), "err", err)
		}
	}
	// The stream may be gone (the host ended it): nothing is left to tell.
	_ = m.outHeld(c, &agentv1.CommandsOutput{Id: id, Msg: &agentv1.CommandsOutput_End{End: end}})
}

// event sends one of command id's events, or holds it back while the
// command is young: until its exit status, EventHoldBytes of events (in
// credit units), or the end of the hold, whichever comes first.
func (m *commandServer) event(id uint64, c *runningCommand, ev *agentv1.ExecResponse, units int) error {
	c.holdMu.Lock()
	if c.holding && ev.GetExit() == nil && c.heldUnits+units <= protocol.EventHoldBytes {
		// The runner reuses an output event's buffer once send returns:
		// what is held is a copy.
		c.held = append(c.held, proto.CloneOf(ev))
		c.heldUnits += units
		c.holdMu.Unlock()
		return nil
	}
	c.holdMu.Unlock()
	return m.outHeld(c, &agentv1.CommandsOutput{Id: id, Msg: &agentv1.CommandsOutput_Event{Event: ev}})
}

// endHold ends command id's hold, sending what it holds: its last event
// as the message's own, those before it as held.
func (m *commandServer) endHold(id uint64, c *runningCommand) error {
	c.holdMu.Lock()
	defer c.holdMu.Unlock()
	c.holding = false
	if len(c.held) == 0 {
		return nil
	}
	last := c.held[len(c.held)-1]
	c.held = c.held[:len(c.held)-1]
	return m.outLocked(c, &agentv1.CommandsOutput{Id: id, Msg: &agentv1.CommandsOutput_Event{Event: last}})
}

// outHeld sends msg, one of c's, with the events c holds, and ends its
// hold.
func (m *commandServer) outHeld(c *runningCommand, msg *agentv1.CommandsOutput) error {
	c.holdMu.Lock()
	defer c.holdMu.Unlock()
	c.holding = false
	return m.outLocked(c, msg)
}

// outLocked sends msg with the events c holds. c.holdMu is held.
func (m *commandServer) outLocked(c *runningCommand, msg *agentv1.CommandsOutput) error {
	msg.Held, c.held, c.heldUnits = c.held, nil, 0
	return m.out(msg)
}

// signalCommand signals c's process group, or keeps sig for it until it
// has started. A signal for a command that has just exited is dropped.
func (m *commandServer) signalCommand(c *runningCommand, sig unix.Signal) {
	c.mu.Lock()
	id := c.execID
	if id == "" {
		c.early = sig
	}
	c.mu.Unlock()
	if id != "" && m.signal != nil {
		m.logSignal(m.signal(id, sig))
	}
}

// started records c's exec id and delivers a signal that came before it.
func (m *commandServer) started(c *runningCommand, execID string) {
	c.mu.Lock()
	c.execID = execID
	sig := c.early
	c.mu.Unlock()
	if sig != 0 && m.signal != nil {
		m.logSignal(m.signal(execID, sig))
	}
}

func (m *commandServer) logSignal(err error) {
	if err != nil {
		m.log.Log(m.ctx, callLevel(err), "signal failed", "rpc", "Commands", "err", err)
	}
}

func (m *commandServer) out(o *agentv1.CommandsOutput) error {
	m.sendMu.Lock()
	defer m.sendMu.Unlock()
	return m.send(o)
}

// take waits until the command has n units of credit, and spends them.
func (c *runningCommand) take(ctx context.Context, n int64) error {
	for {
		c.mu.Lock()
		if c.credit >= n {
			c.credit -= n
			left := c.credit > 0
			c.mu.Unlock()
			if left {
				c.wake() // stdout and stderr may both be waiting
			}
			return nil
		}
		c.mu.Unlock()
		select {
		case <-c.more:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (c *runningCommand) grant(n int64) {
	c.mu.Lock()
	c.credit += n
	c.mu.Unlock()
	c.wake()
}

func (c *runningCommand) wake() {
	select {
	case c.more <- struct{}{}:
	default:
	}
}
