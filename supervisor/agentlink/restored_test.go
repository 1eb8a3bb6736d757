package agentlink

import (
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// oneConn is a listener that hands out one connection.
type oneConn struct {
	c    chan net.Conn
	once sync.Once
	done chan struct{}
}

func (l *oneConn) Accept() (net.Conn, error) {
	select {
	case c := <-l.c:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}
func (l *oneConn) Close() error   { l.once.Do(func() { close(l.done) }); return nil }
func (l *oneConn) Addr() net.Addr { return &net.UnixAddr{Name: "pipe", Net: "unix"} }

// closeNotifier tells when the server closes its end.
type closeNotifier struct {
	net.Conn
	closed chan struct{}
	once   sync.Once
}

func (c *closeNotifier) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// TestEndOldSession: the agent's HTTP/2 server, mid-session (as a restored
// agent's is), fails on the oversized header and answers GOAWAY, which
// endOldSession reads up to; the host's hang-up then ends it at once.
func TestEndOldSession(t *testing.T) {
	host, guest := net.Pipe()
	defer host.Close()
	gc := &closeNotifier{Conn: guest, closed: make(chan struct{})}
	l := &oneConn{c: make(chan net.Conn, 1), done: make(chan struct{})}
	l.c <- gc
	srv := protocol.NewHTTPServer(http.NotFoundHandler())
	go srv.Serve(l)
	defer srv.Close()

	// An established session: the client's preface and SETTINGS, then the
	// server's SETTINGS, acked.
	host.SetDeadline(time.Now().Add(10 * time.Second))
	settings := []byte{0, 0, 0, 4, 0, 0, 0, 0, 0}
	go host.Write(append([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), settings...))
	var hdr [9]byte
	for {
		if _, err := io.ReadFull(host, hdr[:]); err != nil {
			t.Fatal(err)
		}
		n := int(hdr[0])<<16 | int(hdr[1])<<8 | int(hdr[2])
		if _, err := io.CopyN(io.Discard, host, int64(n)); err != nil {
			t.Fatal(err)
		}
		if hdr[3] == 4 && hdr[4]&1 == 0 {
			break // the server's SETTINGS
		}
	}
	go host.Write([]byte{0, 0, 0, 4, 1, 0, 0, 0, 0})
	if err := endOldSession(host); err != nil {
		t.Fatal(err)
	}
	// Left open, the server would read on for its shutdown's second;
	// the hang-up ends it at once.
	start := time.Now()
	host.Close()
	select {
	case <-gc.closed:
		if d := time.Since(start); d > 500*time.Millisecond {
			t.Errorf("the old session closed %s after the hang-up", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the old session did not close its connection")
	}
}

// TestEndOldSessionGivesUp: a peer that never says GOAWAY fails the
// takeover once the deadline passes, instead of hanging.
func TestEndOldSessionGivesUp(t *testing.T) {
	host, guest := net.Pipe()
	defer host.Close()
	defer guest.Close()
	go io.Copy(io.Discard, guest)
	host.SetDeadline(time.Now().Add(200 * time.Millisecond))
	if err := endOldSession(host); err == nil {
		t.Fatal("a takeover with no GOAWAY succeeded")
	}
}
