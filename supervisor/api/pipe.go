package api

import (
	"context"
	"net"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Pipe is a listener for carreld's own in-process clients (the e2b API):
// each Dial makes a connected pair of unix sockets and hands one end to
// Accept. Its connections carry no peer credentials (ConnContext reads
// them only from a *net.UnixConn, and these are wrapped), so a call on
// one is anonymous unless it brings a token: a client in carreld cannot
// act as carreld's own user by mistake.
type Pipe struct {
	self      bool
	conns     chan net.Conn
	done      chan struct{}
	closeOnce sync.Once
}

// NewPipe returns an open Pipe.
func NewPipe() *Pipe {
	return &Pipe{conns: make(chan net.Conn), done: make(chan struct{})}
}

// NewSelfPipe returns an open Pipe whose connections carry carreld's own
// credentials: its calls are carreld's, decided by policy and recorded
// as the calls of carreld's user (the fleet node agent's, which acts for
// its engine as an operator would).
func NewSelfPipe() *Pipe {
	p := NewPipe()
	p.self = true
	return p
}

// pipeConn hides the unix socket underneath from ConnContext.
type pipeConn struct{ net.Conn }

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "carreld-internal" }

// Dial connects a new client to the listener.
func (p *Pipe) Dial(ctx context.Context) (net.Conn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	client, err := fdConn(fds[0])
	if err != nil {
		unix.Close(fds[1])
		return nil, err
	}
	server, err := fdConn(fds[1])
	if err != nil {
		client.Close()
		return nil, err
	}
	var accepted net.Conn = pipeConn{server}
	if p.self {
		accepted = server
	}
	select {
	case p.conns <- accepted:
		return pipeConn{client}, nil
	case <-p.done:
		err = net.ErrClosed
	case <-ctx.Done():
		err = ctx.Err()
	}
	client.Close()
	server.Close()
	return nil, err
}

func fdConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "pipe")
	defer f.Close() // FileConn dups it
	return net.FileConn(f)
}

// Accept returns the next connection Dial made.
func (p *Pipe) Accept() (net.Conn, error) {
	select {
	case c := <-p.conns:
		return c, nil
	case <-p.done:
		return nil, net.ErrClosed
	}
}

// Close stops Accept and Dial; connections made stay open.
func (p *Pipe) Close() error {
	p.closeOnce.Do(func() { close(p.done) })
	return nil
}

// Addr names the listener.
func (p *Pipe) Addr() net.Addr { return pipeAddr{} }

var _ net.Listener = (*Pipe)(nil)
