package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// Recorder is the part of the audit log the API writes to: write-ahead
// intents for actions, and their outcomes.
type Recorder interface {
	Begin(ctx context.Context, rec audit.Record) (*audit.Pending, error)
}

var _ Recorder = (*audit.Log)(nil)

// execIntent is what an exec's intent record holds: the command as the
// guest will run it, and who asked.
type execIntent struct {
	Action string            `json:"action"` // "exec"
	Caller policy.Caller     `json:"caller"`
	Argv   []string          `json:"argv"`
	Env    map[string]string `json:"env,omitempty"`
	Cwd    string            `json:"cwd"`
	User   string            `json:"user"`
	TTY    bool              `json:"tty,omitempty"`
	Detach bool              `json:"detach,omitempty"`
}

// execOutcome is what its outcome record holds.
type execOutcome struct {
	Code        *int32 `json:"code,omitempty"`
	Signal      string `json:"signal,omitempty"`
	StdoutBytes int64  `json:"stdout_bytes"`
	StderrBytes int64  `json:"stderr_bytes"`
	// Error says why the call ended without an exit status (a detached
	// command, a broken link, a timeout).
	Error string `json:"error,omitempty"`
}

// maxRecordedArgs keeps an intent record under the log's data cap: a
// larger command is recorded by its policy decision's input digest only.
const maxRecordedArgs = 48 << 10

// beginExec makes the command's intent ("action.intent", action "exec")
// durable before it is forwarded, and returns the function that records
// its outcome ("exec.exit", tied to the intent). Without a recorder both
// are no-ops. An intent that cannot be recorded stops the command.
func (cfg Config) beginExec(ctx context.Context, vm string, req *agentv1.ExecRequest, detach bool) (func(*eventCheck, error), error) {
	if cfg.Audit == nil {
		return func(*eventCheck, error) {}, nil
	}
	in := execIntent{Action: "exec", Caller: callerOf(ctx), Argv: req.Argv, Env: envMap(req.Env), Cwd: req.Cwd, User: req.User, TTY: req.Tty, Detach: detach}
	if in.Cwd == "" {
		in.Cwd = policy.DefaultCwd
	}
	if in.User == "" {
		in.User = policy.DefaultUser
	}
	data, err := json.Marshal(in)
	if err == nil && len(data) > maxRecordedArgs {
		data, err = json.Marshal(map[string]any{"action": "exec", "caller": in.Caller, "truncated": true, "argv0": req.Argv[0], "args": len(req.Argv)})
	}
	if err != nil {
		return nil, err
	}
	p, err := cfg.Audit.Begin(ctx, audit.Record{Kind: audit.KindIntent, VM: vm, Provenance: audit.Host, Data: data})
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("exec not started: its audit record could not be written: %w", err))
	}
	return func(chk *eventCheck, callErr error) {
		out := execOutcome{StdoutBytes: chk.stdout, StderrBytes: chk.stderr}
		if chk.exit != nil {
			out.Code, out.Signal = &chk.exit.Code, chk.exit.Signal
		} else if callErr != nil {
			out.Error = sanitize(callErr.Error(), 1024)
		} else {
			out.Error = "the call ended before the command did (detached)"
		}
		b, _ := json.Marshal(out)
		// The outcome is recorded even when the caller's context has ended.
		ctx := context.WithoutCancel(ctx)
		if _, err := p.End(ctx, audit.Record{Kind: audit.KindExecExit, VM: vm, Provenance: audit.Host, Data: b}); err != nil && !errors.Is(err, audit.ErrEnded) {
			cfg.Logger.Error("exec outcome not recorded; recovery will mark it unknown", "vm", vm, "err", err)
		}
	}, nil
}
