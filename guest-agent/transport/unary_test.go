package transport

import (
	"context"
	"net"
	"net/http"
	"runtime"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// portEnd is the guest's end of a pipe standing in for the port: reads as
// they come, writes through a portWriter onto a recorder of port writes.
type portEnd struct {
	net.Conn
	w *portWriter
}

func (p *portEnd) Write(b []byte) (int, error)        { return p.w.Write(b) }
func (p *portEnd) SetWriteDeadline(t time.Time) error { return p.w.SetWriteDeadline(t) }

// portWrites counts the writes that reach the port.
type portWrites struct {
	net.Conn
	mu sync.Mutex
	n  int
}

func (p *portWrites) Write(b []byte) (int, error) {
	p.mu.Lock()
	p.n++
	p.mu.Unlock()
	return p.Conn.Write(b)
}

func (p *portWrites) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}

// oneConn is a listener that hands out one connection.
type oneConn struct {
	c    chan net.Conn
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
func (l *oneConn) Close() error   { close(l.done); return nil }
func (l *oneConn) Addr() net.Addr { return serialAddr("test") }

type health struct {
	agentv1connect.UnimplementedAgentServiceHandler
}

func (health) Health(context.Context, *connect.Request[agentv1.HealthRequest]) (*connect.Response[agentv1.HealthResponse], error) {
	return connect.NewResponse(&agentv1.HealthResponse{Version: "test"}), nil
}

// A unary call's answer (headers, message, trailers) leaves the guest in
// one port write on a one-vCPU guest: the HTTP/2 server flushes after each
// of them, and the host waits for the trailers, which otherwise follow in
// a write of their own, a wake-up later under emulation.
func TestUnaryAnswerIsOnePortWrite(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	guest, host := net.Pipe()
	port := &portWrites{Conn: guest}
	l := &oneConn{c: make(chan net.Conn, 1), done: make(chan struct{})}
	l.c <- &portEnd{Conn: guest, w: newPortWriter(port)}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewAgentServiceHandler(health{}, protocol.HandlerOptions()...))
	srv := protocol.NewHTTPServer(mux)
	go srv.Serve(l)
	defer srv.Close()
	hc, tr := protocol.NewHTTPClient(func(context.Context) (net.Conn, error) { return host, nil })
	defer tr.CloseIdleConnections()
	c := agentv1connect.NewAgentServiceClient(hc, "http://agent", protocol.ClientOptions()...)
	ctx := context.Background()
	if _, err := c.Health(ctx, connect.NewRequest(&agentv1.HealthRequest{})); err != nil {
		t.Fatal(err) // sets up the connection
	}
	time.Sleep(50 * time.Millisecond) // for the settings' acks
	const calls = 20
	var merged int
	for range calls {
		before := port.count()
		if _, err := c.Health(ctx, connect.NewRequest(&agentv1.HealthRequest{})); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond) // anything left over is written by now
		if port.count()-before == 1 {
			merged++
		}
	}
	// The client shares the one P here, so now and then it takes the CPU
	// between the frames; without the merge no answer is one write.
	if merged < calls*3/4 {
		t.Errorf("%d of %d unary answers left in one port write; want at least %d", merged, calls, calls*3/4)
	}
}
