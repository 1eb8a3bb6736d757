package agentlink

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// fakeAgent is a guest agent whose Exec replies are scripted.
type fakeAgent struct {
	agentv1connect.UnimplementedAgentServiceHandler
	exec func(*connect.ServerStream[agentv1.ExecResponse]) error
	// health, if not nil, runs before each Health reply.
	health func(context.Context)
}

func (f *fakeAgent) Health(ctx context.Context, _ *connect.Request[agentv1.HealthRequest]) (*connect.Response[agentv1.HealthResponse], error) {
	if f.health != nil {
		f.health(ctx)
	}
	return connect.NewResponse(&agentv1.HealthResponse{Version: "test", Transport: "unix"}), nil
}

func (f *fakeAgent) Exec(_ context.Context, _ *connect.Request[agentv1.ExecRequest], s *connect.ServerStream[agentv1.ExecResponse]) error {
	return f.exec(s)
}

// serve runs a fake agent on a unix socket and returns a dialer for it.
func serve(t *testing.T, f agentv1connect.AgentServiceHandler) func(context.Context) (net.Conn, error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	_, h := agentv1connect.NewAgentServiceHandler(f, connect.WithReadMaxBytes(64<<20), connect.WithSendMaxBytes(64<<20))
	srv := protocol.NewHTTPServer(h)
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
}

// logCounter counts log records containing a substring.
type logCounter struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (c *logCounter) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf.Write(p)
}

func (c *logCounter) count(s string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return strings.Count(c.buf.String(), s)
}

// execVia runs a command through the link's agent client, as carreld's
// relay does: every error goes through done.
func execVia(ctx context.Context, l *Link, argv ...string) ([]*agentv1.ExecResponse, error) {
	c, done := l.Agent()
	s, err := c.Exec(ctx, connect.NewRequest(&agentv1.ExecRequest{Argv: argv}))
	if err != nil {
		return nil, done(ctx, err)
	}
	defer s.Close()
	var evs []*agentv1.ExecResponse
	for s.Receive() {
		evs = append(evs, s.Msg())
	}
	if err := s.Err(); err != nil {
		return evs, done(ctx, err)
	}
	return evs, nil
}

func TestExecStreamsEvents(t *testing.T) {
	dial := serve(t, &fakeAgent{exec: func(s *connect.ServerStream[agentv1.ExecResponse]) error {
		s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: []byte("hi")}})
		return s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: 4}}})
	}})
	l := New(dial, nil)
	defer l.Close()
	ctx := context.Background()
	if err := l.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	evs, err := execVia(ctx, l, "x")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, ev := range evs {
		got = append(got, ev.String())
	}
	if len(got) != 2 || !strings.Contains(got[0], "hi") || !strings.Contains(got[1], "code:4") {
		t.Errorf("events = %q", got)
	}
	if st, _ := l.State(); st != Ready {
		t.Errorf("state = %v", st)
	}
}

func TestWaitReadyRetriesUntilAgentServes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "late.sock")
	var ready sync.WaitGroup
	ready.Add(1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		l, err := net.Listen("unix", path)
		if err != nil {
			panic(err)
		}
		_, h := agentv1connect.NewAgentServiceHandler(&fakeAgent{})
		srv := protocol.NewHTTPServer(h)
		t.Cleanup(func() { srv.Close() })
		ready.Done()
		srv.Serve(l)
	}()
	l := New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}, nil)
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := l.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	ready.Wait()
}

func TestWaitReadyGivesUp(t *testing.T) {
	l := New(func(ctx context.Context) (net.Conn, error) { return nil, errors.New("nobody home") }, nil)
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err := l.WaitReady(ctx)
	if !errors.Is(err, ErrNotReady) || !strings.Contains(err.Error(), "nobody home") {
		t.Errorf("err = %v", err)
	}
}

// garbageGuest answers every connection with bytes that are not HTTP/2.
func garbageGuest(reply []byte) func(context.Context) (net.Conn, error) {
	return func(context.Context) (net.Conn, error) {
		host, guest := net.Pipe()
		go func() {
			go io.Copy(io.Discard, guest)
			guest.Write(reply)
			time.Sleep(100 * time.Millisecond)
			guest.Close()
		}()
		return host, nil
	}
}

func TestGarbledGuestMarksUnhealthyAndLogsOnce(t *testing.T) {
	var logs logCounter
	l := New(garbageGuest([]byte("\x00\x00\x12\x04garbage that is no HTTP/2 frame at all")), slog.New(slog.NewTextHandler(&logs, nil)))
	defer l.Close()
	ctx := context.Background()
	// The first failure happens before the agent was ever ready.
	for i := 0; i < 3; i++ {
		if _, err := l.Health(ctx); err == nil {
			t.Fatal("health over a garbled stream succeeded")
		}
	}
	st, err := l.State()
	if st != Unhealthy || err == nil {
		t.Errorf("state = %v, %v", st, err)
	}
	if n := logs.count("guest agent unhealthy"); n != 1 {
		t.Errorf("logged %d times, want once:\n%s", n, logs.buf.String())
	}
}

func TestOversizedFrameClosesLink(t *testing.T) {
	// An HTTP/2 frame header announcing 16 MiB, far over MaxFrameBytes.
	l := New(garbageGuest([]byte{0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}), nil)
	defer l.Close()
	if _, err := l.Health(context.Background()); err == nil {
		t.Fatal("health succeeded")
	}
	if st, _ := l.State(); st != Unhealthy {
		t.Errorf("state = %v", st)
	}
}

func TestOversizedMessageMarksUnhealthy(t *testing.T) {
	dial := serve(t, &fakeAgent{exec: func(s *connect.ServerStream[agentv1.ExecResponse]) error {
		return s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: make([]byte, protocol.MaxMessageBytes+1)}})
	}})
	var logs logCounter
	l := New(dial, slog.New(slog.NewTextHandler(&logs, nil)))
	defer l.Close()
	ctx := context.Background()
	if err := l.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	evs, err := execVia(ctx, l, "x")
	if len(evs) != 0 || connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("exec: %d events, err %v", len(evs), err)
	}
	if st, _ := l.State(); st != Unhealthy {
		t.Errorf("state = %v", st)
	}
	// The link recovers on a fresh connection once the agent behaves.
	if _, err := l.Health(ctx); err != nil {
		t.Fatal(err)
	}
	if st, _ := l.State(); st != Ready {
		t.Errorf("state after recovery = %v", st)
	}
	if logs.count("guest agent unhealthy") != 1 {
		t.Errorf("logs:\n%s", logs.buf.String())
	}
}

func TestApplicationErrorsKeepLinkHealthy(t *testing.T) {
	dial := serve(t, &fakeAgent{exec: func(s *connect.ServerStream[agentv1.ExecResponse]) error {
		return connect.NewError(connect.CodeNotFound, errors.New(`exec: "foo": executable file not found`))
	}})
	l := New(dial, nil)
	defer l.Close()
	ctx := context.Background()
	if err := l.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := execVia(ctx, l, "foo"); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("err = %v", err)
	}
	if st, _ := l.State(); st != Ready {
		t.Errorf("state = %v", st)
	}
}

// capturingListener remembers the connections it accepts.
type capturingListener struct {
	net.Listener
	conns chan net.Conn
}

func (l *capturingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.conns <- c
	}
	return c, err
}

// TestIdleLinkBrokenByGuestIsNoticed: with no call in flight, the guest
// writes garbage into the stream. The host must notice on its own, close
// the link and mark the agent unhealthy, and log it once.
func TestIdleLinkBrokenByGuestIsNoticed(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	inner, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	l := &capturingListener{Listener: inner, conns: make(chan net.Conn, 4)}
	_, h := agentv1connect.NewAgentServiceHandler(&fakeAgent{})
	srv := protocol.NewHTTPServer(h)
	go srv.Serve(l)
	defer srv.Close()
	var logs logCounter
	link := New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}, slog.New(slog.NewTextHandler(&logs, nil)))
	defer link.Close()
	if err := link.WaitReady(context.Background()); err != nil {
		t.Fatal(err)
	}
	guestSide := <-l.conns
	guestSide.Write([]byte("\x00\x00\x08\x07garbage that breaks the framing"))
	deadline := time.Now().Add(5 * time.Second)
	for {
		if st, _ := link.State(); st == Unhealthy {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("idle link broken by the guest was not noticed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
	if n := logs.count("guest agent unhealthy"); n != 1 {
		t.Errorf("logged %d times:\n%s", n, logs.buf.String())
	}
	// The guest behaves again: a fresh connection makes it ready.
	if _, err := link.Health(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st, _ := link.State(); st != Ready {
		t.Errorf("state after recovery = %v", st)
	}
}

// A guest too busy to answer a health probe in time is marked unhealthy,
// but the calls in flight on its connection go on: the probe's deadline
// alone does not end the connection (it did, and under load it failed
// every call to a busy VM).
func TestSlowHealthProbeKeepsCallsInFlight(t *testing.T) {
	var slow sync.Mutex // held: health probes wait
	release := make(chan struct{})
	dial := serve(t, &fakeAgent{
		health: func(ctx context.Context) {
			slow.Lock()
			slow.Unlock()
		},
		exec: func(s *connect.ServerStream[agentv1.ExecResponse]) error {
			s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: []byte("busy")}})
			<-release
			return s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{}}})
		},
	})
	var logs logCounter
	l := New(dial, slog.New(slog.NewTextHandler(&logs, nil)))
	l.healthTimeout = 100 * time.Millisecond
	defer l.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := l.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}

	type result struct {
		evs []*agentv1.ExecResponse
		err error
	}
	done := make(chan result, 1)
	go func() {
		evs, err := execVia(ctx, l, "work")
		done <- result{evs, err}
	}()
	slow.Lock()
	go l.Keepalive(ctx, 50*time.Millisecond)
	deadline := time.Now().Add(5 * time.Second)
	for st, _ := l.State(); st != Unhealthy; st, _ = l.State() {
		if time.Now().After(deadline) {
			t.Fatal("a probe past its deadline did not mark the agent unhealthy")
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // several more late probes
	close(release)
	r := <-done
	if r.err != nil || len(r.evs) != 2 {
		t.Fatalf("the call in flight: %d events, %v; want it to finish", len(r.evs), r.err)
	}

	slow.Unlock()
	deadline = time.Now().Add(5 * time.Second)
	for st, _ := l.State(); st != Ready; st, _ = l.State() {
		if time.Now().After(deadline) {
			t.Fatal("the agent was not marked ready once it answered probes again")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := logs.count("guest agent unhealthy"); n != 1 {
		t.Errorf("unhealthy logged %d times, want once", n)
	}
}

// TestHoldKeepsCallsAndNamesTheReason: a held link probes nothing and
// leaves the agent's health as it was; a call in flight goes on, and when
// the connection ends under it (as the HTTP/2 keepalive ends it after a
// long pause) it fails with ErrHeld and the reason, the agent is not
// marked unhealthy, and nothing dials until Release.
func TestHoldKeepsCallsAndNamesTheReason(t *testing.T) {
	var probes atomic.Int32
	release := make(chan struct{})
	defer close(release)
	dial := serve(t, &fakeAgent{
		health: func(context.Context) { probes.Add(1) },
		exec: func(s *connect.ServerStream[agentv1.ExecResponse]) error {
			for range 2 {
				if err := s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: []byte("busy")}}); err != nil {
					return err
				}
				select {
				case <-release:
					return nil
				case <-time.After(50 * time.Millisecond):
				}
			}
			<-release
			return nil
		},
	})
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	var dials atomic.Int32
	var logs logCounter
	l := New(func(ctx context.Context) (net.Conn, error) {
		dials.Add(1)
		c, err := dial(ctx)
		if err == nil {
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
		return c, err
	}, slog.New(slog.NewTextHandler(&logs, nil)))
	defer l.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := l.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	go l.Keepalive(ctx, 20*time.Millisecond)

	c, done := l.Agent()
	callCtx, callCancel := context.WithTimeout(ctx, 5*time.Second)
	defer callCancel()
	s, err := c.Exec(callCtx, connect.NewRequest(&agentv1.ExecRequest{Argv: []string{"work"}}))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !s.Receive() {
		t.Fatalf("no first event: %v", s.Err())
	}
	l.Hold("audit log unavailable: disk full")
	probed := probes.Load()
	if !s.Receive() {
		t.Fatalf("the call in flight ended at the hold: %v", s.Err())
	}
	time.Sleep(100 * time.Millisecond) // several keepalive ticks
	if n := probes.Load() - probed; n != 0 {
		t.Errorf("%d health probes while held", n)
	}

	// The connection ends under the call, as after a long pause.
	before := dials.Load()
	mu.Lock()
	conns[len(conns)-1].Close()
	mu.Unlock()
	for s.Receive() {
	}
	err = done(callCtx, s.Err())
	if !errors.Is(err, ErrHeld) || !strings.Contains(err.Error(), "audit log unavailable: disk full") {
		t.Fatalf("the call in flight ended with %v; want ErrHeld and the reason", err)
	}
	if _, err := execVia(ctx, l, "new"); !errors.Is(err, ErrHeld) {
		t.Fatalf("a new call while held: %v; want ErrHeld", err)
	}
	if n := dials.Load() - before; n != 0 {
		t.Errorf("%d dials while held", n)
	}
	if st, _ := l.State(); st != Ready {
		t.Errorf("state while held = %v, want ready as before", st)
	}
	if n := logs.count("unhealthy"); n != 0 {
		t.Errorf("unhealthy logged %d times while held", n)
	}

	before = dials.Load()
	resync := l.Release()
	if resync == nil {
		t.Fatal("Release after a connection lost while held gave no resync")
	}
	if err := resync(ctx); err != nil {
		t.Fatalf("resync: %v", err)
	}
	if dials.Load() == before {
		t.Error("Release did not connect again after the connection was lost while held")
	}
	if _, err := l.Health(ctx); err != nil {
		t.Fatalf("health after release: %v", err)
	}
}

// TestHeldLinkStillEndsABrokenProtocol: bytes the guest sent before its
// pause that break the protocol end the connection and mark the agent
// unhealthy, held or not; they are not the pause's doing.
func TestHeldLinkStillEndsABrokenProtocol(t *testing.T) {
	dial := serve(t, &fakeAgent{exec: func(s *connect.ServerStream[agentv1.ExecResponse]) error {
		return s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: make([]byte, protocol.MaxMessageBytes+1)}})
	}})
	l := New(dial, nil)
	defer l.Close()
	ctx := context.Background()
	if err := l.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	c, done := l.Agent() // the connection is up: the call does not dial
	s, err := c.Exec(ctx, connect.NewRequest(&agentv1.ExecRequest{Argv: []string{"x"}}))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	l.Hold("paused by request")
	for s.Receive() {
	}
	err = done(ctx, s.Err())
	if errors.Is(err, ErrHeld) || connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("an oversized message while held: %v; want ResourceExhausted, not the pause", err)
	}
	if st, _ := l.State(); st != Unhealthy {
		t.Errorf("state = %v, want unhealthy", st)
	}
}

// TestHoldDuringResyncStopsIt: during a resync after a long pause, calls
// are refused (the link is still held, "resuming"); the resync ends at
// once, with ErrHeld, when the link is held again, and marks nothing
// unhealthy; the next Release resyncs again.
func TestHoldDuringResyncStopsIt(t *testing.T) {
	var answer atomic.Bool
	dial := serve(t, &fakeAgent{health: func(ctx context.Context) {
		for !answer.Load() && ctx.Err() == nil {
			time.Sleep(5 * time.Millisecond)
		}
	}})
	answer.Store(true)
	var (
		mu   sync.Mutex
		last net.Conn
	)
	l := New(func(ctx context.Context) (net.Conn, error) {
		c, err := dial(ctx)
		mu.Lock()
		last = c
		mu.Unlock()
		return c, err
	}, nil)
	defer l.Close()
	ctx := context.Background()
	if err := l.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	l.Hold("paused by request")
	mu.Lock()
	last.Close() // lost while held, as after a long pause
	mu.Unlock()
	if _, err := l.Health(ctx); !errors.Is(err, ErrHeld) {
		t.Fatalf("health while held: %v", err)
	}

	answer.Store(false) // the agent is slow to answer the resync's probe
	resync := l.Release()
	if resync == nil {
		t.Fatal("no resync after a connection lost while held")
	}
	errc := make(chan error, 1)
	go func() { errc <- resync(ctx) }()
	time.Sleep(100 * time.Millisecond)
	// Until the resync has a connection the agent answers on, calls are
	// refused, and do not disturb it.
	if _, err := l.Health(ctx); !errors.Is(err, ErrHeld) || !strings.Contains(err.Error(), "resuming") {
		t.Fatalf("a call during the resync: %v; want ErrHeld, resuming", err)
	}
	l.Hold("paused by request, again")
	select {
	case err := <-errc:
		if !errors.Is(err, ErrHeld) {
			t.Fatalf("resync held again: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("resync went on after the link was held again")
	}
	if st, _ := l.State(); st != Ready {
		t.Errorf("state = %v, want ready as before", st)
	}
	answer.Store(true)
	if resync = l.Release(); resync == nil {
		t.Fatal("no resync after a resync the new hold stopped")
	}
	if err := resync(ctx); err != nil {
		t.Fatalf("second resync: %v", err)
	}
}

// swallowFirst is a listener whose first connection is taken and never
// answered, as a guest still in an earlier session takes a new
// connection's first bytes, though it may send it say, the end of that
// session; later ones are served.
type swallowFirst struct {
	net.Listener
	say []byte
	n   atomic.Int32
}

func (l *swallowFirst) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil || l.n.Add(1) > 1 {
			return c, err
		}
		c.Write(l.say)
		go io.Copy(io.Discard, c)
	}
}

// TestKeepaliveEndsAnUngreetedConnection: a connection on which the
// agent's HTTP/2 settings never come (nothing does, or part of another
// frame) is ended by the first probe to time out on it, not left to the
// HTTP/2 keepalive, and the next connection makes the agent ready.
func TestKeepaliveEndsAnUngreetedConnection(t *testing.T) {
	for name, say := range map[string][]byte{"silent": nil, "part of a frame": {0, 0, 0, 0}} {
		t.Run(name, func(t *testing.T) { keepaliveEndsAnUngreeted(t, say) })
	}
}

func keepaliveEndsAnUngreeted(t *testing.T, say []byte) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	ul, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	l := &swallowFirst{Listener: ul, say: say}
	_, h := agentv1connect.NewAgentServiceHandler(&fakeAgent{})
	srv := protocol.NewHTTPServer(h)
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	var logs logCounter
	link := New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}, slog.New(slog.NewTextHandler(&logs, nil)))
	link.healthTimeout = time.Second
	defer link.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go link.Keepalive(ctx, 50*time.Millisecond)
	deadline := time.Now().Add(5 * time.Second) // the HTTP/2 keepalive takes 20 s
	for st, _ := link.State(); st != Ready; st, _ = link.State() {
		if time.Now().After(deadline) {
			t.Fatalf("not ready after 5 s on %d connections; log:\n%s", l.n.Load(), logs.buf.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := l.n.Load(); n != 2 {
		t.Errorf("%d connections, want 2", n)
	}
	if logs.count("the agent never took this connection") != 1 {
		t.Errorf("the log does not say why the first connection ended:\n%s", logs.buf.String())
	}
}
