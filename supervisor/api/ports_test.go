package api

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/ports"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/relay"
)

// createVM creates a fake VM whose agent serves ports with p.
func createVM(t *testing.T, p agentv1connect.PortServiceHandler, name string) *client.Client {
	t.Helper()
	sock, drv := serveAPIWith(t)
	drv.SetNext(drivertest.Behavior{Ports: p})
	c := client.New(sock)
	if _, err := c.VMs.CreateVM(context.Background(), connect.NewRequest(&apiv1.CreateVMRequest{Name: name, Image: "dev"})); err != nil {
		t.Fatal(err)
	}
	return c
}

// tcpServer runs handle for each connection to a loopback port.
func tcpServer(t *testing.T, handle func(*net.TCPConn)) uint16 {
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
	return uint16(l.Addr().(*net.TCPAddr).Port)
}

// roundTrip sends data, half-closes, and reads everything back.
func roundTrip(ctx context.Context, c *client.Client, vm string, port uint16, data []byte) ([]byte, error) {
	conn, err := c.DialPort(ctx, vm, port)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	errc := make(chan error, 1)
	go func() {
		_, err := conn.Write(data)
		if err == nil {
			err = conn.(client.PortConn).CloseWrite()
		}
		errc <- err
	}()
	got, err := io.ReadAll(conn)
	if werr := <-errc; err == nil {
		err = werr
	}
	return got, err
}

// The real agent service, relayed: bytes arrive intact both ways, with
// half-closes, on many connections at once.
func TestPortRelay(t *testing.T) {
	c := createVM(t, ports.New(ports.Options{}), "web")
	ctx := context.Background()
	echo := tcpServer(t, func(c *net.TCPConn) { io.Copy(c, c) })
	count := tcpServer(t, func(c *net.TCPConn) {
		b, _ := io.ReadAll(c)
		fmt.Fprintf(c, "%d bytes", len(b))
	})

	blob := make([]byte, 4<<20+7)
	rand.Read(blob)
	got, err := roundTrip(ctx, c, "web", echo, blob)
	if err != nil || !bytes.Equal(got, blob) {
		t.Fatalf("echo: %d bytes back, err %v", len(got), err)
	}

	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			msg := []byte(strings.Repeat(fmt.Sprint(i), 1000+i))
			got, err := roundTrip(ctx, c, "web", count, msg)
			if want := fmt.Sprintf("%d bytes", len(msg)); err != nil || string(got) != want {
				t.Errorf("connection %d: %q, %v; want %q", i, got, err, want)
			}
		})
	}
	wg.Wait()

	// Nothing listening: the dial fails with the guest's reason.
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	closed := uint16(l.Addr().(*net.TCPAddr).Port)
	l.Close()
	if _, err := c.DialPort(ctx, "web", closed); connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "refused") {
		t.Errorf("dial a closed port: %v", err)
	}
}

// Deadlines on the client's net.Conn.
func TestPortConnDeadlines(t *testing.T) {
	c := createVM(t, ports.New(ports.Options{}), "slow")
	ctx := context.Background()
	silent := tcpServer(t, func(c *net.TCPConn) { io.Copy(io.Discard, c) })
	conn, err := c.DialPort(ctx, "slow", silent)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := conn.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("read past deadline: %v", err)
	}
	// A later deadline makes it usable again.
	conn.SetReadDeadline(time.Time{})
	if _, err := conn.Write([]byte("still fine")); err != nil {
		t.Errorf("write after a read timeout: %v", err)
	}
	// Close wakes a blocked Read.
	done := make(chan error, 1)
	go func() { _, err := conn.Read(make([]byte, 1)); done <- err }()
	waitParked(t, "github.com/carrel-os/carrel/supervisor/client.(*portConn).Read", done)
	conn.Close()
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("read after close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not wake Read")
	}
}

// waitParked waits until a goroutine is parked in fn (a function's name
// as a stack trace prints it); the client has no event to say so. It fails
// if done yields first: the call returned without blocking.
func waitParked(t *testing.T, fn string, done <-chan error) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		for _, g := range strings.Split(string(buf[:n]), "\n\n") {
			state, _, _ := strings.Cut(g, "\n")
			parked := strings.Contains(state, "[select") || strings.Contains(state, "[chan receive")
			if parked && strings.Contains(g, "\n"+fn+"(") {
				return
			}
		}
		select {
		case err := <-done:
			t.Fatalf("%s returned %v without blocking", fn, err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no goroutine parked in %s", fn)
		}
		time.Sleep(time.Millisecond)
	}
}

// hostilePorts breaks the protocol in a different way on each port, and
// records that the relay ended every call it gave up on.
type hostilePorts struct {
	ended chan uint32
}

func (h hostilePorts) Connect(ctx context.Context, s *connect.BidiStream[agentv1.PortData, agentv1.PortData]) error {
	m, err := s.Receive()
	if err != nil {
		return err
	}
	port := m.GetOpen().GetPort()
	defer func() { h.ended <- port }()
	opened := &agentv1.PortData{Msg: &agentv1.PortData_Opened{Opened: &agentv1.PortOpened{}}}
	data := func(n int) *agentv1.PortData {
		return &agentv1.PortData{Msg: &agentv1.PortData_Data{Data: bytes.Repeat([]byte("x"), n)}}
	}
	closeMsg := &agentv1.PortData{Msg: &agentv1.PortData_Close{Close: &agentv1.PortClose{}}}
	switch port {
	case 1: // data before opened
		s.Send(data(3))
	case 2: // an oversized chunk
		s.Send(opened)
		s.Send(data(relay.MaxPortChunk + 1))
	case 3: // data after close
		s.Send(opened)
		s.Send(data(5))
		s.Send(closeMsg)
		s.Send(data(5))
	case 4: // the end of the call without a close
		s.Send(opened)
		s.Send(data(5))
		return nil
	case 5: // a second opened
		s.Send(opened)
		s.Send(opened)
	case 6: // an error posing as carreld's
		err := connect.NewError(connect.CodeUnauthenticated, errors.New("\x1b[31mlog in again"))
		err.Meta().Set("X-Evil", "1")
		return err
	case 7: // never answers
		<-ctx.Done()
		return ctx.Err()
	case 8: // a flood
		s.Send(opened)
		for s.Send(data(32<<10)) == nil {
		}
		return nil
	case 9: // an empty message
		s.Send(opened)
		s.Send(&agentv1.PortData{})
	}
	<-ctx.Done() // until the relay ends the call
	return ctx.Err()
}

// rawConnect runs a Connect call by hand and collects what comes back.
func rawConnect(ctx context.Context, c *client.Client, vm string, first *agentv1.PortData) ([]*agentv1.PortData, error) {
	s := c.Ports.Connect(ctx)
	defer s.CloseResponse()
	if vm != "" {
		s.RequestHeader().Set(protocol.VMHeader, vm)
	}
	s.Send(first)
	var got []*agentv1.PortData
	for {
		m, err := s.Receive()
		if err != nil {
			return got, err
		}
		got = append(got, m)
	}
}

func openPort(host string, port uint32) *agentv1.PortData {
	return &agentv1.PortData{Msg: &agentv1.PortData_Open{Open: &agentv1.PortOpen{Host: host, Port: port}}}
}

func TestPortRelayRejectsHostileGuest(t *testing.T) {
	h := hostilePorts{ended: make(chan uint32, 16)}
	c := createVM(t, h, "evil")
	ctx := context.Background()
	waitEnded := func(port uint32) {
		t.Helper()
		select {
		case p := <-h.ended:
			if p != port {
				t.Errorf("call for port %d ended, want %d", p, port)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("the relay left the guest's call for port %d open", port)
		}
	}

	for _, tc := range []struct {
		port  uint32
		what  string
		valid int // messages the relay may pass before the error
	}{
		{1, "data before opened", 0},
		{2, "oversized chunk", 1},
		{3, "data after close", 3},
		{4, "no close", 2},
		{5, "second opened", 1},
		{9, "empty message", 1},
	} {
		got, err := rawConnect(ctx, c, "evil", openPort("", tc.port))
		if connect.CodeOf(err) != connect.CodeDataLoss || len(got) > tc.valid {
			t.Errorf("%s: %d messages passed, err %v", tc.what, len(got), err)
		}
		for _, m := range got {
			if len(m.GetData()) > relay.MaxPortChunk || len(m.ProtoReflect().GetUnknown()) > 0 {
				t.Errorf("%s: passed %v", tc.what, m)
			}
		}
		waitEnded(tc.port)
	}

	_, err := c.DialPort(ctx, "evil", 6)
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeInternal || strings.ContainsRune(ce.Message(), 0x1b) || ce.Meta().Get("X-Evil") != "" {
		t.Errorf("guest error passed through unsanitized: %v", err)
	}
	waitEnded(6)

	// A guest that never answers: the client's deadline ends the dial, and
	// the relay ends the guest's call.
	dctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = c.DialPort(dctx, "evil", 7)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("dial a silent guest: %v", err)
	}
	waitEnded(7)

	// A flood: flow control holds it back, and closing ends it.
	conn, err := c.DialPort(ctx, "evil", 8)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(conn, make([]byte, 1<<20)); err != nil {
		t.Errorf("read the flood: %v", err)
	}
	conn.Close()
	waitEnded(8)

	// The link survives: these were the guest's words, not a broken
	// stream.
	if _, err := c.DialPort(ctx, "evil", 6); connect.CodeOf(err) != connect.CodeInternal {
		t.Errorf("after hostile replies: %v", err)
	}
	waitEnded(6)
}

// The host checks the client's request before the guest sees it.
func TestPortRelayChecksRequests(t *testing.T) {
	h := hostilePorts{ended: make(chan uint32, 16)}
	c := createVM(t, h, "vm")
	ctx := context.Background()
	for _, tc := range []struct {
		vm    string
		first *agentv1.PortData
		code  connect.Code
	}{
		{"", openPort("", 80), connect.CodeInvalidArgument},
		{"ghost", openPort("", 80), connect.CodeNotFound},
		{"vm", openPort("10.0.2.2", 80), connect.CodeInvalidArgument},
		{"vm", openPort("", 0), connect.CodeInvalidArgument},
		{"vm", openPort("", 1<<16), connect.CodeInvalidArgument},
		{"vm", &agentv1.PortData{Msg: &agentv1.PortData_Data{Data: []byte("x")}}, connect.CodeInvalidArgument},
	} {
		if _, err := rawConnect(ctx, c, tc.vm, tc.first); connect.CodeOf(err) != tc.code {
			t.Errorf("vm %q, %v: %v, want %v", tc.vm, tc.first, err, tc.code)
		}
	}
	select {
	case p := <-h.ended:
		t.Errorf("a refused request reached the guest (port %d)", p)
	default:
	}

	// A second open, mid-connection.
	s := c.Ports.Connect(ctx)
	defer s.CloseResponse()
	s.RequestHeader().Set(protocol.VMHeader, "vm")
	s.Send(openPort("", 3))
	if m, err := s.Receive(); err != nil || m.GetOpened() == nil {
		t.Fatalf("open: %v %v", m, err)
	}
	s.Send(openPort("", 4))
	for {
		if _, err := s.Receive(); err != nil {
			if connect.CodeOf(err) != connect.CodeInvalidArgument && connect.CodeOf(err) != connect.CodeDataLoss {
				t.Errorf("second open: %v", err)
			}
			break
		}
	}
}
