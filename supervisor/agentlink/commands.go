package agentlink

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// ErrNoCommands is what a command gets when the guest's agent has no
// Commands call (an image from before it): nothing ran, and the caller
// runs the command with Exec instead.
var ErrNoCommands = errors.New("the guest agent has no Commands call")

// hostError is an error of carreld's own making, not the guest's: a
// request too large for the link, too many commands, a VM stopping.
// Link.check passes it through without ending the connection.
type hostError struct{ err error }

func (e *hostError) Error() string { return e.err.Error() }
func (e *hostError) Unwrap() error { return e.err }

// IsHostError reports whether err is one of carreld's own (see
// hostError): the relay returns it as it is.
func IsHostError(err error) bool {
	var h *hostError
	return errors.As(err, &h)
}

func hostErr(code connect.Code, format string, args ...any) error {
	return &hostError{connect.NewError(code, fmt.Errorf(format, args...))}
}

// maxQueued and maxQueuedBytes cap what waits for the writer, should the
// guest stop reading: past them, a start or a signal gets
// ResourceExhausted. Grants and cancels need no cap of their own: a
// command has at most one grant waiting, and a start still waiting is
// dropped, not cancelled.
const (
	maxQueued      = 4096
	maxQueuedBytes = 16 << 20
)

// Commands carries a channel's commands to the guest on one Commands
// stream, opened on the first command and again after one ends. In an
// emulated guest a call's own HTTP/2 stream costs about as much again as
// the command it carries; a message on an open stream costs a fraction.
//
// The guest is not trusted: each command's events are held only up to the
// credit granted it (protocol.CommandCredit), and an event past that, an
// end that does not decode, or output for a command never started breaks
// the stream with CodeDataLoss, which ends the channel (see Link.check).
type Commands struct {
	open func(context.Context) *connect.BidiStreamForClient[agentv1.CommandsInput, agentv1.CommandsOutput]

	mu          sync.Mutex
	cur         *commandStream
	unsupported bool
	closed      error
}

func newCommands(client agentv1connect.AgentServiceClient) *Commands {
	return &Commands{open: func(ctx context.Context) *connect.BidiStreamForClient[agentv1.CommandsInput, agentv1.CommandsOutput] {
		st := client.Commands(ctx)
		// This side reads CommandsOutput.held: the agent may hold a young
		// command's events back to send them together.
		st.RequestHeader().Set(protocol.HoldEventsHeader, "1")
		return st
	}}
}

// Supported reports whether commands may be started here: false once the
// agent has shown it lacks the call.
func (c *Commands) Supported() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.unsupported
}

// Start sends req to the guest as a new command. Its events, or the error
// that ended it (ErrNoCommands where the agent lacks the call), come from
// the command's Receive. ctx bounds the command: once it ends, Receive
// returns its error, and Close cancels the command in the guest.
func (c *Commands) Start(ctx context.Context, req *agentv1.ExecRequest) *Command {
	c.mu.Lock()
	s := c.cur
	switch {
	case c.unsupported:
		c.mu.Unlock()
		return endedCommand(ErrNoCommands)
	case c.closed != nil:
		c.mu.Unlock()
		return endedCommand(c.closed)
	case s == nil:
		s = c.startStream()
		c.cur = s
	}
	c.mu.Unlock()
	// Over the cap, the writer's Send would fail and end every command.
	if n := proto.Size(req) + 16; n > protocol.MaxMessageBytes {
		return endedCommand(hostErr(connect.CodeResourceExhausted, "exec: the request is %d bytes, over the link's %d", n, protocol.MaxMessageBytes))
	}
	return s.start(ctx, req)
}

// close ends the current stream and every command on it with err; no
// stream opens after it.
func (c *Commands) close(err error) {
	c.mu.Lock()
	if c.closed == nil {
		c.closed = err
	}
	c.mu.Unlock()
	c.reset(err)
}

// reset ends the current stream, if any, and every command on it with
// err; the next command opens another.
func (c *Commands) reset(err error) {
	c.mu.Lock()
	s := c.cur
	c.cur = nil
	c.mu.Unlock()
	if s != nil {
		s.end(err)
	}
}

// startStream opens a stream (its request goes out with the first
// message) and its reader and writer. The stream outlives any one caller.
func (c *Commands) startStream() *commandStream {
	ctx, cancel := context.WithCancel(context.Background())
	s := &commandStream{
		owner:   c,
		stream:  c.open(ctx),
		cancel:  cancel,
		running: map[uint64]*Command{},
		wake:    make(chan struct{}, 1),
		stopped: make(chan struct{}),
	}
	go s.write()
	go s.read()
	return s
}

// streamEnded forgets s once it has ended; an ErrNoCommands end is kept.
func (c *Commands) streamEnded(s *commandStream, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur == s {
		c.cur = nil
	}
	if errors.Is(err, ErrNoCommands) {
		c.unsupported = true
	}
}

// commandStream is one Commands call.
type commandStream struct {
	owner  *Commands
	stream *connect.BidiStreamForClient[agentv1.CommandsInput, agentv1.CommandsOutput]
	cancel context.CancelFunc

	mu      sync.Mutex
	next    uint64
	running map[uint64]*Command
	heard   bool                     // any message has come
	queue   []*agentv1.CommandsInput // for write, in order
	wake    chan struct{}            // queue has grown
	// queuedBytes is the size of the starts in queue.
	queuedBytes int
	err         error         // why the stream ended
	stopped     chan struct{} // closed when it ends
}

func (s *commandStream) start(ctx context.Context, req *agentv1.ExecRequest) *Command {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return endedCommand(s.err)
	}
	if len(s.running) >= protocol.MaxCommands {
		return endedCommand(hostErr(connect.CodeResourceExhausted, "exec: %d commands are already running on this VM's link", len(s.running)))
	}
	size := proto.Size(req)
	if len(s.queue) >= maxQueued || s.queuedBytes+size > maxQueuedBytes {
		return endedCommand(hostErr(connect.CodeResourceExhausted, "exec: %d messages (%d bytes of requests) are already waiting for the guest", len(s.queue), s.queuedBytes))
	}
	s.next++
	cmd := &Command{s: s, id: s.next, ctx: ctx, granted: protocol.CommandCredit, ready: make(chan struct{}, 1)}
	s.running[cmd.id] = cmd
	s.queuedBytes += size
	s.enqueueLocked(&agentv1.CommandsInput{Id: cmd.id, Msg: &agentv1.CommandsInput_Start{Start: req}})
	return cmd
}

// enqueue passes m to the writer. Nothing that enqueues waits on the
// guest, which may stop reading.
func (s *commandStream) enqueue(m *agentv1.CommandsInput) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil {
		s.enqueueLocked(m)
	}
}

// grantCredit queues n more units for cmd, adding them to its grant
// still in the queue if there is one.
func (s *commandStream) grantCredit(cmd *Command, n int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.err != nil, s.running[cmd.id] != cmd:
		// Ended: no more output comes, and its grant may be on its way.
	case cmd.grant != nil:
		cmd.grant.Msg.(*agentv1.CommandsInput_Credit).Credit += uint32(n)
	default:
		cmd.grant = &agentv1.CommandsInput{Id: cmd.id, Msg: &agentv1.CommandsInput_Credit{Credit: uint32(n)}}
		s.enqueueLocked(cmd.grant)
	}
}

func (s *commandStream) enqueueLocked(m *agentv1.CommandsInput) {
	s.queue = append(s.queue, m)
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// write sends the queue in order until the stream ends. It then closes
// the request side, which also lets a Receive that started before any
// Send return.
func (s *commandStream) write() {
	defer s.stream.CloseRequest()
	for {
		select {
		case <-s.wake:
		case <-s.stopped:
			return
		}
		s.mu.Lock()
		q := s.queue
		s.queue, s.queuedBytes = nil, 0
		for _, m := range q {
			if cmd := s.running[m.Id]; cmd != nil && cmd.grant == m {
				cmd.grant = nil // on its way: the next grant is a new message
			}
		}
		s.mu.Unlock()
		for _, m := range q {
			if err := s.stream.Send(m); err != nil {
				// io.EOF: the guest ended the stream, and the reader gets
				// its error. Anything else ends it from here.
				if !errors.Is(err, io.EOF) {
					s.end(fmt.Errorf("commands: send: %w", err))
				}
				return
			}
		}
	}
}

// read delivers the guest's messages until the stream ends.
func (s *commandStream) read() {
	for {
		out, err := s.stream.Receive()
		if err != nil {
			s.mu.Lock()
			heard := s.heard
			s.mu.Unlock()
			if errors.Is(err, io.EOF) {
				err = connect.NewError(connect.CodeUnavailable, errors.New("commands: the guest agent ended the stream"))
			} else if !heard && connect.CodeOf(err) == connect.CodeUnimplemented {
				err = ErrNoCommands
			}
			s.end(err)
			return
		}
		if err := s.deliver(out); err != nil {
			s.end(err)
			return
		}
	}
}

// deliver hands one message to its command, or refuses it. A refusal
// ends the stream, and with it every command still running.
func (s *commandStream) deliver(out *agentv1.CommandsOutput) error {
	var endErr error
	switch m := out.Msg.(type) {
	case *agentv1.CommandsOutput_Event:
		if m.Event == nil {
			return errGuest("an empty event for command %d", out.GetId())
		}
	case *agentv1.CommandsOutput_End:
		var bad error
		if endErr, bad = commandEndErr(m.End); bad != nil {
			return bad
		}
	default:
		return errGuest("an unknown message for command %d", out.GetId())
	}
	for _, ev := range out.GetHeld() {
		if ev.GetExit() != nil { // an exit status ends a command: it is never held
			return errGuest("an exit status held back for command %d", out.GetId())
		}
	}
	s.mu.Lock()
	s.heard = true
	cmd := s.running[out.GetId()]
	if cmd == nil {
		defer s.mu.Unlock()
		if out.GetId() == 0 || out.GetId() > s.next {
			return errGuest("output for command %d, never started", out.GetId())
		}
		return nil // late output of a command that was cancelled
	}
	s.mu.Unlock()
	// Events the agent held back come before what they came with, and
	// count against the credit the guest had when it sent them.
	ev := out.GetEvent()
	evs := out.GetHeld()
	if ev != nil {
		evs = append(evs, ev)
	}
	// A refusal leaves the command running, for end to finish.
	if err := cmd.push(evs...); err != nil {
		return err
	}
	if ev == nil {
		s.mu.Lock()
		if s.running[out.GetId()] == cmd {
			delete(s.running, out.GetId())
		}
		s.mu.Unlock()
		cmd.finish(endErr)
		return nil
	}
	if ev.GetExit() != nil { // an exit status ends the command
		s.mu.Lock()
		if s.running[out.GetId()] == cmd {
			delete(s.running, out.GetId())
		}
		s.mu.Unlock()
		cmd.finish(nil)
	}
	return nil
}

// commandEndErr turns a command's end into its error: nil for a clean end,
// else the agent's code and message as a wire error; bad if it is no end.
func commandEndErr(e *agentv1.CommandEnd) (err, bad error) {
	switch {
	case e == nil:
		return nil, errGuest("an empty end")
	case e.Code == 0:
		return nil, nil
	case e.Code > uint32(connect.CodeUnauthenticated):
		return nil, errGuest("an end with code %d", e.Code)
	}
	return connect.NewWireError(connect.Code(e.Code), errors.New(protocol.CleanText(e.Message, maxEndMessage))), nil
}

// maxEndMessage caps the error text kept from a command's end.
const maxEndMessage = 1024

func errGuest(format string, args ...any) error {
	return connect.NewError(connect.CodeDataLoss, fmt.Errorf("guest agent (commands): "+format, args...))
}

// end ends the stream with err, once: every command on it ends with err.
func (s *commandStream) end(err error) {
	s.mu.Lock()
	if s.err != nil {
		s.mu.Unlock()
		return
	}
	s.err = err
	running := s.running
	s.running = nil
	s.queue, s.queuedBytes = nil, 0
	// Cancelled before the writer stops, so the request it closes on its
	// way out is never made.
	s.cancel()
	close(s.stopped)
	s.mu.Unlock()
	s.owner.streamEnded(s, err)
	for _, cmd := range running {
		cmd.finish(err)
	}
}

// Command is one command on a Commands stream: Receive gives its events.
type Command struct {
	s   *commandStream // nil for one that ended before it began
	id  uint64
	ctx context.Context

	mu       sync.Mutex
	queue    []*agentv1.ExecResponse
	held     int64 // units in queue
	granted  int64 // units the guest may send in all
	received int64 // units it has sent
	consumed int64 // units taken since the last grant
	ended    bool
	err      error
	closed   bool
	ready    chan struct{}
	grant    *agentv1.CommandsInput // a grant still in the queue (s.mu)
	// lastSignal is the last signal given to Signal.
	lastSignal int32
}

func endedCommand(err error) *Command {
	return &Command{ended: true, err: err, closed: true, ready: make(chan struct{}, 1)}
}

func units(ev *agentv1.ExecResponse) int64 {
	return int64(proto.Size(ev)) + protocol.CommandEventOverhead
}

// push queues the events of one message, all within the command's credit.
func (c *Command) push(evs ...*agentv1.ExecResponse) error {
	var n int64
	for _, ev := range evs {
		n += units(ev)
	}
	c.mu.Lock()
	c.received += n
	if received, granted := c.received, c.granted; received > granted {
		c.mu.Unlock()
		return errGuest("command %d sent %d units of output with %d granted", c.id, received, granted)
	}
	if !c.ended {
		c.queue = append(c.queue, evs...)
		c.held += n
	}
	c.mu.Unlock()
	c.signal()
	return nil
}

func (c *Command) finish(err error) {
	c.mu.Lock()
	if !c.ended {
		c.ended, c.err = true, err
	}
	c.mu.Unlock()
	c.signal()
}

func (c *Command) signal() {
	select {
	case c.ready <- struct{}{}:
	default:
	}
}

// Receive returns the command's next event; io.EOF after its last, when
// it ended cleanly; or the error that ended it: the guest's (a wire
// error), the stream's, or its context's.
func (c *Command) Receive() (*agentv1.ExecResponse, error) {
	for {
		if c.ctx != nil && c.ctx.Err() != nil {
			return nil, ctxError(c.ctx)
		}
		c.mu.Lock()
		if len(c.queue) > 0 {
			ev := c.queue[0]
			c.queue[0] = nil
			c.queue = c.queue[1:]
			n := units(ev)
			c.held -= n
			c.consumed += n
			var grant int64
			if c.consumed >= protocol.CommandCredit/2 && !c.ended {
				grant, c.consumed = c.consumed, 0
				c.granted += grant
			}
			c.mu.Unlock()
			if grant > 0 {
				c.s.grantCredit(c, grant)
			}
			return ev, nil
		}
		if c.ended {
			err := c.err
			c.mu.Unlock()
			if err == nil {
				return nil, io.EOF
			}
			return nil, err
		}
		c.mu.Unlock()
		select {
		case <-c.ready:
		case <-c.ctx.Done():
			return nil, ctxError(c.ctx)
		}
	}
}

// ctxError is ctx's end as connect's own clients report it, or the
// connect error it was cancelled with.
func ctxError(ctx context.Context) error {
	var ce *connect.Error
	if errors.As(context.Cause(ctx), &ce) {
		return ce
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return connect.NewError(connect.CodeDeadlineExceeded, ctx.Err())
	}
	return connect.NewError(connect.CodeCanceled, ctx.Err())
}

// Signal sends sig (1 to MaxSignal) to the command's process group in the
// guest, unless the command has ended. The agent ends the whole stream on
// a signal out of range, so one is refused here.
func (c *Command) Signal(sig int32) error {
	if sig < 1 || sig > MaxSignal {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("signal %d is not 1 to %d", sig, MaxSignal))
	}
	c.mu.Lock()
	ended := c.ended
	c.lastSignal = sig
	c.mu.Unlock()
	if ended {
		return nil
	}
	s := c.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil || s.running[c.id] != c {
		// Ended or closed meanwhile; its start may have been dropped, and
		// the guest refuses a signal for a command it never heard of.
		return nil
	}
	if len(s.queue) >= maxQueued {
		return hostErr(connect.CodeResourceExhausted, "signal: %d messages are already waiting for the guest", len(s.queue))
	}
	s.enqueueLocked(&agentv1.CommandsInput{Id: c.id, Msg: &agentv1.CommandsInput_Signal{Signal: sig}})
	return nil
}

// LastSignal is the last signal Signal was given, 0 if none: for a caller
// that runs the command another way after ErrNoCommands.
func (c *Command) LastSignal() int32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lastSignal
}

// MaxSignal is the highest signal number a command may be sent, as the
// agent's (proctable.MaxSignal).
const MaxSignal = 64

// Close ends the command: if the guest has not ended it, it is cancelled
// there, as ending an Exec call does. Its events still queued are dropped.
func (c *Command) Close() {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	ended := c.ended
	c.ended = true
	if c.err == nil && !ended {
		c.err = connect.NewError(connect.CodeCanceled, errors.New("commands: closed"))
	}
	c.queue = nil
	c.mu.Unlock()
	if ended {
		return
	}
	s := c.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.running[c.id] != c || s.err != nil {
		return
	}
	delete(s.running, c.id)
	// A start still waiting for the writer is dropped: the guest never
	// hears of the command (it allows gaps in the ids). Its grant goes too.
	kept := s.queue[:0]
	dropped := false
	for _, m := range s.queue {
		switch {
		case m.Id != c.id:
			kept = append(kept, m)
		case m.GetStart() != nil:
			s.queuedBytes -= proto.Size(m.GetStart())
			dropped = true
		}
	}
	clear(s.queue[len(kept):])
	s.queue = kept
	if !dropped {
		s.enqueueLocked(&agentv1.CommandsInput{Id: c.id, Msg: &agentv1.CommandsInput_Cancel{Cancel: &agentv1.Cancel{}}})
	}
}
