package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/recorder"
)

const testVM = "demo"

// fakeAgent is a guest agent that keeps what it is asked: the commands
// started by Exec and Process, and the Input calls, each with whether the
// host had recorded its intent by the time it arrived.
type fakeAgent struct {
	agentv1connect.UnimplementedAgentServiceHandler
	auditDir string

	mu     sync.Mutex
	starts []*agentv1.ExecRequest
	inputs []*agentv1.InputRequest
	// recorded says, for each input, whether its intent was in the log
	// when the guest got it.
	recorded []bool
	// inputErr, if set, is Input's reply.
	inputErr error

	// commands serves the Commands call; without it the agent is one from
	// before it. Its commands named "wait" run until cancelled or
	// signalled (exit 130).
	commands    bool
	viaCommands int
	processes   int
	signals     []int32
	signalled   chan struct{} // closed by Signal, for Exec's "wait"
	gate        chan struct{} // if set, Exec's "wait" starts once it is closed
}

func (a *fakeAgent) Commands(ctx context.Context, s *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
	if !a.commands {
		return connect.NewError(connect.CodeUnimplemented, errors.New("no Commands"))
	}
	send := func(id uint64, ev *agentv1.ExecResponse) error {
		return s.Send(&agentv1.CommandsOutput{Id: id, Msg: &agentv1.CommandsOutput_Event{Event: ev}})
	}
	exit := func(code int32) *agentv1.ExecResponse {
		return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: code}}}
	}
	for {
		in, err := s.Receive()
		if err != nil {
			return nil
		}
		switch m := in.Msg.(type) {
		case *agentv1.CommandsInput_Start:
			a.mu.Lock()
			a.starts = append(a.starts, m.Start)
			a.viaCommands++
			a.mu.Unlock()
			err = send(in.Id, &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: 7, Id: "e1"}}})
			if err == nil && m.Start.GetArgv()[0] != "wait" {
				err = send(in.Id, exit(0))
			}
		case *agentv1.CommandsInput_Signal:
			a.mu.Lock()
			a.signals = append(a.signals, m.Signal)
			a.mu.Unlock()
			err = send(in.Id, exit(130))
		case *agentv1.CommandsInput_Cancel:
			err = s.Send(&agentv1.CommandsOutput{Id: in.Id, Msg: &agentv1.CommandsOutput_End{End: &agentv1.CommandEnd{Code: uint32(connect.CodeCanceled)}}})
		}
		if err != nil {
			return err
		}
	}
}

func (a *fakeAgent) Exec(ctx context.Context, req *connect.Request[agentv1.ExecRequest], s *connect.ServerStream[agentv1.ExecResponse]) error {
	a.mu.Lock()
	a.starts = append(a.starts, req.Msg)
	if a.signalled == nil {
		a.signalled = make(chan struct{})
	}
	signalled, gate := a.signalled, a.gate
	a.mu.Unlock()
	if req.Msg.GetArgv()[0] == "wait" { // runs until signalled: exit 130
		if gate != nil {
			<-gate
		}
		if err := s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: 7, Id: "e1"}}}); err != nil {
			return err
		}
		select {
		case <-signalled:
		case <-ctx.Done():
			return ctx.Err()
		}
		return s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: 130}}})
	}
	return s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{}}})
}

func (a *fakeAgent) Signal(_ context.Context, req *connect.Request[agentv1.SignalRequest]) (*connect.Response[agentv1.SignalResponse], error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if req.Msg.GetExecId() != "e1" {
		return nil, connect.NewError(connect.CodeNotFound, errors.New("no such command"))
	}
	a.signals = append(a.signals, req.Msg.Signal)
	if a.signalled != nil {
		close(a.signalled)
		a.signalled = nil
	}
	return connect.NewResponse(&agentv1.SignalResponse{}), nil
}

func (a *fakeAgent) Process(_ context.Context, s *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error {
	first, err := s.Receive()
	if err != nil {
		return err
	}
	a.mu.Lock()
	a.starts = append(a.starts, first.GetStart())
	a.processes++
	a.mu.Unlock()
	if err := s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: 7, Id: "e1"}}}); err != nil {
		return err
	}
	return s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{}}})
}

func (a *fakeAgent) Input(_ context.Context, req *connect.Request[agentv1.InputRequest]) (*connect.Response[agentv1.InputResponse], error) {
	found := false
	for _, r := range auditRecords(a.auditDir, audit.KindIntent) {
		var in audit.InputIntent
		if json.Unmarshal(r.Data, &in) == nil && in.Action == audit.ActionInput && in.ExecID == req.Msg.ExecId {
			found = true
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.inputs = append(a.inputs, req.Msg)
	a.recorded = append(a.recorded, found)
	if a.inputErr != nil {
		return nil, a.inputErr
	}
	return connect.NewResponse(&agentv1.InputResponse{}), nil
}

// fakeVMs is one running VM, testVM, whose agent is a fakeAgent.
type fakeVMs struct {
	link *agentlink.Link
	env  []string
}

var _ VMs = (*fakeVMs)(nil)

func (v *fakeVMs) Link(name string) (*agentlink.Link, error) {
	if name != testVM {
		return nil, connect.NewError(connect.CodeNotFound, errors.New("no such vm"))
	}
	return v.link, nil
}

func (v *fakeVMs) SessionOf(name string) string { return "ses_test" }

func (v *fakeVMs) EnvOf(name string) []string {
	if name != testVM {
		return nil
	}
	return v.env
}

// harness is a relay to a fake agent, recording to a real audit log and
// keeping the policy inputs it decides.
type harness struct {
	r     *Relay
	agent *fakeAgent
	vms   *fakeVMs
	dir   string // the audit log's

	mu      sync.Mutex
	decided []policy.Input
}

var keyCaller = policy.Caller{Type: policy.CallerKey, KeyID: "0123456789abcdef", Name: "alice", Images: []string{"dev"}, VM: testVM}

func newHarness(t *testing.T) *harness {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "audit")
	log, err := audit.Open(dir, audit.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { log.Close() })

	h := &harness{agent: &fakeAgent{auditDir: dir}, dir: dir}
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	_, handler := agentv1connect.NewAgentServiceHandler(h.agent)
	srv := protocol.NewHTTPServer(handler)
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	link := agentlink.New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}, nil)
	t.Cleanup(func() { link.Close() })
	h.vms = &fakeVMs{link: link}
	h.r = New(Config{
		VMs: h.vms,
		Decide: func(_ context.Context, in policy.Input) error {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.decided = append(h.decided, in)
			return nil
		},
		Caller:   func(context.Context) policy.Caller { return keyCaller },
		Recorder: recorder.New(log, nil),
	})
	return h
}

// auditRecords returns the log's records of kind.
func auditRecords(dir, kind string) []audit.Record {
	var out []audit.Record
	_ = audit.Scan(dir, func(_ uint64, _ int64, p []byte) error {
		if r, err := audit.Decode(p); err == nil && r.Kind == kind {
			out = append(out, r)
		}
		return nil
	})
	return out
}

func inputReq(id string, msg *agentv1.InputRequest) *connect.Request[agentv1.InputRequest] {
	msg.ExecId = id
	req := connect.NewRequest(msg)
	req.Header().Set(protocol.VMHeader, testVM)
	return req
}

// inputIntents returns the log's exec.input intents and the outcome of
// each (a zero Record where there is none).
func (h *harness) inputIntents(t *testing.T) ([]audit.Record, []audit.Record) {
	t.Helper()
	var intents []audit.Record
	for _, r := range auditRecords(h.dir, audit.KindIntent) {
		var in audit.InputIntent
		if err := json.Unmarshal(r.Data, &in); err != nil {
			t.Fatal(err)
		}
		if in.Action == audit.ActionInput {
			intents = append(intents, r)
		}
	}
	outcomes := make([]audit.Record, len(intents))
	for _, o := range auditRecords(h.dir, audit.KindOutcome) {
		for i, in := range intents {
			if o.Intent != nil && *o.Intent == in.Seq {
				outcomes[i] = o
			}
		}
	}
	return intents, outcomes
}

func TestInputIsRecordedFirst(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	stdin := []byte("hello\x00\xffworld\n")
	if _, err := h.r.Agent().Input(ctx, inputReq("e1", &agentv1.InputRequest{Input: &agentv1.InputRequest_Stdin{Stdin: stdin}})); err != nil {
		t.Fatal(err)
	}
	if _, err := h.r.Agent().Input(ctx, inputReq("e1", &agentv1.InputRequest{Input: &agentv1.InputRequest_CloseStdin{CloseStdin: &agentv1.CloseStdin{}}})); err != nil {
		t.Fatal(err)
	}
	if _, err := h.r.Agent().Input(ctx, inputReq("e1", &agentv1.InputRequest{Input: &agentv1.InputRequest_Resize{Resize: &agentv1.Resize{Rows: 30, Cols: 100}}})); err != nil {
		t.Fatal(err)
	}

	h.agent.mu.Lock()
	inputs, recorded := h.agent.inputs, h.agent.recorded
	h.agent.mu.Unlock()
	if len(inputs) != 3 || !bytes.Equal(inputs[0].GetStdin(), stdin) || inputs[1].GetCloseStdin() == nil ||
		inputs[2].GetResize().GetRows() != 30 || inputs[2].GetResize().GetCols() != 100 || inputs[0].ExecId != "e1" {
		t.Fatalf("the guest got %v", inputs)
	}
	if !slices.Equal(recorded, []bool{true, true, true}) {
		t.Errorf("intent recorded before the guest got the input: %v", recorded)
	}

	intents, outcomes := h.inputIntents(t)
	if len(intents) != 3 {
		t.Fatalf("%d input intents", len(intents))
	}
	for i, want := range []audit.InputIntent{
		{Action: audit.ActionInput, Caller: keyCaller, ExecID: "e1", Input: "stdin", Bytes: len(stdin)},
		{Action: audit.ActionInput, Caller: keyCaller, ExecID: "e1", Input: "close_stdin"},
		{Action: audit.ActionInput, Caller: keyCaller, ExecID: "e1", Input: "resize"},
	} {
		r := intents[i]
		var got audit.InputIntent
		if err := json.Unmarshal(r.Data, &got); err != nil {
			t.Fatal(err)
		}
		if got.Action != want.Action || got.ExecID != want.ExecID || got.Input != want.Input || got.Bytes != want.Bytes ||
			got.Caller.Type != policy.CallerKey || got.Caller.KeyID != keyCaller.KeyID || got.Caller.Name != "alice" {
			t.Errorf("intent %d: %+v, want %+v", i, got, want)
		}
		if r.VM != testVM || r.Session != "ses_test" || r.Provenance != audit.Host {
			t.Errorf("intent %d: vm %q session %q provenance %v", i, r.VM, r.Session, r.Provenance)
		}
		if outcomes[i].Kind != audit.KindOutcome || outcomes[i].Seq <= r.Seq {
			t.Errorf("intent %d (seq %d): outcome %+v", i, r.Seq, outcomes[i])
		}
		var out audit.InputOutcome
		if err := json.Unmarshal(outcomes[i].Data, &out); err != nil || out.Error != "" {
			t.Errorf("outcome %d: %s, %v", i, outcomes[i].Data, err)
		}
	}
	// stdin's bytes are the first intent's blob; the others have none.
	if len(intents[0].Blobs) != 1 {
		t.Fatalf("stdin intent blobs %q", intents[0].Blobs)
	}
	p, err := audit.BlobPath(h.dir, intents[0].Blobs[0])
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(p); err != nil || !bytes.Equal(b, stdin) {
		t.Errorf("blob %q, %v; want %q", b, err, stdin)
	}
	if len(intents[1].Blobs) != 0 || len(intents[2].Blobs) != 0 {
		t.Errorf("blobs on close_stdin %q, resize %q", intents[1].Blobs, intents[2].Blobs)
	}
}

// TestInputGuestError: an input the guest refuses is recorded with its
// error, and the client gets the guest's code.
func TestInputGuestError(t *testing.T) {
	h := newHarness(t)
	h.agent.inputErr = connect.NewError(connect.CodeFailedPrecondition, errors.New("input: command e1 has exited"))
	_, err := h.r.Agent().Input(context.Background(), inputReq("e1", &agentv1.InputRequest{Input: &agentv1.InputRequest_Stdin{Stdin: []byte("x")}}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "has exited") {
		t.Fatalf("err %v", err)
	}
	intents, outcomes := h.inputIntents(t)
	if len(intents) != 1 || outcomes[0].Kind != audit.KindOutcome {
		t.Fatalf("intents %d, outcome %+v", len(intents), outcomes)
	}
	var out audit.InputOutcome
	if err := json.Unmarshal(outcomes[0].Data, &out); err != nil || !strings.Contains(out.Error, "has exited") {
		t.Errorf("outcome %s, %v", outcomes[0].Data, err)
	}
}

// TestInputRefused: a malformed input, or one for no VM, reaches neither
// the log nor the guest.
func TestInputRefused(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	stdin := &agentv1.InputRequest_Stdin{Stdin: []byte("x")}
	noVM := connect.NewRequest(&agentv1.InputRequest{ExecId: "e1", Input: stdin})
	otherVM := inputReq("e1", &agentv1.InputRequest{Input: stdin})
	otherVM.Header().Set(protocol.VMHeader, "other")
	tests := []struct {
		name string
		req  *connect.Request[agentv1.InputRequest]
		code connect.Code
	}{
		{"no exec id", inputReq("", &agentv1.InputRequest{Input: stdin}), connect.CodeInvalidArgument},
		{"a long exec id", inputReq(strings.Repeat("x", protocol.MaxExecID+1), &agentv1.InputRequest{Input: stdin}), connect.CodeInvalidArgument},
		{"no input", inputReq("e1", &agentv1.InputRequest{}), connect.CodeInvalidArgument},
		{"no vm", noVM, connect.CodeInvalidArgument},
		{"another vm", otherVM, connect.CodeNotFound},
	}
	for _, tt := range tests {
		if _, err := h.r.Agent().Input(ctx, tt.req); connect.CodeOf(err) != tt.code {
			t.Errorf("%s: %v, want %v", tt.name, err, tt.code)
		}
	}
	if intents, _ := h.inputIntents(t); len(intents) != 0 {
		t.Errorf("%d intents recorded for refused input", len(intents))
	}
	h.agent.mu.Lock()
	defer h.agent.mu.Unlock()
	if len(h.agent.inputs) != 0 {
		t.Errorf("the guest got %v", h.agent.inputs)
	}
}

// TestVMEnvUnderCommandEnv: Exec and Process starts get the VM's env under
// the command's own, whose entries win; the policy decides, the log
// records and the guest gets the merged env, and neither the VM's env nor
// the client's request is changed.
func TestVMEnvUnderCommandEnv(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	vmEnv := make([]string, 2, 8) // room to spare: an append must not write into it
	copy(vmEnv, []string{"A=vm", "B=vm"})
	h.vms.env = vmEnv
	wantGuest := []string{"A=vm", "B=vm", "B=cmd", "C=cmd"}
	wantMap := map[string]string{"A": "vm", "B": "cmd", "C": "cmd"}

	exec := &agentv1.ExecRequest{Argv: []string{"env"}, Env: []string{"B=cmd", "C=cmd"}}
	if err := h.r.Exec(ctx, testVM, exec, time.Minute, func(*agentv1.ExecResponse) error { return nil }); err != nil {
		t.Fatal(err)
	}
	start := &agentv1.ExecRequest{Argv: []string{"env"}, Env: []string{"B=cmd", "C=cmd"}, Detach: true}
	hdr := http.Header{}
	hdr.Set(protocol.VMHeader, testVM)
	first := &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: start}}
	recv := func() (*agentv1.ProcessInput, error) { return nil, io.EOF }
	if err := h.r.process(ctx, hdr, first, recv, func(*agentv1.ExecResponse) error { return nil }); err != nil {
		t.Fatal(err)
	}

	h.agent.mu.Lock()
	starts := h.agent.starts
	h.agent.mu.Unlock()
	if len(starts) != 2 {
		t.Fatalf("the guest started %d commands", len(starts))
	}
	for i, s := range starts {
		if !slices.Equal(s.Env, wantGuest) {
			t.Errorf("start %d: the guest got env %q, want %q", i, s.Env, wantGuest)
		}
	}
	if !starts[1].Detach || !slices.Equal(starts[1].Argv, []string{"env"}) {
		t.Errorf("process start lost its fields: %v", starts[1])
	}
	if len(h.decided) != 2 {
		t.Fatalf("%d decisions", len(h.decided))
	}
	for i, in := range h.decided {
		ex, ok := in.(*policy.ExecInput)
		if !ok || !maps.Equal(ex.Env, wantMap) {
			t.Errorf("decision %d: policy saw %+v, want env %v", i, in, wantMap)
		}
	}
	var execIntents int
	for _, r := range auditRecords(h.dir, audit.KindIntent) {
		var in audit.ExecIntent
		if json.Unmarshal(r.Data, &in) != nil || in.Action != audit.ActionExec {
			continue
		}
		execIntents++
		if !maps.Equal(in.Env, wantMap) {
			t.Errorf("exec intent %d records env %v, want %v", r.Seq, in.Env, wantMap)
		}
	}
	if execIntents != 2 {
		t.Errorf("%d exec intents", execIntents)
	}
	if !slices.Equal(exec.Env, []string{"B=cmd", "C=cmd"}) || !slices.Equal(start.Env, []string{"B=cmd", "C=cmd"}) {
		t.Errorf("the client's requests were changed: %q, %q", exec.Env, start.Env)
	}
	if !slices.Equal(vmEnv, []string{"A=vm", "B=vm"}) || vmEnv[:3][2] != "" {
		t.Errorf("the VM's env was written to: %q (spare %q)", vmEnv, vmEnv[:3][2])
	}
}

// TestNoVMEnv: a VM without env leaves a command's env as it is.
func TestNoVMEnv(t *testing.T) {
	h := newHarness(t)
	exec := &agentv1.ExecRequest{Argv: []string{"env"}, Env: []string{"C=cmd"}}
	if err := h.r.Exec(context.Background(), testVM, exec, time.Minute, func(*agentv1.ExecResponse) error { return nil }); err != nil {
		t.Fatal(err)
	}
	h.agent.mu.Lock()
	starts := h.agent.starts
	h.agent.mu.Unlock()
	if len(starts) != 1 || !slices.Equal(starts[0].Env, []string{"C=cmd"}) {
		t.Errorf("the guest got %v", starts)
	}
	if ex := h.decided[0].(*policy.ExecInput); !maps.Equal(ex.Env, map[string]string{"C": "cmd"}) {
		t.Errorf("policy saw env %v", ex.Env)
	}
}
