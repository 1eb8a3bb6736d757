//go:build linux

// Package server serves carrel.agent.v1.AgentService, FileService and
// PortService (and EgressService, when given one) on any net.Listener:
// vsock or virtio-serial in the guest, a unix socket in tests. SetSandbox
// puts the host's sandbox into force for the commands and file operations
// that follow (package sandbox).
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/exec"
	"github.com/carrel-os/carrel/guest-agent/files"
	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/ports"
	"github.com/carrel-os/carrel/guest-agent/proctable"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/reaper"
	"github.com/carrel-os/carrel/guest-agent/requests"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
)

// Version is the agent's build version, set with
// -ldflags "-X github.com/carrel-os/carrel/guest-agent/server.Version=...".
var Version = "dev"

// started is when the agent started, for Health's uptime.
var started = time.Now()

// shutdownGrace bounds how long in-flight calls may run after a Shutdown
// call before the connection is cut and PowerOff runs.
const shutdownGrace = 2 * time.Second

// Config configures Serve.
type Config struct {
	// Transport is reported by Health: "vsock", "virtio-serial" or "unix".
	Transport string
	// DataPort is reported by Health: Files has the data port for bulk
	// file content.
	DataPort bool
	// Sandbox is what SetSandbox sets; nil means a new Guard, given to the
	// default Runner and Files. A Runner or Files passed in must be given
	// the same Guard to be confined by it.
	Sandbox *sandbox.Guard
	// Runner runs Exec and Process calls; nil means one using
	// reaper.Default() and Sandbox. Detached commands are kept per Serve
	// call: they keep running after Serve returns but can no longer be
	// attached.
	Runner *exec.Runner
	// Files serves FileService; nil means
	// files.New(files.Options{Sandbox: Sandbox}).
	Files agentv1connect.FileServiceHandler
	// Ports serves PortService; nil means ports.New with Log.
	Ports agentv1connect.PortServiceHandler
	// PowerOff is called once a Shutdown call has been answered and the
	// server has stopped; nil makes Shutdown fail with CodeUnimplemented.
	PowerOff func(reboot bool)
	// Activity serves the Activity call: it sends batches to send until
	// ctx ends or sending fails (activity.Monitor.Serve). nil makes the
	// call fail with CodeUnimplemented.
	Activity func(ctx context.Context, send func(*agentv1.ActivityResponse) error) error
	// Egress serves EgressService (package egress, whose proxies feed
	// it); nil leaves it unserved (CodeUnimplemented).
	Egress agentv1connect.EgressServiceHandler
	// Requests holds what programs in the guest ask the host for
	// (GuestRequests); nil leaves both calls CodeUnimplemented.
	Requests *requests.Broker
	// Log receives server logs; nil means slog.Default().
	Log *slog.Logger
}

// Serve serves the agent API on l until ctx ends (then it returns nil) or a
// Shutdown call has been answered (then it calls cfg.PowerOff and, if that
// returns, returns nil). It returns an error if accepting fails. l is
// closed when Serve returns.
func Serve(ctx context.Context, l net.Listener, cfg Config) error {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Sandbox == nil {
		cfg.Sandbox = &sandbox.Guard{Log: cfg.Log}
	}
	if cfg.Runner == nil {
		cfg.Runner = &exec.Runner{Reaper: reaper.Default(), Sandbox: cfg.Sandbox}
	}
	if cfg.Files == nil {
		cfg.Files = files.New(files.Options{Sandbox: cfg.Sandbox})
	}
	if cfg.Ports == nil {
		cfg.Ports = ports.New(ports.Options{Log: cfg.Log})
	}
	svc := &service{cfg: cfg, sessions: proctable.New(cfg.Runner), shutdown: make(chan bool, 1)}
	h := NewHandler(svc, cfg.Files, cfg.Ports)
	if cfg.Egress != nil {
		mux := http.NewServeMux()
		mux.Handle("/", h)
		mux.Handle(agentv1connect.NewEgressServiceHandler(cfg.Egress, protocol.HandlerOptions()...))
		h = mux
	}
	srv := protocol.NewHTTPServer(h)
	srv.ErrorLog = slog.NewLogLogger(cfg.Log.Handler(), slog.LevelWarn)
	srv.BaseContext = func(net.Listener) context.Context { return ctx }

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve %s: %w", l.Addr(), err)
	case <-ctx.Done():
		srv.Close()
		<-errc
		return nil
	case reboot := <-svc.shutdown:
		// Shutdown waits until every call, the Shutdown call included,
		// has finished writing its response.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownGrace)
		defer cancel()
		if err := srv.Shutdown(sctx); err != nil {
			cfg.Log.Warn("graceful shutdown cut short", "err", err)
			srv.Close()
		}
		<-errc
		cfg.Log.Info("powering off", "reboot", reboot)
		cfg.PowerOff(reboot)
		return nil
	}
}

// NewHandler returns the HTTP handler for the agent, file and port services, and
// a 404 (which connect clients see as CodeUnimplemented) for every other
// path.
func NewHandler(agent agentv1connect.AgentServiceHandler, fs agentv1connect.FileServiceHandler, ps agentv1connect.PortServiceHandler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewAgentServiceHandler(agent, protocol.HandlerOptions()...))
	mux.Handle(agentv1connect.NewFileServiceHandler(fs, protocol.HandlerOptions()...))
	mux.Handle(agentv1connect.NewPortServiceHandler(ps, protocol.HandlerOptions()...))
	return mux
}

type service struct {
	cfg      Config
	sessions *proctable.Table
	shutdown chan bool // the reboot flag of the first Shutdown call
}

var _ agentv1connect.AgentServiceHandler = (*service)(nil)

func (s *service) Health(context.Context, *connect.Request[agentv1.HealthRequest]) (*connect.Response[agentv1.HealthResponse], error) {
	return connect.NewResponse(&agentv1.HealthResponse{
		Version:   Version,
		Kernel:    kernelRelease(),
		UptimeMs:  time.Since(started).Milliseconds(),
		Transport: s.cfg.Transport,
		DataPort:  s.cfg.DataPort,
	}), nil
}

func (s *service) Exec(ctx context.Context, req *connect.Request[agentv1.ExecRequest], stream *connect.ServerStream[agentv1.ExecResponse]) error {
	start := time.Now()
	var exit *agentv1.ExitStatus
	var id string
	err := s.cfg.Runner.Run(ctx, req.Msg, func(m *agentv1.ExecResponse) error {
		if e := m.GetExit(); e != nil {
			exit = e
		}
		if st := m.GetStarted(); st != nil {
			id = st.Id
		}
		return stream.Send(m)
	})
	level := callLevel(err)
	if !s.cfg.Log.Enabled(ctx, level) {
		return err
	}
	log := s.cfg.Log.With("rpc", "Exec", "argv0", firstArg(req.Msg.GetArgv()), "user", truncate(req.Msg.GetUser()),
		"tty", req.Msg.GetTty(), "exec_id", id, "duration", time.Since(start))
	switch {
	case err != nil:
		log.Log(ctx, level, "exec failed", "err", err)
	case exit != nil:
		log.Debug("exec done", "code", exit.Code, "signal", exit.Signal)
	}
	return err
}

func (s *service) Shutdown(_ context.Context, req *connect.Request[agentv1.ShutdownRequest]) (*connect.Response[agentv1.ShutdownResponse], error) {
	if s.cfg.PowerOff == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("shutdown is not supported here"))
	}
	select {
	case s.shutdown <- req.Msg.GetReboot():
	default: // already shutting down
	}
	return connect.NewResponse(&agentv1.ShutdownResponse{}), nil
}

func firstArg(argv []string) string {
	if len(argv) == 0 {
		return ""
	}
	if len(argv[0]) > 128 {
		return argv[0][:128]
	}
	return argv[0]
}

func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return ""
	}
	return strings.TrimRight(string(u.Release[:]), "\x00")
}
