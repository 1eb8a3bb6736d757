package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// These tests take the path of carrel exec: client.Run, carreld's Process
// relay, the agent link, and drivertest's scripted agent.

// processVM serves the API with an audit log and creates VM "a", whose
// agent serves Process with script (nil: drivertest's cat). Its context
// bounds the test, so that a lost message fails it rather than hangs it.
func processVM(t *testing.T, script func(context.Context, *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error) (context.Context, *client.Client, *audit.Log) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	sock, _, drv, _, alog := authzAPIWithAudit(t)
	drv.SetNext(drivertest.Behavior{Process: script})
	c := client.New(sock)
	if _, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: "a", Image: "dev"})); err != nil {
		t.Fatal(err)
	}
	return ctx, c, alog
}

// closeLog waits until the log holds n api.call records of Process (the
// client returns at the exit status, before carreld records the call's
// end, which it does after the command's), closes it and reads it.
func closeLog(t *testing.T, alog *audit.Log, n int) []audit.Record {
	t.Helper()
	dir := alog.Dir()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		calls := 0
		audit.Scan(dir, func(_ uint64, _ int64, payload []byte) error {
			r, err := audit.Decode(payload)
			if err == nil && r.Kind == audit.KindAPICall && strings.Contains(string(r.Data), agentv1connect.AgentServiceProcessProcedure) {
				calls++
			}
			return nil
		})
		if calls >= n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d Process calls recorded", calls, n)
		}
	}
	if err := alog.Close(); err != nil {
		t.Fatal(err)
	}
	return readLog(t, dir)
}

func unmarshal[T any](t *testing.T, r audit.Record) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(r.Data, &v); err != nil {
		t.Fatalf("record %d (%s): %v", r.Seq, r.Kind, err)
	}
	return v
}

// TestProcessRelaysStdinAndRecordsIt: stdin reaches the guest and its echo
// comes back; the exit status is the guest's. The log holds the decision,
// the intent, both streams as blobs, the outcome tied to the intent, and
// the call.
func TestProcessRelaysStdinAndRecordsIt(t *testing.T) {
	ctx, c, alog := processVM(t, nil)
	in := "hello\n\x00binary\xff\n"
	var out bytes.Buffer
	var id string
	var pid int32
	exit, err := c.Run(ctx, client.Session{VM: "a", Start: &agentv1.ExecRequest{Argv: []string{"cat", "-"}, Env: []string{"K=v"}},
		Stdin: strings.NewReader(in), Stdout: &out, Started: func(i string, p int32) { id, pid = i, p }})
	if err != nil {
		t.Fatal(err)
	}
	if exit.Code != 0 || exit.Signal != "" || out.String() != in || id != "fake-1" || pid != 101 {
		t.Errorf("exit %v, stdout %q, started %q pid %d", exit, out.String(), id, pid)
	}

	recs := closeLog(t, alog, 1)
	var intent *audit.Record
	streams := map[string]string{}
	var outcome audit.ExecExit
	var outcomeSeq uint64
	outcomes := 0
	execDecided := false
	for _, r := range recs {
		switch r.Kind {
		case audit.KindPolicyDecision:
			d := unmarshal[audit.Decision](t, r)
			execDecided = execDecided || d.Kind == "exec" && d.Allow && d.VM == "a" && strings.Contains(string(d.Input), `"cat"`)
		case audit.KindIntent:
			if intent != nil {
				t.Errorf("a second intent: %s", r.Data)
			}
			intent = &r
			x := unmarshal[audit.ExecIntent](t, r)
			if x.Action != audit.ActionExec || strings.Join(x.Argv, " ") != "cat -" || x.Env["K"] != "v" || x.User != "agent" || x.Cwd != "/workspace" || r.VM != "a" || r.Provenance != audit.Host {
				t.Errorf("intent %+v: %s", r, r.Data)
			}
		case audit.KindExecOutput:
			x := unmarshal[audit.ExecOutput](t, r)
			if intent == nil || x.Exec != intent.Seq || x.Offset != 0 || x.Size != int64(len(in)) {
				t.Errorf("exec output %s does not follow its intent", r.Data)
			}
			if want := map[string]audit.Provenance{"stdin": audit.Host, "stdout": audit.Guest}[x.Stream]; r.Provenance != want || len(r.Blobs) != 1 {
				t.Errorf("exec output %+v: %s", r, r.Data)
				continue
			}
			streams[x.Stream] = string(blobBytes(t, alog.Dir(), r.Blobs[0]))
		case audit.KindExecExit:
			outcomes++
			outcome, outcomeSeq = unmarshal[audit.ExecExit](t, r), r.Seq
			if intent == nil || r.Intent == nil || *r.Intent != intent.Seq {
				t.Errorf("outcome %+v is not tied to the intent", r)
			}
		}
	}
	if !execDecided {
		t.Error("no allowing exec decision for cat in vm a")
	}
	if streams["stdin"] != in || streams["stdout"] != in {
		t.Errorf("recorded streams %q", streams)
	}
	if outcomes != 1 || outcome.Code == nil || *outcome.Code != 0 || outcome.ExecID != "fake-1" || outcome.Error != "" ||
		outcome.StdinBytes != int64(len(in)) || outcome.StdoutBytes != int64(len(in)) || outcome.StderrBytes != 0 {
		t.Errorf("%d outcomes, last %+v", outcomes, outcome)
	}
	for _, r := range recs {
		if r.Kind != audit.KindAPICall {
			continue
		}
		if call := unmarshal[audit.APICall](t, r); call.Procedure == agentv1connect.AgentServiceProcessProcedure && (call.Code != "ok" || r.VM != "a" || r.Seq < outcomeSeq) {
			t.Errorf("the call's record %+v: %s", r, r.Data)
		}
	}
	if rep, err := audit.Verify(alog.Dir(), audit.VerifyOptions{}); err != nil || !rep.OK() {
		t.Errorf("verify: %v %+v", err, rep)
	}
}

// TestProcessForwardsSignals: a signal from the client ends the guest's
// command, whose status says so, and the outcome record too.
func TestProcessForwardsSignals(t *testing.T) {
	ctx, c, alog := processVM(t, nil)
	sigs := make(chan int32, 1)
	exit, err := c.Run(ctx, client.Session{VM: "a", Start: &agentv1.ExecRequest{Argv: []string{"sleep", "1d"}},
		Signals: sigs, Started: func(string, int32) { sigs <- 15 }})
	if err != nil {
		t.Fatal(err)
	}
	if exit.Code != 128+15 || exit.Signal != "SIGTERM" {
		t.Errorf("exit %v, want 143 SIGTERM", exit)
	}
	for _, r := range closeLog(t, alog, 1) {
		if r.Kind == audit.KindExecExit {
			if x := unmarshal[audit.ExecExit](t, r); x.Code == nil || *x.Code != 143 || x.Signal != "SIGTERM" || x.StdinBytes != 0 {
				t.Errorf("outcome %s", r.Data)
			}
		}
	}
}

// TestProcessDeniedBeforeTheGuest: a command the policy denies never
// reaches the guest, and nothing is recorded as started.
func TestProcessDeniedBeforeTheGuest(t *testing.T) {
	var reached atomic.Bool
	ctx, c, alog := processVM(t, func(context.Context, *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error {
		reached.Store(true)
		return errors.New("reached the guest")
	})
	_, err := c.Run(ctx, client.Session{VM: "a", Start: &agentv1.ExecRequest{Argv: []string{"id"}, User: "root"}})
	wantDenied(t, "process as root", err, "carrel.exec")
	for _, r := range closeLog(t, alog, 1) {
		if r.Kind == audit.KindIntent || r.Kind == audit.KindExecExit {
			t.Errorf("recorded %s for a denied command: %s", r.Kind, r.Data)
		}
	}
	if reached.Load() {
		t.Error("the guest was asked to run a denied command")
	}
}

// TestProcessDetachAtStart: a detached start with detach_at_start may end
// right after Started, cleanly, and the outcome on record says the command
// was left running; a stream that ends so before Started, or after it
// without detach_at_start, is the guest's fault.
func TestProcessDetachAtStart(t *testing.T) {
	var asked atomic.Bool
	ctx, c, alog := processVM(t, func(_ context.Context, s *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error {
		first, err := s.Receive()
		if err != nil {
			return err
		}
		if first.GetStart().GetArgv()[0] == "client" {
			asked.Store(first.GetStart().GetDetachAtStart())
		}
		switch first.GetStart().GetArgv()[0] {
		case "never-starts":
			return nil
		case "talks":
			if err := s.Send(started(7, "x")); err != nil {
				return err
			}
			return s.Send(stdout("more"))
		}
		return s.Send(started(7, "x"))
	})
	run := func(argv0 string, atStart bool) error {
		s := c.Agent.Process(ctx)
		s.RequestHeader().Set(protocol.VMHeader, "a")
		start := &agentv1.ExecRequest{Argv: []string{argv0}, Detach: true, DetachAtStart: atStart}
		if err := s.Send(&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: start}}); err != nil {
			return err
		}
		defer s.CloseResponse()
		for {
			if _, err := s.Receive(); err != nil {
				if errors.Is(err, io.EOF) {
					return nil
				}
				return err
			}
		}
	}
	if err := run("sleep", true); err != nil {
		t.Errorf("detach_at_start, ended after Started: %v", err)
	}
	if err := run("never-starts", true); connect.CodeOf(err) != connect.CodeDataLoss {
		t.Errorf("detach_at_start, ended before Started: %v, want data loss", err)
	}
	if err := run("talks", true); connect.CodeOf(err) != connect.CodeDataLoss {
		t.Errorf("detach_at_start, output after Started: %v, want data loss", err)
	}
	if err := run("sleep", false); connect.CodeOf(err) != connect.CodeDataLoss {
		t.Errorf("detach alone, ended after Started: %v, want data loss", err)
	}
	// carrel exec --detach: the client asks the guest to let go at once.
	req := &agentv1.ExecRequest{Argv: []string{"client"}, Detach: true}
	if _, err := c.Run(ctx, client.Session{VM: "a", Start: req, DetachAfterStart: true}); !errors.Is(err, client.ErrDetached) {
		t.Errorf("client.Run with DetachAfterStart: %v", err)
	}
	if !asked.Load() || req.DetachAtStart {
		t.Errorf("the guest was asked detach_at_start %v, and the caller's request changed to %v; want true, and unchanged", asked.Load(), req.DetachAtStart)
	}
	var outcomes []string
	for _, r := range closeLog(t, alog, 5) {
		if r.Kind == audit.KindExecExit {
			outcomes = append(outcomes, unmarshal[audit.ExecExit](t, r).Error)
		}
	}
	// The client's own run ends the call itself on Started, which may
	// reach carreld before the guest's end does: detached all the same.
	want := []string{"(detached)", "without an exit status", "without an exit status", "without an exit status", "(detached)"}
	for i, w := range want {
		if len(outcomes) != len(want) || !strings.Contains(outcomes[i], w) {
			t.Fatalf("outcomes %q; want them to say %q", outcomes, want)
		}
	}
}

func started(pid int32, id string) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: pid, Id: id}}}
}

func stdout(s string) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: []byte(s)}}
}

func exited(code int32, signal string) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: code, Signal: signal}}}
}

// hostileStreams are event streams a guest could send, by the command
// (argv[0]) that makes hostileProcess send them, with what the client gets:
// an error (its code and text) or else an exit code. The oversized one ends
// the link's connection, so it is last.
var hostileStreams = []struct {
	name   string
	events []*agentv1.ExecResponse
	code   connect.Code
	says   string
	exit   int32
}{
	{name: "late-start", events: []*agentv1.ExecResponse{stdout("x"), started(7, "x")}, code: connect.CodeDataLoss, says: "guest agent: an invalid start event"},
	{name: "start-twice", events: []*agentv1.ExecResponse{started(7, "x"), started(8, "y")}, code: connect.CodeDataLoss, says: "guest agent: an invalid start event"},
	{name: "zero-pid", events: []*agentv1.ExecResponse{started(0, "x"), exited(0, "")}, code: connect.CodeDataLoss, says: "guest agent: an invalid start event"},
	{name: "long-id", events: []*agentv1.ExecResponse{started(7, strings.Repeat("i", protocol.MaxExecID+1)), exited(0, "")}, code: connect.CodeDataLoss, says: "guest agent: an invalid start event"},
	// An id the client prints (carrel exec -d): a terminal escape must
	// not reach the operator's screen.
	{name: "escape-id", events: []*agentv1.ExecResponse{started(7, "\x1b[2Jid\a"), exited(0, "")}, code: connect.CodeDataLoss, says: "guest agent: an invalid start event"},
	{name: "no-event", events: []*agentv1.ExecResponse{started(7, "x"), {}}, code: connect.CodeDataLoss, says: "exec: guest agent sent an unknown event"},
	{name: "exit-negative", events: []*agentv1.ExecResponse{started(7, "x"), exited(-1, "")}, code: connect.CodeDataLoss, says: "exec: guest agent sent an invalid exit status"},
	{name: "exit-256", events: []*agentv1.ExecResponse{started(7, "x"), exited(256, "")}, code: connect.CodeDataLoss, says: "exec: guest agent sent an invalid exit status"},
	{name: "long-signal", events: []*agentv1.ExecResponse{started(7, "x"), exited(137, strings.Repeat("S", 17))}, code: connect.CodeDataLoss, says: "exec: guest agent sent an invalid exit status"},
	{name: "escape-signal", events: []*agentv1.ExecResponse{started(7, "x"), exited(137, "\x1b[2J")}, code: connect.CodeDataLoss, says: "exec: guest agent sent an invalid exit status"},
	{name: "no-exit", events: []*agentv1.ExecResponse{started(7, "x"), stdout("bye")}, code: connect.CodeDataLoss, says: "guest agent ended the stream without an exit status"},
	// A code that would pose as carreld's, and a terminal escape (see
	// hostileProcess): Internal, cleaned.
	{name: "guest-error", code: connect.CodeInternal, says: "guest agent: [2Jlog in"},
	// Accepted today: output with no start event, and a second exit, which
	// the relay never reads, as it ends the call at the first.
	{name: "output-first", events: []*agentv1.ExecResponse{stdout("early"), exited(3, "")}, exit: 3},
	{name: "exit-twice", events: []*agentv1.ExecResponse{started(7, "x"), exited(3, ""), exited(4, "")}, exit: 3},
	{name: "oversized", events: []*agentv1.ExecResponse{started(7, "x"), stdout(strings.Repeat("o", protocol.MaxMessageBytes))}, code: connect.CodeResourceExhausted, says: "larger than configured max"},
}

// hostileProcess sends the hostile stream its command names.
func hostileProcess(_ context.Context, s *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error {
	first, err := s.Receive()
	if err != nil {
		return err
	}
	name := first.GetStart().GetArgv()[0]
	if name == "guest-error" {
		return connect.NewError(connect.CodeUnauthenticated, errors.New("\x1b[2Jlog in"))
	}
	for _, h := range hostileStreams {
		if h.name != name {
			continue
		}
		for _, ev := range h.events {
			if err := s.Send(ev); err != nil {
				return err
			}
		}
	}
	return nil
}

// TestProcessRefusesHostileStreams: carreld checks each event of the
// guest's stream before relaying it; a broken stream ends the call with an
// error that says what the guest did, and that error is the outcome on
// record.
func TestProcessRefusesHostileStreams(t *testing.T) {
	ctx, c, alog := processVM(t, hostileProcess)
	for _, h := range hostileStreams {
		var out bytes.Buffer
		var id string
		exit, err := c.Run(ctx, client.Session{VM: "a", Start: &agentv1.ExecRequest{Argv: []string{h.name}}, Stdout: &out,
			Started: func(i string, _ int32) { id = i }})
		switch {
		case h.says == "" && (err != nil || exit.Code != h.exit):
			t.Errorf("%s: exit %v, err %v; want exit %d", h.name, exit, err, h.exit)
		case h.says != "" && (connect.CodeOf(err) != h.code || !strings.Contains(err.Error(), h.says)):
			t.Errorf("%s: %v; want %v saying %q", h.name, err, h.code, h.says)
		}
		switch h.name {
		case "output-first":
			if out.String() != "early" || id != "" {
				t.Errorf("output-first: stdout %q, started %q", out.String(), id)
			}
		case "escape-id":
			if id != "" {
				t.Errorf("escape-id: the client was told the id %q", id)
			}
		}
	}

	// Each command's outcome, by its name.
	outcomes := map[string]audit.ExecExit{}
	names := map[uint64]string{}
	for _, r := range closeLog(t, alog, len(hostileStreams)) {
		switch r.Kind {
		case audit.KindIntent:
			names[r.Seq] = unmarshal[audit.ExecIntent](t, r).Argv[0]
		case audit.KindExecExit:
			outcomes[names[*r.Intent]] = unmarshal[audit.ExecExit](t, r)
		}
	}
	for _, h := range hostileStreams {
		x, ok := outcomes[h.name]
		switch {
		case !ok:
			t.Errorf("%s: no outcome recorded", h.name)
		case h.says != "" && (x.Code != nil || !strings.Contains(x.Error, h.says)):
			t.Errorf("%s: outcome %+v, want the error", h.name, x)
		case h.says == "" && (x.Code == nil || *x.Code != h.exit || x.Error != ""):
			t.Errorf("%s: outcome %+v, want exit %d", h.name, x, h.exit)
		}
	}
	if x := outcomes["output-first"]; x.ExecID != "" || x.StdoutBytes != 5 {
		t.Errorf("output-first: outcome %+v", x)
	}
}

// TestExecSyncs counts the audit log's group commits (each one fdatasync)
// on a command's path: at most one from the call's arrival to the guest
// seeing it (the api and exec decisions and the intent go together), and
// at most one from the guest's exit status to the end of the reply (the
// last output and the outcome go with the api.call record). Every record
// is still there, in order, durable before what it admits.
func TestExecSyncs(t *testing.T) {
	var alog *audit.Log
	var atStart, atExit atomic.Uint64
	ctx, c, alog := processVM(t, func(_ context.Context, s *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error {
		if _, err := s.Receive(); err != nil {
			return err
		}
		atStart.Store(alog.Commits())
		if err := s.Send(started(7, "e1")); err != nil {
			return err
		}
		if err := s.Send(stdout("out")); err != nil {
			return err
		}
		atExit.Store(alog.Commits())
		return s.Send(exited(0, ""))
	})
	before := alog.Commits()
	p := c.Agent.Process(ctx)
	p.RequestHeader().Set(protocol.VMHeader, "a")
	if err := p.Send(&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: &agentv1.ExecRequest{Argv: []string{"true"}}}}); err != nil {
		t.Fatal(err)
	}
	p.CloseRequest()
	for {
		if _, err := p.Receive(); err != nil {
			if !errors.Is(err, io.EOF) {
				t.Fatal(err)
			}
			break
		}
	}
	end := alog.Commits()
	if n := atStart.Load() - before; n > 1 {
		t.Errorf("%d fdatasyncs between the call's arrival and the guest", n)
	}
	if n := end - atExit.Load(); n > 1 {
		t.Errorf("%d fdatasyncs between the guest's exit status and the reply", n)
	}
	t.Logf("fdatasyncs: %d before the guest, %d after its exit", atStart.Load()-before, end-atExit.Load())
	kinds := []string{}
	for _, r := range closeLog(t, alog, 1) {
		switch r.Kind {
		case audit.KindPolicyDecision, audit.KindIntent, audit.KindExecOutput, audit.KindExecExit, audit.KindAPICall:
			if r.VM == "a" {
				kinds = append(kinds, r.Kind)
			}
		}
	}
	want := []string{audit.KindPolicyDecision, audit.KindPolicyDecision, audit.KindIntent, audit.KindExecOutput, audit.KindExecExit, audit.KindAPICall}
	if !slices.Equal(kinds[len(kinds)-len(want):], want) {
		t.Errorf("records %v, want them to end %v", kinds, want)
	}
}
