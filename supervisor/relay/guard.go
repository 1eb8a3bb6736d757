package relay

import (
	"context"
	"net/http"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/recorder"
)

// Decisions on operations bound for a guest. Each runs after the api
// decision, with the policy of the VM the call names, and before anything
// is forwarded. Paths are cleaned first and the cleaned path is what the
// guest receives: the guest then acts on exactly the path that was decided
// (its kernel would resolve "a/../b" through a symlink at a, which lexical
// cleaning cannot see).

// allowFile decides one file operation on *path and replaces *path with
// its cleaned form.
func (r *Relay) allowFile(ctx context.Context, h http.Header, op string, path *string, recursive bool) error {
	in := &policy.FSInput{Caller: r.caller(ctx), VM: h.Get(protocol.VMHeader), Operation: op, Path: *path, Recursive: recursive}
	if err := r.decide(ctx, in); err != nil {
		return err
	}
	if in.Path != "" {
		*path = in.Path // normalised by Decide
	}
	return nil
}

// allowExec decides a command. Its cwd is cleaned in place; user and cwd
// are decided with the guest's defaults filled in, and sent as they were
// (empty still means the default).
func (r *Relay) allowExec(ctx context.Context, vm string, req *agentv1.ExecRequest) error {
	in := &policy.ExecInput{
		Caller: r.caller(ctx), VM: vm, Argv: req.Argv, Env: recorder.EnvMap(req.Env),
		Cwd: req.Cwd, User: req.User, TTY: req.Tty,
	}
	if err := r.decide(ctx, in); err != nil {
		return err
	}
	if req.Cwd != "" {
		req.Cwd = in.Cwd
	}
	return nil
}

// allowForward decides a port-forward connection into the VM.
func (r *Relay) allowForward(ctx context.Context, vm, host string, port uint32) error {
	if host == "" {
		host = "127.0.0.1"
	}
	return r.decide(ctx, &policy.NetInput{
		Caller: r.caller(ctx), VM: vm, Direction: policy.DirForward,
		Host: host, Port: int(min(port, 1<<20)), Protocol: "tcp",
	})
}
