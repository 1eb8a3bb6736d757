package api

import (
	"context"
	"errors"
	"fmt"
	"io"
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
type agentRelay struct {
	agentv1connect.UnimplementedAgentServiceHandler
	cfg Config
}

var _ agentv1connect.AgentServiceHandler = (*agentRelay)(nil)

func (r *agentRelay) agent(h http.Header) (agentv1connect.AgentServiceClient, func(context.Context, error) error, error) {
	link, err := linkFor(r.cfg, h)
	if err != nil {
		return nil, nil, err
	}
	c, done := link.Agent()
	return c, done, nil
}

func (r *agentRelay) Health(ctx context.Context, req *connect.Request[agentv1.HealthRequest]) (*connect.Response[agentv1.HealthResponse], error) {
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
func (r *agentRelay) SetSandbox(context.Context, *connect.Request[agentv1.SetSandboxRequest]) (*connect.Response[agentv1.SetSandboxResponse], error) {
	return nil, connect.NewError(connect.CodePermissionDenied, errors.New("the guest sandbox is not relayed: it follows the vm's policy (carrel policy apply)"))
}

// Activity is carreld's alone: it records the guest's workspace activity
// in the audit log (carrel audit), where clients read it.
func (r *agentRelay) Activity(context.Context, *connect.Request[agentv1.ActivityRequest], *connect.ServerStream[agentv1.ActivityResponse]) error {
	return connect.NewError(connect.CodePermissionDenied, errors.New("workspace activity is not relayed: carreld records it in the audit log"))
}

func (r *agentRelay) Shutdown(context.Context, *connect.Request[agentv1.ShutdownRequest]) (*connect.Response[agentv1.ShutdownResponse], error) {
	return nil, connect.NewError(connect.CodePermissionDenied, errors.New("shutdown is not relayed: stop the vm with VMService.StopVM (carrel vm stop)"))
}

func (r *agentRelay) Exec(ctx context.Context, req *connect.Request[agentv1.ExecRequest], out *connect.ServerStream[agentv1.ExecResponse]) (err error) {
	c, done, err := r.agent(req.Header())
	if err != nil {
		return err
	}
	if err := r.cfg.allowExec(ctx, req.Header().Get(protocol.VMHeader), req.Msg); err != nil {
		return err
	}
	var chk eventCheck
	rec, err := r.cfg.beginExec(ctx, req.Header().Get(protocol.VMHeader), req.Msg, false)
	if err != nil {
		return err
	}
	defer func() { rec.finish(ctx, &chk, err) }()
	s, err := c.Exec(ctx, connect.NewRequest(req.Msg))
	if err != nil {
		return relayErr(ctx, done, err)
	}
	defer s.Close()
	for s.Receive() {
		if err := chk.check(s.Msg()); err != nil {
			return err
		}
		if err := rec.event(ctx, s.Msg()); err != nil {
			return err
		}
		if err := out.Send(s.Msg()); err != nil {
			return err
		}
	}
	return chk.end(relayErr(ctx, done, s.Err()))
}

// Process relays an interactive session both ways: the client's stdin,
// signals and resizes to the guest, the guest's checked events back.
func (r *agentRelay) Process(ctx context.Context, in *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) (err error) {
	c, done, err := r.agent(in.RequestHeader())
	if err != nil {
		return err
	}
	// The first message starts a command (decided here, before the guest
	// sees it) or attaches to one the policy allowed when it started.
	first, err := in.Receive()
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("process: no first message: %w", err))
	}
	var chk eventCheck
	var rec *execRecord // nil for an attach, which started nothing
	if start := first.GetStart(); start != nil {
		vm := in.RequestHeader().Get(protocol.VMHeader)
		if err := r.cfg.allowExec(ctx, vm, start); err != nil {
			return err
		}
		rec, err = r.cfg.beginExec(ctx, vm, start, start.Detach)
		if err != nil {
			return err
		}
	}
	defer func() { rec.finish(ctx, &chk, err) }()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g := c.Process(ctx)
	defer g.CloseResponse()
	// Cancelling ctx alone does not wake a Receive while the request body
	// is open (net/http's HTTP/2 client): close the response when the
	// client goes, so the guest side ends at once.
	stop := context.AfterFunc(ctx, func() { g.CloseResponse() })
	defer stop()
	// A failed send shows up as the guest's reply (or its absence).
	_ = g.Send(first)
	go func() {
		// Client to guest. The guest checks these too; the host has
		// already capped their size.
		for {
			msg, err := in.Receive()
			if err != nil {
				g.CloseRequest()
				return
			}
			// What the guest is sent is recorded first.
			if rec.output(ctx, streamStdin, msg.GetStdin()) != nil {
				cancel()
				return
			}
			if g.Send(msg) != nil {
				return
			}
		}
	}()
	for {
		ev, err := g.Receive()
		if err != nil {
			return chk.end(relayErr(ctx, done, ignoreEOF(err)))
		}
		if err := chk.check(ev); err != nil {
			return err
		}
		if err := rec.event(ctx, ev); err != nil {
			return err
		}
		if err := in.Send(ev); err != nil {
			return err
		}
		if chk.exited {
			return nil
		}
	}
}

func (r *agentRelay) ListProcesses(ctx context.Context, req *connect.Request[agentv1.ListProcessesRequest]) (*connect.Response[agentv1.ListProcessesResponse], error) {
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

func (r *agentRelay) Signal(ctx context.Context, req *connect.Request[agentv1.SignalRequest]) (*connect.Response[agentv1.SignalResponse], error) {
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

// eventCheck enforces the shape of an exec event stream from the guest:
// known events only, the start at most once and first, an exit status in
// range, and nothing after it.
type eventCheck struct {
	events  int
	started bool
	id      string // the guest's exec id (its file.activity records name it)
	exited  bool
	// What the audit record of the command's end says.
	exit           *agentv1.ExitStatus
	stdout, stderr int64
}

func (c *eventCheck) check(ev *agentv1.ExecResponse) error {
	c.events++
	if c.exited {
		return errGuest("an event after the exit status")
	}
	if _, _, err := relayEvent(ev); err != nil {
		return err
	}
	switch e := ev.Event.(type) {
	case *agentv1.ExecResponse_Started:
		// The id goes to the client as it is (carrel exec -d prints it):
		// only the agent's own alphabet passes.
		if c.started || c.events != 1 || e.Started.Pid <= 0 || !protocol.ValidExecID(e.Started.Id) {
			return errGuest("an invalid start event")
		}
		c.started, c.id = true, e.Started.Id
	case *agentv1.ExecResponse_Exit:
		c.exited, c.exit = true, e.Exit
	case *agentv1.ExecResponse_Stdout:
		c.stdout += int64(len(e.Stdout))
	case *agentv1.ExecResponse_Stderr:
		c.stderr += int64(len(e.Stderr))
	}
	return nil
}

// end turns a stream's end into the call's error: a stream may end without
// an exit status only with an error.
func (c *eventCheck) end(err error) error {
	if err == nil && !c.exited {
		return connect.NewError(connect.CodeDataLoss, errors.New("guest agent ended the stream without an exit status"))
	}
	return err
}

func ignoreEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}
