package recorder

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// maxRecordedArgs keeps an intent record under the log's data cap: a
// larger command is recorded by its policy decision's input digest only.
const maxRecordedArgs = 48 << 10

// Output is kept in memory until one of these is reached, then written
// as a blob with an "exec.output" record that references it.
const (
	outputFlushBytes  = 256 << 10
	outputFlushChunks = 2048
)

// Stream is one of a command's streams, as exec.output names them.
type Stream int

const (
	Stdin Stream = iota
	Stdout
	Stderr
)

var streamNames = [...]string{"stdin", "stdout", "stderr"}

func (s Stream) String() string { return streamNames[s] }

// Exec records one command: its intent before it starts, the bytes of
// its streams as it runs, and its outcome. A nil *Exec records nothing.
type Exec struct {
	c     *Call
	p     *audit.Pending
	start time.Time

	mu      sync.Mutex
	streams [3]outputBuf
	failed  error // the first failure to record output
	ended   bool  // Finish ran: nothing more is taken
}

// outputBuf is one stream's bytes not yet written.
type outputBuf struct {
	buf    []byte
	chunks [][2]int64 // ns since start, length
	offset int64      // bytes of the stream already recorded
}

// BeginExec makes the command's intent ("action.intent", action "exec")
// durable before it is forwarded. An intent that cannot be recorded stops
// the command: the error matches ErrNotRecorded.
func (c *Call) BeginExec(ctx context.Context, req *agentv1.ExecRequest, detach bool) (*Exec, error) {
	if c == nil {
		return nil, nil
	}
	in := audit.ExecIntent{Action: audit.ActionExec, Caller: c.caller, Argv: req.Argv, Env: EnvMap(req.Env), Cwd: req.Cwd, User: req.User, TTY: req.Tty, Detach: detach}
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
	p, err := c.r.log.BeginAfter(ctx, takeHeld(ctx), c.record(audit.KindIntent, audit.Host, data))
	if err != nil {
		return nil, &notRecorded{"exec not started: its audit record could not be written", err}
	}
	return &Exec{c: c, p: p, start: time.Now()}, nil
}

// EnvMap turns KEY=VALUE pairs into the map an exec's policy input and
// intent hold; a pair without '=' is a name with an empty value, as the
// guest treats it.
func EnvMap(env []string) map[string]string {
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

// Output takes bytes of one stream. It writes them to the log when
// enough have gathered; an error means they could not be recorded, and
// the call must end.
func (e *Exec) Output(ctx context.Context, stream Stream, p []byte) error {
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
	return e.flushLocked(ctx, stream, false)
}

// Event records the output an exec event from the guest carries.
func (e *Exec) Event(ctx context.Context, ev *agentv1.ExecResponse) error {
	switch x := ev.Event.(type) {
	case *agentv1.ExecResponse_Stdout:
		return e.Output(ctx, Stdout, x.Stdout)
	case *agentv1.ExecResponse_Stderr:
		return e.Output(ctx, Stderr, x.Stderr)
	}
	return nil
}

// flushLocked writes one stream's pending bytes as a blob and an
// "exec.output" record, which is held back (Hold) when last is set: the
// command's last output is durable with its outcome. e.mu must be held.
func (e *Exec) flushLocked(ctx context.Context, stream Stream, last bool) error {
	s := &e.streams[stream]
	if len(s.buf) == 0 {
		return nil
	}
	err := func() error {
		digest, err := e.c.r.log.PutBlob(bytes.NewReader(s.buf))
		if err != nil {
			return err
		}
		data, err := json.Marshal(audit.ExecOutput{Exec: e.p.Seq(), Stream: stream.String(), Offset: s.offset, Size: int64(len(s.buf)), Chunks: s.chunks})
		if err != nil {
			return err
		}
		// The guest produced stdout and stderr; carreld saw what it sent
		// to stdin.
		prov := audit.Guest
		if stream == Stdin {
			prov = audit.Host
		}
		rec := e.c.record(audit.KindExecOutput, prov, data)
		rec.Blobs = []string{digest}
		if last && hold(ctx, rec) {
			return nil
		}
		return e.c.r.append(context.WithoutCancel(ctx), rec)
	}()
	if err != nil {
		e.failed = &notRecorded{fmt.Sprintf("the command's %s could not be recorded", stream), err}
		return e.failed
	}
	s.offset += int64(len(s.buf))
	s.buf, s.chunks = s.buf[:0], s.chunks[:0]
	return nil
}

// Result is what a command's stream from the guest showed, checked.
type Result struct {
	ID             string // the guest's exec id
	Exit           *agentv1.ExitStatus
	Stdout, Stderr int64 // bytes relayed
}

// Finish records what output is left and the outcome ("exec.exit", tied
// to the intent): the exit status, or callErr, or that the call ended
// before the command (a detached one). The outcome is recorded even when
// the caller's context has ended.
func (e *Exec) Finish(ctx context.Context, res Result, callErr error) {
	if e == nil {
		return
	}
	ctx = context.WithoutCancel(ctx)
	log := e.c.r.logger
	e.mu.Lock()
	e.ended = true
	for i := range e.streams {
		if err := e.flushLocked(ctx, Stream(i), true); err != nil {
			log.Error("exec output not recorded", "vm", e.c.vm, "err", err)
		}
	}
	stdin := e.streams[Stdin].offset
	e.mu.Unlock()
	out := audit.ExecExit{ExecID: res.ID, StdinBytes: stdin, StdoutBytes: res.Stdout, StderrBytes: res.Stderr}
	switch {
	case res.Exit != nil:
		out.Code, out.Signal = &res.Exit.Code, res.Exit.Signal
	case callErr != nil:
		out.Error = protocol.CleanText(callErr.Error(), 1024)
	default:
		out.Error = "the call ended before the command did (detached)"
	}
	b, _ := json.Marshal(out)
	rec := e.c.record(audit.KindExecExit, audit.Host, b)
	if hold(ctx, e.p.Outcome(rec)) {
		return // durable with the call's api.call record
	}
	_, err := e.p.End(ctx, rec)
	switch {
	case err == nil || errors.Is(err, audit.ErrEnded):
	case errors.Is(err, audit.ErrUnavailable):
		log.Warn("exec outcome kept until the audit log is writable again", "vm", e.c.vm, "err", err)
	default:
		log.Error("exec outcome not recorded; recovery will mark it unknown", "vm", e.c.vm, "err", err)
	}
}
