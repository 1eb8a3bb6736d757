//go:build linux

package proctable

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/exec"
	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/reaper"
)

func TestMain(m *testing.M) {
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	os.Exit(m.Run())
}

// fakeStream is a Process call's server side, driven by a test.
type fakeStream struct {
	in  chan *agentv1.ProcessInput // closed: the client sends no more
	out chan *agentv1.ExecResponse
	hdr http.Header
}

func newStream(first *agentv1.ProcessInput) *fakeStream {
	s := &fakeStream{in: make(chan *agentv1.ProcessInput, 16), out: make(chan *agentv1.ExecResponse, 1024), hdr: http.Header{}}
	s.in <- first
	return s
}

func (s *fakeStream) Receive() (*agentv1.ProcessInput, error) {
	m, ok := <-s.in
	if !ok {
		return nil, io.EOF
	}
	return m, nil
}

func (s *fakeStream) Send(m *agentv1.ExecResponse) error {
	switch e := m.Event.(type) { // the sender reuses its buffers
	case *agentv1.ExecResponse_Stdout:
		m = &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: bytes.Clone(e.Stdout)}}
	case *agentv1.ExecResponse_Stderr:
		m = &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stderr{Stderr: bytes.Clone(e.Stderr)}}
	}
	s.out <- m
	return nil
}

func (s *fakeStream) ResponseHeader() http.Header { return s.hdr }

// call is one Process call running in the background.
type call struct {
	s      *fakeStream
	cancel context.CancelFunc
	errc   chan error
}

func process(t *testing.T, tb *Table, first *agentv1.ProcessInput) *call {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	c := &call{s: newStream(first), cancel: cancel, errc: make(chan error, 1)}
	go func() { c.errc <- tb.Process(ctx, c.s) }()
	return c
}

// started waits for Started, or fails with the call's error.
func (c *call) started(t *testing.T) *agentv1.Started {
	t.Helper()
	select {
	case m := <-c.s.out:
		if m.GetStarted() == nil {
			t.Fatalf("first message %v", m)
		}
		return m.GetStarted()
	case err := <-c.errc:
		t.Fatalf("call ended: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no Started")
	}
	return nil
}

// end ends the call and returns its error.
func (c *call) end(t *testing.T) error {
	t.Helper()
	c.cancel()
	select {
	case err := <-c.errc:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("call did not end")
	}
	return nil
}

// testUser is who tests run commands as: root when the tests run as root
// (as in CI), else the tests' own user, the only one a non-root agent can
// run commands as.
func testUser() string {
	if os.Geteuid() == 0 {
		return "root"
	}
	return ""
}

func table(t *testing.T) *Table {
	return New(&exec.Runner{Reaper: reaper.Default(), Dir: t.TempDir(), User: testUser(), WaitDelay: 100 * time.Millisecond})
}

func startDetached(argv ...string) *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: &agentv1.ExecRequest{Argv: argv, Detach: true}}}
}

// waitFor polls cond for up to 10 seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func exited(tb *Table, id string) func() bool {
	return func() bool {
		return connect.CodeOf(tb.SignalCommand(id, unix.SIGCONT)) == connect.CodeFailedPrecondition
	}
}

func TestTableFull(t *testing.T) {
	tb := table(t)
	tb.max = 2
	var ids []string
	for range 2 {
		c := process(t, tb, startDetached("sleep", "300"))
		ids = append(ids, c.started(t).Id)
		if err := c.end(t); connect.CodeOf(err) != connect.CodeCanceled {
			t.Fatalf("detach: %v", err)
		}
	}
	err := <-process(t, tb, startDetached("true")).errc
	if connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("third detached command: %v, want resource_exhausted", err)
	}

	// Once one has exited, it makes room for a new one.
	if err := tb.SignalCommand(ids[0], unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "exit", exited(tb, ids[0]))
	c := process(t, tb, startDetached("sleep", "300"))
	c.started(t)
	if err := <-process(t, tb, &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Attach{Attach: &agentv1.AttachRequest{Id: ids[0]}}}).errc; connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("attach to the evicted command: %v", err)
	}
	tb.SignalCommand(ids[1], unix.SIGKILL)
	c.s.in <- &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Signal{Signal: int32(unix.SIGKILL)}}
	if err := <-c.errc; err != nil {
		t.Fatal(err)
	}
}

func TestExitedExpire(t *testing.T) {
	tb := table(t)
	tb.keep = 100 * time.Millisecond
	c := process(t, tb, startDetached("sleep", "0.2"))
	id := c.started(t).Id
	c.end(t)
	waitFor(t, "exit", exited(tb, id))
	if tb.Detached() != 1 {
		t.Fatalf("%d detached right after exit", tb.Detached())
	}
	waitFor(t, "expiry", func() bool { return tb.Detached() == 0 })
	if err := tb.SignalCommand(id, unix.SIGTERM); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("signal after expiry: %v", err)
	}
}

// TestHalfCloseDetached: the end of the client's messages neither detaches
// nor closes stdin.
func TestHalfCloseDetached(t *testing.T) {
	tb := table(t)
	c := process(t, tb, startDetached("cat"))
	c.s.in <- &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Stdin{Stdin: []byte("hi")}}
	close(c.s.in)
	st := c.started(t)
	if m := <-c.s.out; string(m.GetStdout()) != "hi" {
		t.Fatalf("got %v", m)
	}
	select {
	case err := <-c.errc:
		t.Fatalf("call ended: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	if err := tb.SignalCommand(st.Id, unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := <-c.errc; err != nil {
		t.Fatal(err)
	}
	last := <-c.s.out
	if last.GetExit().GetSignal() != "SIGTERM" {
		t.Fatalf("last %v", last)
	}
}

func TestNoFirstMessage(t *testing.T) {
	tb := table(t)
	s := newStream(nil)
	<-s.in
	close(s.in)
	if err := tb.Process(context.Background(), s); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("%v", err)
	}
}

// TestDetachAtStart: a start with detach_at_start is answered with Started
// alone and ends, and the command it leaves running is free at once for an
// attach, which gets its output from the start. Without detach it is
// refused.
func TestDetachAtStart(t *testing.T) {
	tb := table(t)
	first := startDetached("sh", "-c", "echo before; read x; echo got $x")
	first.GetStart().DetachAtStart = true
	c := process(t, tb, first)
	st := c.started(t)
	select {
	case err := <-c.errc:
		if err != nil {
			t.Fatalf("the starting call ended with %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the starting call did not end after Started")
	}
	if len(c.s.out) != 0 {
		t.Fatalf("the starting call was sent %v after Started", <-c.s.out)
	}
	a := process(t, tb, &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Attach{Attach: &agentv1.AttachRequest{Id: st.Id}}})
	if got := a.started(t); got.Id != st.Id {
		t.Fatalf("attach: started %v, want id %s", got, st.Id)
	}
	a.s.in <- &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Stdin{Stdin: []byte("in\n")}}
	var out []byte
	for m := range a.s.out {
		out = append(out, m.GetStdout()...)
		if x := m.GetExit(); x != nil {
			if x.Code != 0 {
				t.Fatalf("exit %v", x)
			}
			break
		}
	}
	if string(out) != "before\ngot in\n" {
		t.Fatalf("attach got %q, want the output from the start", out)
	}
	if err := <-a.errc; err != nil {
		t.Fatal(err)
	}

	bad := &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: &agentv1.ExecRequest{Argv: []string{"true"}, DetachAtStart: true}}}
	if err := tb.Process(context.Background(), newStream(bad)); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("detach_at_start without detach: %v, want invalid argument", err)
	}
}

// TestAttachWaitsForTheClientBefore: an attach that finds the command
// attached waits for that client to go, up to attachWait, and fails with
// CodeFailedPrecondition if it does not.
func TestAttachWaitsForTheClientBefore(t *testing.T) {
	tb := table(t)
	tb.attachWait = 5 * time.Second
	first := process(t, tb, startDetached("cat"))
	id := first.started(t).Id
	attach := &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Attach{Attach: &agentv1.AttachRequest{Id: id}}}
	second := process(t, tb, attach)
	time.Sleep(200 * time.Millisecond) // the second attach is waiting
	if err := first.end(t); connect.CodeOf(err) != connect.CodeCanceled {
		t.Fatalf("the first call ended with %v", err)
	}
	if got := second.started(t); got.Id != id {
		t.Fatalf("second attach: started %v", got)
	}

	tb.attachWait = 300 * time.Millisecond
	begin := time.Now()
	err := tb.Process(context.Background(), newStream(attach))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || time.Since(begin) < tb.attachWait {
		t.Fatalf("an attach while another stays: %v after %v; want failed precondition after %v", err, time.Since(begin), tb.attachWait)
	}
	if err := tb.SignalCommand(id, unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := <-second.errc; err != nil {
		t.Fatalf("the second call: %v", err)
	}
}
