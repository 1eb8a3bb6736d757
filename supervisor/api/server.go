// Package api serves carreld's public API: connect handlers for the
// services in supervisor/proto/carrel/api/v1, reachable by gRPC clients and
// by plain HTTP+JSON (curl) on a unix socket.
//
// Every call is authenticated and decided by the api policy in an
// interceptor (authz.go) before a handler runs, and gets an api.call record
// when it ends. The agent's services are served by supervisor/relay, which
// decides each operation again with its VM's policy and records it before
// anything is forwarded. The error interceptor gives every error a handler
// returns its connect code (toConnect).
package api

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/image/debian"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1/apiv1connect"
	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/policystore"
	"github.com/carrel-os/carrel/supervisor/recorder"
	"github.com/carrel-os/carrel/supervisor/relay"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// Caps on what a client may send.
const (
	maxRequestBytes = 1 << 20
	maxHeaderBytes  = 64 << 10
	// streamWindowBytes is how much of an upload a client may send ahead
	// of what carreld has read, and connWindowBytes the same for all of a
	// connection's streams (HTTP/2 flow control). A few whole messages, so
	// that a client is never waiting for a window update when carreld
	// wants the next message for the guest (Go's default is one 1 MiB).
	streamWindowBytes = 4 << 20
	connWindowBytes   = 2 * streamWindowBytes
	// defaultDeadline applies to unary calls that bring none.
	defaultDeadline = 5 * time.Minute
	// defaultStreamDeadline applies to streaming calls that bring none
	// (file transfers); Exec has its own timeout.
	defaultStreamDeadline = time.Hour
	// maxSessionDeadline bounds an interactive session without a deadline.
	maxSessionDeadline = 24 * time.Hour
)

// ImageBuilder builds an image (the development image when spec is nil,
// else the Debian spec), stores it under tag and returns its digest;
// cached says a build with the same inputs had already made it.
type ImageBuilder func(ctx context.Context, spec *debian.Spec, tag string, noCache bool) (digest string, cached bool, err error)

// Config wires the API to the rest of carreld.
type Config struct {
	Manager *vm.Manager
	Images  ImageLister
	Build   ImageBuilder
	Info    func() Info
	Logger  *slog.Logger
	// Policies decides every call; nil turns authorization off (unit tests
	// of the handlers alone; carreld always sets it).
	Policies *policystore.Store
	// Tokens verifies bearer tokens; nil means peer credentials only.
	Tokens *identity.Tokens
	// DaemonUID is carreld's own uid: the default policy lets that user
	// (and root) operate.
	DaemonUID uint32
	// Recorder, when set, writes the audit records of every call, and of
	// every action relayed to a guest: a durable intent before it starts
	// and its outcome after.
	Recorder *recorder.Recorder
	// GPUs lists the host's GPUs (GPUService); nil answers Unimplemented.
	GPUs *gpu.Host
	// AuditDir is the audit log's directory, which ListAuditRecords reads;
	// "" answers Unimplemented.
	AuditDir string
	// Fence, when set, is asked before any call that acts on a VM, except
	// to read, stop or delete it: an error refuses the call (Unavailable).
	// A fleet host whose engine has not heard from it fences its fleet VMs
	// this way (supervisor/fence).
	Fence func(procedure, vm string) error
}

// Info describes the supervisor for SystemService.GetInfo.
type Info struct {
	Version     string
	Accelerator string
	StateDir    string
	Vsock       bool
}

// Handler returns the HTTP handler for every service.
func Handler(cfg Config) http.Handler {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	// The error interceptor is innermost: the call's record (authz) has
	// the code the client gets.
	opts := []connect.HandlerOption{
		connect.WithReadMaxBytes(maxRequestBytes),
		connect.WithInterceptors(deadlineInterceptor{}, authzInterceptor{cfg: cfg}, errorInterceptor{}),
	}
	relays := cfg.relay()
	mux := http.NewServeMux()
	mux.Handle(apiv1connect.NewVMServiceHandler(&vmService{cfg: cfg, relay: relays}, opts...))
	mux.Handle(apiv1connect.NewImageServiceHandler(&imageService{cfg: cfg}, opts...))
	mux.Handle(apiv1connect.NewSystemServiceHandler(&systemService{cfg: cfg}, opts...))
	mux.Handle(apiv1connect.NewPolicyServiceHandler(&policyService{cfg: cfg}, opts...))
	mux.Handle(apiv1connect.NewTokenServiceHandler(&tokenService{cfg: cfg}, opts...))
	mux.Handle(apiv1connect.NewGPUServiceHandler(&gpuService{cfg: cfg}, opts...))
	// The file relay's codec reads uploads into buffers it reuses.
	mux.Handle(agentv1connect.NewFileServiceHandler(relays.Files(), append(slices.Clip(opts), connect.WithCodec(relay.Codec{}))...))
	mux.Handle(agentv1connect.NewAgentServiceHandler(relays.Agent(), opts...))
	mux.Handle(agentv1connect.NewPortServiceHandler(relays.Ports(), opts...))
	return mux
}

// relay is the relays to the guests, deciding with cfg's policies.
func (cfg Config) relay() *relay.Relay {
	var vms relay.VMs
	if cfg.Manager != nil {
		vms = cfg.Manager
	}
	return relay.New(relay.Config{VMs: vms, Decide: cfg.decide, Caller: callerOf, Recorder: cfg.Recorder, Logger: cfg.Logger})
}

// Serve serves h on l until ctx ends, then shuts down gracefully. Requests
// are not tied to ctx: a create in flight runs to its end (or is cut off
// when its connection closes) and cleans up after itself either way.
func Serve(ctx context.Context, l net.Listener, h http.Handler) error {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Handler:   h,
		Protocols: p,
		HTTP2: &http.HTTP2Config{
			MaxReceiveBufferPerStream:     streamWindowBytes,
			MaxReceiveBufferPerConnection: connWindowBytes,
		},
		MaxHeaderBytes:    maxHeaderBytes,
		ReadHeaderTimeout: 10 * time.Second,
		ConnContext:       identity.ConnContext,
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := srv.Shutdown(sctx)
	if errors.Is(err, context.DeadlineExceeded) {
		err = srv.Close()
	}
	if e := <-errc; !errors.Is(e, http.ErrServerClosed) && err == nil {
		err = e
	}
	return err
}

// deadlineInterceptor gives calls without a deadline a default one.
type deadlineInterceptor struct{}

func (deadlineInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if _, ok := ctx.Deadline(); !ok {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, defaultDeadline)
			defer cancel()
		}
		return next(ctx, req)
	}
}

func (deadlineInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (deadlineInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if _, ok := ctx.Deadline(); !ok {
			d := defaultStreamDeadline
			switch conn.Spec().Procedure {
			case agentv1connect.AgentServiceProcessProcedure, agentv1connect.PortServiceConnectProcedure:
				d = maxSessionDeadline // an interactive shell, a forwarded connection
			}
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, d)
			defer cancel()
		}
		return next(ctx, conn)
	}
}

// errorInterceptor gives every error a handler returns its connect code
// (toConnect).
type errorInterceptor struct{}

func (errorInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		return resp, toConnect(err)
	}
}

func (errorInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (errorInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return toConnect(next(ctx, conn))
	}
}

// toConnect maps errors to RPC codes: carreld's own connect errors pass
// as they are, a guest agent's are rebuilt (relay.GuestError), and the errors
// of the VM manager, the GPUs and the audit log get theirs.
func toConnect(err error) error {
	if err == nil {
		return nil
	}
	if ce, ok := err.(*connect.Error); ok && !connect.IsWireError(ce) {
		return err
	}
	code := connect.CodeInternal
	switch {
	case errors.Is(err, recorder.ErrNotRecorded):
		code = connect.CodeUnavailable
	case errors.Is(err, vm.ErrInvalid), errors.Is(err, gpu.ErrInvalid):
		code = connect.CodeInvalidArgument
	case errors.Is(err, gpu.ErrUnavailable):
		code = connect.CodeFailedPrecondition
	case errors.Is(err, vm.ErrExists):
		code = connect.CodeAlreadyExists
	case errors.Is(err, vm.ErrNotFound), errors.Is(err, vm.ErrImageMissing):
		code = connect.CodeNotFound
	case errors.Is(err, vm.ErrRunning), errors.Is(err, vm.ErrNotRunning), errors.Is(err, vm.ErrPaused),
		errors.Is(err, vm.ErrSnapshotDamaged), errors.Is(err, driver.ErrUnsupported):
		code = connect.CodeFailedPrecondition
	case errors.Is(err, vm.ErrBusy):
		code = connect.CodeAborted
	case errors.Is(err, vm.ErrClosing):
		code = connect.CodeUnavailable
	case errors.Is(err, context.DeadlineExceeded):
		code = connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		code = connect.CodeCanceled
	default:
		if connect.IsWireError(err) {
			return relay.GuestError(err)
		}
		var ce *connect.Error
		if errors.As(err, &ce) {
			code = ce.Code()
		}
	}
	return connect.NewError(code, err)
}
