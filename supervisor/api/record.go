package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// Recorder is the part of the audit log the API writes to: records,
// write-ahead intents for actions and their outcomes, and blobs.
type Recorder interface {
	Append(ctx context.Context, rec audit.Record) (uint64, error)
	Begin(ctx context.Context, rec audit.Record) (*audit.Pending, error)
	PutBlob(r io.Reader) (string, error)
}

var _ Recorder = (*audit.Log)(nil)

// session names the current run of vm, for its records.
func (cfg Config) session(vm string) string {
	if cfg.Manager == nil || vm == "" {
		return ""
	}
	return cfg.Manager.SessionOf(vm)
}

// recordedCaller is callerOf as audit records name it.
func recordedCaller(ctx context.Context) audit.Caller {
	return callerOf(ctx)
}

// maxRecordedArgs keeps an intent record under the log's data cap: a
// larger command is recorded by its policy decision's input digest only.
const maxRecordedArgs = 48 << 10

// Output is kept in memory until one of these is reached, then written
// as a blob with an "exec.output" record that references it.
const (
	outputFlushBytes  = 256 << 10
	outputFlushChunks = 2048
)

// The streams of a command, as exec.output names them.
const (
	streamStdin = iota
	streamStdout
	streamStderr
)

var streamNames = [...]string{"stdin", "stdout", "stderr"}

// execRecord records one command: its intent before it starts, the bytes
// of its streams as it runs, and its outcome. A nil *execRecord records
// nothing (no audit log configured).
type execRecord struct {
	cfg         Config
	vm, session string
	p           *audit.Pending
	start       time.Time

	mu      sync.Mutex
	streams [3]outputBuf
	failed  error // the first failure to record output
	ended   bool  // finish ran: nothing more is taken
}

// outputBuf is one stream's bytes not yet written.
type outputBuf struct {
	buf    []byte
	chunks [][2]int64 // ns since start, length
	offset int64      // bytes of the stream already recorded
}

// beginExec makes the command's intent ("action.intent", action "exec")
// durable before it is forwarded. An intent that cannot be recorded stops
// the command.
func (cfg Config) beginExec(ctx context.Context, vm string, req *agentv1.ExecRequest, detach bool) (*execRecord, error) {
	if cfg.Audit == nil {
		return nil, nil
	}
	in := audit.ExecIntent{Action: audit.ActionExec, Caller: recordedCaller(ctx), Argv: req.Argv, Env: envMap(req.Env), Cwd: req.Cwd, User: req.User, TTY: req.Tty, Detach: detach}
	if in.Cwd == "" {
		in.Cwd = policy.DefaultCwd
	}
	if in.User == "" {
		in.User = policy.DefaultUser
	}
	data, err := json.Marshal(in)
	if err == nil && len(data) > maxRecordedArgs {
		data, err = json.Marshal(audit.ExecIntentTruncated{Action: audit.ActionExec, Args: len(req.Argv), Argv0: req.Argv[0], Caller: in.Caller, Truncated: true})
	}
	if err != nil {
		return nil, err
	}
	session := cfg.session(vm)
	p, err := cfg.Audit.Begin(ctx, audit.Record{Kind: audit.KindIntent, VM: vm, Session: session, Provenance: audit.Host, Data: data})
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("exec not started: its audit record could not be written: %w", err))
	}
	return &execRecord{cfg: cfg, vm: vm, session: session, p: p, start: time.Now()}, nil
}

// output takes bytes of one stream. It writes them to the log when
// enough have gathered; an error means they could not be recorded, and
// the call must end.
func (e *execRecord) output(ctx context.Context, stream int, p []byte) error {
	if e == nil || len(p) == 0 {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.failed != nil {
		return e.failed
	}
	if e.ended {
		return errors.New("the command's record is closed")
	}
	s := &e.streams[stream]
	s.buf = append(s.buf, p...)
	s.chunks = append(s.chunks, [2]int64{time.Since(e.start).Nanoseconds(), int64(len(p))})
	if len(s.buf) < outputFlushBytes && len(s.chunks) < outputFlushChunks {
		return nil
	}
	return e.flushLocked(ctx, stream)
}

// flushLocked writes one stream's pending bytes as a blob and an
// "exec.output" record. e.mu must be held.
func (e *execRecord) flushLocked(ctx context.Context, stream int) error {
	s := &e.streams[stream]
	if len(s.buf) == 0 {
		return nil
	}
	err := func() error {
		digest, err := e.cfg.Audit.PutBlob(bytes.NewReader(s.buf))
		if err != nil {
			return err
		}
		data, err := json.Marshal(audit.ExecOutput{Exec: e.p.Seq(), Stream: streamNames[stream], Offset: s.offset, Size: int64(len(s.buf)), Chunks: s.chunks})
		if err != nil {
			return err
		}
		// The guest produced stdout and stderr; carreld saw what it sent
		// to stdin.
		prov := audit.Guest
		if stream == streamStdin {
			prov = audit.Host
		}
		_, err = e.cfg.Audit.Append(context.WithoutCancel(ctx), audit.Record{Kind: audit.KindExecOutput, VM: e.vm, Session: e.session,
			Provenance: prov, Blobs: []string{digest}, Data: data})
		return err
	}()
	if err != nil {
		e.failed = connect.NewError(connect.CodeUnavailable, fmt.Errorf("the command's %s could not be recorded: %w", streamNames[stream], err))
		return e.failed
	}
	s.offset += int64(len(s.buf))
	s.buf, s.chunks = s.buf[:0], s.chunks[:0]
	return nil
}

// finish records what output is left and the outcome ("exec.exit", tied
// to the intent). The outcome is recorded even when the caller's context
// has ended.
func (e *execRecord) finish(ctx context.Context, chk *eventCheck, callErr error) {
	if e == nil {
		return
	}
	ctx = context.WithoutCancel(ctx)
	e.mu.Lock()
	e.ended = true
	var stdin int64
	for i := range e.streams {
		if err := e.flushLocked(ctx, i); err != nil {
			e.cfg.Logger.Error("exec output not recorded", "vm", e.vm, "err", err)
		}
	}
	stdin = e.streams[streamStdin].offset
	e.mu.Unlock()
	out := audit.ExecExit{ExecID: chk.id, StdinBytes: stdin, StdoutBytes: chk.stdout, StderrBytes: chk.stderr}
	switch {
	case chk.exit != nil:
		out.Code, out.Signal = &chk.exit.Code, chk.exit.Signal
	case callErr != nil:
		out.Error = protocol.CleanText(callErr.Error(), 1024)
	default:
		out.Error = "the call ended before the command did (detached)"
	}
	b, _ := json.Marshal(out)
	if _, err := e.p.End(ctx, audit.Record{Kind: audit.KindExecExit, VM: e.vm, Session: e.session, Provenance: audit.Host, Data: b}); err != nil && !errors.Is(err, audit.ErrEnded) {
		e.cfg.Logger.Error("exec outcome not recorded; recovery will mark it unknown", "vm", e.vm, "err", err)
	}
}

// event records the output an exec event carries.
func (e *execRecord) event(ctx context.Context, ev *agentv1.ExecResponse) error {
	switch x := ev.Event.(type) {
	case *agentv1.ExecResponse_Stdout:
		return e.output(ctx, streamStdout, x.Stdout)
	case *agentv1.ExecResponse_Stderr:
		return e.output(ctx, streamStderr, x.Stderr)
	}
	return nil
}

// apiCall is one call, for its "api.call" record once it ends.
type apiCall struct {
	audit.APICall
	// vm is the VM the call named, if any.
	vm    string
	start time.Time
}

func (cfg Config) newCall(procedure string) *apiCall {
	return &apiCall{APICall: audit.APICall{Procedure: procedure}, start: time.Now()}
}

// recordCall records a call once it has ended, before its reply (or its
// stream's end) reaches the caller. Its admission is already on record
// (the api decision); a failure here is logged.
func (cfg Config) recordCall(ctx context.Context, c *apiCall, err error) {
	if cfg.Audit == nil {
		return
	}
	c.DurationNs = time.Since(c.start).Nanoseconds()
	c.Code = "ok"
	if err != nil {
		c.Code = connect.CodeOf(err).String()
		c.Error = protocol.CleanText(err.Error(), 1024)
	}
	data, merr := json.Marshal(c.APICall)
	if merr != nil {
		return
	}
	if _, err := cfg.Audit.Append(context.WithoutCancel(ctx), audit.Record{Kind: audit.KindAPICall, VM: c.vm, Session: cfg.session(c.vm), Provenance: audit.Host, Data: data}); err != nil {
		cfg.Logger.Error("api call not recorded", "procedure", c.Procedure, "err", err)
	}
}
