package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// portChunkBytes is the most bytes one data message to the guest carries.
const portChunkBytes = 32 << 10

// PortConn is a TCP connection to a port inside a VM, carried by one
// PortService.Connect call through carreld. It is a net.Conn whose
// CloseWrite half-closes the connection, as *net.TCPConn's does.
type PortConn interface {
	net.Conn
	// CloseWrite tells the guest's service that no more bytes are coming
	// (it reads EOF); bytes from it can still be read.
	CloseWrite() error
}

// DialPort connects to TCP port on vm's loopback interface (127.0.0.1) and
// returns the connection once the guest has made it, or the reason it
// could not, e.g. nothing listening there. As with net.Dialer.DialContext,
// ctx bounds the dial only: once connected, the connection lasts until it
// is closed (or carreld's limit on one connection, a day, runs out). The
// net.Conn it returns is a PortConn.
func (c *Client) DialPort(ctx context.Context, vm string, port uint16) (net.Conn, error) {
	if port == 0 {
		return nil, errors.New("dial port: port 0")
	}
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	stream := c.Ports.Connect(sctx)
	stream.RequestHeader().Set(protocol.VMHeader, vm)
	// Cancelling alone does not wake a Receive while the request body is
	// open (net/http's HTTP/2 client watches the context only once the
	// body is done); closing the response resets the stream.
	context.AfterFunc(sctx, func() { stream.CloseResponse() })
	fail := func(err error) (net.Conn, error) {
		cancel()
		stream.CloseResponse()
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, fmt.Errorf("connect to port %d in vm %s: %w", port, vm, err)
	}
	open := &agentv1.PortData{Msg: &agentv1.PortData_Open{Open: &agentv1.PortOpen{Host: "127.0.0.1", Port: uint32(port)}}}
	if err := stream.Send(open); err != nil && !errors.Is(err, io.EOF) {
		return fail(err) // on EOF, Receive has the reason
	}
	msg, err := stream.Receive()
	if !stop() {
		return fail(ctx.Err())
	}
	if errors.Is(err, io.EOF) {
		return fail(errors.New("the call ended before the connection opened"))
	}
	if err != nil {
		return fail(err)
	}
	if msg.GetOpened() == nil {
		return fail(fmt.Errorf("unexpected first reply %T", msg.Msg))
	}
	pc := &portConn{
		stream: stream, cancel: cancel,
		local: portAddr{vm: "client"}, remote: portAddr{vm: vm, port: port},
		recv: make(chan portRecv), done: make(chan struct{}),
		readDeadline: newDeadline(), writeDeadline: newDeadline(),
	}
	go pc.receive()
	return pc, nil
}

// portConn implements PortConn over a Connect stream.
type portConn struct {
	stream *connect.BidiStreamForClient[agentv1.PortData, agentv1.PortData]
	cancel context.CancelFunc
	local  portAddr
	remote portAddr

	recv chan portRecv // from the receive goroutine
	done chan struct{} // closed by Close

	rmu          sync.Mutex // one Read at a time
	rbuf         []byte     // the unread rest of the last chunk
	rerr         error      // sticky: io.EOF after the guest's close
	readDeadline *deadline

	wmu           sync.Mutex // one Write or CloseWrite at a time
	wclosed       bool
	werr          error // sticky
	writeDeadline *deadline
	wtimedOut     atomic.Bool

	closeOnce sync.Once
}

var _ PortConn = (*portConn)(nil)

type portRecv struct {
	data []byte
	eof  bool // the guest closed its side
	err  error
}

// receive hands the stream's messages to Read, one at a time, until the
// guest's close, the stream's end, or Close.
func (c *portConn) receive() {
	defer c.stream.CloseResponse()
	for {
		var r portRecv
		msg, err := c.stream.Receive()
		switch {
		case errors.Is(err, io.EOF):
			r.err = io.ErrUnexpectedEOF // carreld ends a call only after a close
		case err != nil:
			r.err = err
		case msg.GetClose() != nil:
			r.eof = true
		case len(msg.GetData()) > 0:
			r.data = msg.GetData()
		default:
			continue // an empty chunk
		}
		select {
		case c.recv <- r:
		case <-c.done:
			return
		}
		if r.err != nil {
			return
		}
		if r.eof {
			// Read is done; the call ends once our side closes too.
			// Draining keeps the stream's flow control moving.
			for {
				if _, err := c.stream.Receive(); err != nil {
					return
				}
			}
		}
	}
}

// Read implements net.Conn.
func (c *portConn) Read(p []byte) (int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	for len(c.rbuf) == 0 {
		if c.rerr != nil {
			return 0, c.rerr
		}
		select {
		case <-c.done:
			return 0, net.ErrClosed
		default:
		}
		select {
		case r := <-c.recv:
			switch {
			case r.err != nil:
				if c.wtimedOut.Load() {
					r.err = os.ErrDeadlineExceeded
				}
				c.rerr = r.err
			case r.eof:
				c.rerr = io.EOF
			default:
				c.rbuf = r.data
			}
		case <-c.readDeadline.wait():
			return 0, os.ErrDeadlineExceeded
		case <-c.done:
			return 0, net.ErrClosed
		}
	}
	n := copy(p, c.rbuf)
	c.rbuf = c.rbuf[n:]
	return n, nil
}

// Write implements net.Conn. A Write that runs past the write deadline
// breaks the connection (as with crypto/tls): what reached the guest is
// unknown.
func (c *portConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	switch {
	case c.werr != nil:
		return 0, c.werr
	case c.isClosed():
		return 0, net.ErrClosed
	case c.wclosed:
		return 0, errors.New("write after CloseWrite")
	}
	select {
	case <-c.writeDeadline.wait():
		return 0, os.ErrDeadlineExceeded
	default:
	}
	if t := c.writeDeadline.when(); !t.IsZero() {
		timer := time.AfterFunc(time.Until(t), func() {
			c.wtimedOut.Store(true)
			c.cancel()
		})
		defer timer.Stop()
	}
	n := 0
	for len(p) > 0 {
		k := min(len(p), portChunkBytes)
		if err := c.stream.Send(&agentv1.PortData{Msg: &agentv1.PortData_Data{Data: p[:k]}}); err != nil {
			switch {
			case c.wtimedOut.Load():
				err = os.ErrDeadlineExceeded
			case c.isClosed():
				return n, net.ErrClosed
			case errors.Is(err, io.EOF):
				// The call ended; Read reports why.
				err = fmt.Errorf("write to port %d in vm %s: %w", c.remote.port, c.remote.vm, io.ErrClosedPipe)
			}
			c.werr = err
			return n, err
		}
		n += k
		p = p[k:]
	}
	return n, nil
}

// CloseWrite implements PortConn.
func (c *portConn) CloseWrite() error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.wclosed || c.isClosed() {
		return nil
	}
	c.wclosed = true
	err := c.stream.Send(&agentv1.PortData{Msg: &agentv1.PortData_Close{Close: &agentv1.PortClose{}}})
	if errors.Is(err, io.EOF) {
		err = nil // the call has ended anyway
	}
	return errors.Join(err, c.stream.CloseRequest())
}

// Close implements net.Conn: it ends the call, which drops the guest's
// connection. Blocked Reads and Writes return.
func (c *portConn) Close() error {
	c.closeOnce.Do(func() {
		close(c.done)
		c.cancel()
	})
	return nil
}

func (c *portConn) isClosed() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

func (c *portConn) LocalAddr() net.Addr  { return c.local }
func (c *portConn) RemoteAddr() net.Addr { return c.remote }

func (c *portConn) SetDeadline(t time.Time) error {
	c.readDeadline.set(t)
	c.writeDeadline.set(t)
	return nil
}

func (c *portConn) SetReadDeadline(t time.Time) error {
	c.readDeadline.set(t)
	return nil
}

// SetWriteDeadline implements net.Conn; it applies to Writes that start
// after it.
func (c *portConn) SetWriteDeadline(t time.Time) error {
	c.writeDeadline.set(t)
	return nil
}

// portAddr names one end of a PortConn: "VM:PORT".
type portAddr struct {
	vm   string
	port uint16
}

func (portAddr) Network() string { return "carrel" }
func (a portAddr) String() string {
	if a.port == 0 {
		return a.vm
	}
	return a.vm + ":" + strconv.Itoa(int(a.port))
}

// deadline is a settable deadline whose wait channel is closed once it
// passes (as in net.Pipe).
type deadline struct {
	mu     sync.Mutex
	t      time.Time
	timer  *time.Timer
	passed chan struct{}
}

func newDeadline() *deadline { return &deadline{passed: make(chan struct{})} }

// set moves the deadline; the zero time means none.
func (d *deadline) set(t time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.timer != nil && !d.timer.Stop() {
		<-d.passed // the timer fired: wait for it to close passed
	}
	d.timer = nil
	closed := isDone(d.passed)
	d.t = t
	if t.IsZero() {
		if closed {
			d.passed = make(chan struct{})
		}
		return
	}
	if dur := time.Until(t); dur > 0 {
		if closed {
			d.passed = make(chan struct{})
		}
		ch := d.passed
		d.timer = time.AfterFunc(dur, func() { close(ch) })
		return
	}
	if !closed {
		close(d.passed)
	}
}

func (d *deadline) wait() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.passed
}

func (d *deadline) when() time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.t
}

func isDone(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
