//go:build linux

package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/proctable"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// procCall is the client side of one Process call.
type procCall struct {
	t       *testing.T
	s       *connect.BidiStreamForClient[agentv1.ProcessInput, agentv1.ExecResponse]
	ctx     context.Context
	cancel  context.CancelFunc
	started *agentv1.Started
	stdout  bytes.Buffer
	stderr  bytes.Buffer
	exit    *agentv1.ExitStatus
	err     error // how the call ended, once it has
}

// openProcess sends first and returns the call without reading anything.
func openProcess(t *testing.T, f *fixture, first *agentv1.ProcessInput) *procCall {
	t.Helper()
	ctx, cancel := context.WithCancel(callCtx(t))
	t.Cleanup(cancel)
	c := &procCall{t: t, s: f.client.Process(ctx), ctx: ctx, cancel: cancel}
	if err := c.s.Send(first); err != nil && !errors.Is(err, io.EOF) {
		t.Fatalf("send first message: %v", err)
	}
	return c
}

// startProcess starts req (or attaches, with attach) and reads Started.
func startProcess(t *testing.T, f *fixture, first *agentv1.ProcessInput) *procCall {
	t.Helper()
	c := openProcess(t, f, first)
	if !c.recv() || c.started == nil {
		t.Fatalf("no Started: %v", c.err)
	}
	return c
}

func start(req *agentv1.ExecRequest) *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: req}}
}

func attachTo(id string) *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Attach{Attach: &agentv1.AttachRequest{Id: id}}}
}

func stdin(s string) *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Stdin{Stdin: []byte(s)}}
}

var closeStdin = &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_CloseStdin{CloseStdin: &agentv1.CloseStdin{}}}

func signalMsg(sig int32) *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Signal{Signal: sig}}
}

func resize(rows, cols uint32) *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Resize{Resize: &agentv1.Resize{Rows: rows, Cols: cols}}}
}

// end ends the call from the client's side, which detaches from a
// detached command and kills any other. Cancelling the context alone is not
// enough: net/http's HTTP/2 client resets the stream only once the request
// body is closed or the response body is.
func (c *procCall) end() {
	c.cancel()
	c.s.CloseRequest()
	c.s.CloseResponse()
	if c.err == nil {
		c.err = context.Canceled
	}
}

func (c *procCall) send(m *agentv1.ProcessInput) {
	c.t.Helper()
	if err := c.s.Send(m); err != nil {
		c.t.Fatalf("send: %v", err)
	}
}

// recv reads one message; false once the call has ended (c.err).
func (c *procCall) recv() bool {
	if c.err != nil {
		return false
	}
	m, err := c.s.Receive()
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = nil
		}
		c.err = err
		if c.err == nil {
			c.err = io.EOF
		}
		return false
	}
	switch e := m.Event.(type) {
	case *agentv1.ExecResponse_Started:
		if c.started != nil {
			c.t.Errorf("second Started %v", e.Started)
		}
		c.started = e.Started
	case *agentv1.ExecResponse_Stdout:
		if len(e.Stdout) > protocol.ExecChunkBytes {
			c.t.Errorf("chunk of %d bytes", len(e.Stdout))
		}
		c.stdout.Write(e.Stdout)
	case *agentv1.ExecResponse_Stderr:
		c.stderr.Write(e.Stderr)
	case *agentv1.ExecResponse_Exit:
		c.exit = e.Exit
	}
	if c.started == nil {
		c.t.Errorf("%v before Started", m)
	}
	return true
}

// waitStdout reads until stdout contains s.
func (c *procCall) waitStdout(s string) {
	c.t.Helper()
	for !strings.Contains(c.stdout.String(), s) {
		if !c.recv() {
			c.t.Fatalf("call ended (%v) before stdout had %q: %q", c.err, s, c.stdout.String())
		}
	}
}

// wait reads to the end and returns the exit status, which must be last.
func (c *procCall) wait() *agentv1.ExitStatus {
	c.t.Helper()
	for c.recv() {
		if c.exit != nil {
			if c.recv() {
				c.t.Fatalf("message after the exit status")
			}
		}
	}
	if c.err != io.EOF {
		c.t.Fatalf("call failed: %v (stdout %q)", c.err, c.stdout.String())
	}
	if c.exit == nil {
		c.t.Fatal("no exit status")
	}
	return c.exit
}

// failure reads to the end and returns the call's error.
func (c *procCall) failure() error {
	for c.recv() {
	}
	if c.err == io.EOF {
		return nil
	}
	return c.err
}

func TestProcessStdinRoundTrip(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"cat"}}))
	if c.started.Pid <= 0 || len(c.started.Id) != 16 {
		t.Fatalf("started %v", c.started)
	}
	c.send(stdin("hello\n"))
	c.waitStdout("hello\n") // cat echoes while stdin is still open
	c.send(stdin("world"))
	c.send(closeStdin)
	if exit := c.wait(); exit.Code != 0 || c.stdout.String() != "hello\nworld" {
		t.Fatalf("exit %v stdout %q", exit, c.stdout.String())
	}
}

func TestProcessHalfCloseKeepsStdinOpen(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, start(sh(`read x; echo "got $x"`)))
	if err := c.s.CloseRequest(); err != nil {
		t.Fatal(err)
	}
	// Without close_stdin, read waits until the command is signalled.
	time.Sleep(200 * time.Millisecond)
	if _, err := f.client.Signal(callCtx(t), connect.NewRequest(&agentv1.SignalRequest{
		Target: &agentv1.SignalRequest_ExecId{ExecId: c.started.Id}})); err != nil {
		t.Fatal(err)
	}
	if exit := c.wait(); exit.Signal != "SIGTERM" || c.stdout.Len() != 0 {
		t.Fatalf("exit %v stdout %q", exit, c.stdout.String())
	}
}

func TestProcessStdinAfterClose(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"sleep", "300"}}))
	c.send(closeStdin)
	c.send(stdin("late"))
	if err := c.failure(); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("err %v, want failed_precondition", err)
	}
	waitGone(t, int(c.started.Pid)) // the call ended: the command was killed
}

func TestProcessSignal(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"sleep", "300"}}))
	c.send(signalMsg(int32(unix.SIGTERM)))
	if exit := c.wait(); exit.Code != 143 || exit.Signal != "SIGTERM" {
		t.Fatalf("exit %v, want 143 SIGTERM", exit)
	}
	for _, sig := range []int32{0, -1, 65} {
		c := startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"sleep", "300"}}))
		c.send(signalMsg(sig))
		if err := c.failure(); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Fatalf("signal %d: %v, want invalid_argument", sig, err)
		}
	}
}

func TestProcessCancelKillsGroup(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, start(sh("sleep 300 & echo $!; wait")))
	c.waitStdout("\n")
	child, err := strconv.Atoi(strings.TrimSpace(c.stdout.String()))
	if err != nil {
		t.Fatal(err)
	}
	c.end()
	waitGone(t, int(c.started.Pid))
	waitGone(t, child)
}

func TestProcessTTY(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"sh", "-c", `tty; stty size; echo "$TERM"; echo err >&2`},
		Tty: true, Rows: 30, Cols: 100}))
	if exit := c.wait(); exit.Code != 0 {
		t.Fatalf("exit %v", exit)
	}
	out := c.stdout.String()
	if !strings.Contains(out, "/dev/pts/") || !strings.Contains(out, "30 100\r\n") ||
		!strings.Contains(out, "xterm-256color\r\n") || !strings.Contains(out, "err\r\n") || c.stderr.Len() != 0 {
		t.Fatalf("stdout %q stderr %q", out, c.stderr.String())
	}

	// Exec takes a terminal too, with nothing typed into it.
	res, err := execute(callCtx(t), f.client, &agentv1.ExecRequest{Argv: []string{"stty", "size"}, Tty: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.stdout.String() != "24 80\r\n" {
		t.Fatalf("exec on a tty: %q", res.stdout.String())
	}
}

func TestProcessTTYResize(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"sh", "-c", `stty size; read x; stty size; echo "x=$x"`},
		Tty: true, Rows: 30, Cols: 100}))
	c.waitStdout("30 100\r\n")
	c.send(resize(40, 120))
	c.send(stdin("go\n"))
	c.waitStdout("x=go")
	if !strings.Contains(c.stdout.String(), "40 120\r\n") {
		t.Fatalf("stdout %q", c.stdout.String())
	}
	c.wait()

	// ^D ends cat's input on a terminal.
	c = startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"cat"}, Tty: true}))
	c.send(stdin("abc\n"))
	c.waitStdout("abc\r\nabc\r\n") // the echo, then cat's copy
	c.send(closeStdin)
	if exit := c.wait(); exit.Code != 0 {
		t.Fatalf("exit %v", exit)
	}

	c = startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"sleep", "300"}, Tty: true}))
	c.send(resize(0, 80))
	if err := c.failure(); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("resize 0x80: %v", err)
	}
}

// TestProcessResizeWithoutTTY: a resize is ignored when there is no
// terminal.
func TestProcessResizeWithoutTTY(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"cat"}}))
	c.send(resize(40, 120))
	c.send(stdin("x"))
	c.send(closeStdin)
	if exit := c.wait(); exit.Code != 0 || c.stdout.String() != "x" {
		t.Fatalf("exit %v stdout %q", exit, c.stdout.String())
	}
}

func detached(req *agentv1.ExecRequest) *agentv1.ProcessInput {
	req.Detach = true
	return start(req)
}

// signal calls Signal by exec id.
func signal(t *testing.T, f *fixture, id string, sig unix.Signal) error {
	_, err := f.client.Signal(callCtx(t), connect.NewRequest(&agentv1.SignalRequest{
		Target: &agentv1.SignalRequest_ExecId{ExecId: id}, Signal: int32(sig)}))
	return err
}

// waitExited waits until the command with id has exited (signalling it
// then fails with failed_precondition).
func waitExited(t *testing.T, f *fixture, id string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := signal(t, f, id, unix.SIGCONT)
		if connect.CodeOf(err) == connect.CodeFailedPrecondition {
			return
		}
		if err != nil {
			t.Fatalf("signal %s: %v", id, err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("command %s did not exit", id)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// reattach attaches to id, retrying while the server has yet to see the
// previous client go.
func reattach(t *testing.T, f *fixture, id string) *procCall {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c := openProcess(t, f, attachTo(id))
		if c.recv() && c.started != nil {
			return c
		}
		if connect.CodeOf(c.err) != connect.CodeFailedPrecondition || time.Now().After(deadline) {
			t.Fatalf("attach %s: %v", id, c.err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestDetachAttach(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, detached(sh("echo one; read x; echo two $x; sleep 0.5; echo err >&2; exit 7")))
	id, pid := c.started.Id, c.started.Pid
	c.waitStdout("one\n")
	c.end() // detach

	// The command still runs: attach, which replays the output so far,
	// type, and see the rest.
	a := reattach(t, f, id)
	if a.started.Id != id || a.started.Pid != pid {
		t.Fatalf("attach started %v, want id %s pid %d", a.started, id, pid)
	}
	if h := a.s.ResponseHeader().Get(proctable.DroppedHeader); h != "0" {
		t.Fatalf("dropped header %q", h)
	}
	a.waitStdout("one\n")
	a.send(stdin("three\n"))
	a.waitStdout("two three\n")
	a.end() // detach again
	waitExited(t, f, id)

	// After the exit: the whole output again, then the exit status.
	b := reattach(t, f, id)
	if exit := b.wait(); exit.Code != 7 || b.stdout.String() != "one\ntwo three\n" || b.stderr.String() != "err\n" {
		t.Fatalf("exit %v stdout %q stderr %q", exit, b.stdout.String(), b.stderr.String())
	}
	// Then the command is forgotten.
	if err := openProcess(t, f, attachTo(id)).failure(); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("attach after the exit was collected: %v, want not_found", err)
	}
	if err := signal(t, f, id, unix.SIGTERM); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("signal after the exit was collected: %v, want not_found", err)
	}
}

// TestDetachedStarterSeesExit: the client that started a detached command
// gets its exit status like any other, and the command is then forgotten.
func TestDetachedStarterSeesExit(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, detached(sh("echo hi; exit 4")))
	if exit := c.wait(); exit.Code != 4 || c.stdout.String() != "hi\n" {
		t.Fatalf("exit %v stdout %q", exit, c.stdout.String())
	}
	if err := openProcess(t, f, attachTo(c.started.Id)).failure(); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("attach: %v, want not_found", err)
	}
}

// TestDetachedOutputDropsOldest: output written while nobody is attached
// is kept up to proctable.OutputBytes, the newest bytes.
func TestDetachedOutputDropsOldest(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, detached(sh("sleep 0.5; seq 1 400000; exit 3")))
	id := c.started.Id
	c.end()
	waitExited(t, f, id)

	a := reattach(t, f, id)
	if exit := a.wait(); exit.Code != 3 {
		t.Fatalf("exit %v", exit)
	}
	var all strings.Builder
	for i := 1; i <= 400000; i++ {
		fmt.Fprintf(&all, "%d\n", i)
	}
	want := all.String()[all.Len()-proctable.OutputBytes:]
	if a.stdout.Len() != proctable.OutputBytes || a.stdout.String() != want {
		t.Fatalf("got %d bytes ending %q, want the last %d", a.stdout.Len(), a.stdout.String()[max(0, a.stdout.Len()-20):], proctable.OutputBytes)
	}
	if h := a.s.ResponseHeader().Get(proctable.DroppedHeader); h != strconv.Itoa(all.Len()-proctable.OutputBytes) {
		t.Fatalf("dropped header %q, want %d", h, all.Len()-proctable.OutputBytes)
	}
}

// TestAttachedClientLosesNothing: while a client is attached, output is
// not dropped however much there is.
func TestAttachedClientLosesNothing(t *testing.T) {
	f := serve(t)
	const n = 3 << 20
	c := startProcess(t, f, detached(sh(fmt.Sprintf("head -c %d /dev/zero", n))))
	if exit := c.wait(); exit.Code != 0 || c.stdout.Len() != n {
		t.Fatalf("exit %v, %d bytes, want %d", c.exit, c.stdout.Len(), n)
	}
}

func TestSecondAttachRefused(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, detached(&agentv1.ExecRequest{Argv: []string{"sleep", "300"}}))
	err := openProcess(t, f, attachTo(c.started.Id)).failure()
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "already attached") {
		t.Fatalf("second attach: %v, want failed_precondition already attached", err)
	}

	// A command started without detach belongs to its call.
	d := startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"sleep", "300"}}))
	if err := openProcess(t, f, attachTo(d.started.Id)).failure(); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("attach to an attached command: %v", err)
	}

	if err := signal(t, f, c.started.Id, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if exit := c.wait(); exit.Code != 137 {
		t.Fatalf("exit %v", exit)
	}
}

func TestProcessBadRequests(t *testing.T) {
	f := serve(t)
	tests := []struct {
		name  string
		first *agentv1.ProcessInput
		code  connect.Code
	}{
		{"unknown id", attachTo("0123456789abcdef"), connect.CodeNotFound},
		{"stdin first", stdin("x"), connect.CodeInvalidArgument},
		{"empty", &agentv1.ProcessInput{}, connect.CodeInvalidArgument},
		{"empty argv", start(&agentv1.ExecRequest{}), connect.CodeInvalidArgument},
		{"unknown user", start(&agentv1.ExecRequest{Argv: []string{"true"}, User: "carrel-nobody"}), connect.CodeInvalidArgument},
		{"not found", start(&agentv1.ExecRequest{Argv: []string{"carrel-no-such-cmd"}}), connect.CodeNotFound},
		{"huge terminal", start(&agentv1.ExecRequest{Argv: []string{"true"}, Tty: true, Rows: 1 << 16}), connect.CodeInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := openProcess(t, f, tt.first)
			if err := c.failure(); connect.CodeOf(err) != tt.code || c.started != nil {
				t.Fatalf("err %v started %v, want %v", err, c.started, tt.code)
			}
		})
	}

	// A second start on the same call is refused, and ends it.
	c := startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"sleep", "300"}}))
	c.send(start(&agentv1.ExecRequest{Argv: []string{"true"}}))
	if err := c.failure(); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("second start: %v", err)
	}

	// Exec cannot detach.
	_, err := execute(callCtx(t), f.client, &agentv1.ExecRequest{Argv: []string{"true"}, Detach: true})
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("exec with detach: %v", err)
	}
}

func TestListProcesses(t *testing.T) {
	f := serve(t)
	c := startProcess(t, f, start(sh("sleep 301 & echo $!; wait")))
	c.waitStdout("\n")
	child, err := strconv.Atoi(strings.TrimSpace(c.stdout.String()))
	if err != nil {
		t.Fatal(err)
	}
	var resp *connect.Response[agentv1.ListProcessesResponse]
	found := map[int32]*agentv1.ProcessInfo{}
	// The child may not have become sleep yet.
	for deadline := time.Now().Add(10 * time.Second); found[int32(child)].GetCommand() != "sleep 301" && time.Now().Before(deadline); {
		resp, err = f.client.ListProcesses(callCtx(t), connect.NewRequest(&agentv1.ListProcessesRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range resp.Msg.Processes {
			found[p.Pid] = p
		}
		time.Sleep(10 * time.Millisecond)
	}
	leader, sleeper := found[c.started.Pid], found[int32(child)]
	if leader == nil || leader.ExecId != c.started.Id || !strings.HasPrefix(leader.Command, "sh -c sleep 301") ||
		leader.Uid != uint32(os.Geteuid()) || leader.RssBytes == 0 || leader.State == "" {
		t.Fatalf("leader %v", leader)
	}
	if sleeper == nil || sleeper.ExecId != c.started.Id || sleeper.Command != "sleep 301" || sleeper.Ppid != c.started.Pid {
		t.Fatalf("child %v", sleeper)
	}
	for _, p := range resp.Msg.Processes {
		if p.Pid == c.started.Pid || p.Pid == int32(child) {
			continue
		}
		if p.ExecId != "" {
			t.Errorf("unrelated process with an exec id: %v", p)
		}
	}
}

func TestSignal(t *testing.T) {
	f := serve(t)
	// By pid; signal 0 means SIGTERM.
	c := startProcess(t, f, start(&agentv1.ExecRequest{Argv: []string{"sleep", "300"}}))
	if _, err := f.client.Signal(callCtx(t), connect.NewRequest(&agentv1.SignalRequest{
		Target: &agentv1.SignalRequest_Pid{Pid: c.started.Pid}})); err != nil {
		t.Fatal(err)
	}
	if exit := c.wait(); exit.Code != 143 || exit.Signal != "SIGTERM" {
		t.Fatalf("by pid: exit %v", exit)
	}

	// By exec id: the whole process group.
	c = startProcess(t, f, start(sh("sleep 300 & echo $!; wait")))
	c.waitStdout("\n")
	child, _ := strconv.Atoi(strings.TrimSpace(c.stdout.String()))
	if err := signal(t, f, c.started.Id, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if exit := c.wait(); exit.Code != 137 || exit.Signal != "SIGKILL" {
		t.Fatalf("by id: exit %v", exit)
	}
	waitGone(t, child)

	// An Exec call's command has an id too.
	stream, err := f.client.Exec(callCtx(t), connect.NewRequest(&agentv1.ExecRequest{Argv: []string{"sleep", "300"}}))
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() || stream.Msg().GetStarted().GetId() == "" {
		t.Fatalf("exec started: %v %v", stream.Msg(), stream.Err())
	}
	if err := signal(t, f, stream.Msg().GetStarted().GetId(), unix.SIGINT); err != nil {
		t.Fatal(err)
	}
	for stream.Receive() {
		if e := stream.Msg().GetExit(); e != nil && e.Signal != "SIGINT" {
			t.Fatalf("exec exit %v", e)
		}
	}
	stream.Close()

	bad := []struct {
		name string
		req  *agentv1.SignalRequest
		code connect.Code
	}{
		{"pid 1", &agentv1.SignalRequest{Target: &agentv1.SignalRequest_Pid{Pid: 1}}, connect.CodeInvalidArgument},
		{"pid 0", &agentv1.SignalRequest{Target: &agentv1.SignalRequest_Pid{Pid: 0}}, connect.CodeInvalidArgument},
		{"group", &agentv1.SignalRequest{Target: &agentv1.SignalRequest_Pid{Pid: -5}}, connect.CodeInvalidArgument},
		{"agent", &agentv1.SignalRequest{Target: &agentv1.SignalRequest_Pid{Pid: int32(unix.Getpid())}}, connect.CodeInvalidArgument},
		{"no target", &agentv1.SignalRequest{Signal: 9}, connect.CodeInvalidArgument},
		{"signal 65", &agentv1.SignalRequest{Target: &agentv1.SignalRequest_ExecId{ExecId: "x"}, Signal: 65}, connect.CodeInvalidArgument},
		{"negative signal", &agentv1.SignalRequest{Target: &agentv1.SignalRequest_ExecId{ExecId: "x"}, Signal: -1}, connect.CodeInvalidArgument},
		{"unknown id", &agentv1.SignalRequest{Target: &agentv1.SignalRequest_ExecId{ExecId: "0123456789abcdef"}}, connect.CodeNotFound},
		{"no such pid", &agentv1.SignalRequest{Target: &agentv1.SignalRequest_Pid{Pid: 1 << 30}}, connect.CodeNotFound},
	}
	for _, tt := range bad {
		if _, err := f.client.Signal(callCtx(t), connect.NewRequest(tt.req)); connect.CodeOf(err) != tt.code {
			t.Errorf("%s: %v, want %v", tt.name, err, tt.code)
		}
	}
}

// Calls that went well, and calls the caller got wrong, stay off the
// console; the agent's and the guest's own failures are logged.
func TestCallLevel(t *testing.T) {
	for _, c := range []struct {
		err  error
		want slog.Level
	}{
		{nil, slog.LevelDebug},
		{connect.NewError(connect.CodeNotFound, errors.New("exec: \"nope\": not found")), slog.LevelDebug},
		{connect.NewError(connect.CodeInvalidArgument, errors.New("exec: empty argv")), slog.LevelDebug},
		{connect.NewError(connect.CodePermissionDenied, errors.New("outside the sandbox")), slog.LevelDebug},
		{connect.NewError(connect.CodeCanceled, context.Canceled), slog.LevelDebug},
		{connect.NewError(connect.CodeInternal, errors.New("fork: out of memory")), slog.LevelInfo},
		{connect.NewError(connect.CodeResourceExhausted, errors.New("too many commands")), slog.LevelInfo},
		{errors.New("pipe: too many open files"), slog.LevelInfo},
	} {
		if got := callLevel(c.err); got != c.want {
			t.Errorf("callLevel(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
