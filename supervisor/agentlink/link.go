// Package agentlink is carreld's side of the stream to one guest agent.
//
// A Link multiplexes RPCs over a single connection made by its dialer
// (vsock, or the VM's virtio-serial port), redials after a failure, and
// tracks whether the agent is healthy. Everything the guest sends is
// untrusted: messages are size-capped (protocol.MaxMessageBytes), every call
// carries a deadline, and a guest that breaks the protocol gets its
// connection closed and is marked unhealthy, which is logged once.
//
// On a virtio-serial VM the link also has the data port (UseDataPort):
// file content crosses it in frames as Outbound and Inbound transfers,
// held to the same rules, and a guest that breaks them has the port
// turned off, its content going in the stream from then on.
//
// Commands that take no stdin share one Commands stream per connection
// (AgentCommands), each paced by the output credit carreld grants it; a
// stream of their own would cost an emulated guest about as much again
// as the command. carreld asks the agent (protocol.HoldEventsHeader) to
// send a young command's start and output with its exit status, in one
// message; those held events count against the same credit.
//
// While carreld keeps a VM's vCPUs stopped, its link is held (Hold): no
// probes, no new connections, and a call the pause outlasts fails with
// the pause's reason; Release connects again with care after a pause
// that outlasted the connection.
package agentlink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// State is the agent's health as the host sees it.
type State int

const (
	// Unknown: not yet connected.
	Unknown State = iota
	// Ready: the last exchange with the agent succeeded.
	Ready
	// Unhealthy: the link broke or the guest violated the protocol.
	Unhealthy
)

func (s State) String() string {
	switch s {
	case Ready:
		return "ready"
	case Unhealthy:
		return "unhealthy"
	}
	return "unknown"
}

// Defaults for deadlines.
const (
	// HealthTimeout bounds one health probe. An answer takes milliseconds
	// even from a loaded TCG guest; five seconds without one means the
	// guest is wedged or holds the connection with a frame it never ends.
	HealthTimeout = 5 * time.Second
	// KeepaliveInterval is how often a ready agent is probed. With
	// HealthTimeout it bounds how long a wedged or desynced link goes
	// unnoticed: at most 4 s + 5 s.
	KeepaliveInterval = 4 * time.Second
)

// ErrNotReady is returned by WaitReady when ctx ends before the agent
// answers.
var ErrNotReady = errors.New("guest agent did not become ready")

// Link is the host end of one agent connection.
type Link struct {
	log           *slog.Logger
	dial          func(ctx context.Context) (net.Conn, error)
	healthTimeout time.Duration

	mu      sync.Mutex
	cur     *channel
	state   State
	lastErr error
	info    *agentv1.HealthResponse
	closed  bool
	held    error  // non-nil while Hold holds the link: why
	holds   uint64 // Holds so far: a resync stops at a new one
	// stopResync ends the probe of a resync in progress (Release).
	stopResync context.CancelFunc
	// lostHeld is set when a connection ended while the link was held.
	lostHeld bool
	data     *dataPort // nil without one (UseDataPort)
}

// channel is one HTTP/2 connection to the agent and the client bound to
// it. A broken channel is dropped whole and the next call makes a new one,
// so no call is ever handed to a connection already known to be dead.
type channel struct {
	transport *http.Transport
	client    agentv1connect.AgentServiceClient
	files     agentv1connect.FileServiceClient
	ports     agentv1connect.PortServiceClient
	egress    agentv1connect.EgressServiceClient
	commands  *Commands

	// resync marks the channel of Release's probe, which may connect
	// while the link is still held.
	resync bool

	mu   sync.Mutex
	conn net.Conn
	dead bool
}

// New returns a link that dials with dial. It does not connect yet.
func New(dial func(ctx context.Context) (net.Conn, error), log *slog.Logger) *Link {
	if log == nil {
		log = slog.Default()
	}
	return &Link{log: log, dial: dial, healthTimeout: HealthTimeout}
}

// channel returns the current channel, making one if needed.
func (l *Link) channel() *channel {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cur == nil {
		l.cur = l.newChannel(false)
	}
	return l.cur
}

func (l *Link) newChannel(resync bool) *channel {
	s := &channel{resync: resync}
	httpClient, t := protocol.NewHTTPClient(func(ctx context.Context) (net.Conn, error) {
		return l.dialFor(ctx, s)
	})
	s.transport = t
	s.client = agentv1connect.NewAgentServiceClient(httpClient, protocol.BaseURL, protocol.ClientOptions()...)
	s.files = agentv1connect.NewFileServiceClient(httpClient, protocol.BaseURL, protocol.ClientOptions()...)
	s.ports = agentv1connect.NewPortServiceClient(httpClient, protocol.BaseURL, protocol.ClientOptions()...)
	s.egress = agentv1connect.NewEgressServiceClient(httpClient, protocol.BaseURL, protocol.ClientOptions()...)
	s.commands = newCommands(s.client)
	return s
}

func (l *Link) dialFor(ctx context.Context, s *channel) (net.Conn, error) {
	l.mu.Lock()
	closed, held := l.closed, l.held
	l.mu.Unlock()
	if closed {
		return nil, net.ErrClosed
	}
	if held != nil && !s.resync {
		return nil, held
	}
	c, err := l.dial(ctx)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead {
		c.Close()
		return nil, net.ErrClosed
	}
	tc := &watchedConn{Conn: c}
	tc.broken = func(err error) { l.connBroken(s, tc, err) }
	s.conn = tc
	return tc, nil
}

// errTransportClosed is what a connection the HTTP/2 transport closed on
// its own reports: it does that on a protocol error (garbage, an oversized
// frame) or a keepalive ping that went unanswered.
var errTransportClosed = errors.New("the connection was closed by the HTTP/2 transport (protocol error or no answer to keepalive)")

// connBroken is called when connection c of channel s ends without the
// link having ended it: the guest closed it, or broke the protocol. That
// makes the agent unhealthy even when no call was in flight to notice. A
// connection the transport has already replaced is not the link's.
func (l *Link) connBroken(s *channel, c net.Conn, err error) {
	s.mu.Lock()
	current := !s.dead && s.conn == c
	s.mu.Unlock()
	if current && !l.lose(s) {
		l.fail(s, err)
	}
}

// watchedConn reports the first read error, or a close it did not expect,
// to broken.
type watchedConn struct {
	net.Conn
	once   sync.Once
	broken func(error)
	// The first frame header read, and how much of it has come (only the
	// transport's read loop reads); greeted once it is a SETTINGS frame's
	// (not an ack), which an agent sends first, once it has read the
	// host's preface.
	head    [frameHeaderBytes]byte
	seen    int
	greeted atomic.Bool
}

// An HTTP/2 frame header: length (3), type (1), flags (1), stream (4).
const (
	frameHeaderBytes = 9
	frameSettings    = 0x4
	flagAck          = 0x1
)

// ungreeted reports whether s has a connection on which the agent's
// settings have yet to come.
func (s *channel) ungreeted() bool {
	if s == nil {
		return false
	}
	s.mu.Lock()
	c, _ := s.conn.(*watchedConn)
	s.mu.Unlock()
	return c != nil && !c.greeted.Load()
}

func (c *watchedConn) report(err error) {
	c.once.Do(func() { go c.broken(err) })
}

func (c *watchedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if c.seen < len(c.head) {
		c.seen += copy(c.head[c.seen:], p[:n])
		if c.seen == len(c.head) && c.head[3] == frameSettings && c.head[4]&flagAck == 0 {
			c.greeted.Store(true)
		}
	}
	if err != nil {
		c.report(fmt.Errorf("read from guest: %w", err))
	}
	return n, err
}

func (c *watchedConn) Close() error {
	c.report(errTransportClosed)
	return c.Conn.Close()
}

func (s *channel) close() {
	s.mu.Lock()
	s.dead = true
	c := s.conn
	s.conn = nil
	s.mu.Unlock()
	if c != nil {
		c.Close()
	}
	s.commands.close(errChannelClosed)
	s.transport.CloseIdleConnections()
}

// errChannelClosed ends the commands of a channel the link has ended.
var errChannelClosed = connect.NewError(connect.CodeUnavailable, errors.New("the connection to the guest agent was closed"))

// drop ends channel s if it is still the current one.
func (l *Link) drop(s *channel) {
	l.mu.Lock()
	if l.cur == s {
		l.cur = nil
	}
	l.mu.Unlock()
	s.close()
}

// State returns the agent's health and the error that made it unhealthy.
func (l *Link) State() (State, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.state, l.lastErr
}

// Info returns the agent's last health reply, or nil. Its fields come from
// the guest: display them only after sanitizing.
func (l *Link) Info() *agentv1.HealthResponse {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.info
}

func (l *Link) markReady(info *agentv1.HealthResponse) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if info != nil {
		l.info = info
	}
	if l.state == Unhealthy {
		l.log.Info("guest agent healthy again", "subsystem", "agentlink")
	}
	l.state, l.lastErr = Ready, nil
}

// fail ends channel s and marks the agent unhealthy; the transition is
// logged once.
func (l *Link) fail(s *channel, err error) {
	l.drop(s)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.state != Unhealthy && !l.closed {
		l.log.Warn("guest agent unhealthy: link closed", "subsystem", "agentlink", "err", err)
	}
	l.state, l.lastErr = Unhealthy, err
}

// check classifies an RPC error. An error the agent sent as a proper
// response (a wire error: bad argument, no such command, even an internal
// error of its own) leaves the link alone. An error raised on this side,
// i.e. a broken connection, an oversized frame or message, or bytes that
// do not decode, means the stream can no longer be trusted: it ends.
func (l *Link) check(ctx context.Context, s *channel, err error) error {
	if err == nil {
		return nil
	}
	if ctx.Err() != nil || IsHostError(err) {
		// The caller gave up (deadline or cancel), or carreld refused;
		// not the guest's fault.
		return err
	}
	if connect.IsWireError(err) {
		return err
	}
	// A connection lost while the guest cannot run (the HTTP/2 keepalive
	// gave up on it, or the dial was refused) is the pause's doing, not
	// the guest's. Anything else (an oversized or undecodable message)
	// breaks the protocol, held or not.
	if !brokeProtocol(err) && l.lose(s) {
		if held := l.Held(); held != nil && !errors.Is(err, ErrHeld) {
			return fmt.Errorf("%w (%v)", held, err)
		}
		return err
	}
	l.fail(s, err)
	return err
}

// brokeProtocol reports whether err is this side refusing what the guest
// sent (a message over the cap, one that does not decode, a reply the
// relay found wrong), rather than the connection ending under the call,
// which surfaces as any of several codes (Unavailable, or InvalidArgument
// for a message cut short).
func brokeProtocol(err error) bool {
	switch connect.CodeOf(err) {
	case connect.CodeResourceExhausted, connect.CodeDataLoss, connect.CodeInternal:
		return true
	case connect.CodeInvalidArgument:
		return strings.Contains(err.Error(), "unmarshal")
	}
	return false
}

// lose ends channel s, lost while the link is held, and reports whether
// it was held: the agent's health stays as it was, and Release connects
// again with care.
func (l *Link) lose(s *channel) bool {
	l.mu.Lock()
	held := l.held != nil
	if held {
		l.lostHeld = true
	}
	l.mu.Unlock()
	if held {
		l.drop(s)
	}
	return held
}

// ErrHeld is what calls get while the link is held (Hold): ended if they
// were in flight, refused if new.
var ErrHeld = errors.New("the vm is paused")

// Hold is for a VM whose vCPUs carreld stops: the guest answers nothing
// until they run again. Until Release, the keepalive probes nothing, so
// the agent's health stays as it was, and the link does not connect:
// calls that would have to fail with an error wrapping ErrHeld and why.
// The connection stays up, and the calls in flight on it go on after a
// short pause as if there had been none. After a long one (past the
// HTTP/2 keepalive, about 20 s) the transport gives up on the connection,
// and those calls fail with ErrHeld and why, not as a broken link.
//
// Hold does not end the connection itself: on a virtio-serial port the
// guest learns that a connection ended only when it runs, and a host that
// connects again before it has (as soon as the VM resumes) talks to the
// old session. See Release.
func (l *Link) Hold(why string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.held = fmt.Errorf("%w: %s", ErrHeld, why)
	l.holds++
	if l.stopResync != nil {
		l.stopResync()
		l.stopResync = nil
		l.lostHeld = true // no connection known to be good
	}
}

// Release ends Hold. When the connection ended while the link was held,
// the guest, which learns of that only once it runs, may still send the
// end of the old session into the port, and the first connection after
// it can meet those bytes and fail. Then the link stays held, refusing
// calls with ErrHeld ("resuming"), and Release returns resync, which
// probes the agent on fresh connections of its own until one answers: it
// makes that one the link's and releases it. It gives up when ctx ends
// (releasing the link, marked unhealthy) or when the link is held again
// or closed; its error says which. Otherwise Release releases the link at
// once and resync is nil.
func (l *Link) Release() (resync func(context.Context) error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.lostHeld {
		l.held = nil
		return nil
	}
	l.lostHeld = false
	l.held = fmt.Errorf("%w: it is resuming, and carreld is connecting to its agent again; try again in a moment", ErrHeld)
	holds := l.holds
	return func(ctx context.Context) error { return l.resync(ctx, holds) }
}

func (l *Link) resync(ctx context.Context, holds uint64) error {
	probeCtx, stop := context.WithCancel(ctx)
	defer stop()
	l.mu.Lock()
	if l.holds == holds {
		l.stopResync = stop
	}
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		if l.holds == holds {
			l.stopResync = nil
		}
		l.mu.Unlock()
	}()
	attempt := resyncAttempt
	for {
		l.mu.Lock()
		closed, again, held := l.closed, l.holds != holds, l.held
		l.mu.Unlock()
		switch {
		case closed:
			return net.ErrClosed
		case again:
			return held
		}
		s := l.newChannel(true)
		pctx, cancel := context.WithTimeout(probeCtx, attempt)
		resp, err := s.client.Health(pctx, connect.NewRequest(&agentv1.HealthRequest{}))
		cancel()
		if err == nil {
			l.mu.Lock()
			if l.closed || l.holds != holds {
				l.mu.Unlock()
				s.close()
				continue // the top of the loop says which
			}
			old := l.cur
			l.cur, l.held = s, nil
			l.mu.Unlock()
			if old != nil {
				old.close()
			}
			l.markReady(resp.Msg)
			return nil
		}
		s.close()
		if ctx.Err() != nil {
			l.mu.Lock()
			mine := l.holds == holds
			if mine {
				l.held = nil
			}
			l.mu.Unlock()
			if mine {
				l.markUnhealthy(err)
			}
			return fmt.Errorf("the guest agent did not answer on a new connection after the pause: %w", err)
		}
		attempt = min(2*attempt, 4*resyncAttempt)
		select {
		case <-probeCtx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// resyncAttempt is how long resync's first probe waits: a guest that has
// just resumed answers in milliseconds on a connection it has taken.
const resyncAttempt = time.Second

// Held returns why the link is held (Hold), or nil.
func (l *Link) Held() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.held
}

// Health probes the agent once.
func (l *Link) Health(ctx context.Context) (*agentv1.HealthResponse, error) {
	resp, _, err := l.probe(ctx)
	return resp, err
}

// probe is Health, also returning the channel it asked on.
func (l *Link) probe(ctx context.Context) (*agentv1.HealthResponse, *channel, error) {
	ctx, cancel := context.WithTimeout(ctx, l.healthTimeout)
	defer cancel()
	s := l.channel()
	resp, err := s.client.Health(ctx, connect.NewRequest(&agentv1.HealthRequest{}))
	if err := l.check(ctx, s, err); err != nil {
		return nil, s, err
	}
	l.markReady(resp.Msg)
	return resp.Msg, s, nil
}

// WaitReady returns once the agent answers a health probe. A probe to a
// booting guest simply waits (the port buffers the request until the guest
// opens it), so there is no blind sleep. A probe that fails, or that gets
// no answer within an attempt's time (the handshake can be lost if the
// guest opens the port while an old connection is torn down), is retried on
// a fresh connection. It gives up when ctx ends.
func (l *Link) WaitReady(ctx context.Context) error {
	return l.WaitReadyEvery(ctx, firstAttempt)
}

// WaitReadyEvery is WaitReady whose first probe waits attempt, for an
// agent known to be running already (a VM restored from a snapshot).
func (l *Link) WaitReadyEvery(ctx context.Context, attempt time.Duration) error {
	var last error
	for {
		s := l.channel()
		pctx, cancel := context.WithTimeout(ctx, attempt)
		resp, err := s.client.Health(pctx, connect.NewRequest(&agentv1.HealthRequest{}))
		cancel()
		if err == nil {
			l.markReady(resp.Msg)
			return nil
		}
		last = err
		l.drop(s)
		if attempt < time.Minute {
			attempt *= 2
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %w (last error: %v)", ErrNotReady, ctx.Err(), last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// firstAttempt is how long the first readiness probe waits: longer than a
// TCG boot takes, so a normal boot is one probe.
const firstAttempt = 15 * time.Second

// Keepalive probes the agent every interval until ctx ends, keeping State
// current. Failed probes mark the agent unhealthy; a later success marks it
// ready again. A probe that only ran out of time leaves the connection be:
// a guest busy with the calls in flight answers late, and ending the
// connection would fail every one of them. A connection that stops
// carrying frames at all (a frozen or wedged guest, a frame trickled a byte
// at a time) is ended by the HTTP/2 keepalive (protocol.HTTP2).
//
// The exception is a connection the agent never took: its HTTP/2
// settings, which an agent sends first once it has read the host's
// preface, have not come, so none of the calls on it has reached the
// agent, and they would only wait. On a virtio-serial port that means the
// guest is still in an earlier session, which took this connection's first
// bytes as its own (and may have sent the end of its own into it). The
// probe's timeout ends it (and fails those calls as Unavailable), so that
// the next connection comes seconds sooner than the HTTP/2 keepalive
// would allow.
func (l *Link) Keepalive(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if l.Held() != nil {
			continue
		}
		_, probed, err := l.probe(ctx)
		if err == nil || ctx.Err() != nil || l.Held() != nil {
			continue // a probe the pause caught out says nothing
		}
		if connect.CodeOf(err) == connect.CodeDeadlineExceeded {
			if !probed.ungreeted() {
				l.markUnhealthy(err)
				continue
			}
			l.fail(probed, fmt.Errorf("the agent never took this connection (the guest may still be in an earlier session): %w", err))
			continue
		}
		l.mu.Lock()
		s := l.cur
		l.mu.Unlock()
		if s != nil {
			l.fail(s, err)
		} else {
			l.markUnhealthy(err)
		}
	}
}

// Files returns the guest's file service on the current connection, and
// done, which the caller must pass every error of the calls it makes with
// it (including a stream's final error): done ends the connection when the
// error means the guest broke the protocol, as for the link's own calls.
func (l *Link) Files() (client agentv1connect.FileServiceClient, done func(ctx context.Context, err error) error) {
	s := l.channel()
	return s.files, func(ctx context.Context, err error) error { return l.check(ctx, s, err) }
}

// Ports returns the guest's port service on the current connection, and
// done, to be passed every error of the calls made with it (see Files).
func (l *Link) Ports() (client agentv1connect.PortServiceClient, done func(ctx context.Context, err error) error) {
	s := l.channel()
	return s.ports, func(ctx context.Context, err error) error { return l.check(ctx, s, err) }
}

// Egress returns the guest's egress service on the current connection,
// and done, to be passed every error of the calls made with it (see Files).
func (l *Link) Egress() (client agentv1connect.EgressServiceClient, done func(ctx context.Context, err error) error) {
	s := l.channel()
	return s.egress, func(ctx context.Context, err error) error { return l.check(ctx, s, err) }
}

// AgentCommands is Agent, with the same connection's commands (see
// Commands); done takes the commands' errors too.
func (l *Link) AgentCommands() (client agentv1connect.AgentServiceClient, commands *Commands, done func(ctx context.Context, err error) error) {
	s := l.channel()
	return s.client, s.commands, func(ctx context.Context, err error) error { return l.check(ctx, s, err) }
}

// Agent returns the guest's agent service on the current connection, and
// done, to be passed every error of the calls made with it (see Files).
func (l *Link) Agent() (client agentv1connect.AgentServiceClient, done func(ctx context.Context, err error) error) {
	s := l.channel()
	return s.client, func(ctx context.Context, err error) error { return l.check(ctx, s, err) }
}

// Shutdown asks the guest to power off (or reboot). The commands stream
// ends first: the agent's own shutdown waits for open calls.
func (l *Link) Shutdown(ctx context.Context, reboot bool) error {
	s := l.channel()
	s.commands.reset(hostErr(connect.CodeUnavailable, "the vm is stopping"))
	_, err := s.client.Shutdown(ctx, connect.NewRequest(&agentv1.ShutdownRequest{Reboot: reboot}))
	return l.check(ctx, s, err)
}

// Close ends the link; calls in flight fail.
func (l *Link) Close() error {
	l.mu.Lock()
	l.closed = true
	s := l.cur
	l.cur = nil
	data := l.data
	l.mu.Unlock()
	if s != nil {
		s.close()
	}
	if data != nil {
		data.turnOff(nil, net.ErrClosed)
	}
	return nil
}

func (l *Link) markUnhealthy(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.state != Unhealthy && !l.closed {
		l.log.Warn("guest agent unhealthy", "subsystem", "agentlink", "err", err)
	}
	l.state, l.lastErr = Unhealthy, err
}
