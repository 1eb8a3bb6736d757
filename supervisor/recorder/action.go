package recorder

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/cas"
)

// maxRecordedWrite is the largest file write whose content the audit log
// keeps as a blob (a rerun replays it); a larger one is recorded by size
// and digest only.
const maxRecordedWrite = 16 << 20

// Action records one action that changes the guest (a file write, a
// forwarded connection): its intent before the guest sees it, its outcome
// after. A nil *Action records nothing.
type Action struct {
	c *Call
	p *audit.Pending
}

func (c *Call) begin(ctx context.Context, what string, intent any) (*Action, error) {
	data, err := json.Marshal(intent)
	if err != nil {
		return nil, err
	}
	p, err := c.r.log.BeginAfter(ctx, takeHeld(ctx), c.record("", audit.Host, data))
	if err != nil {
		return nil, &notRecorded{what + " not forwarded: its audit record could not be written", err}
	}
	return &Action{c: c, p: p}, nil
}

// end ties the outcome rec to the intent, even when ctx has ended.
func (a *Action) end(ctx context.Context, rec audit.Record, what string) {
	_, err := a.p.End(context.WithoutCancel(ctx), rec)
	switch {
	case err == nil || errors.Is(err, audit.ErrEnded):
	case errors.Is(err, audit.ErrUnavailable):
		a.c.r.logger.Warn(what+" outcome kept until the audit log is writable again", "vm", a.c.vm, "err", err)
	default:
		a.c.r.logger.Error(what+" outcome not recorded; recovery will mark it unknown", "vm", a.c.vm, "err", err)
	}
}

// BeginFile makes a file action's intent durable; the action must not be
// forwarded when that fails (the error matches ErrNotRecorded).
func (c *Call) BeginFile(ctx context.Context, in audit.FileIntent) (*Action, error) {
	if c == nil {
		return nil, nil
	}
	in.Caller = c.caller
	return c.begin(ctx, in.Action, in)
}

// EndFile records the action's file.op, with err's text when it failed
// and the content's blob when one was kept.
func (a *Action) EndFile(ctx context.Context, op audit.FileOp, blob string, err error) {
	if a == nil {
		return
	}
	rec := a.c.fileOp(op, err)
	if blob != "" {
		rec.Blobs = []string{blob}
	}
	a.end(ctx, rec, "file "+op.Op)
}

// fileOp is op's file.op record, with err's text when it failed.
func (c *Call) fileOp(op audit.FileOp, err error) audit.Record {
	if err != nil {
		op.Error = protocol.CleanText(err.Error(), 1024)
	}
	data, _ := json.Marshal(op) // a struct of strings and numbers
	return c.record(audit.KindFileOp, audit.Host, data)
}

// Read records a read, a stat or a listing after it: it changed nothing,
// and its decision is already on record.
func (c *Call) Read(ctx context.Context, op audit.FileOp, err error) {
	if c == nil {
		return
	}
	if err := c.r.append(context.WithoutCancel(ctx), c.fileOp(op, err)); err != nil {
		c.r.logger.Error("file read not recorded", "vm", c.vm, "op", op.Op, "err", err)
	}
}

// BeginForward makes a forwarded connection's intent durable before the
// guest is asked to open it.
func (c *Call) BeginForward(ctx context.Context, host string, port uint32) (*Action, error) {
	if c == nil {
		return nil, nil
	}
	return c.begin(ctx, "connection", audit.ForwardIntent{Action: audit.ActionForward, Caller: c.caller, Host: host, Port: port})
}

// EndForward records a forwarded connection's outcome.
func (a *Action) EndForward(ctx context.Context, fromGuest int64, err error) {
	if a == nil {
		return
	}
	out := audit.ForwardOutcome{BytesFromGuest: fromGuest}
	if err != nil {
		out.Error = protocol.CleanText(err.Error(), 1024)
	}
	data, _ := json.Marshal(out)
	a.end(ctx, a.c.record(audit.KindOutcome, audit.Host, data), "forward")
}

// BeginInput makes the intent of input for a running command durable
// before the guest gets it: stdin's bytes go into a blob with it.
func (c *Call) BeginInput(ctx context.Context, execID, input string, stdin []byte) (*Action, error) {
	if c == nil {
		return nil, nil
	}
	data, err := json.Marshal(audit.InputIntent{Action: audit.ActionInput, Caller: c.caller, ExecID: execID, Input: input, Bytes: len(stdin)})
	if err != nil {
		return nil, err
	}
	rec := c.record("", audit.Host, data)
	if len(stdin) > 0 {
		digest, err := c.r.log.PutBlob(bytes.NewReader(stdin))
		if err != nil {
			return nil, &notRecorded{"input not forwarded: its audit record could not be written", err}
		}
		rec.Blobs = []string{digest}
	}
	p, err := c.r.log.BeginAfter(ctx, takeHeld(ctx), rec)
	if err != nil {
		return nil, &notRecorded{"input not forwarded: its audit record could not be written", err}
	}
	return &Action{c: c, p: p}, nil
}

// EndInput records an input's outcome.
func (a *Action) EndInput(ctx context.Context, err error) {
	if a == nil {
		return
	}
	var out audit.InputOutcome
	if err != nil {
		out.Error = protocol.CleanText(err.Error(), 1024)
	}
	data, _ := json.Marshal(out)
	a.end(ctx, a.c.record(audit.KindOutcome, audit.Host, data), "input")
}

// Content keeps what a write sends as a blob, up to maxRecordedWrite
// bytes, written to the blob store as the write is relayed. The relay
// hashes every byte it forwards for the digest its client gets, and that
// digest names the blob (Finish), so the content is hashed once. A nil
// *Content keeps nothing.
type Content struct {
	w    *cas.Writer // nil once the content is kept or dropped
	n    int64
	kept string // the blob, once kept
	why  error  // why the content is not kept, once dropped
	log  *slog.Logger
}

var errTooLargeToKeep = errors.New("larger than the content the audit log keeps")

// Content starts keeping a write's content.
func (c *Call) Content() *Content {
	if c == nil {
		return nil
	}
	w, err := c.r.log.CreateBlob()
	return &Content{w: w, why: err, log: c.r.logger}
}

// Write keeps p, unless the content is already over the cap or could not
// be kept.
func (b *Content) Write(p []byte) {
	if b == nil || b.w == nil || len(p) == 0 {
		return
	}
	b.n += int64(len(p))
	if b.n > maxRecordedWrite {
		b.drop(errTooLargeToKeep)
		return
	}
	if _, err := b.w.Write(p); err != nil {
		b.drop(err)
	}
}

// drop stops keeping the content, for reason why.
func (b *Content) drop(why error) {
	if err := b.w.Discard(); err != nil {
		// audit.Open removes it at the next start.
		b.log.Warn("write content not kept: its temp file stays", "err", err)
	}
	b.w, b.why = nil, why
}

// Finish keeps the content as the blob digest, which must be the sha256
// of exactly what Write was given, and returns digest; or it returns ""
// and why the content is not kept. abort drops the content (the write did
// not happen).
func (b *Content) Finish(digest string, abort bool) (blob, why string) {
	if b == nil {
		return "", ""
	}
	if abort {
		if b.w != nil {
			b.drop(errors.New("write abandoned"))
		}
		return "", ""
	}
	if b.w != nil {
		if err := b.w.Commit(digest); err != nil {
			b.why = err
		} else {
			b.kept = digest
		}
		b.w = nil
	}
	switch {
	case b.kept != "":
		return b.kept, ""
	case errors.Is(b.why, errTooLargeToKeep):
		return "", fmt.Sprintf("not kept: over %d MiB", maxRecordedWrite>>20)
	case b.why != nil:
		return "", "not kept: " + protocol.CleanText(b.why.Error(), 256)
	}
	return "", ""
}

// watchRecordBytes bounds one watch.event record's data, under the log's
// cap; a message with more is recorded as several.
const watchRecordBytes = 48 << 10

// Watch records the events of one checked watch message, reported by the
// guest, before they are relayed.
func (c *Call) Watch(ctx context.Context, root string, msg *agentv1.WatchResponse) error {
	if c == nil {
		return nil
	}
	flush := func(d audit.Watch) error {
		data, err := json.Marshal(d)
		if err != nil {
			return err
		}
		return c.r.append(ctx, c.record(audit.KindWatchEvent, audit.Guest, data))
	}
	d := audit.Watch{Watch: root, Dropped: msg.Dropped}
	size := 0
	for _, e := range msg.Events {
		ev := audit.WatchEvent{Op: strings.ToLower(strings.TrimPrefix(e.Op.String(), "WATCH_OP_")), Path: e.Path, OldPath: e.OldPath, Dir: e.IsDir, TimeNs: e.TimeUnixNano}
		// JSON may escape a byte as six.
		n := 6*(len(ev.Path)+len(ev.OldPath)) + 96
		if size+n > watchRecordBytes && len(d.Events) > 0 {
			if err := flush(d); err != nil {
				return &notRecorded{"watch events could not be recorded", err}
			}
			d, size = audit.Watch{Watch: root}, 0
		}
		d.Events = append(d.Events, ev)
		size += n
	}
	if len(d.Events) == 0 && d.Dropped == 0 {
		return nil
	}
	if err := flush(d); err != nil {
		return &notRecorded{"watch events could not be recorded", err}
	}
	return nil
}
