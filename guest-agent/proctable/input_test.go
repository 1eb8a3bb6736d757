//go:build linux

package proctable

import (
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/pty"
)

func stdinMsg(s string) *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Stdin{Stdin: []byte(s)}}
}

func closeStdinMsg() *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_CloseStdin{CloseStdin: &agentv1.CloseStdin{}}}
}

func resizeMsg(rows, cols uint32) *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Resize{Resize: &agentv1.Resize{Rows: rows, Cols: cols}}}
}

func start(req *agentv1.ExecRequest) *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: req}}
}

// next returns the call's next event, or nil and the call's error once it
// has ended and sent everything. Events come first: a call that ended has
// already queued all it sent.
func (c *call) next(t *testing.T) (*agentv1.ExecResponse, error) {
	t.Helper()
	select {
	case m := <-c.s.out:
		return m, nil
	default:
	}
	select {
	case m := <-c.s.out:
		return m, nil
	case err := <-c.errc:
		select {
		case m := <-c.s.out:
			c.errc <- err // for a later next
			return m, nil
		default:
			return nil, err
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no event and no end")
	}
	return nil, nil
}

// output reads the call's events until stdout holds want, or fails.
func (c *call) output(t *testing.T, want string) {
	t.Helper()
	var got strings.Builder
	for !strings.Contains(got.String(), want) {
		m, err := c.next(t)
		switch {
		case m == nil:
			t.Fatalf("call ended (%v) with output %q, want %q", err, got.String(), want)
		case m.GetExit() != nil:
			t.Fatalf("exited (%v) with output %q, want %q", m.GetExit(), got.String(), want)
		}
		got.Write(m.GetStdout())
	}
}

// exit reads the call's events up to its exit status and the call's end.
func (c *call) exit(t *testing.T) *agentv1.ExitStatus {
	t.Helper()
	for {
		m, err := c.next(t)
		if m == nil {
			t.Fatalf("call ended (%v) before the exit status", err)
		}
		if x := m.GetExit(); x != nil {
			if m, err := c.next(t); m != nil || err != nil {
				t.Fatalf("after the exit status: %v, %v", m, err)
			}
			return x
		}
	}
}

// TestInputAttached: Input feeds a command whose Process call is still
// open, and close_stdin ends its stdin.
func TestInputAttached(t *testing.T) {
	tb := table(t)
	c := process(t, tb, start(&agentv1.ExecRequest{Argv: []string{"cat"}}))
	id := c.started(t).Id
	if err := tb.Input(id, stdinMsg("hello")); err != nil {
		t.Fatal(err)
	}
	c.output(t, "hello")
	if err := tb.Input(id, resizeMsg(30, 100)); err != nil {
		t.Errorf("resize of a command without a terminal: %v", err)
	}
	if err := tb.Input(id, stdinMsg(" again")); err != nil {
		t.Fatal(err)
	}
	c.output(t, " again")
	if err := tb.Input(id, closeStdinMsg()); err != nil {
		t.Fatal(err)
	}
	if x := c.exit(t); x.GetCode() != 0 || x.GetSignal() != "" {
		t.Errorf("cat after close_stdin: %v", x)
	}
	if err := tb.Input(id, stdinMsg("late")); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("input to an attached command that exited: %v, want not_found", err)
	}
}

// TestInputDetached: Input feeds a detached command no client follows;
// once it has exited it is a failed precondition until its output is
// collected, and then not found.
func TestInputDetached(t *testing.T) {
	tb := table(t)
	c := process(t, tb, startDetached("cat"))
	id := c.started(t).Id
	if err := c.end(t); connect.CodeOf(err) != connect.CodeCanceled {
		t.Fatalf("detach: %v", err)
	}
	if err := tb.Input(id, stdinMsg("one ")); err != nil {
		t.Fatal(err)
	}
	if err := tb.Input(id, resizeMsg(30, 100)); err != nil {
		t.Errorf("resize of a command without a terminal: %v", err)
	}
	if err := tb.Input(id, stdinMsg("two")); err != nil {
		t.Fatal(err)
	}
	if err := tb.Input(id, closeStdinMsg()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "cat to exit", exited(tb, id))
	for _, m := range []*agentv1.ProcessInput{stdinMsg("x"), closeStdinMsg(), resizeMsg(1, 1)} {
		if err := tb.Input(id, m); connect.CodeOf(err) != connect.CodeFailedPrecondition {
			t.Errorf("%v to an exited detached command: %v, want failed_precondition", m, err)
		}
	}
	// What Input fed it is in its output.
	a := process(t, tb, &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Attach{Attach: &agentv1.AttachRequest{Id: id}}})
	if m, err := a.next(t); m.GetStarted() == nil {
		t.Fatalf("attach: %v, %v", m, err)
	}
	a.output(t, "one two")
	if x := a.exit(t); x.GetCode() != 0 {
		t.Errorf("exit %v", x)
	}
	if err := tb.Input(id, stdinMsg("x")); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("input to a collected command: %v, want not_found", err)
	}
}

func TestInputStdinAfterClose(t *testing.T) {
	tb := table(t)
	c := process(t, tb, startDetached("sleep", "300"))
	id := c.started(t).Id
	t.Cleanup(func() { tb.SignalCommand(id, unix.SIGKILL) })
	if err := tb.Input(id, closeStdinMsg()); err != nil {
		t.Fatal(err)
	}
	if err := tb.Input(id, stdinMsg("x")); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("stdin after close_stdin: %v, want failed_precondition", err)
	}
}

// TestInputResizeTTY: a resize reaches a command's terminal; a size out of
// range is refused.
func TestInputResizeTTY(t *testing.T) {
	tb := table(t)
	c := process(t, tb, start(&agentv1.ExecRequest{
		Argv: []string{"sh", "-c", "read x; stty size"}, Tty: true, Rows: 24, Cols: 80}))
	id := c.started(t).Id
	if err := tb.Input(id, resizeMsg(31, 101)); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][2]uint32{{0, 80}, {24, 0}, {pty.MaxSize + 1, 80}} {
		if err := tb.Input(id, resizeMsg(bad[0], bad[1])); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("resize to %dx%d: %v, want invalid_argument", bad[0], bad[1], err)
		}
	}
	if err := tb.Input(id, stdinMsg("\n")); err != nil {
		t.Fatal(err)
	}
	c.output(t, "31 101")
	if x := c.exit(t); x.GetCode() != 0 {
		t.Errorf("exit %v", x)
	}
}

func TestInputRefusals(t *testing.T) {
	tb := table(t)
	c := process(t, tb, startDetached("sleep", "300"))
	id := c.started(t).Id
	t.Cleanup(func() { tb.SignalCommand(id, unix.SIGKILL) })

	for _, unknown := range []string{"0123456789abcdef", "", strings.Repeat("x", 100)} {
		if err := tb.Input(unknown, stdinMsg("x")); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("input to %q: %v, want not_found", unknown, err)
		}
	}
	wrong := []*agentv1.ProcessInput{
		{},
		{Msg: &agentv1.ProcessInput_Signal{Signal: int32(unix.SIGKILL)}},
		startDetached("true"),
		{Msg: &agentv1.ProcessInput_Attach{Attach: &agentv1.AttachRequest{Id: id}}},
	}
	for _, m := range wrong {
		for _, target := range []string{id, "0123456789abcdef"} {
			if err := tb.Input(target, m); connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Errorf("%v to %q: %v, want invalid_argument", m, target, err)
			}
		}
	}
	// None of them reached the command: a signal among them would have
	// killed it, a start started another.
	if err := tb.SignalCommand(id, 0); err != nil {
		t.Errorf("the command after refused input: %v", err)
	}
	if n := tb.Detached(); n != 1 {
		t.Errorf("%d detached commands, want 1", n)
	}
}
