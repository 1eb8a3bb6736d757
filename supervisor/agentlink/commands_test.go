package agentlink

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/proctable"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// commandsAgent is a fake agent whose Commands stream is scripted.
type commandsAgent struct {
	fakeAgent
	calls  atomic.Int32
	script func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error
}

func (f *commandsAgent) Commands(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
	f.calls.Add(1)
	return f.script(ctx, s)
}

func event(id uint64, ev *agentv1.ExecResponse) *agentv1.CommandsOutput {
	return &agentv1.CommandsOutput{Id: id, Msg: &agentv1.CommandsOutput_Event{Event: ev}}
}

func exitEvent(code int32) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: code}}}
}

func stdoutEvent(b []byte) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: b}}
}

// eachStart calls f with every start the host sends on s until the stream
// ends; f's error ends it.
func eachStart(s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput], f func(in *agentv1.CommandsInput) error) error {
	for {
		in, err := s.Receive()
		if err != nil {
			return nil
		}
		if in.GetStart() == nil {
			continue
		}
		if err := f(in); err != nil {
			return err
		}
	}
}

// readyLink is a link to f, ready.
func readyLink(t *testing.T, f *commandsAgent) *Link {
	t.Helper()
	l := New(serve(t, f), nil)
	t.Cleanup(func() { l.Close() })
	if err := l.WaitReady(context.Background()); err != nil {
		t.Fatal(err)
	}
	return l
}

// run starts argv as a command on l and collects its events and end, as
// the relay does: errors go through done.
func runCommand(ctx context.Context, l *Link, argv ...string) ([]*agentv1.ExecResponse, error) {
	_, cmds, done := l.AgentCommands()
	cmd := cmds.Start(ctx, &agentv1.ExecRequest{Argv: argv})
	defer cmd.Close()
	var evs []*agentv1.ExecResponse
	for {
		ev, err := cmd.Receive()
		if errors.Is(err, io.EOF) {
			return evs, nil
		}
		if err != nil {
			return evs, done(ctx, err)
		}
		evs = append(evs, ev)
	}
}

func TestCommandsShareOneStream(t *testing.T) {
	f := &commandsAgent{script: func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
		var mu sync.Mutex
		return eachStart(s, func(in *agentv1.CommandsInput) error {
			mu.Lock()
			defer mu.Unlock()
			return errors.Join(s.Send(event(in.Id, stdoutEvent([]byte(in.GetStart().Argv[0])))), s.Send(event(in.Id, exitEvent(int32(in.Id)))))
		})
	}}
	l := readyLink(t, f)
	var wg sync.WaitGroup
	for _, name := range []string{"a", "b", "c", "d"} {
		wg.Go(func() {
			evs, err := runCommand(context.Background(), l, name)
			if err != nil || len(evs) != 2 || string(evs[0].GetStdout()) != name || evs[1].GetExit() == nil {
				t.Errorf("%s: %v %v", name, evs, err)
			}
		})
	}
	wg.Wait()
	if n := f.calls.Load(); n != 1 {
		t.Errorf("%d Commands calls for 4 commands, want 1", n)
	}
}

// An agent without the call: ErrNoCommands, nothing marked unhealthy, and
// no second try.
func TestCommandsWithoutTheCall(t *testing.T) {
	l := New(serve(t, &fakeAgent{}), nil)
	defer l.Close()
	ctx := context.Background()
	if err := l.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	_, cmds, _ := l.AgentCommands()
	cmd := cmds.Start(ctx, &agentv1.ExecRequest{Argv: []string{"x"}})
	if _, err := cmd.Receive(); !errors.Is(err, ErrNoCommands) {
		t.Fatalf("got %v, want ErrNoCommands", err)
	}
	cmd.Close()
	if cmds.Supported() {
		t.Error("still Supported after the agent said it lacks the call")
	}
	if _, err := cmds.Start(ctx, &agentv1.ExecRequest{}).Receive(); !errors.Is(err, ErrNoCommands) {
		t.Errorf("second command: %v", err)
	}
	if st, err := l.State(); st != Ready {
		t.Errorf("state %v (%v), want ready", st, err)
	}
}

// A guest that breaks the protocol breaks the stream with DataLoss, and
// the link ends the connection; the next command opens a new stream.
func TestCommandsRefuseAHostileGuest(t *testing.T) {
	for name, misbehave := range map[string]func(s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput], id uint64) error{
		"past its credit": func(s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput], id uint64) error {
			// Whatever the host has granted by then, one event over the
			// whole credit is past it.
			return s.Send(event(id, stdoutEvent(make([]byte, protocol.CommandCredit))))
		},
		"a command never started": func(s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput], id uint64) error {
			return s.Send(event(id+1, exitEvent(0)))
		},
		"an end with an unknown code": func(s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput], id uint64) error {
			return s.Send(&agentv1.CommandsOutput{Id: id, Msg: &agentv1.CommandsOutput_End{End: &agentv1.CommandEnd{Code: 99}}})
		},
		"no message": func(s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput], id uint64) error {
			return s.Send(&agentv1.CommandsOutput{Id: id})
		},
		"held events and no message": func(s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput], id uint64) error {
			return s.Send(&agentv1.CommandsOutput{Id: id, Held: []*agentv1.ExecResponse{stdoutEvent([]byte("x"))}})
		},
		"an exit status held back": func(s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput], id uint64) error {
			out := event(id, stdoutEvent([]byte("x")))
			out.Held = []*agentv1.ExecResponse{exitEvent(0)}
			return s.Send(out)
		},
		"held events past its credit": func(s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput], id uint64) error {
			out := event(id, exitEvent(0))
			out.Held = []*agentv1.ExecResponse{stdoutEvent(make([]byte, protocol.CommandCredit/2)), stdoutEvent(make([]byte, protocol.CommandCredit/2))}
			return s.Send(out)
		},
	} {
		t.Run(name, func(t *testing.T) {
			var hostile atomic.Bool
			hostile.Store(true)
			f := &commandsAgent{script: func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
				for {
					in, err := s.Receive()
					if err != nil {
						return nil
					}
					if in.GetStart() == nil {
						continue
					}
					if hostile.Load() {
						if err := misbehave(s, in.Id); err != nil {
							return nil
						}
						continue
					}
					if err := s.Send(event(in.Id, exitEvent(0))); err != nil {
						return err
					}
				}
			}}
			l := readyLink(t, f)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := runCommand(ctx, l, "x")
			if connect.CodeOf(err) != connect.CodeDataLoss {
				t.Fatalf("got %v, want data_loss", err)
			}
			if st, _ := l.State(); st != Unhealthy {
				t.Errorf("state %v, want unhealthy: the connection can no longer be trusted", st)
			}
			hostile.Store(false)
			if evs, err := runCommand(ctx, l, "y"); err != nil || len(evs) != 1 {
				t.Fatalf("after reconnecting: %v %v", evs, err)
			}
			if n := f.calls.Load(); n != 2 {
				t.Errorf("%d Commands calls, want 2 (one per connection)", n)
			}
		})
	}
}

// Closing a command the guest has not ended cancels it there; its late
// output is dropped, and the stream goes on.
func TestCommandsCloseCancels(t *testing.T) {
	cancelled := make(chan uint64, 1)
	slow := make(chan struct{})
	f := &commandsAgent{script: func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
		for {
			in, err := s.Receive()
			if err != nil {
				return nil
			}
			switch {
			case in.GetStart() != nil && in.GetStart().Argv[0] == "slow":
				close(slow)
			case in.GetStart() != nil && in.GetStart().Argv[0] == "quick":
				err = s.Send(event(in.Id, exitEvent(0)))
			case in.GetCancel() != nil:
				cancelled <- in.Id
				err = errors.Join(s.Send(event(in.Id, stdoutEvent([]byte("late")))),
					s.Send(&agentv1.CommandsOutput{Id: in.Id, Msg: &agentv1.CommandsOutput_End{End: &agentv1.CommandEnd{Code: uint32(connect.CodeCanceled)}}}))
			}
			if err != nil {
				return err
			}
		}
	}}
	l := readyLink(t, f)
	ctx, cancel := context.WithCancel(context.Background())
	_, cmds, _ := l.AgentCommands()
	cmd := cmds.Start(ctx, &agentv1.ExecRequest{Argv: []string{"slow"}})
	<-slow // a start still waiting to go out is dropped, not cancelled
	cancel()
	if _, err := cmd.Receive(); connect.CodeOf(err) != connect.CodeCanceled {
		t.Fatalf("got %v, want canceled", err)
	}
	cmd.Close()
	select {
	case id := <-cancelled:
		if id != 1 {
			t.Fatalf("cancelled %d, want 1", id)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the guest was not told")
	}
	if evs, err := runCommand(context.Background(), l, "quick"); err != nil || len(evs) != 1 {
		t.Fatalf("next command: %v %v", evs, err)
	}
	if st, _ := l.State(); st != Ready {
		t.Errorf("state %v, want ready", st)
	}
}

// The host grants credit as its caller takes events, so a command's
// output of any size gets through, paced.
func TestCommandsGrantCredit(t *testing.T) {
	chunk := make([]byte, protocol.ExecChunkBytes)
	const chunks = 40 // 1.25 MiB, five times the first credit
	f := &commandsAgent{script: func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
		in, err := s.Receive()
		if err != nil {
			return err
		}
		credit := int64(protocol.CommandCredit)
		cost := units(stdoutEvent(chunk))
		for sent := 0; sent < chunks; {
			if credit < cost {
				g, err := s.Receive()
				if err != nil {
					return err
				}
				credit += int64(g.GetCredit())
				continue
			}
			if err := s.Send(event(in.Id, stdoutEvent(chunk))); err != nil {
				return err
			}
			credit -= cost
			sent++
		}
		if err := s.Send(event(in.Id, exitEvent(0))); err != nil {
			return err
		}
		_, err = s.Receive()
		return nil
	}}
	l := readyLink(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	evs, err := runCommand(ctx, l, "big")
	if err != nil || len(evs) != chunks+1 {
		t.Fatalf("%d events, %v", len(evs), err)
	}
}

func TestCommandSignal(t *testing.T) {
	got := make(chan int32, 1)
	f := &commandsAgent{script: func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
		for {
			in, err := s.Receive()
			if err != nil {
				return nil
			}
			if sig := in.GetSignal(); sig != 0 {
				got <- sig
				if err := s.Send(event(in.Id, exitEvent(130))); err != nil {
					return err
				}
			}
		}
	}}
	if MaxSignal != proctable.MaxSignal {
		t.Fatalf("MaxSignal %d, the agent's %d", MaxSignal, proctable.MaxSignal)
	}
	l := readyLink(t, f)
	_, cmds, _ := l.AgentCommands()
	cmd := cmds.Start(context.Background(), &agentv1.ExecRequest{Argv: []string{"x"}})
	defer cmd.Close()
	for _, bad := range []int32{0, -1, MaxSignal + 1} {
		if err := cmd.Signal(bad); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("signal %d: %v", bad, err)
		}
	}
	if err := cmd.Signal(2); err != nil {
		t.Fatal(err)
	}
	if sig := <-got; sig != 2 {
		t.Fatalf("guest got signal %d", sig)
	}
	if ev, err := cmd.Receive(); err != nil || ev.GetExit().GetCode() != 130 {
		t.Fatalf("%v %v", ev, err)
	}
}

// An exit status past the credit is refused like any other event: the
// caller gets DataLoss, not a wait that never ends.
func TestCommandsExitPastCredit(t *testing.T) {
	n := protocol.CommandCredit - 10
	for units(stdoutEvent(make([]byte, n))) > protocol.CommandCredit-10 {
		n--
	}
	f := &commandsAgent{script: func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
		in, err := s.Receive()
		if err != nil {
			return nil
		}
		if err := errors.Join(s.Send(event(in.Id, stdoutEvent(make([]byte, n)))), s.Send(event(in.Id, exitEvent(0)))); err != nil {
			return err
		}
		<-ctx.Done()
		return nil
	}}
	l := readyLink(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, cmds, _ := l.AgentCommands()
	cmd := cmds.Start(ctx, &agentv1.ExecRequest{Argv: []string{"x"}})
	defer cmd.Close()
	<-cmd.s.stopped // both events came before any was taken, so no grant
	var err error
	for err == nil {
		_, err = cmd.Receive()
	}
	if connect.CodeOf(err) != connect.CodeDataLoss {
		t.Fatalf("got %v, want data_loss", err)
	}
}

// Stopping the VM ends its commands with an error that is carreld's, and
// leaves the connection for the Shutdown call.
func TestCommandsEndAtShutdown(t *testing.T) {
	f := &commandsAgent{script: func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
		for {
			if _, err := s.Receive(); err != nil {
				return nil
			}
		}
	}}
	l := readyLink(t, f)
	ctx := context.Background()
	_, cmds, done := l.AgentCommands()
	cmd := cmds.Start(ctx, &agentv1.ExecRequest{Argv: []string{"sleep"}})
	defer cmd.Close()
	errc := make(chan error, 1)
	go func() {
		_, err := cmd.Receive()
		errc <- done(ctx, err)
	}()
	l.Shutdown(ctx, false) // the fake agent does not implement it
	err := <-errc
	if !IsHostError(err) || connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("got %v, want carreld's own unavailable", err)
	}
	if st, err := l.State(); st != Ready {
		t.Errorf("state %v (%v): stopping the VM blamed the guest", st, err)
	}
}

// A caller's context ends its command even while events keep coming.
func TestCommandsDeadlineWithOutputWaiting(t *testing.T) {
	f := &commandsAgent{script: func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
		in, err := s.Receive()
		if err != nil {
			return nil
		}
		for range 4 {
			if err := s.Send(event(in.Id, stdoutEvent([]byte("y\n")))); err != nil {
				return err
			}
		}
		<-ctx.Done()
		return nil
	}}
	l := readyLink(t, f)
	ctx, cancel := context.WithCancel(context.Background())
	_, cmds, _ := l.AgentCommands()
	cmd := cmds.Start(ctx, &agentv1.ExecRequest{Argv: []string{"yes"}})
	defer cmd.Close()
	if _, err := cmd.Receive(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	cancel()
	if _, err := cmd.Receive(); connect.CodeOf(err) != connect.CodeCanceled {
		t.Fatalf("got %v, want canceled though events wait", err)
	}
}

// A request too large for the link, and a command past MaxCommands, are
// refused for that caller alone; the link and the other commands go on.
func TestCommandsRefuseWhatTheLinkCannotCarry(t *testing.T) {
	f := &commandsAgent{script: func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
		return eachStart(s, func(in *agentv1.CommandsInput) error { return s.Send(event(in.Id, exitEvent(0))) })
	}}
	l := readyLink(t, f)
	ctx := context.Background()
	_, cmds, done := l.AgentCommands()
	_, err := cmds.Start(ctx, &agentv1.ExecRequest{Argv: []string{string(make([]byte, protocol.MaxMessageBytes))}}).Receive()
	if err = done(ctx, err); connect.CodeOf(err) != connect.CodeResourceExhausted || !IsHostError(err) {
		t.Fatalf("a request over the cap: %v", err)
	}
	if evs, err := runCommand(ctx, l, "x"); err != nil || len(evs) != 1 {
		t.Fatalf("after it: %v %v", evs, err)
	}
	if st, _ := l.State(); st != Ready {
		t.Errorf("state %v", st)
	}

	// MaxCommands and the signal queue, on a stream with no writer.
	c := &Commands{}
	s := &commandStream{owner: c, cancel: func() {}, running: map[uint64]*Command{}, wake: make(chan struct{}, 1), stopped: make(chan struct{})}
	var first *Command
	for i := range protocol.MaxCommands {
		cmd := s.start(ctx, &agentv1.ExecRequest{})
		if i == 0 {
			first = cmd
		}
	}
	if _, err := s.start(ctx, &agentv1.ExecRequest{}).Receive(); connect.CodeOf(err) != connect.CodeResourceExhausted || !IsHostError(err) {
		t.Fatalf("command %d: %v", protocol.MaxCommands+1, err)
	}
	for len(s.queue) < maxQueued {
		if err := first.Signal(2); err != nil {
			t.Fatalf("signal with %d queued: %v", len(s.queue), err)
		}
	}
	if err := first.Signal(2); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("signal past the queue's cap: %v", err)
	}
}

// While the guest does not read, what waits for it stays bounded: a start
// still waiting is dropped at Close instead of cancelled, and a command's
// grants merge into one message.
func TestCommandsQueueStaysBounded(t *testing.T) {
	c := &Commands{}
	s := &commandStream{owner: c, cancel: func() {}, running: map[uint64]*Command{}, wake: make(chan struct{}, 1), stopped: make(chan struct{})}
	ctx := context.Background()
	a := s.start(ctx, &agentv1.ExecRequest{Argv: []string{"a"}})
	b := s.start(ctx, &agentv1.ExecRequest{Argv: []string{"b"}})
	if len(s.queue) != 2 || s.queuedBytes == 0 {
		t.Fatalf("queue %d, %d bytes", len(s.queue), s.queuedBytes)
	}
	a.Close()
	if len(s.queue) != 1 || s.queue[0].Id != b.id {
		t.Fatalf("after closing a waiting start: %v", s.queue)
	}
	s.grantCredit(b, 100)
	s.grantCredit(b, 50)
	if len(s.queue) != 2 || s.queue[1].GetCredit() != 150 {
		t.Fatalf("grants did not merge: %v", s.queue)
	}
	b.Close()
	if len(s.queue) != 0 || s.queuedBytes != 0 {
		t.Fatalf("after closing b: %v, %d bytes", s.queue, s.queuedBytes)
	}
	big := &agentv1.ExecRequest{Argv: []string{string(make([]byte, 900<<10))}}
	var cmd *Command
	for i := 0; cmd == nil || !cmd.ended; i++ {
		if i > maxQueuedBytes/(900<<10)+1 {
			t.Fatal("no cap on the bytes of waiting starts")
		}
		cmd = s.start(ctx, big)
	}
	if _, err := cmd.Receive(); connect.CodeOf(err) != connect.CodeResourceExhausted || !IsHostError(err) {
		t.Fatalf("got %v", err)
	}
}

// Events the agent held back come before the message's own, in order, on
// a stream whose request asked for them.
func TestCommandsHeldEventsComeFirst(t *testing.T) {
	header := make(chan string, 1)
	f := &commandsAgent{script: func(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
		header <- s.RequestHeader().Get(protocol.HoldEventsHeader)
		return eachStart(s, func(in *agentv1.CommandsInput) error {
			started := &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: 9, Id: "x-1"}}}
			var out *agentv1.CommandsOutput
			switch in.GetStart().Argv[0] {
			case "exit":
				out = event(in.Id, exitEvent(3))
			case "end":
				out = &agentv1.CommandsOutput{Id: in.Id, Msg: &agentv1.CommandsOutput_End{End: &agentv1.CommandEnd{Code: uint32(connect.CodeCanceled)}}}
			}
			out.Held = []*agentv1.ExecResponse{started, stdoutEvent([]byte("a")), stdoutEvent([]byte("b"))}
			return s.Send(out)
		})
	}}
	l := readyLink(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	evs, err := runCommand(ctx, l, "exit")
	if err != nil || len(evs) != 4 || evs[0].GetStarted().GetId() != "x-1" || string(evs[1].GetStdout()) != "a" ||
		string(evs[2].GetStdout()) != "b" || evs[3].GetExit().GetCode() != 3 {
		t.Fatalf("got %v %v, want started, a, b, exit 3", evs, err)
	}
	if h := <-header; h != "1" {
		t.Errorf("%s: %q, want 1", protocol.HoldEventsHeader, h)
	}
	evs, err = runCommand(ctx, l, "end")
	if connect.CodeOf(err) != connect.CodeCanceled || len(evs) != 3 || evs[0].GetStarted() == nil {
		t.Fatalf("got %v %v, want started, a, b, then canceled", evs, err)
	}
}

// A message's events are checked against the credit together: when they
// pass it, none of them is queued, whatever a grant meanwhile would allow.
func TestCommandsCheckAMessageAgainstTheCreditWhole(t *testing.T) {
	s := &commandStream{owner: &Commands{}, cancel: func() {}, running: map[uint64]*Command{},
		wake: make(chan struct{}, 1), stopped: make(chan struct{})}
	cmd := s.start(context.Background(), &agentv1.ExecRequest{Argv: []string{"x"}})
	half := stdoutEvent(make([]byte, protocol.CommandCredit/2))
	out := event(cmd.id, exitEvent(0))
	out.Held = []*agentv1.ExecResponse{half, half}
	if err := s.deliver(out); connect.CodeOf(err) != connect.CodeDataLoss {
		t.Fatalf("got %v, want data_loss", err)
	}
	cmd.mu.Lock()
	defer cmd.mu.Unlock()
	if len(cmd.queue) != 0 || cmd.held != 0 {
		t.Errorf("%d events (%d units) queued from a message past the credit, want none", len(cmd.queue), cmd.held)
	}
}
