package egress

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// firstError keeps the first error either direction of a connection
// reports.
type firstError struct {
	mu  sync.Mutex
	err error
}

func (f *firstError) set(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err == nil {
		f.err = err
	}
}

func (f *firstError) get() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

// halfCloser is a connection whose write side can be closed alone.
type halfCloser interface {
	net.Conn
	CloseWrite() error
}

// pump carries an allowed connection's bytes both ways until both
// directions are closed, one breaks, or the tunnel's call ends (which
// closes conn). r is what the program sends (conn, or a reader holding
// bytes already read from it before conn). up counts bytes to carreld,
// down bytes from it. Only this goroutine sends on the stream.
func pump(t *tunnel, conn halfCloser, r io.Reader) (up, down int64, err error) {
	var first firstError
	ctx := t.ctx
	stop := context.AfterFunc(ctx, func() {
		first.set(ctx.Err())
		conn.Close()
	})
	defer stop()

	downc := make(chan int64, 1)
	go func() {
		n, err := copyFromHost(t.stream, conn)
		if err != nil {
			first.set(err)
			conn.Close()
		}
		downc <- n
	}()

	up, err = copyToHost(r, t.stream)
	if err != nil {
		first.set(err)
		conn.Close()
		select {
		case down = <-downc:
		default:
		}
		return up, down, first.get()
	}
	select {
	case down = <-downc:
	case <-ctx.Done():
	}
	return up, down, first.get()
}

// copyToHost sends what the program writes, then a close at its EOF.
func copyToHost(r io.Reader, stream dataStream) (int64, error) {
	buf := make([]byte, ChunkBytes)
	var n int64
	for {
		k, rerr := r.Read(buf)
		if k > 0 {
			// Send marshals before it returns, so buf can be reused.
			if err := stream.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Data{Data: buf[:k]}}); err != nil {
				return n, err
			}
			n += int64(k)
		}
		if errors.Is(rerr, io.EOF) {
			return n, stream.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Close{Close: &agentv1.EgressClose{}}})
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// copyFromHost writes carreld's bytes to the program and half-closes its
// connection at carreld's close (or the end of the stream). The half-close
// fails only when the program has gone already, which the other direction
// sees; it is no error here.
func copyFromHost(stream dataStream, conn halfCloser) (int64, error) {
	var n int64
	for {
		msg, err := stream.Receive()
		if errors.Is(err, io.EOF) {
			conn.CloseWrite()
			return n, nil
		}
		if err != nil {
			return n, err
		}
		switch m := msg.Msg.(type) {
		case *agentv1.EgressData_Data:
			k, err := conn.Write(m.Data)
			n += int64(k)
			if err != nil {
				return n, err
			}
		case *agentv1.EgressData_Close:
			conn.CloseWrite()
			return n, nil
		default:
			return n, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("egress connect: unexpected message %T after the verdict", msg.Msg))
		}
	}
}

// finish hands the tunnel back to its Connect handler with the pump's
// result: a connection that broke ends the call with Aborted.
func (t *tunnel) finish(err error) {
	if err != nil {
		if _, ok := errors.AsType[*connect.Error](err); !ok {
			err = connect.NewError(connect.CodeAborted, err)
		}
	}
	t.done <- err
}
