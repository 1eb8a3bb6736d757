//go:build linux

package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/procs"
	"github.com/carrel-os/carrel/guest-agent/proctable"
)

// procRoot is where ListProcesses reads processes.
const procRoot = "/proc"

func (s *service) Process(ctx context.Context, stream *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error {
	start := time.Now()
	ls := &loggedStream{BidiStream: stream}
	err := s.sessions.Process(ctx, ls)
	level := callLevel(err)
	if !s.cfg.Log.Enabled(ctx, level) {
		return err
	}
	log := s.cfg.Log.With("rpc", "Process", "duration", time.Since(start))
	if req := ls.first.GetStart(); req != nil {
		log = log.With("argv0", firstArg(req.GetArgv()), "user", truncate(req.GetUser()), "tty", req.GetTty(), "detach", req.GetDetach())
	} else if a := ls.first.GetAttach(); a != nil {
		log = log.With("attach", truncate(a.GetId()))
	}
	if ls.started != nil {
		log = log.With("exec_id", ls.started.Id, "pid", ls.started.Pid)
	}
	if ls.exit != nil {
		log = log.With("code", ls.exit.Code, "signal", ls.exit.Signal)
	}
	if err != nil {
		log.Log(ctx, level, "process call ended", "err", err)
	} else {
		log.Debug("process call done")
	}
	return err
}

// callLevel is the level a call that ended with err is logged at. One that
// went well, or failed by the caller's own doing (a program that is not
// there, a bad argument, a path or state the call may not use, a call it
// cancelled), is logged at debug level only: the host's audit log has it
// with its outcome, and under emulation each console line costs the guest
// milliseconds of CPU, byte by byte on the UART, on the path of the next
// command. Any other failure is the agent's or the guest's, and is logged.
func callLevel(err error) slog.Level {
	if err == nil {
		return slog.LevelDebug
	}
	switch connect.CodeOf(err) {
	case connect.CodeNotFound, connect.CodeInvalidArgument, connect.CodeFailedPrecondition,
		connect.CodePermissionDenied, connect.CodeAlreadyExists, connect.CodeOutOfRange, connect.CodeCanceled:
		return slog.LevelDebug
	}
	return slog.LevelInfo
}

// loggedStream remembers what Process logs: the first message, Started and
// the exit status.
type loggedStream struct {
	*connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]
	first   *agentv1.ProcessInput
	started *agentv1.Started
	exit    *agentv1.ExitStatus
}

func (l *loggedStream) Receive() (*agentv1.ProcessInput, error) {
	m, err := l.BidiStream.Receive()
	if l.first == nil {
		l.first = m
	}
	return m, err
}

func (l *loggedStream) Send(m *agentv1.ExecResponse) error {
	switch e := m.Event.(type) {
	case *agentv1.ExecResponse_Started:
		l.started = e.Started
	case *agentv1.ExecResponse_Exit:
		l.exit = e.Exit
	}
	return l.BidiStream.Send(m)
}

// ListProcesses lists userspace processes, at most procs.MaxProcesses. A
// process in the process group or session of a running command the agent
// started carries the command's id.
func (s *service) ListProcesses(context.Context, *connect.Request[agentv1.ListProcessesRequest]) (*connect.Response[agentv1.ListProcessesResponse], error) {
	ps, err := procs.List(procRoot)
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	ids := s.cfg.Runner.Running()
	resp := &agentv1.ListProcessesResponse{Processes: make([]*agentv1.ProcessInfo, 0, len(ps))}
	for _, p := range ps {
		id := ids[p.Pid]
		if id == "" {
			id = ids[p.Pgid]
		}
		if id == "" {
			id = ids[p.Sid]
		}
		resp.Processes = append(resp.Processes, &agentv1.ProcessInfo{
			Pid:      int32(p.Pid),
			Ppid:     int32(p.PPid),
			Uid:      p.UID,
			State:    p.State,
			Command:  p.Command,
			ExecId:   id,
			RssBytes: p.RSSBytes,
		})
	}
	return connect.NewResponse(resp), nil
}

// Signal signals one process by pid (never PID 1 or the agent itself), or
// the process group of a running command by its id.
func (s *service) Signal(ctx context.Context, req *connect.Request[agentv1.SignalRequest]) (*connect.Response[agentv1.SignalResponse], error) {
	sig, err := proctable.Signal(req.Msg.GetSignal())
	if err != nil {
		return nil, err
	}
	switch t := req.Msg.GetTarget().(type) {
	case *agentv1.SignalRequest_Pid:
		err = signalPid(int(t.Pid), sig)
	case *agentv1.SignalRequest_ExecId:
		err = s.sessions.SignalCommand(t.ExecId, sig)
	default:
		err = connect.NewError(connect.CodeInvalidArgument, errors.New("signal: pid or exec_id is required"))
	}
	log := s.cfg.Log.With("rpc", "Signal", "signal", unix.SignalName(sig))
	if pid := req.Msg.GetPid(); pid != 0 {
		log = log.With("pid", pid)
	} else {
		log = log.With("exec_id", truncate(req.Msg.GetExecId()))
	}
	if err != nil {
		log.Log(ctx, callLevel(err), "signal failed", "err", err)
		return nil, err
	}
	log.Debug("signalled")
	return connect.NewResponse(&agentv1.SignalResponse{}), nil
}

// Input feeds a running command by its id (proctable.Table.Input).
func (s *service) Input(ctx context.Context, req *connect.Request[agentv1.InputRequest]) (*connect.Response[agentv1.InputResponse], error) {
	in := &agentv1.ProcessInput{}
	switch m := req.Msg.GetInput().(type) {
	case *agentv1.InputRequest_Stdin:
		in.Msg = &agentv1.ProcessInput_Stdin{Stdin: m.Stdin}
	case *agentv1.InputRequest_CloseStdin:
		in.Msg = &agentv1.ProcessInput_CloseStdin{CloseStdin: &agentv1.CloseStdin{}}
	case *agentv1.InputRequest_Resize:
		in.Msg = &agentv1.ProcessInput_Resize{Resize: m.Resize}
	}
	if err := s.sessions.Input(req.Msg.GetExecId(), in); err != nil {
		s.cfg.Log.Log(ctx, callLevel(err), "input failed", "exec_id", truncate(req.Msg.GetExecId()), "err", err)
		return nil, err
	}
	return connect.NewResponse(&agentv1.InputResponse{}), nil
}

func signalPid(pid int, sig unix.Signal) error {
	switch {
	case pid <= 1:
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("signal: pid %d: must be more than 1", pid))
	case pid == os.Getpid():
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("signal: pid %d is the agent", pid))
	}
	err := unix.Kill(pid, sig)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.ESRCH):
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("signal: no process %d", pid))
	case errors.Is(err, unix.EPERM):
		return connect.NewError(connect.CodePermissionDenied, fmt.Errorf("signal: process %d: %w", pid, err))
	}
	return connect.NewError(connect.CodeInternal, fmt.Errorf("signal: process %d: %w", pid, err))
}

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
