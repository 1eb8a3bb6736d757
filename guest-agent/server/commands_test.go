//go:build linux

package server

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// commandsHarness drives a commandServer: in carries the host's messages,
// out collects the agent's.
type commandsHarness struct {
	t    *testing.T
	in   chan *agentv1.CommandsInput
	out  chan *agentv1.CommandsOutput
	done chan error
	m    *commandServer
}

func newCommandsHarness(t *testing.T, run func(context.Context, *agentv1.ExecRequest, func(*agentv1.ExecResponse) error) error) *commandsHarness {
	h := &commandsHarness{t: t, in: make(chan *agentv1.CommandsInput), out: make(chan *agentv1.CommandsOutput, 1024), done: make(chan error, 1)}
	h.m = newCommandServer(context.Background(), run, func(o *agentv1.CommandsOutput) error {
		if _, err := proto.Marshal(o); err != nil { // as connect would
			return err
		}
		h.out <- o
		return nil
	}, nil)
	go func() {
		h.done <- h.m.serve(func() (*agentv1.CommandsInput, error) {
			m, ok := <-h.in
			if !ok {
				return nil, io.EOF
			}
			return m, nil
		})
	}()
	return h
}

func (h *commandsHarness) send(m *agentv1.CommandsInput) {
	h.t.Helper()
	select {
	case h.in <- m:
	case err := <-h.done:
		h.t.Fatalf("serve ended early: %v", err)
	}
}

func (h *commandsHarness) next() *agentv1.CommandsOutput {
	h.t.Helper()
	select {
	case o := <-h.out:
		return o
	case <-time.After(10 * time.Second):
		h.t.Fatal("no output")
		return nil
	}
}

func (h *commandsHarness) quiet() {
	h.t.Helper()
	select {
	case o := <-h.out:
		h.t.Fatalf("unexpected output %v", o)
	case <-time.After(50 * time.Millisecond):
	}
}

func startMsg(id uint64, argv ...string) *agentv1.CommandsInput {
	return &agentv1.CommandsInput{Id: id, Msg: &agentv1.CommandsInput_Start{Start: &agentv1.ExecRequest{Argv: argv}}}
}

func startedEvent(id string) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: 7, Id: id}}}
}

func exited(code int32) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: code}}}
}

func TestCommandsTagEventsAndEndWithTheExit(t *testing.T) {
	h := newCommandsHarness(t, func(_ context.Context, req *agentv1.ExecRequest, send func(*agentv1.ExecResponse) error) error {
		if err := send(startedEvent(req.Argv[0])); err != nil {
			return err
		}
		if err := send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: []byte(req.Argv[0])}}); err != nil {
			return err
		}
		return send(exited(3))
	})
	h.send(startMsg(1, "a"))
	got := map[uint64][]string{}
	for range 3 {
		o := h.next()
		got[o.Id] = append(got[o.Id], eventName(o))
	}
	h.send(startMsg(5, "b")) // ids need only increase
	for range 3 {
		o := h.next()
		got[o.Id] = append(got[o.Id], eventName(o))
	}
	want := "started stdout exit"
	for _, id := range []uint64{1, 5} {
		if s := strings.Join(got[id], " "); s != want {
			t.Errorf("command %d: %s, want %s (the exit status ends it: no end follows)", id, s, want)
		}
	}
	h.quiet()
	close(h.in)
	if err := <-h.done; err != nil {
		t.Fatal(err)
	}
}

func eventName(o *agentv1.CommandsOutput) string {
	switch o.GetEvent().GetEvent().(type) {
	case *agentv1.ExecResponse_Started:
		return "started"
	case *agentv1.ExecResponse_Stdout:
		return "stdout"
	case *agentv1.ExecResponse_Exit:
		return "exit"
	}
	if o.GetEnd() != nil {
		return "end"
	}
	return "?"
}

func TestCommandsEndWithTheRunnersError(t *testing.T) {
	h := newCommandsHarness(t, func(context.Context, *agentv1.ExecRequest, func(*agentv1.ExecResponse) error) error {
		return connect.NewError(connect.CodeNotFound, errors.New("exec: nope: not found"))
	})
	h.send(startMsg(1, "nope"))
	o := h.next()
	if e := o.GetEnd(); o.Id != 1 || e == nil || connect.Code(e.Code) != connect.CodeNotFound || e.Message != "exec: nope: not found" {
		t.Fatalf("got %v, want command 1's end: not_found with the runner's message", o)
	}
	close(h.in)
	<-h.done
}

// An error's text is cut to a character boundary and made UTF-8, which a
// proto string must be: otherwise the end could not be sent, and the host
// would wait for it.
func TestCommandsEndWithAnyText(t *testing.T) {
	h := newCommandsHarness(t, func(context.Context, *agentv1.ExecRequest, func(*agentv1.ExecResponse) error) error {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("exec: working directory: stat /workspace/"+strings.Repeat("é", 600)+"\xff: file name too long"))
	})
	h.send(startMsg(1, "x"))
	o := h.next()
	if e := o.GetEnd(); e == nil || !utf8.ValidString(e.Message) || len(e.Message) > maxEndMessage || !strings.HasPrefix(e.Message, "exec: working directory") {
		t.Fatalf("got %v", o)
	}
	close(h.in)
	<-h.done
}

// A command waits for credit; another command's output is not held up
// meanwhile, and a grant lets the first go on.
func TestCommandsPaceOutputByCredit(t *testing.T) {
	chunk := make([]byte, protocol.ExecChunkBytes)
	h := newCommandsHarness(t, func(_ context.Context, req *agentv1.ExecRequest, send func(*agentv1.ExecResponse) error) error {
		n := 1
		if req.Argv[0] == "big" {
			n = 20 // 640 KiB, over the 256 KiB credit
		}
		for range n {
			if err := send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: chunk}}); err != nil {
				return err
			}
		}
		return send(exited(0))
	})
	h.send(startMsg(1, "big"))
	per := int64(len(chunk)) + 4 + protocol.CommandEventOverhead // size of an event of one chunk, roughly
	first := 0
	for {
		select {
		case o := <-h.out:
			if o.Id != 1 || o.GetEvent().GetStdout() == nil {
				t.Fatalf("unexpected %v", o)
			}
			first++
			continue
		case <-time.After(200 * time.Millisecond):
		}
		break
	}
	if max := int(protocol.CommandCredit / per); first == 0 || first > max {
		t.Fatalf("%d chunks went out before any grant, want 1 to %d", first, max)
	}
	h.send(startMsg(2, "small"))
	if o := h.next(); o.Id != 2 || o.GetEvent().GetStdout() == nil {
		t.Fatalf("command 2 held up behind command 1: %v", o)
	}
	if o := h.next(); o.Id != 2 || o.GetEvent().GetExit() == nil {
		t.Fatalf("want command 2's exit, got %v", o)
	}
	got := first
	for got < 20 {
		h.send(&agentv1.CommandsInput{Id: 1, Msg: &agentv1.CommandsInput_Credit{Credit: protocol.CommandCredit}})
		for {
			select {
			case o := <-h.out:
				if o.GetEvent().GetStdout() != nil {
					got++
					continue
				}
				if o.GetEvent().GetExit() == nil || got != 20 {
					t.Fatalf("after %d chunks: %v", got, o)
				}
			case <-time.After(200 * time.Millisecond):
			}
			break
		}
	}
	close(h.in)
	if err := <-h.done; err != nil {
		t.Fatal(err)
	}
}

// Cancel ends the command's context; the end of the stream ends every
// command, and serve waits for them.
func TestCommandsCancel(t *testing.T) {
	var mu sync.Mutex
	ended := map[string]bool{}
	h := newCommandsHarness(t, func(ctx context.Context, req *agentv1.ExecRequest, send func(*agentv1.ExecResponse) error) error {
		_ = send(startedEvent(req.Argv[0]))
		<-ctx.Done()
		time.Sleep(20 * time.Millisecond) // serve must wait for this
		mu.Lock()
		ended[req.Argv[0]] = true
		mu.Unlock()
		return connect.NewError(connect.CodeCanceled, ctx.Err())
	})
	h.send(startMsg(1, "one"))
	h.send(startMsg(2, "two"))
	h.next()
	h.next()
	h.send(&agentv1.CommandsInput{Id: 1, Msg: &agentv1.CommandsInput_Cancel{Cancel: &agentv1.Cancel{}}})
	if o := h.next(); o.Id != 1 || connect.Code(o.GetEnd().GetCode()) != connect.CodeCanceled {
		t.Fatalf("want command 1's end (canceled), got %v", o)
	}
	close(h.in)
	if err := <-h.done; err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !ended["one"] || !ended["two"] {
		t.Fatalf("serve returned before its commands ended: %v", ended)
	}
}

// A signal reaches the command by its exec id, also one sent before it
// started.
func TestCommandsSignal(t *testing.T) {
	release := make(chan struct{})
	h := newCommandsHarness(t, func(ctx context.Context, req *agentv1.ExecRequest, send func(*agentv1.ExecResponse) error) error {
		<-release
		if err := send(startedEvent("x-1")); err != nil {
			return err
		}
		<-ctx.Done()
		return ctx.Err()
	})
	signals := make(chan string, 4)
	h.m.signal = func(id string, sig unix.Signal) error {
		signals <- id + " " + unix.SignalName(sig)
		return nil
	}
	h.send(startMsg(1, "x"))
	h.send(&agentv1.CommandsInput{Id: 1, Msg: &agentv1.CommandsInput_Signal{Signal: int32(unix.SIGINT)}})
	select {
	case s := <-signals:
		t.Fatalf("signalled %s before the command started", s)
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	h.next() // started
	if s := <-signals; s != "x-1 SIGINT" {
		t.Fatalf("early signal: %s", s)
	}
	h.send(&agentv1.CommandsInput{Id: 1, Msg: &agentv1.CommandsInput_Signal{Signal: int32(unix.SIGTERM)}})
	if s := <-signals; s != "x-1 SIGTERM" {
		t.Fatalf("signal: %s", s)
	}
	close(h.in)
	<-h.done
}

// What breaks the protocol ends the stream with InvalidArgument.
func TestCommandsRefuseWhatBreaksTheProtocol(t *testing.T) {
	for name, msgs := range map[string][]*agentv1.CommandsInput{
		"id 0":             {startMsg(0, "x")},
		"started twice":    {startMsg(1, "x"), startMsg(1, "x")},
		"ids going back":   {startMsg(2, "x"), startMsg(1, "x")},
		"empty start":      {{Id: 1, Msg: &agentv1.CommandsInput_Start{}}},
		"credit, no start": {{Id: 1, Msg: &agentv1.CommandsInput_Credit{Credit: 1}}},
		"cancel, no start": {{Id: 3, Msg: &agentv1.CommandsInput_Cancel{Cancel: &agentv1.Cancel{}}}},
		"signal 0":         {startMsg(1, "x"), {Id: 1, Msg: &agentv1.CommandsInput_Signal{}}},
		"signal 65":        {startMsg(1, "x"), {Id: 1, Msg: &agentv1.CommandsInput_Signal{Signal: 65}}},
		"no message":       {{Id: 1}},
	} {
		t.Run(name, func(t *testing.T) {
			h := newCommandsHarness(t, func(ctx context.Context, _ *agentv1.ExecRequest, _ func(*agentv1.ExecResponse) error) error {
				<-ctx.Done()
				return ctx.Err()
			})
			for _, m := range msgs {
				select {
				case h.in <- m:
				case err := <-h.done:
					h.done <- err
				}
			}
			select {
			case err := <-h.done:
				if connect.CodeOf(err) != connect.CodeInvalidArgument {
					t.Fatalf("got %v, want invalid_argument", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the stream went on")
			}
		})
	}
}

// Past MaxCommands running at once, a start gets ResourceExhausted alone;
// the stream goes on.
func TestCommandsCapRunning(t *testing.T) {
	h := newCommandsHarness(t, func(ctx context.Context, _ *agentv1.ExecRequest, _ func(*agentv1.ExecResponse) error) error {
		<-ctx.Done()
		return ctx.Err()
	})
	for id := uint64(1); id <= protocol.MaxCommands; id++ {
		h.send(startMsg(id, "x"))
	}
	h.send(startMsg(protocol.MaxCommands+1, "x"))
	o := h.next()
	if o.Id != protocol.MaxCommands+1 || connect.Code(o.GetEnd().GetCode()) != connect.CodeResourceExhausted {
		t.Fatalf("got %v, want the last start refused", o)
	}
	h.send(&agentv1.CommandsInput{Id: 1, Msg: &agentv1.CommandsInput_Cancel{Cancel: &agentv1.Cancel{}}})
	if o := h.next(); o.Id != 1 || o.GetEnd() == nil {
		t.Fatalf("got %v, want command 1's end", o)
	}
	close(h.in)
	if err := <-h.done; err != nil {
		t.Fatal(err)
	}
}

// names lists a message's held events, then its own event or end.
func names(o *agentv1.CommandsOutput) string {
	var s []string
	for _, ev := range o.Held {
		s = append(s, eventName(&agentv1.CommandsOutput{Msg: &agentv1.CommandsOutput_Event{Event: ev}}))
	}
	return strings.Join(append(s, eventName(o)), " ")
}

func stdoutOf(n int) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: make([]byte, n)}}
}

// For a host that reads held events, a young command's start and output go
// out with its exit status, or with its end, in one message.
func TestCommandsHoldAYoungCommandsEvents(t *testing.T) {
	h := newCommandsHarness(t, func(_ context.Context, req *agentv1.ExecRequest, send func(*agentv1.ExecResponse) error) error {
		if err := send(startedEvent("x-1")); err != nil {
			return err
		}
		// As the runner does, each chunk is read into the same buffer.
		buf := []byte("aaa")
		if err := send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: buf}}); err != nil {
			return err
		}
		copy(buf, "bbb")
		if err := send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stderr{Stderr: buf[:1]}}); err != nil {
			return err
		}
		if req.Argv[0] == "fail" {
			return connect.NewError(connect.CodeDeadlineExceeded, errors.New("exec: too slow"))
		}
		return send(exited(0))
	})
	h.m.hold = time.Hour // only the exit status, the end or size lets them go
	h.send(startMsg(1, "ok"))
	if o := h.next(); o.Id != 1 || names(o) != "started stdout ? exit" {
		t.Fatalf("got %s (%v), want started, stdout and stderr held, with the exit", names(o), o)
	} else if out, errOut := string(o.Held[1].GetStdout()), string(o.Held[2].GetStderr()); out != "aaa" || errOut != "b" {
		t.Fatalf("held output %q and %q, want aaa and b: a held chunk must not share the runner's buffer", out, errOut)
	}
	h.send(startMsg(2, "fail"))
	if o := h.next(); o.Id != 2 || names(o) != "started stdout ? end" || connect.Code(o.GetEnd().GetCode()) != connect.CodeDeadlineExceeded {
		t.Fatalf("got %s (%v), want the held events with the end", names(o), o)
	}
	h.quiet()
	close(h.in)
	if err := <-h.done; err != nil {
		t.Fatal(err)
	}
}

// What is held goes out when the hold ends, or when it would pass
// protocol.EventHoldBytes; after that, each event goes out at once.
func TestCommandsHoldEnds(t *testing.T) {
	next := make(chan *agentv1.ExecResponse)
	h := newCommandsHarness(t, func(ctx context.Context, _ *agentv1.ExecRequest, send func(*agentv1.ExecResponse) error) error {
		for {
			select {
			case ev := <-next:
				if err := send(ev); err != nil || ev.GetExit() != nil {
					return err
				}
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	})
	h.m.hold = 100 * time.Millisecond
	start := time.Now()
	h.send(startMsg(1, "x"))
	next <- startedEvent("x-1")
	next <- stdoutOf(1)
	if o := h.next(); names(o) != "started stdout" {
		t.Fatalf("got %s, want the start held with the output", names(o))
	} else if d := time.Since(start); d < h.m.hold {
		t.Errorf("sent after %v, before the hold of %v ended", d, h.m.hold)
	}
	next <- stdoutOf(2)
	if o := h.next(); names(o) != "stdout" {
		t.Fatalf("got %s, want the output alone once the hold has ended", names(o))
	}
	next <- exited(0)
	if o := h.next(); names(o) != "exit" {
		t.Fatalf("got %s, want the exit alone", names(o))
	}

	h.m.hold = time.Hour
	h.send(startMsg(2, "y"))
	next <- startedEvent("x-2")
	next <- stdoutOf(protocol.EventHoldBytes / 2)
	next <- stdoutOf(protocol.EventHoldBytes / 2) // past EventHoldBytes with what is held
	if o := h.next(); names(o) != "started stdout stdout" {
		t.Fatalf("got %s, want what was held sent with the output that would pass the cap", names(o))
	}
	next <- stdoutOf(1)
	if o := h.next(); names(o) != "stdout" {
		t.Fatalf("got %s, want later output at once", names(o))
	}
	next <- exited(0)
	h.next()
	close(h.in)
	if err := <-h.done; err != nil {
		t.Fatal(err)
	}
}

// The hold's cap counts what the host counts: each event's size plus
// protocol.CommandEventOverhead.
func TestCommandsHoldCountsCreditUnits(t *testing.T) {
	const chunk = 100
	units := proto.Size(stdoutOf(chunk)) + protocol.CommandEventOverhead
	n := protocol.EventHoldBytes/units + 10 // past the cap in units, well within it in bytes
	h := newCommandsHarness(t, func(_ context.Context, _ *agentv1.ExecRequest, send func(*agentv1.ExecResponse) error) error {
		if err := send(startedEvent("x-1")); err != nil {
			return err
		}
		for range n {
			if err := send(stdoutOf(chunk)); err != nil {
				return err
			}
		}
		return send(exited(0))
	})
	h.m.hold = time.Hour
	h.send(startMsg(1, "x"))
	o := h.next()
	if o.GetEvent().GetExit() != nil {
		t.Fatalf("all %d events held until the exit: the cap did not count %d units per event", n+1, units)
	}
	for o.GetEvent().GetExit() == nil {
		o = h.next()
	}
	close(h.in)
	if err := <-h.done; err != nil {
		t.Fatal(err)
	}
}
