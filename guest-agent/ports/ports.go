// Package ports serves carrel.agent.v1.PortService: TCP connections from
// the host to services listening on the guest's loopback interface. Each
// connection is one Connect call; its bytes travel in PortData messages,
// with a close message for each direction's end (TCP half-close).
//
// Only loopback addresses are dialled: port forwarding reaches the guest's
// own services and is never a way out of it.
package ports

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

const (
	// ChunkBytes is the most bytes one data message from the agent carries.
	ChunkBytes = 32 << 10
	// DefaultDialTimeout bounds the dial of a guest port.
	DefaultDialTimeout = 10 * time.Second
)

// Options configures a Service. Zero fields take the defaults.
type Options struct {
	// DialTimeout bounds connecting to the guest port.
	DialTimeout time.Duration
	// Log receives one record per connection; nil means slog.Default().
	Log *slog.Logger
}

// Service is the agent's PortService.
type Service struct {
	opts Options
}

var _ agentv1connect.PortServiceHandler = (*Service)(nil)

// New returns a Service.
func New(opts Options) *Service {
	if opts.DialTimeout <= 0 {
		opts.DialTimeout = DefaultDialTimeout
	}
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	return &Service{opts: opts}
}

// Connect implements agentv1connect.PortServiceHandler. Its errors are
// *connect.Error: InvalidArgument for a bad request, FailedPrecondition or
// DeadlineExceeded when the dial fails, Aborted when the connection breaks.
func (s *Service) Connect(ctx context.Context, stream *connect.BidiStream[agentv1.PortData, agentv1.PortData]) error {
	first, err := stream.Receive()
	if errors.Is(err, io.EOF) {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("port connect: no open message"))
	}
	if err != nil {
		return err
	}
	open := first.GetOpen()
	if open == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("port connect: the first message must be open"))
	}
	addr, err := protocol.PortAddress(open.GetHost(), open.GetPort())
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("port connect: %w", err))
	}
	start := time.Now()
	dctx, cancel := context.WithTimeout(ctx, s.opts.DialTimeout)
	var d net.Dialer
	c, err := d.DialContext(dctx, "tcp", addr)
	cancel()
	if err != nil {
		code := connect.CodeFailedPrecondition
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
			code = connect.CodeDeadlineExceeded
		}
		s.opts.Log.Info("port connect failed", "rpc", "Connect", "addr", addr, "err", err)
		return connect.NewError(code, fmt.Errorf("connect to %s: %w", addr, unwrapOp(err)))
	}
	conn := c.(*net.TCPConn)
	defer conn.Close()
	if err := stream.Send(&agentv1.PortData{Msg: &agentv1.PortData_Opened{Opened: &agentv1.PortOpened{}}}); err != nil {
		return err
	}
	in, out, err := pump(ctx, stream, conn)
	log := s.opts.Log.With("rpc", "Connect", "addr", addr, "bytes_in", in, "bytes_out", out, "duration", time.Since(start))
	if err != nil {
		log.Info("port connection ended", "err", err)
		if _, ok := errors.AsType[*connect.Error](err); !ok {
			err = connect.NewError(connect.CodeAborted, fmt.Errorf("connection to %s: %w", addr, unwrapOp(err)))
		}
		return err
	}
	log.Debug("port connection closed")
	return nil
}

// unwrapOp drops a *net.OpError's "dial tcp 127.0.0.1:1->127.0.0.1:2"
// prefix, which the messages here already say better.
func unwrapOp(err error) error {
	if op, ok := errors.AsType[*net.OpError](err); ok && op.Err != nil {
		return op.Err
	}
	return err
}

// portStream is the part of the call pump uses; tests fake it.
type portStream interface {
	Receive() (*agentv1.PortData, error)
	Send(*agentv1.PortData) error
}

// pump carries bytes both ways until both directions are closed, one
// breaks, or ctx ends (which closes conn). in counts bytes from the host,
// out bytes to it. Only this goroutine sends on stream, so nothing is sent
// after the handler returns.
func pump(ctx context.Context, stream portStream, conn *net.TCPConn) (in, out int64, err error) {
	var first protocol.FirstError
	stop := context.AfterFunc(ctx, func() {
		first.Set(ctx.Err())
		conn.Close()
	})
	defer stop()

	down := make(chan int64, 1)
	go func() {
		n, err := copyFromHost(stream, conn)
		if err != nil {
			// Record the cause before the close makes the other
			// direction fail too.
			first.Set(err)
			conn.Close()
		}
		down <- n
	}()

	out, err = copyToHost(conn, stream)
	if err != nil {
		first.Set(err)
		conn.Close()
		// The other direction may wait on a host that sends nothing;
		// ending the call ends it.
		select {
		case in = <-down:
		default:
		}
		return in, out, first.Get()
	}
	select {
	case in = <-down:
	case <-ctx.Done():
		// The AfterFunc has closed conn; the host side may still be
		// blocked in Receive, which ending the call unblocks.
	}
	return in, out, first.Get()
}

// copyToHost sends what the guest service writes, then a close at its EOF.
func copyToHost(conn *net.TCPConn, stream portStream) (int64, error) {
	buf := make([]byte, ChunkBytes)
	var n int64
	for {
		k, rerr := conn.Read(buf)
		if k > 0 {
			// Send marshals before it returns, so buf can be reused.
			if err := stream.Send(&agentv1.PortData{Msg: &agentv1.PortData_Data{Data: buf[:k]}}); err != nil {
				return n, err
			}
			n += int64(k)
		}
		if errors.Is(rerr, io.EOF) {
			return n, stream.Send(&agentv1.PortData{Msg: &agentv1.PortData_Close{Close: &agentv1.PortClose{}}})
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// copyFromHost writes the host's bytes to the guest service and
// half-closes it at the host's close (or the end of its stream). It stops
// reading the stream at the close: the call ends once both sides are done.
func copyFromHost(stream portStream, conn *net.TCPConn) (int64, error) {
	var n int64
	for {
		msg, err := stream.Receive()
		if errors.Is(err, io.EOF) {
			return n, conn.CloseWrite()
		}
		if err != nil {
			return n, err
		}
		switch m := msg.Msg.(type) {
		case *agentv1.PortData_Data:
			k, err := conn.Write(m.Data)
			n += int64(k)
			if err != nil {
				return n, err
			}
		case *agentv1.PortData_Close:
			return n, conn.CloseWrite()
		case *agentv1.PortData_Open:
			return n, connect.NewError(connect.CodeInvalidArgument, errors.New("port connect: a second open"))
		default:
			return n, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("port connect: unexpected message %T", msg.Msg))
		}
	}
}
