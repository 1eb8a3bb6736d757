// Package agentlink is carreld's side of the stream to one guest agent.
//
// A Link multiplexes RPCs over a single connection made by its dialer
// (vsock, or the VM's virtio-serial port), redials after a failure, and
// tracks whether the agent is healthy. Everything the guest sends is
// untrusted: messages are size-capped (protocol.MaxMessageBytes), every call
// carries a deadline, and a guest that breaks the protocol gets its
// connection closed and is marked unhealthy, which is logged once.
package agentlink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
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
	// HealthTimeout bounds one health probe.
	HealthTimeout = 5 * time.Second
	// KeepaliveInterval is how often a ready agent is probed.
	KeepaliveInterval = 10 * time.Second
)

// ErrNotReady is returned by WaitReady when ctx ends before the agent
// answers.
var ErrNotReady = errors.New("guest agent did not become ready")

// Link is the host end of one agent connection.
type Link struct {
	log       *slog.Logger
	dial      func(ctx context.Context) (net.Conn, error)
	transport *http.Transport
	client    agentv1connect.AgentServiceClient

	mu      sync.Mutex
	conn    net.Conn // the live connection, closed by reset
	state   State
	lastErr error
	info    *agentv1.HealthResponse
	closed  bool
}

// New returns a link that dials with dial. It does not connect yet.
func New(dial func(ctx context.Context) (net.Conn, error), log *slog.Logger) *Link {
	if log == nil {
		log = slog.Default()
	}
	l := &Link{log: log, dial: dial}
	httpClient, t := protocol.NewHTTPClient(l.dialTracked)
	l.transport = t
	l.client = agentv1connect.NewAgentServiceClient(httpClient, protocol.BaseURL, protocol.ClientOptions()...)
	return l
}

func (l *Link) dialTracked(ctx context.Context) (net.Conn, error) {
	l.mu.Lock()
	closed := l.closed
	l.mu.Unlock()
	if closed {
		return nil, net.ErrClosed
	}
	c, err := l.dial(ctx)
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		c.Close()
		return nil, net.ErrClosed
	}
	l.conn = c
	return c, nil
}

// State returns the agent's health and the error that made it unhealthy.
func (l *Link) State() (State, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.state, l.lastErr
}

// Info returns the agent's last health reply, or nil.
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

// fail records err. Protocol violations and transport failures close the
// connection and mark the agent unhealthy; the transition is logged once.
func (l *Link) fail(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn != nil {
		l.conn.Close()
		l.conn = nil
	}
	if l.state != Unhealthy && !l.closed {
		l.log.Warn("guest agent unhealthy: link closed", "subsystem", "agentlink", "err", err)
	}
	l.state, l.lastErr = Unhealthy, err
}

// check classifies an RPC error. Application errors (bad argument, no such
// command) leave the link alone; anything that means the stream can no
// longer be trusted ends it.
func (l *Link) check(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if ctx.Err() != nil {
		// The caller gave up (deadline or cancel); not the guest's fault.
		return err
	}
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable, connect.CodeInternal, connect.CodeUnknown,
		connect.CodeResourceExhausted, connect.CodeDataLoss, connect.CodeUnimplemented:
		l.fail(err)
	}
	return err
}

// Health probes the agent once.
func (l *Link) Health(ctx context.Context) (*agentv1.HealthResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, HealthTimeout)
	defer cancel()
	resp, err := l.client.Health(ctx, connect.NewRequest(&agentv1.HealthRequest{}))
	if err := l.check(ctx, err); err != nil {
		return nil, err
	}
	l.markReady(resp.Msg)
	return resp.Msg, nil
}

// WaitReady returns once the agent answers a health probe. A probe to a
// booting guest simply waits (the port buffers the request until the guest
// opens it), so there is no blind sleep. A probe that fails, or that gets
// no answer within an attempt's time (the handshake can be lost if the
// guest opens the port while an old connection is torn down), is retried on
// a fresh connection. It gives up when ctx ends.
func (l *Link) WaitReady(ctx context.Context) error {
	var last error
	attempt := firstAttempt
	for {
		pctx, cancel := context.WithTimeout(ctx, attempt)
		resp, err := l.client.Health(pctx, connect.NewRequest(&agentv1.HealthRequest{}))
		cancel()
		if err == nil {
			l.markReady(resp.Msg)
			return nil
		}
		last = err
		l.resetConn()
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

func (l *Link) resetConn() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn != nil {
		l.conn.Close()
		l.conn = nil
	}
}

// Keepalive probes the agent every interval until ctx ends, keeping State
// current. Failed probes mark the agent unhealthy; a later success marks it
// ready again.
func (l *Link) Keepalive(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if _, err := l.Health(ctx); err != nil && ctx.Err() == nil {
			l.fail(err)
		}
	}
}

// ExecStream is an exec call's stream of events from the guest.
type ExecStream struct {
	l      *Link
	ctx    context.Context
	stream *connect.ServerStreamForClient[agentv1.ExecResponse]
}

// Exec starts a command in the guest.
func (l *Link) Exec(ctx context.Context, req *agentv1.ExecRequest) (*ExecStream, error) {
	s, err := l.client.Exec(ctx, connect.NewRequest(req))
	if err := l.check(ctx, err); err != nil {
		return nil, err
	}
	return &ExecStream{l: l, ctx: ctx, stream: s}, nil
}

// Recv returns the next event. It returns io.EOF-free semantics: ok is
// false when the stream has ended, with err set if it ended badly.
func (s *ExecStream) Recv() (msg *agentv1.ExecResponse, ok bool, err error) {
	if s.stream.Receive() {
		return s.stream.Msg(), true, nil
	}
	return nil, false, s.l.check(s.ctx, s.stream.Err())
}

// Close ends the stream.
func (s *ExecStream) Close() error { return s.stream.Close() }

// Shutdown asks the guest to power off (or reboot).
func (l *Link) Shutdown(ctx context.Context, reboot bool) error {
	_, err := l.client.Shutdown(ctx, connect.NewRequest(&agentv1.ShutdownRequest{Reboot: reboot}))
	return l.check(ctx, err)
}

// Close ends the link; calls in flight fail.
func (l *Link) Close() error {
	l.mu.Lock()
	l.closed = true
	c := l.conn
	l.conn = nil
	l.mu.Unlock()
	if c != nil {
		c.Close()
	}
	l.transport.CloseIdleConnections()
	return nil
}
