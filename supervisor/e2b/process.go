package e2b

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	processpb "github.com/carrel-os/carrel/supervisor/gen/envdpb/process"
	"github.com/carrel-os/carrel/supervisor/gen/envdpb/process/processpbconnect"
)

// procService is envd's process.Process over carrel's AgentService.
// Every command starts detached: e2b's commands outlive the call that
// started them ("the command is not killed" when the client goes), and
// Connect follows one again. e2b names commands by pid (or a tag);
// carrel by id, which the table keeps for each pid it started.
type procService struct{ s *server }

var _ processpbconnect.ProcessHandler = procService{}

// defaultUser is who a command runs as when the request names no user
// (the SDKs send one only when the caller asks, for envd 0.4.0 and
// later): carrel's own default.
const defaultUser = ""

// userOf reads the user a request asks for: "Authorization: Basic
// base64(user:)". carrel's policy decides whether it may.
func userOf(h http.Header) (string, error) {
	auth := h.Get("Authorization")
	if auth == "" {
		return defaultUser, nil
	}
	enc, ok := strings.CutPrefix(auth, "Basic ")
	if !ok {
		return "", connect.NewError(connect.CodeInvalidArgument, errors.New("the Authorization header must be Basic base64(user:)"))
	}
	b, err := base64.StdEncoding.DecodeString(enc)
	if err != nil || len(b) > 256 {
		return "", connect.NewError(connect.CodeInvalidArgument, errors.New("the Authorization header is not valid base64 of user:"))
	}
	user, _, _ := strings.Cut(string(b), ":")
	return user, nil
}

// keepaliveEvery reads the interval between keepalive events the client
// asks for (seconds); 0 means none.
func keepaliveEvery(h http.Header) time.Duration {
	n, err := strconv.Atoi(h.Get(headerKeepalive))
	if err != nil || n <= 0 {
		return 0
	}
	return time.Duration(min(max(n, 1), 3600)) * time.Second
}

func (p procService) Start(ctx context.Context, req *connect.Request[processpb.StartRequest], out *connect.ServerStream[processpb.StartResponse]) error {
	m := req.Msg
	cfg := m.GetProcess()
	if cfg == nil || cfg.Cmd == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("start: process.cmd is required"))
	}
	user, err := userOf(req.Header())
	if err != nil {
		return err
	}
	if len(m.GetTag()) > maxTag {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("start: a tag of %d bytes, at most %d", len(m.GetTag()), maxTag))
	}
	start := &agentv1.ExecRequest{
		Argv: append([]string{cfg.Cmd}, cfg.Args...), Cwd: resolve(cfg.GetCwd()), User: user, Detach: true,
	}
	for k, v := range cfg.Envs {
		start.Env = append(start.Env, k+"="+v)
	}
	if pty := m.GetPty(); pty != nil {
		start.Tty, start.Rows, start.Cols = true, pty.GetSize().GetRows(), pty.GetSize().GetCols()
	}
	first := &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: start}}
	// stdin: false gives the command a stdin at its end at once.
	closeStdin := m.Stdin != nil && !*m.Stdin
	info := procInfo{config: cfg, tag: m.GetTag(), tty: start.Tty}
	f, sub, err := p.s.follow(ctx, first, closeStdin, info)
	if err != nil {
		return err
	}
	return f.relay(ctx, sub, keepaliveEvery(req.Header()), func(ev *processpb.ProcessEvent) error {
		return out.Send(&processpb.StartResponse{Event: ev})
	})
}

func (p procService) Connect(ctx context.Context, req *connect.Request[processpb.ConnectRequest], out *connect.ServerStream[processpb.ConnectResponse]) error {
	vm := callOf(ctx).vm
	e, err := p.s.lookup(ctx, vm, req.Msg.GetProcess())
	if err != nil {
		return err
	}
	// A command the façade follows already gets another client; one it
	// does not (started elsewhere, or before carreld restarted) is
	// attached to, its buffered output replayed first.
	f, sub := e.follower, (*subscriber)(nil)
	if f != nil {
		// This client joins another's stream: carreld decides that it may
		// follow the VM's commands, as for an attach of its own. It joins
		// first, so that what the command prints during that round trip
		// to the guest is not lost, and leaves if refused.
		if sub = f.subscribe(); sub != nil {
			if _, err := p.s.c.Agent.ListProcesses(ctx, forVM(ctx, &agentv1.ListProcessesRequest{})); err != nil {
				f.unsubscribe(sub)
				return err
			}
		}
	}
	if sub == nil {
		first := &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Attach{Attach: &agentv1.AttachRequest{Id: e.id}}}
		if f, sub, err = p.s.follow(ctx, first, false, e); err != nil {
			return err
		}
	}
	return f.relay(ctx, sub, keepaliveEvery(req.Header()), func(ev *processpb.ProcessEvent) error {
		return out.Send(&processpb.ConnectResponse{Event: ev})
	})
}

// endEvent is envd's form of an exit status: as Go's os.ProcessState
// gives it, -1 and "signal: NAME" for a command a signal ended.
func endEvent(x *agentv1.ExitStatus) *processpb.ProcessEvent_EndEvent {
	if x.Signal == "" {
		return &processpb.ProcessEvent_EndEvent{ExitCode: x.Code, Exited: true, Status: fmt.Sprintf("exit status %d", x.Code)}
	}
	name := x.Signal
	if n := unix.SignalNum(x.Signal); n != 0 {
		name = unix.Signal(n).String()
	}
	return &processpb.ProcessEvent_EndEvent{ExitCode: -1, Exited: false, Status: "signal: " + name}
}

func (p procService) List(ctx context.Context, req *connect.Request[processpb.ListRequest]) (*connect.Response[processpb.ListResponse], error) {
	ps, err := p.s.c.ListProcesses(ctx, callOf(ctx).vm)
	if err != nil {
		return nil, err
	}
	vm := callOf(ctx).vm
	// A command is the process of its group that carrel started: the one
	// whose parent is not of the same command.
	idOf := map[int32]string{}
	for _, pr := range ps {
		idOf[pr.Pid] = pr.ExecId
	}
	resp := &processpb.ListResponse{}
	for _, pr := range ps {
		if pr.ExecId == "" || idOf[pr.Ppid] == pr.ExecId {
			continue
		}
		info := processpb.ProcessInfo{Pid: uint32(pr.Pid)}
		if e, ok := p.s.procs.get(vm, uint32(pr.Pid)); ok && e.id == pr.ExecId {
			info.Config = e.config
			if e.tag != "" {
				info.Tag = &e.tag
			}
		} else {
			fields := strings.Fields(pr.Command)
			info.Config = &processpb.ProcessConfig{}
			if len(fields) > 0 {
				info.Config.Cmd, info.Config.Args = fields[0], fields[1:]
			}
		}
		resp.Processes = append(resp.Processes, &info)
	}
	return connect.NewResponse(resp), nil
}

func (p procService) SendInput(ctx context.Context, req *connect.Request[processpb.SendInputRequest]) (*connect.Response[processpb.SendInputResponse], error) {
	in := &agentv1.InputRequest{}
	switch d := req.Msg.GetInput().GetInput().(type) {
	case *processpb.ProcessInput_Stdin:
		in.Input = &agentv1.InputRequest_Stdin{Stdin: d.Stdin}
	case *processpb.ProcessInput_Pty:
		in.Input = &agentv1.InputRequest_Stdin{Stdin: d.Pty}
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("send input: input.stdin or input.pty is required"))
	}
	if err := p.s.input(ctx, req.Msg.GetProcess(), in); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.SendInputResponse{}), nil
}

func (p procService) CloseStdin(ctx context.Context, req *connect.Request[processpb.CloseStdinRequest]) (*connect.Response[processpb.CloseStdinResponse], error) {
	in := &agentv1.InputRequest{Input: &agentv1.InputRequest_CloseStdin{CloseStdin: &agentv1.CloseStdin{}}}
	if err := p.s.input(ctx, req.Msg.GetProcess(), in); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.CloseStdinResponse{}), nil
}

func (p procService) Update(ctx context.Context, req *connect.Request[processpb.UpdateRequest]) (*connect.Response[processpb.UpdateResponse], error) {
	size := req.Msg.GetPty().GetSize()
	if size == nil {
		return connect.NewResponse(&processpb.UpdateResponse{}), nil // nothing to change
	}
	in := &agentv1.InputRequest{Input: &agentv1.InputRequest_Resize{Resize: &agentv1.Resize{Rows: size.Rows, Cols: size.Cols}}}
	if err := p.s.input(ctx, req.Msg.GetProcess(), in); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.UpdateResponse{}), nil
}

func (s *server) input(ctx context.Context, sel *processpb.ProcessSelector, in *agentv1.InputRequest) error {
	e, err := s.lookup(ctx, callOf(ctx).vm, sel)
	if err != nil {
		return err
	}
	in.ExecId = e.id
	_, err = s.c.Agent.Input(ctx, forVM(ctx, in))
	return err
}

func (p procService) SendSignal(ctx context.Context, req *connect.Request[processpb.SendSignalRequest]) (*connect.Response[processpb.SendSignalResponse], error) {
	var sig int32
	switch req.Msg.Signal {
	case processpb.Signal_SIGNAL_SIGKILL:
		sig = int32(unix.SIGKILL)
	case processpb.Signal_SIGNAL_SIGTERM:
		sig = int32(unix.SIGTERM)
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("send signal: SIGTERM or SIGKILL"))
	}
	e, err := p.s.lookup(ctx, callOf(ctx).vm, req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	_, err = p.s.c.Agent.Signal(ctx, forVM(ctx, &agentv1.SignalRequest{Target: &agentv1.SignalRequest_ExecId{ExecId: e.id}, Signal: sig}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.SendSignalResponse{}), nil
}

// StreamInput is not called by the SDKs, which send input unary.
func (procService) StreamInput(context.Context, *connect.ClientStream[processpb.StreamInputRequest]) (*connect.Response[processpb.StreamInputResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("stream input: use SendInput"))
}

// lookup finds the command a selector names: by pid from the table, or
// from the guest's process list when the table does not have it (a
// command started by another carrel client, or before carreld
// restarted); by tag from the table alone.
func (s *server) lookup(ctx context.Context, vm string, sel *processpb.ProcessSelector) (procInfo, error) {
	switch t := sel.GetSelector().(type) {
	case *processpb.ProcessSelector_Pid:
		if e, ok := s.procs.get(vm, t.Pid); ok {
			return e, nil
		}
		ps, err := s.c.ListProcesses(ctx, vm)
		if err != nil {
			return procInfo{}, err
		}
		for _, p := range ps {
			if uint32(p.Pid) == t.Pid && p.ExecId != "" {
				return procInfo{id: p.ExecId}, nil
			}
		}
		return procInfo{}, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", t.Pid))
	case *processpb.ProcessSelector_Tag:
		if e, ok := s.procs.byTag(vm, t.Tag); ok {
			return e, nil
		}
		return procInfo{}, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with tag %q not found", clip(t.Tag)))
	}
	return procInfo{}, connect.NewError(connect.CodeInvalidArgument, errors.New("process: a pid or a tag is required"))
}

// procTable remembers the commands started through the façade, per
// sandbox, by pid: their carrel id, tag and config. It is bounded; what
// it forgets is found again by pid from the guest.
type procTable struct {
	mu   sync.Mutex
	byVM map[string]map[uint32]procInfo
}

type procInfo struct {
	id       string
	tag      string
	tty      bool
	config   *processpb.ProcessConfig
	follower *follower // while the façade follows it
}

const (
	maxProcsPerVM = 1024
	maxTag        = 256
)

func newProcTable() *procTable { return &procTable{byVM: map[string]map[uint32]procInfo{}} }

func (t *procTable) put(vm string, pid uint32, e procInfo) {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.byVM[vm]
	if m == nil {
		m = map[uint32]procInfo{}
		t.byVM[vm] = m
	}
	if len(m) >= maxProcsPerVM {
		for k, old := range m { // forget one; the guest still knows it by pid
			if old.follower != nil {
				old.follower.cancel()
			}
			delete(m, k)
			break
		}
	}
	m[pid] = e
}

func (t *procTable) get(vm string, pid uint32) (procInfo, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.byVM[vm][pid]
	return e, ok
}

func (t *procTable) byTag(vm, tag string) (procInfo, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range t.byVM[vm] {
		if e.tag == tag {
			return e, true
		}
	}
	return procInfo{}, false
}

// ended forgets a command the follower f followed to its end (or its
// stream's), unless the pid names another command since.
func (t *procTable) ended(vm string, pid uint32, f *follower) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.byVM[vm][pid]; ok && e.follower == f {
		delete(t.byVM[vm], pid)
		if len(t.byVM[vm]) == 0 {
			delete(t.byVM, vm)
		}
	}
}

// forget drops a sandbox's commands (it stopped or was removed), and
// stops following them.
func (t *procTable) forget(vm string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range t.byVM[vm] {
		if e.follower != nil {
			e.follower.cancel()
		}
	}
	delete(t.byVM, vm)
}
