// Package debugserver serves Go's runtime profiles (net/http/pprof) for
// carreld --debug-socket: goroutine counts and stacks, heap and CPU
// profiles, for load tests and leak hunts. It is off unless an operator
// asks for it, and it serves only what the listener it is given reaches:
// carreld gives it a unix socket, never a network port.
package debugserver

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/pprof"
	"time"
)

// Handler serves the profiles under /debug/pprof/, on a mux of its own, so
// that nothing registered on http.DefaultServeMux is exposed with them.
func Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index) // goroutine, heap, allocs, ...
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}

// Serve serves Handler on l until ctx ends, then closes l. It returns nil
// when ctx ended it.
func Serve(ctx context.Context, l net.Listener) error {
	srv := &http.Server{Handler: Handler(), ReadHeaderTimeout: 10 * time.Second}
	stop := context.AfterFunc(ctx, func() { srv.Close() })
	defer stop()
	err := srv.Serve(l)
	if errors.Is(err, http.ErrServerClosed) && ctx.Err() != nil {
		return nil
	}
	return err
}
