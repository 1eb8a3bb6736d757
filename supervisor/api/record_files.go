package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// maxRecordedWrite is the largest file write whose content the audit log
// keeps as a blob (a rerun replays it); a larger one is recorded by size
// and digest only.
const maxRecordedWrite = 16 << 20

// actionRecord records one file action: its intent before the guest sees
// it, its file.op after. A nil *actionRecord records nothing.
type actionRecord struct {
	cfg         Config
	vm, session string
	p           *audit.Pending
}

// beginFile makes a file action's intent durable; the action must not be
// forwarded when that fails.
func (cfg Config) beginFile(ctx context.Context, h http.Header, in audit.FileIntent) (*actionRecord, error) {
	if cfg.Audit == nil {
		return nil, nil
	}
	vm := h.Get(protocol.VMHeader)
	in.Caller = recordedCaller(ctx)
	data, err := json.Marshal(in)
	if err != nil {
		return nil, err
	}
	session := cfg.session(vm)
	p, err := cfg.Audit.Begin(ctx, audit.Record{VM: vm, Session: session, Provenance: audit.Host, Data: data})
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("%s not forwarded: its audit record could not be written: %w", in.Action, err))
	}
	return &actionRecord{cfg: cfg, vm: vm, session: session, p: p}, nil
}

// end records the action's file.op, with err's text when it failed.
func (a *actionRecord) end(ctx context.Context, op audit.FileOp, blob string, err error) {
	if a == nil {
		return
	}
	if err != nil {
		op.Error = protocol.CleanText(err.Error(), 1024)
	}
	data, merr := json.Marshal(op)
	if merr != nil {
		return
	}
	rec := audit.Record{Kind: audit.KindFileOp, VM: a.vm, Session: a.session, Provenance: audit.Host, Data: data}
	if blob != "" {
		rec.Blobs = []string{blob}
	}
	if _, err := a.p.End(context.WithoutCancel(ctx), rec); err != nil && !errors.Is(err, audit.ErrEnded) {
		a.cfg.Logger.Error("file outcome not recorded; recovery will mark it unknown", "vm", a.vm, "op", op.Op, "err", err)
	}
}

// recordRead records a read, a stat or a listing after it: it changed
// nothing, and its decision is already on record.
func (cfg Config) recordRead(ctx context.Context, h http.Header, op audit.FileOp, err error) {
	if cfg.Audit == nil {
		return
	}
	if err != nil {
		op.Error = protocol.CleanText(err.Error(), 1024)
	}
	data, merr := json.Marshal(op)
	if merr != nil {
		return
	}
	vm := h.Get(protocol.VMHeader)
	if _, err := cfg.Audit.Append(context.WithoutCancel(ctx), audit.Record{Kind: audit.KindFileOp, VM: vm, Session: cfg.session(vm), Provenance: audit.Host, Data: data}); err != nil {
		cfg.Logger.Error("file read not recorded", "vm", vm, "op", op.Op, "err", err)
	}
}

// contentBlob copies what a write sends into a blob as it is relayed, up
// to maxRecordedWrite bytes.
type contentBlob struct {
	w    *io.PipeWriter
	n    int64
	over bool
	done chan struct{}
	dig  string
	err  error
}

var errTooLargeToKeep = errors.New("larger than the content the audit log keeps")

func (cfg Config) newContentBlob() *contentBlob {
	if cfg.Audit == nil {
		return nil
	}
	r, w := io.Pipe()
	b := &contentBlob{w: w, done: make(chan struct{})}
	go func() {
		defer close(b.done)
		b.dig, b.err = cfg.Audit.PutBlob(r)
		r.CloseWithError(b.err) // unblocks a writer if PutBlob failed early
	}()
	return b
}

func (b *contentBlob) write(p []byte) {
	if b == nil || b.over || len(p) == 0 {
		return
	}
	b.n += int64(len(p))
	if b.n > maxRecordedWrite {
		b.over = true
		b.w.CloseWithError(errTooLargeToKeep)
		return
	}
	if _, err := b.w.Write(p); err != nil {
		b.over = true
	}
}

// finish returns the blob's digest, or "" and why the content is not
// kept. abort drops the content (the write did not happen).
func (b *contentBlob) finish(abort bool) (string, string) {
	if b == nil {
		return "", ""
	}
	if abort {
		b.w.CloseWithError(errors.New("write abandoned"))
	} else {
		b.w.Close()
	}
	<-b.done
	switch {
	case abort:
		return "", ""
	case b.n > maxRecordedWrite:
		return "", fmt.Sprintf("not kept: over %d MiB", maxRecordedWrite>>20)
	case b.err != nil:
		return "", "not kept: " + protocol.CleanText(b.err.Error(), 256)
	}
	return b.dig, ""
}

// watchRecordBytes bounds one watch.event record's data, under the log's
// cap; a message with more is recorded as several.
const watchRecordBytes = 48 << 10

// recordWatch records the events of one checked watch message, reported
// by the guest, before they are relayed.
func (cfg Config) recordWatch(ctx context.Context, h http.Header, root string, msg *agentv1.WatchResponse) error {
	if cfg.Audit == nil {
		return nil
	}
	vm := h.Get(protocol.VMHeader)
	session := cfg.session(vm)
	flush := func(d audit.Watch) error {
		data, err := json.Marshal(d)
		if err != nil {
			return err
		}
		_, err = cfg.Audit.Append(ctx, audit.Record{Kind: audit.KindWatchEvent, VM: vm, Session: session, Provenance: audit.Guest, Data: data})
		return err
	}
	d := audit.Watch{Watch: root, Dropped: msg.Dropped}
	size := 0
	for _, e := range msg.Events {
		ev := audit.WatchEvent{Op: strings.ToLower(strings.TrimPrefix(e.Op.String(), "WATCH_OP_")), Path: e.Path, OldPath: e.OldPath, Dir: e.IsDir, TimeNs: e.TimeUnixNano}
		// JSON may escape a byte as six.
		n := 6*(len(ev.Path)+len(ev.OldPath)) + 96
		if size+n > watchRecordBytes && len(d.Events) > 0 {
			if err := flush(d); err != nil {
				return err
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
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("watch events could not be recorded: %w", err))
	}
	return nil
}

// beginForward makes a forwarded connection's intent durable before the
// guest is asked to open it.
func (cfg Config) beginForward(ctx context.Context, h http.Header, host string, port uint32) (*actionRecord, error) {
	if cfg.Audit == nil {
		return nil, nil
	}
	vm := h.Get(protocol.VMHeader)
	data, err := json.Marshal(audit.ForwardIntent{Action: audit.ActionForward, Caller: recordedCaller(ctx), Host: host, Port: port})
	if err != nil {
		return nil, err
	}
	session := cfg.session(vm)
	p, err := cfg.Audit.Begin(ctx, audit.Record{VM: vm, Session: session, Provenance: audit.Host, Data: data})
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("connection not forwarded: its audit record could not be written: %w", err))
	}
	return &actionRecord{cfg: cfg, vm: vm, session: session, p: p}, nil
}

// endForward records a forwarded connection's outcome.
func (a *actionRecord) endForward(ctx context.Context, fromGuest int64, err error) {
	if a == nil {
		return
	}
	out := audit.ForwardOutcome{BytesFromGuest: fromGuest}
	if err != nil {
		out.Error = protocol.CleanText(err.Error(), 1024)
	}
	data, _ := json.Marshal(out)
	if _, err := a.p.End(context.WithoutCancel(ctx), audit.Record{Kind: audit.KindOutcome, VM: a.vm, Session: a.session, Provenance: audit.Host, Data: data}); err != nil && !errors.Is(err, audit.ErrEnded) {
		a.cfg.Logger.Error("forward outcome not recorded; recovery will mark it unknown", "vm", a.vm, "err", err)
	}
}
