//go:build linux

package transport

import (
	"errors"
	"net"
	"testing"

	"github.com/mdlayher/vsock"
)

// fakeListener hands out conns from a list, then fails with net.ErrClosed.
type fakeListener struct {
	conns []net.Conn
}

func (l *fakeListener) Accept() (net.Conn, error) {
	if len(l.conns) == 0 {
		return nil, net.ErrClosed
	}
	c := l.conns[0]
	l.conns = l.conns[1:]
	return c, nil
}
func (l *fakeListener) Close() error   { return nil }
func (l *fakeListener) Addr() net.Addr { return &vsock.Addr{ContextID: 3, Port: 1024} }

// fakeConn is a conn with a chosen remote address that records Close.
type fakeConn struct {
	net.Conn // nil: only the methods below are used
	remote   net.Addr
	closed   bool
}

func (c *fakeConn) RemoteAddr() net.Addr { return c.remote }
func (c *fakeConn) Close() error         { c.closed = true; return nil }

func TestCIDListenerAcceptsOnlyHost(t *testing.T) {
	guest := &fakeConn{remote: &vsock.Addr{ContextID: 5, Port: 9}}
	hypervisor := &fakeConn{remote: &vsock.Addr{ContextID: vsock.Hypervisor, Port: 9}}
	notVsock := &fakeConn{remote: &net.UnixAddr{Name: "x", Net: "unix"}}
	host := &fakeConn{remote: &vsock.Addr{ContextID: vsock.Host, Port: 9}}
	l := newCIDListener(&fakeListener{conns: []net.Conn{guest, hypervisor, notVsock, host}}, vsock.Host, nil)

	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	if c != host {
		t.Fatalf("accepted %v, want the host's conn", c.RemoteAddr())
	}
	for _, c := range []*fakeConn{guest, hypervisor, notVsock} {
		if !c.closed {
			t.Errorf("conn from %v was not closed", c.remote)
		}
	}
	if host.closed {
		t.Error("host conn was closed")
	}
	if _, err := l.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("accept on exhausted listener: %v, want net.ErrClosed", err)
	}
}
