// Package recorder writes carreld's audit records: every policy decision,
// every step in a VM's life, and, for each call relayed to a guest, the
// intent before it is forwarded, what the guest sent back and the outcome.
//
// A Recorder writes to one audit log. A call's facts (its VM, the VM's
// session and the caller) are taken once, in a Call, and every record the
// call writes carries them. A nil *Recorder's Call is nil, and a nil
// *Call (with what it begins) and APICallEnded on a nil *Recorder record
// nothing: carreld always has a log; unit tests of the handlers may not.
package recorder

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/cas"
)

// Log is the part of the audit log the recorder writes to: records,
// write-ahead intents for actions and their outcomes, and blobs.
type Log interface {
	AppendAll(ctx context.Context, recs ...audit.Record) ([]uint64, error)
	BeginAfter(ctx context.Context, before []audit.Record, rec audit.Record) (*audit.Pending, error)
	PutBlob(r io.Reader) (string, error)
	CreateBlob() (*cas.Writer, error)
}

var _ Log = (*audit.Log)(nil)

// ErrNotRecorded is wrapped by the error of an action that did not go
// ahead because its record could not be written.
var ErrNotRecorded = errors.New("audit record not written")

// notRecorded is an action refused for want of its record: its message
// says what did not happen and why, and it matches ErrNotRecorded.
type notRecorded struct {
	what string
	err  error
}

func (e *notRecorded) Error() string        { return e.what + ": " + e.err.Error() }
func (e *notRecorded) Unwrap() error        { return e.err }
func (e *notRecorded) Is(target error) bool { return target == ErrNotRecorded }

// Recorder writes carreld's records to one audit log.
type Recorder struct {
	log    Log
	logger *slog.Logger
}

// New returns a recorder writing to log; failures that cannot reach a
// caller are logged to logger (slog.Default() if nil).
func New(log Log, logger *slog.Logger) *Recorder {
	if logger == nil {
		logger = slog.Default()
	}
	return &Recorder{log: log, logger: logger}
}

// Call is one call's part of the log: every record it writes names its VM
// (if any), the VM's session and, for intents, its caller.
type Call struct {
	r       *Recorder
	vm      string
	session string
	caller  audit.Caller
}

// Call starts recording one call that acts on vm in its run session for
// caller. On a nil Recorder it returns nil, which records nothing.
func (r *Recorder) Call(vm, session string, caller audit.Caller) *Call {
	if r == nil {
		return nil
	}
	return &Call{r: r, vm: vm, session: session, caller: caller}
}

// record is a host record of kind for the call's VM.
func (c *Call) record(kind string, prov audit.Provenance, data []byte) audit.Record {
	return audit.Record{Kind: kind, VM: c.vm, Session: c.session, Provenance: prov, Data: data}
}

// append makes one record durable.
func (r *Recorder) append(ctx context.Context, rec audit.Record) error {
	_, err := r.log.AppendAll(ctx, rec)
	return err
}

// A call's records need not each cost an fdatasync of their own: the
// decisions that admit a command can become durable with its intent, in
// one group commit, and its last output and outcome with the call's
// api.call record. Under a context from Hold, the recorder holds such
// records back until the next record the call must have durable before
// it goes on: an intent (BeginExec, BeginFile, BeginForward), the
// api.call record (APICallEnded), or Flush. Nothing is less durable for
// it: the action waits for its intent, and the reply for its api.call.
type held struct {
	mu   sync.Mutex
	recs []audit.Record
}

type heldKey struct{}

// Hold returns ctx holding back the records that may wait, until the
// call's next durable record. Whoever holds must end the call with
// APICallEnded (the API's interceptor does), or Flush.
func Hold(ctx context.Context) context.Context {
	return context.WithValue(ctx, heldKey{}, &held{})
}

// hold keeps recs for the next durable record of ctx's call; false when
// ctx holds nothing back.
func hold(ctx context.Context, recs ...audit.Record) bool {
	h, ok := ctx.Value(heldKey{}).(*held)
	if !ok {
		return false
	}
	h.mu.Lock()
	h.recs = append(h.recs, recs...)
	h.mu.Unlock()
	return true
}

// takeHeld returns, and forgets, the records held back under ctx.
func takeHeld(ctx context.Context) []audit.Record {
	h, ok := ctx.Value(heldKey{}).(*held)
	if !ok {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	recs := h.recs
	h.recs = nil
	return recs
}

// Flush makes the records held back under ctx durable now: before an
// action that writes no intent of its own (an attach to a command).
func (r *Recorder) Flush(ctx context.Context) error {
	recs := takeHeld(ctx)
	if r == nil || len(recs) == 0 {
		return nil
	}
	if _, err := r.log.AppendAll(ctx, recs...); err != nil {
		return &notRecorded{"the call's decisions could not be recorded", err}
	}
	return nil
}

type sessionKey struct{}

type vmSession struct{ vm, session string }

// WithSession returns ctx saying that vm is in its run session: a policy
// decision about vm made under ctx is recorded in that session.
func WithSession(ctx context.Context, vm, session string) context.Context {
	return context.WithValue(ctx, sessionKey{}, vmSession{vm, session})
}

// sessionOf is the session ctx gives vm, or "".
func sessionOf(ctx context.Context, vm string) string {
	if s, ok := ctx.Value(sessionKey{}).(vmSession); ok && s.vm == vm {
		return s.session
	}
	return ""
}
