package api

import (
	"context"
	"net/http"
	"strings"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
)

// Decisions on operations bound for a guest. Each runs after the api
// decision, with the policy of the VM the call names, and before anything
// is forwarded. Paths are cleaned first and the cleaned path is what the
// guest receives: the guest then acts on exactly the path that was decided
// (its kernel would resolve "a/../b" through a symlink at a, which lexical
// cleaning cannot see).

// allowFile decides one file operation on *path and replaces *path with
// its cleaned form.
func (cfg Config) allowFile(ctx context.Context, h http.Header, op string, path *string, recursive bool) error {
	in := &policy.FSInput{Caller: callerOf(ctx), VM: h.Get(protocol.VMHeader), Operation: op, Path: *path, Recursive: recursive}
	if err := cfg.decide(ctx, in); err != nil {
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
func (cfg Config) allowExec(ctx context.Context, vm string, req *agentv1.ExecRequest) error {
	in := &policy.ExecInput{
		Caller: callerOf(ctx), VM: vm, Argv: req.Argv, Env: envMap(req.Env),
		Cwd: req.Cwd, User: req.User, TTY: req.Tty,
	}
	if err := cfg.decide(ctx, in); err != nil {
		return err
	}
	if req.Cwd != "" {
		req.Cwd = in.Cwd
	}
	return nil
}

// allowForward decides a port-forward connection into the VM.
func (cfg Config) allowForward(ctx context.Context, vm, host string, port uint32) error {
	if host == "" {
		host = "127.0.0.1"
	}
	return cfg.decide(ctx, &policy.NetInput{
		Caller: callerOf(ctx), VM: vm, Direction: policy.DirForward,
		Host: host, Port: int(min(port, 1<<20)), Protocol: "tcp",
	})
}

// envMap turns KEY=VALUE pairs into the map the exec input holds; a pair
// without '=' is a name with an empty value, as the guest treats it.
func envMap(env []string) map[string]string {
	if len(env) == 0 {
		return nil
	}
	m := make(map[string]string, len(env))
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return m
}
