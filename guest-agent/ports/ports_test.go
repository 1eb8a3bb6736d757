package ports

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// serve serves a Service on a unix socket, the way carrel-agent does, and
// returns a client for it.
func serve(t testing.TB, opts Options) agentv1connect.PortServiceClient {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "ports.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewPortServiceHandler(New(opts), protocol.HandlerOptions()...))
	srv := protocol.NewHTTPServer(mux)
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	hc, tr := protocol.NewHTTPClient(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	})
	t.Cleanup(tr.CloseIdleConnections)
	return agentv1connect.NewPortServiceClient(hc, protocol.BaseURL, protocol.ClientOptions()...)
}

// listen starts a TCP server on the loopback that runs handle for each
// connection, and returns its port.
func listen(t testing.TB, handle func(*net.TCPConn)) uint32 {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(c.(*net.TCPConn))
			}()
		}
	}()
	return uint32(l.Addr().(*net.TCPAddr).Port)
}

// echo copies everything back, then half-closes at EOF.
func echo(c *net.TCPConn) {
	io.Copy(c, c)
	c.CloseWrite()
}

func openMsg(host string, port uint32) *agentv1.PortData {
	return &agentv1.PortData{Msg: &agentv1.PortData_Open{Open: &agentv1.PortOpen{Host: host, Port: port}}}
}

func dataMsg(b []byte) *agentv1.PortData {
	return &agentv1.PortData{Msg: &agentv1.PortData_Data{Data: b}}
}

func closeMsg() *agentv1.PortData {
	return &agentv1.PortData{Msg: &agentv1.PortData_Close{Close: &agentv1.PortClose{}}}
}

type stream = *connect.BidiStreamForClient[agentv1.PortData, agentv1.PortData]

// dial opens a connection to port and checks the opened reply.
func dial(t *testing.T, ctx context.Context, c agentv1connect.PortServiceClient, port uint32) stream {
	t.Helper()
	s := c.Connect(ctx)
	t.Cleanup(func() { s.CloseRequest(); s.CloseResponse() })
	if err := s.Send(openMsg("", port)); err != nil {
		t.Fatal(err)
	}
	m, err := s.Receive()
	if err != nil {
		t.Fatal(err)
	}
	if m.GetOpened() == nil {
		t.Fatalf("first reply %v, want opened", m)
	}
	return s
}

// readAll collects data until the agent's close, checking chunk sizes, and
// returns the bytes and the call's end.
func readAll(t *testing.T, s stream) ([]byte, error) {
	var buf bytes.Buffer
	closed := false
	for {
		m, err := s.Receive()
		if errors.Is(err, io.EOF) {
			if !closed {
				return buf.Bytes(), errors.New("call ended without a close")
			}
			return buf.Bytes(), nil
		}
		if err != nil {
			return buf.Bytes(), err
		}
		switch {
		case closed:
			return buf.Bytes(), fmt.Errorf("%v after close", m)
		case m.GetClose() != nil:
			closed = true
		case len(m.GetData()) > ChunkBytes:
			return buf.Bytes(), fmt.Errorf("a %d-byte chunk", len(m.GetData()))
		default:
			buf.Write(m.GetData())
		}
	}
}

func TestEchoLargeTransfer(t *testing.T) {
	c := serve(t, Options{})
	port := listen(t, echo)
	s := dial(t, context.Background(), c, port)

	blob := make([]byte, 8<<20+123)
	rand.Read(blob)
	errc := make(chan error, 1)
	go func() {
		for b := blob; len(b) > 0; {
			n := min(len(b), 100<<10) // bigger than the agent's chunks
			if err := s.Send(dataMsg(b[:n])); err != nil {
				errc <- err
				return
			}
			b = b[n:]
		}
		errc <- s.Send(closeMsg())
	}()
	got, err := readAll(t, s)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, blob) {
		t.Fatalf("echoed %d bytes, not the %d sent", len(got), len(blob))
	}
}

// The host's close reaches the service as EOF while the other direction
// stays open: the reply comes after it.
func TestHalfClose(t *testing.T) {
	c := serve(t, Options{})
	port := listen(t, func(c *net.TCPConn) {
		b, _ := io.ReadAll(c)
		fmt.Fprintf(c, "got %d bytes", len(b))
	})
	s := dial(t, context.Background(), c, port)
	s.Send(dataMsg([]byte("hello ")))
	s.Send(dataMsg([]byte("world")))
	s.Send(closeMsg())
	got, err := readAll(t, s)
	if err != nil || string(got) != "got 11 bytes" {
		t.Fatalf("reply %q, err %v", got, err)
	}
}

// The end of the request stream counts as the host's close.
func TestRequestEndIsClose(t *testing.T) {
	c := serve(t, Options{})
	port := listen(t, func(c *net.TCPConn) {
		b, _ := io.ReadAll(c)
		c.Write(bytes.ToUpper(b))
	})
	s := dial(t, context.Background(), c, port)
	s.Send(dataMsg([]byte("shout")))
	s.CloseRequest()
	got, err := readAll(t, s)
	if err != nil || string(got) != "SHOUT" {
		t.Fatalf("reply %q, err %v", got, err)
	}
}

// A service that speaks first and closes keeps the host's direction open
// until the host closes it.
func TestServiceClosesFirst(t *testing.T) {
	c := serve(t, Options{})
	gotHost := make(chan string, 1)
	port := listen(t, func(c *net.TCPConn) {
		c.Write([]byte("banner\n"))
		c.CloseWrite()
		b, _ := io.ReadAll(c)
		gotHost <- string(b)
	})
	s := dial(t, context.Background(), c, port)
	m, err := s.Receive()
	if err != nil || string(m.GetData()) != "banner\n" {
		t.Fatalf("first data %v, %v", m, err)
	}
	if m, err := s.Receive(); err != nil || m.GetClose() == nil {
		t.Fatalf("want close, got %v, %v", m, err)
	}
	s.Send(dataMsg([]byte("late")))
	s.Send(closeMsg())
	if _, err := s.Receive(); !errors.Is(err, io.EOF) {
		t.Fatalf("call end: %v", err)
	}
	if got := <-gotHost; got != "late" {
		t.Errorf("service read %q after its close", got)
	}
}

func TestRefused(t *testing.T) {
	c := serve(t, Options{})
	port := listen(t, echo)
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	closedPort := uint32(l.Addr().(*net.TCPAddr).Port)
	l.Close()

	for _, tc := range []struct {
		name  string
		first *agentv1.PortData
		code  connect.Code
	}{
		{"other host", openMsg("10.0.2.2", port), connect.CodeInvalidArgument},
		{"name", openMsg("localhost", port), connect.CodeInvalidArgument},
		{"other loopback", openMsg("127.0.0.2", port), connect.CodeInvalidArgument},
		{"port 0", openMsg("", 0), connect.CodeInvalidArgument},
		{"port too big", openMsg("", 70000), connect.CodeInvalidArgument},
		{"data first", dataMsg([]byte("x")), connect.CodeInvalidArgument},
		{"nothing listening", openMsg("127.0.0.1", closedPort), connect.CodeFailedPrecondition},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := c.Connect(context.Background())
			defer s.CloseResponse()
			s.Send(tc.first)
			s.CloseRequest()
			_, err := s.Receive()
			if connect.CodeOf(err) != tc.code {
				t.Errorf("got %v, want %v", err, tc.code)
			}
		})
	}
	t.Run("no open", func(t *testing.T) {
		s := c.Connect(context.Background())
		defer s.CloseResponse()
		s.CloseRequest()
		if _, err := s.Receive(); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("got %v", err)
		}
	})
	t.Run("second open", func(t *testing.T) {
		s := dial(t, context.Background(), c, port)
		s.Send(openMsg("", port))
		if _, err := readAll(t, s); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("got %v", err)
		}
	})
	t.Run("ipv6", func(t *testing.T) {
		l, err := net.Listen("tcp", "[::1]:0")
		if err != nil {
			t.Skip("no ::1 here:", err)
		}
		defer l.Close()
		go func() {
			if c, err := l.Accept(); err == nil {
				c.Write([]byte("six"))
				c.Close()
			}
		}()
		s := c.Connect(context.Background())
		defer s.CloseResponse()
		s.Send(openMsg("::1", uint32(l.Addr().(*net.TCPAddr).Port)))
		s.CloseRequest()
		if m, err := s.Receive(); err != nil || m.GetOpened() == nil {
			t.Fatalf("open ::1: %v %v", m, err)
		}
		if got, err := readAll(t, s); err != nil || string(got) != "six" {
			t.Errorf("read %q, %v", got, err)
		}
	})
}

// Ending the call closes the guest connection.
func TestCancelClosesConnection(t *testing.T) {
	c := serve(t, Options{})
	ended := make(chan error, 1)
	port := listen(t, func(c *net.TCPConn) {
		_, err := io.Copy(io.Discard, c)
		ended <- err
	})
	ctx, cancel := context.WithCancel(context.Background())
	s := dial(t, ctx, c, port)
	s.Send(dataMsg([]byte("some")))
	// What the host does to end a call: cancel, and close the response
	// (which resets the stream even while the request is open).
	cancel()
	s.CloseResponse()
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the service's connection is still open after the call was cancelled")
	}
}

// A connection the service resets ends the call with an error.
func TestResetIsAnError(t *testing.T) {
	c := serve(t, Options{})
	port := listen(t, func(c *net.TCPConn) {
		c.Read(make([]byte, 1))
		c.SetLinger(0) // close sends RST
	})
	s := dial(t, context.Background(), c, port)
	s.Send(dataMsg([]byte("x")))
	if _, err := readAll(t, s); connect.CodeOf(err) != connect.CodeAborted {
		t.Errorf("got %v, want aborted", err)
	}
}

func TestDialTimeout(t *testing.T) {
	c := serve(t, Options{DialTimeout: time.Nanosecond})
	port := listen(t, echo)
	s := c.Connect(context.Background())
	defer s.CloseResponse()
	s.Send(openMsg("", port))
	if _, err := s.Receive(); connect.CodeOf(err) != connect.CodeDeadlineExceeded {
		t.Errorf("got %v, want deadline exceeded", err)
	}
}

func TestAddress(t *testing.T) {
	for _, tc := range []struct {
		host string
		port uint32
		want string
	}{
		{"", 80, "127.0.0.1:80"},
		{"127.0.0.1", 65535, "127.0.0.1:65535"},
		{"::1", 1, "[::1]:1"},
	} {
		if got, err := protocol.PortAddress(tc.host, tc.port); err != nil || got != tc.want {
			t.Errorf("%q %d: %q %v", tc.host, tc.port, got, err)
		}
	}
	for _, h := range []string{"0.0.0.0", "::", "127.1", "host:1", "169.254.169.254"} {
		if _, err := protocol.PortAddress(h, 80); err == nil {
			t.Errorf("%q accepted", h)
		}
	}
}

// BenchmarkThroughput measures one connection's echo throughput through the
// service over a unix socket (the transport carrel-agent uses in tests).
func BenchmarkThroughput(b *testing.B) {
	c := serve(b, Options{})
	port := listen(b, echo)
	chunk := make([]byte, 256<<10)
	b.SetBytes(int64(len(chunk)))
	s := c.Connect(context.Background())
	defer s.CloseResponse()
	s.Send(openMsg("", port))
	if m, err := s.Receive(); err != nil || m.GetOpened() == nil {
		b.Fatal(m, err)
	}
	done := make(chan int64)
	go func() {
		var n int64
		for {
			m, err := s.Receive()
			if err != nil || m.GetClose() != nil {
				done <- n
				return
			}
			n += int64(len(m.GetData()))
		}
	}()
	b.ResetTimer()
	for range b.N {
		if err := s.Send(dataMsg(chunk)); err != nil {
			b.Fatal(err)
		}
	}
	s.Send(closeMsg())
	if n := <-done; n != int64(b.N*len(chunk)) {
		b.Fatalf("echoed %d bytes, want %d", n, b.N*len(chunk))
	}
}
