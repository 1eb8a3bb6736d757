package relay

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// Caps on process listings from a guest.
const (
	maxProcesses   = 4096
	maxCommandText = 4096
)

// agentRelay serves carrel.agent.v1.AgentService on carreld's socket for
// the VM named in the Carrel-Vm header, checking everything the guest
// sends back. Shutdown is not relayed: VMService.StopVM is the way.
type agentRelay struct{ *Relay }

var _ agentv1connect.AgentServiceHandler = agentRelay{}

func (r agentRelay) agent(h http.Header) (agentv1connect.AgentServiceClient, func(context.Context, error) error, error) {
	link, err := r.link(h)
	if err != nil {
		return nil, nil, err
	}
	c, done := link.Agent()
	return c, done, nil
}

func (r agentRelay) Health(ctx context.Context, req *connect.Request[agentv1.HealthRequest]) (*connect.Response[agentv1.HealthResponse], error) {
	c, done, err := r.agent(req.Header())
	if err != nil {
		return nil, err
	}
	resp, err := c.Health(ctx, connect.NewRequest(req.Msg))
	if err != nil {
		return nil, relayErr(ctx, done, err)
	}
	m := resp.Msg
	return connect.NewResponse(&agentv1.HealthResponse{
		Version: protocol.CleanText(m.Version, 128), Kernel: protocol.CleanText(m.Kernel, 128), UptimeMs: max(m.UptimeMs, 0), Transport: protocol.CleanText(m.Transport, 32),
	}), nil
}

// SetSandbox is carreld's alone: the sandbox follows from the VM's policy
// (carrel policy apply), never from a client.
func (r agentRelay) SetSandbox(context.Context, *connect.Request[agentv1.SetSandboxRequest]) (*connect.Response[agentv1.SetSandboxResponse], error) {
	return nil, connect.NewError(connect.CodePermissionDenied, errors.New("the guest sandbox is not relayed: it follows the vm's policy (carrel policy apply)"))
}

// Activity is carreld's alone: it records the guest's workspace activity
// in the audit log (carrel audit), where clients read it.
func (r agentRelay) Activity(context.Context, *connect.Request[agentv1.ActivityRequest], *connect.ServerStream[agentv1.ActivityResponse]) error {
	return connect.NewError(connect.CodePermissionDenied, errors.New("workspace activity is not relayed: carreld records it in the audit log"))
}

// Restored is carreld's alone: it calls it after a restore or a fork.
func (r agentRelay) Restored(context.Context, *connect.Request[agentv1.RestoredRequest]) (*connect.Response[agentv1.RestoredResponse], error) {
	return nil, connect.NewError(connect.CodePermissionDenied, errors.New("restored is not relayed: carreld tells the guest itself after a restore or fork"))
}

// GuestRequests and AnswerGuestRequest are carreld's alone: it decides
// and records what the guest asks for.
func (r agentRelay) GuestRequests(context.Context, *connect.Request[agentv1.GuestRequestsRequest], *connect.ServerStream[agentv1.GuestRequest]) error {
	return connect.NewError(connect.CodePermissionDenied, errors.New("guest requests are not relayed: carreld decides and records them"))
}

func (r agentRelay) AnswerGuestRequest(context.Context, *connect.Request[agentv1.GuestAnswer]) (*connect.Response[agentv1.GuestAnswerResponse], error) {
	return nil, connect.NewError(connect.CodePermissionDenied, errors.New("guest requests are not relayed: carreld decides and records them"))
}

func (r agentRelay) Shutdown(context.Context, *connect.Request[agentv1.ShutdownRequest]) (*connect.Response[agentv1.ShutdownResponse], error) {
	return nil, connect.NewError(connect.CodePermissionDenied, errors.New("shutdown is not relayed: stop the vm with VMService.StopVM (carrel vm stop)"))
}

// Commands is the link's own way to carry many commands (carreld to the
// guest); a client runs each with Exec or Process.
func (r agentRelay) Commands(context.Context, *connect.BidiStream[agentv1.CommandsInput, agentv1.CommandsOutput]) error {
	return connect.NewError(connect.CodeUnimplemented, errors.New("commands are not relayed: use Exec or Process, which carreld carries to the guest on one stream"))
}

// Exec runs a command and relays its events (see Relay.exec).
func (r agentRelay) Exec(ctx context.Context, req *connect.Request[agentv1.ExecRequest], out *connect.ServerStream[agentv1.ExecResponse]) error {
	return r.exec(ctx, req.Header(), req.Msg, 0, out.Send)
}

// Process relays an interactive session both ways: the client's stdin,
// signals and resizes to the guest, the guest's checked events back (see
// Relay.process and Relay.run). The first message starts a command,
// decided here before the guest sees it, or attaches to one the policy
// allowed when it started.
func (r agentRelay) Process(ctx context.Context, in *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error {
	if _, err := vmOf(in.RequestHeader()); err != nil {
		return err
	}
	first, err := in.Receive()
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("process: no first message: %w", err))
	}
	return r.process(ctx, in.RequestHeader(), first, in.Receive, in.Send)
}

func (r agentRelay) ListProcesses(ctx context.Context, req *connect.Request[agentv1.ListProcessesRequest]) (*connect.Response[agentv1.ListProcessesResponse], error) {
	c, done, err := r.agent(req.Header())
	if err != nil {
		return nil, err
	}
	resp, err := c.ListProcesses(ctx, connect.NewRequest(req.Msg))
	if err != nil {
		return nil, relayErr(ctx, done, err)
	}
	ps := resp.Msg.Processes
	if len(ps) > maxProcesses {
		return nil, errGuest("%d processes listed, more than %d", len(ps), maxProcesses)
	}
	out := make([]*agentv1.ProcessInfo, 0, len(ps))
	for _, p := range ps {
		if p.Pid <= 0 || p.Ppid < 0 || len(p.ExecId) > protocol.MaxExecID || len(p.State) > 1 {
			return nil, errGuest("invalid process entry (pid %d)", p.Pid)
		}
		out = append(out, &agentv1.ProcessInfo{Pid: p.Pid, Ppid: p.Ppid, Uid: p.Uid, State: protocol.CleanText(p.State, 1),
			Command: protocol.CleanText(p.Command, maxCommandText), ExecId: protocol.CleanText(p.ExecId, protocol.MaxExecID), RssBytes: p.RssBytes})
	}
	return connect.NewResponse(&agentv1.ListProcessesResponse{Processes: out}), nil
}

func (r agentRelay) Signal(ctx context.Context, req *connect.Request[agentv1.SignalRequest]) (*connect.Response[agentv1.SignalResponse], error) {
	c, done, err := r.agent(req.Header())
	if err != nil {
		return nil, err
	}
	resp, err := c.Signal(ctx, connect.NewRequest(req.Msg))
	if err != nil {
		return nil, relayErr(ctx, done, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

// Input feeds a running command by its id. The stdin it carries is
// recorded, as on the Process stream, before the guest gets it.
func (r agentRelay) Input(ctx context.Context, req *connect.Request[agentv1.InputRequest]) (*connect.Response[agentv1.InputResponse], error) {
	id := req.Msg.GetExecId()
	if id == "" || len(id) > protocol.MaxExecID {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("input: an exec id of 1 to %d bytes is required", protocol.MaxExecID))
	}
	if req.Msg.GetInput() == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("input: stdin, close_stdin or resize is required"))
	}
	c, done, err := r.agent(req.Header())
	if err != nil {
		return nil, err
	}
	vm, _ := vmOf(req.Header())
	kind := "stdin"
	switch req.Msg.GetInput().(type) {
	case *agentv1.InputRequest_CloseStdin:
		kind = "close_stdin"
	case *agentv1.InputRequest_Resize:
		kind = "resize"
	}
	act, err := r.call(ctx, vm).BeginInput(ctx, id, kind, req.Msg.GetStdin())
	if err != nil {
		return nil, err
	}
	resp, err := c.Input(ctx, connect.NewRequest(req.Msg))
	if err != nil {
		err = relayErr(ctx, done, err)
	}
	act.EndInput(ctx, err)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp.Msg), nil
}
