// Package api serves carreld's public API: connect handlers for the
// services in supervisor/proto/carrel/api/v1, reachable by gRPC clients and
// by plain HTTP+JSON (curl) on a unix socket.
package api

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/supervisor/gen/apiv1/apiv1connect"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// Caps on what a client may send.
const (
	maxRequestBytes = 1 << 20
	maxHeaderBytes  = 64 << 10
	// defaultDeadline applies to unary calls that bring none.
	defaultDeadline = 5 * time.Minute
)

// ImageBuilder builds the development image and returns its digest.
type ImageBuilder func(ctx context.Context, tag string) (digest string, err error)

// Config wires the API to the rest of carreld.
type Config struct {
	Manager *vm.Manager
	Images  ImageLister
	Build   ImageBuilder
	Info    func() Info
	Logger  *slog.Logger
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
	opts := []connect.HandlerOption{
		connect.WithReadMaxBytes(maxRequestBytes),
		connect.WithInterceptors(deadlineInterceptor{}),
	}
	mux := http.NewServeMux()
	mux.Handle(apiv1connect.NewVMServiceHandler(&vmService{cfg: cfg}, opts...))
	mux.Handle(apiv1connect.NewImageServiceHandler(&imageService{cfg: cfg}, opts...))
	mux.Handle(apiv1connect.NewSystemServiceHandler(&systemService{cfg: cfg}, opts...))
	return mux
}

// Serve serves h on l until ctx ends, then shuts down gracefully.
func Serve(ctx context.Context, l net.Listener, h http.Handler) error {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Handler:           h,
		Protocols:         p,
		MaxHeaderBytes:    maxHeaderBytes,
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return ctx },
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

// deadlineInterceptor gives unary calls without a deadline a default one.
// Streaming calls carry their own (Exec's timeout field).
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
	return next
}

// toConnect maps manager errors to RPC codes.
func toConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	code := connect.CodeInternal
	switch {
	case errors.Is(err, vm.ErrInvalid):
		code = connect.CodeInvalidArgument
	case errors.Is(err, vm.ErrExists):
		code = connect.CodeAlreadyExists
	case errors.Is(err, vm.ErrNotFound), errors.Is(err, vm.ErrImageMissing):
		code = connect.CodeNotFound
	case errors.Is(err, vm.ErrRunning), errors.Is(err, vm.ErrNotRunning):
		code = connect.CodeFailedPrecondition
	case errors.Is(err, vm.ErrBusy):
		code = connect.CodeAborted
	case errors.Is(err, context.DeadlineExceeded):
		code = connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		code = connect.CodeCanceled
	}
	return connect.NewError(code, err)
}
