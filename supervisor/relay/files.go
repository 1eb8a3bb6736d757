package relay

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/recorder"
)

// The file API is the agent's own carrel.agent.v1.FileService, relayed
// for the VM that protocol.VMHeader names: carreld checks every reply from
// the guest before passing it on.

// Caps on what a guest may send back through the file relay.
const (
	MaxPathBytes   = 4096
	maxListEntries = 100_000
	maxListBatch   = 1024
)

type fileRelay struct{ *Relay }

var _ agentv1connect.FileServiceHandler = fileRelay{}

// files returns the guest's file service for the VM the call names.
func (r fileRelay) files(h http.Header) (agentv1connect.FileServiceClient, func(context.Context, error) error, error) {
	c, done, _, err := r.filesLink(h)
	return c, done, err
}

// filesLink is files, with the link itself for its data port.
func (r fileRelay) filesLink(h http.Header) (agentv1connect.FileServiceClient, func(context.Context, error) error, *agentlink.Link, error) {
	link, err := r.link(h)
	if err != nil {
		return nil, nil, nil, err
	}
	c, done := link.Files()
	return c, done, link, nil
}

// records starts the audit records of a call for the VM it names.
func (r fileRelay) records(ctx context.Context, h http.Header) *recorder.Call {
	return r.call(ctx, h.Get(protocol.VMHeader))
}

func checkInfo(fi *agentv1.FileInfo) error {
	switch {
	case fi == nil:
		return errGuest("missing file info")
	case len(fi.Path) > MaxPathBytes || len(fi.LinkTarget) > MaxPathBytes:
		return errGuest("path over %d bytes", MaxPathBytes)
	case !strings.HasPrefix(fi.Path, "/") || strings.ContainsRune(fi.Path, 0):
		return errGuest("invalid path %q", protocol.CleanText(fi.Path, 256))
	case fi.Mode > 0o7777:
		return errGuest("invalid mode %o", fi.Mode)
	case fi.Size < 0:
		return errGuest("negative size")
	}
	if _, ok := agentv1.FileType_name[int32(fi.Type)]; !ok || fi.Type == agentv1.FileType_FILE_TYPE_UNSPECIFIED {
		return errGuest("invalid file type %d", fi.Type)
	}
	return nil
}

func (r fileRelay) Stat(ctx context.Context, req *connect.Request[agentv1.StatRequest]) (*connect.Response[agentv1.StatResponse], error) {
	if err := r.allowFile(ctx, req.Header(), policy.OpList, &req.Msg.Path, false); err != nil {
		return nil, err
	}
	c, done, err := r.files(req.Header())
	if err != nil {
		return nil, err
	}
	resp, err := c.Stat(ctx, connect.NewRequest(req.Msg))
	if err == nil {
		err = checkInfo(resp.Msg.Info)
	}
	op := audit.FileOp{Op: "stat", Path: req.Msg.Path}
	if err == nil {
		op.Size = resp.Msg.Info.Size
	}
	r.records(ctx, req.Header()).Read(ctx, op, err)
	if err != nil {
		return nil, relayErr(ctx, done, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

func (r fileRelay) List(ctx context.Context, req *connect.Request[agentv1.ListRequest], out *connect.ServerStream[agentv1.ListResponse]) (err error) {
	var n uint32
	defer func() {
		r.records(ctx, req.Header()).Read(ctx, audit.FileOp{Op: "list", Path: req.Msg.Path, Entries: int(n)}, err)
	}()
	if err := r.allowFile(ctx, req.Header(), policy.OpList, &req.Msg.Path, req.Msg.Recursive); err != nil {
		return err
	}
	c, done, err := r.files(req.Header())
	if err != nil {
		return err
	}
	limit := uint32(maxListEntries)
	if req.Msg.MaxEntries != 0 && req.Msg.MaxEntries < limit {
		limit = req.Msg.MaxEntries
	}
	ask := &agentv1.ListRequest{Path: req.Msg.Path, Recursive: req.Msg.Recursive, MaxDepth: req.Msg.MaxDepth, MaxEntries: limit}
	s, err := c.List(ctx, connect.NewRequest(ask))
	if err != nil {
		return relayErr(ctx, done, err)
	}
	defer s.Close()
	for s.Receive() {
		msg := s.Msg()
		if len(msg.Entries) > maxListBatch {
			return errGuest("%d entries in one message", len(msg.Entries))
		}
		n += uint32(len(msg.Entries))
		if n > limit {
			return errGuest("sent more than the %d entries asked for", limit)
		}
		for _, e := range msg.Entries {
			if err := checkInfo(e); err != nil {
				return err
			}
		}
		if err := out.Send(msg); err != nil {
			return err
		}
	}
	return relayErr(ctx, done, s.Err())
}

func (r fileRelay) Read(ctx context.Context, req *connect.Request[agentv1.ReadRequest], out *connect.ServerStream[agentv1.ReadResponse]) (err error) {
	if err := r.allowFile(ctx, req.Header(), policy.OpRead, &req.Msg.Path, false); err != nil {
		return err
	}
	var total int64
	sum := sha256.New() // of what the client was sent
	defer func() {
		r.records(ctx, req.Header()).Read(ctx, audit.FileOp{Op: "read", Path: req.Msg.Path, Size: total, Digest: "sha256:" + hex.EncodeToString(sum.Sum(nil))}, err)
	}()
	c, done, link, err := r.filesLink(req.Header())
	if err != nil {
		return err
	}
	// The client's own bulk_id is never passed on: only carreld names a
	// transfer on the data port.
	ask := &agentv1.ReadRequest{Path: req.Msg.Path, Offset: req.Msg.Offset, Length: req.Msg.Length}
	// Each piece of content is checked and counted before it is passed on.
	pass := func(b []byte) error {
		if req.Msg.Length > 0 && total+int64(len(b)) > req.Msg.Length {
			return errGuest("sent more than the %d bytes asked for", req.Msg.Length)
		}
		total += int64(len(b))
		sum.Write(b)
		return out.Send(&agentv1.ReadResponse{Data: b})
	}
	if in := link.ReceiveData(ctx); in != nil {
		defer in.Close()
		ask.BulkId = in.ID
		return readBulk(ctx, link, c, done, ask, in, pass)
	}
	s, err := c.Read(ctx, connect.NewRequest(ask))
	if err != nil {
		return relayErr(ctx, done, err)
	}
	defer s.Close()
	for s.Receive() {
		if err := pass(s.Msg().Data); err != nil {
			return err
		}
	}
	return relayErr(ctx, done, s.Err())
}

// readBulk relays a read whose content comes on the data port as transfer
// in. The guest's call itself sends no messages; its end says whether the
// read worked. Either failing ends the other.
func readBulk(ctx context.Context, link *agentlink.Link, c agentv1connect.FileServiceClient, done func(context.Context, error) error,
	ask *agentv1.ReadRequest, in *agentlink.Inbound, pass func([]byte) error) error {
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	rpc := make(chan error, 1)
	// The call is made meanwhile: it returns only once the guest has
	// answered, which it does after the content has gone.
	go func() {
		s, err := c.Read(cctx, connect.NewRequest(ask))
		if err != nil {
			cancel()
			rpc <- err
			return
		}
		defer s.Close()
		if s.Receive() {
			err = errGuest("sent data messages for a read on the data port")
		} else {
			err = s.Err()
		}
		if err != nil {
			cancel() // a wait for frames that will not come
		}
		rpc <- err
	}()
	for {
		b, err := in.Next(cctx)
		if err == io.EOF {
			return relayErr(ctx, done, <-rpc)
		}
		if err == nil {
			err = pass(b)
		}
		if err != nil {
			// Whether the call ended first, cancelling the wait: looked at
			// before our own cancel, which would make it always so.
			rpcEnded := cctx.Err() != nil
			cancel()
			rerr := <-rpc
			if rerr != nil && (errors.Is(err, protocol.ErrTransferAborted) || rpcEnded) && ctx.Err() == nil {
				// The guest's call says why it gave up.
				return relayErr(ctx, done, rerr)
			}
			return dataErr(link, err)
		}
	}
}

// dataErr is a failed transfer on the data port, as the client sees it.
// The stream to the agent is not to blame, so it is left alone. A port
// that stalled while carreld held the VM paused stalled for the pause:
// its reason is the error.
func dataErr(link *agentlink.Link, err error) error {
	if ce := new(connect.Error); errors.As(err, &ce) {
		return err
	}
	switch {
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		return err
	case errors.Is(err, agentlink.ErrDataProtocol):
		return connect.NewError(connect.CodeDataLoss, fmt.Errorf("guest agent: %w", err))
	}
	if held := link.Held(); held != nil {
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("%w (%v)", held, err))
	}
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf("%w; the call can be retried", err))
}

func (r fileRelay) Write(ctx context.Context, in *connect.ClientStream[agentv1.WriteRequest]) (*connect.Response[agentv1.WriteResponse], error) {
	return r.relayWrite(ctx, in, false, agentv1connect.FileServiceClient.Write)
}

func (r fileRelay) WriteTar(ctx context.Context, in *connect.ClientStream[agentv1.WriteRequest]) (*connect.Response[agentv1.WriteResponse], error) {
	return r.relayWrite(ctx, in, true, agentv1connect.FileServiceClient.WriteTar)
}

// relayWrite passes a header, data and commit stream on to the guest.
func (r fileRelay) relayWrite(ctx context.Context, in *connect.ClientStream[agentv1.WriteRequest], tree bool,
	open func(agentv1connect.FileServiceClient, context.Context) *connect.ClientStreamForClient[agentv1.WriteRequest, agentv1.WriteResponse]) (_ *connect.Response[agentv1.WriteResponse], err error) {
	c, done, link, err := r.filesLink(in.RequestHeader())
	if err != nil {
		return nil, err
	}
	if !in.Receive() {
		if err := in.Err(); err != nil {
			return nil, err
		}
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("write: no header"))
	}
	hdr := in.Msg().GetHeader()
	if hdr == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("write: the first message must be the header"))
	}
	if err := r.allowFile(ctx, in.RequestHeader(), policy.OpWrite, &hdr.Path, tree); err != nil {
		return nil, err
	}
	rc := r.records(ctx, in.RequestHeader())
	act, err := rc.BeginFile(ctx, audit.FileIntent{Action: "file.write", Path: hdr.Path, Mode: hdr.Mode, Tar: tree})
	if err != nil {
		return nil, err
	}
	op := audit.FileOp{Op: "write", Path: hdr.Path}
	if tree {
		op.Op = "write_tar"
	}
	content := rc.Content()
	var resp *connect.Response[agentv1.WriteResponse]
	defer func() {
		if resp != nil {
			op.Size, op.Digest = resp.Msg.Size, resp.Msg.Digest
		}
		// The digest is of what went to the guest, which is what the
		// content holds.
		blob, why := content.Finish(op.Digest, err != nil)
		op.Content = why
		act.EndFile(ctx, op, blob, err)
	}()
	// Cancelled when we return, so the guest drops a write that did not
	// complete instead of committing it.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The client's own bulk_id is never passed on: only carreld names a
	// transfer on the data port.
	hdr = &agentv1.WriteHeader{Path: hdr.Path, Mode: hdr.Mode, MakeParents: hdr.MakeParents}
	if !tree {
		if t := link.SendData(ctx); t != nil {
			defer t.Abort()
			hdr.BulkId = t.ID
			resp, err = writeBulk(ctx, link, open(c, ctx), done, hdr, in, t, content)
			return resp, err
		}
	}
	s := open(c, ctx)
	var sent int64
	sum := sha256.New() // of what went to the guest: the digest clients get
	for msg := wrapHeader(hdr); ; msg = in.Msg() {
		if err := s.Send(msg); err != nil {
			break // the guest ended the call; CloseAndReceive says why
		}
		if !in.Receive() {
			break
		}
		if in.Msg().GetHeader() != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("write: a second header"))
		}
		// The commit passes through only if the client sent it: a client
		// that closed without one gave up, and the guest writes nothing.
		sent += int64(len(in.Msg().GetData()))
		sum.Write(in.Msg().GetData())
		content.Write(in.Msg().GetData())
	}
	if err := in.Err(); err != nil {
		return nil, err
	}
	got, err := s.CloseAndReceive()
	if err != nil {
		return nil, relayErr(ctx, done, err)
	}
	if got.Msg.Size != sent {
		return nil, errGuest("write reply does not match what was sent (%d bytes sent, %d reported)", sent, got.Msg.Size)
	}
	resp = connect.NewResponse(&agentv1.WriteResponse{Size: sent, Digest: "sha256:" + hex.EncodeToString(sum.Sum(nil))})
	return resp, nil
}

func wrapHeader(h *agentv1.WriteHeader) *agentv1.WriteRequest {
	return &agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Header{Header: h}}
}

// writeBulk relays a write whose content goes on the data port as
// transfer t. The guest's call gets the header and the commit at once,
// and writes the file once t ends (FrameEnd), or drops it if t is
// aborted; its reply is watched meanwhile, so a guest that refuses the
// write early stops the sending.
func writeBulk(ctx context.Context, link *agentlink.Link, s *connect.ClientStreamForClient[agentv1.WriteRequest, agentv1.WriteResponse], done func(context.Context, error) error,
	hdr *agentv1.WriteHeader, in *connect.ClientStream[agentv1.WriteRequest], t *agentlink.Outbound, content *recorder.Content) (*connect.Response[agentv1.WriteResponse], error) {
	type reply struct {
		resp *connect.Response[agentv1.WriteResponse]
		err  error
	}
	replied := make(chan reply, 1)
	if s.Send(wrapHeader(hdr)) == nil {
		s.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Commit{Commit: &agentv1.WriteCommit{}}})
	}
	go func() {
		resp, err := s.CloseAndReceive()
		if err != nil {
			// Refused, or failed, before the content was all sent: a
			// frame stuck going to a guest that no longer reads stops.
			t.Interrupt()
		}
		replied <- reply{resp, err}
	}()
	var sent int64
	sum := sha256.New() // of what went to the guest: the digest clients get
	committed := false
	var early *reply
	// The messages are read into m, whose data buffer each data message
	// reuses (codec.go): everything below is done with it before the next.
	conn := in.Conn()
	m := takeWriteMessage()
	defer m.release()
	var rerr error
	for !committed {
		m.reset()
		if rerr = conn.Receive(m); rerr != nil {
			break
		}
		select {
		case r := <-replied:
			early = &r
		default:
		}
		if early != nil {
			break
		}
		data, isData := m.chunk()
		switch {
		case isData:
			if err := t.Write(data); err != nil {
				if errors.Is(err, agentlink.ErrInterrupted) {
					// Only the guest's refusal interrupts: its reason.
					return nil, relayErr(ctx, done, (<-replied).err)
				}
				return nil, dataErr(link, err)
			}
			sent += int64(len(data))
			sum.Write(data)
			content.Write(data)
		case m.msg.GetHeader() != nil:
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("write: a second header"))
		case m.msg.GetCommit() != nil:
			committed = true
		}
	}
	if early == nil {
		if rerr != nil && !errors.Is(rerr, io.EOF) {
			return nil, rerr
		}
		if !committed {
			// The client gave up: the guest drops what it has.
			t.Abort()
			r := <-replied
			if r.err == nil {
				return nil, errGuest("write committed without the commit")
			}
			return nil, connect.NewError(connect.CodeAborted, errors.New("write: the stream ended without a commit; nothing was written"))
		}
		if err := t.End(); err != nil {
			return nil, dataErr(link, err)
		}
		r := <-replied
		early = &r
	}
	if early.err != nil {
		return nil, relayErr(ctx, done, early.err)
	}
	if !committed {
		return nil, errGuest("write reply before the content was sent")
	}
	if early.resp.Msg.Size != sent {
		return nil, errGuest("write reply does not match what was sent (%d bytes sent, %d reported)", sent, early.resp.Msg.Size)
	}
	return connect.NewResponse(&agentv1.WriteResponse{Size: sent, Digest: "sha256:" + hex.EncodeToString(sum.Sum(nil))}), nil
}

// ReadTar relays an archive. carreld does not look inside: whoever
// extracts it must treat it as hostile (tarfs.Extract does).
func (r fileRelay) ReadTar(ctx context.Context, req *connect.Request[agentv1.ReadTarRequest], out *connect.ServerStream[agentv1.ReadResponse]) (err error) {
	if err := r.allowFile(ctx, req.Header(), policy.OpRead, &req.Msg.Path, true); err != nil {
		return err
	}
	var total int64
	sum := sha256.New()
	defer func() {
		r.records(ctx, req.Header()).Read(ctx, audit.FileOp{Op: "read_tar", Path: req.Msg.Path, Size: total, Digest: "sha256:" + hex.EncodeToString(sum.Sum(nil))}, err)
	}()
	c, done, err := r.files(req.Header())
	if err != nil {
		return err
	}
	s, err := c.ReadTar(ctx, connect.NewRequest(req.Msg))
	if err != nil {
		return relayErr(ctx, done, err)
	}
	defer s.Close()
	for s.Receive() {
		total += int64(len(s.Msg().Data))
		sum.Write(s.Msg().Data)
		if err := out.Send(s.Msg()); err != nil {
			return err
		}
	}
	return relayErr(ctx, done, s.Err())
}

// unary relays a file action whose reply carries nothing to check: its
// intent is recorded before the guest sees it, its outcome after.
func unary[Req, Resp any](ctx context.Context, r fileRelay, req *connect.Request[Req], intent audit.FileIntent,
	call func(agentv1connect.FileServiceClient, context.Context, *connect.Request[Req]) (*connect.Response[Resp], error)) (*connect.Response[Resp], error) {
	c, done, err := r.files(req.Header())
	if err != nil {
		return nil, err
	}
	act, err := r.records(ctx, req.Header()).BeginFile(ctx, intent)
	if err != nil {
		return nil, err
	}
	resp, err := call(c, ctx, connect.NewRequest(req.Msg))
	if err != nil {
		err = relayErr(ctx, done, err)
	}
	act.EndFile(ctx, audit.FileOp{Op: strings.TrimPrefix(intent.Action, "file."), Path: intent.Path, To: intent.To}, "", err)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp.Msg), nil
}

func (r fileRelay) MakeDir(ctx context.Context, req *connect.Request[agentv1.MakeDirRequest]) (*connect.Response[agentv1.MakeDirResponse], error) {
	if err := r.allowFile(ctx, req.Header(), policy.OpCreate, &req.Msg.Path, req.Msg.Parents); err != nil {
		return nil, err
	}
	return unary(ctx, r, req, audit.FileIntent{Action: "file.mkdir", Path: req.Msg.Path, Mode: req.Msg.Mode, Recursive: req.Msg.Parents}, agentv1connect.FileServiceClient.MakeDir)
}

func (r fileRelay) Remove(ctx context.Context, req *connect.Request[agentv1.RemoveRequest]) (*connect.Response[agentv1.RemoveResponse], error) {
	if err := r.allowFile(ctx, req.Header(), policy.OpDelete, &req.Msg.Path, req.Msg.Recursive); err != nil {
		return nil, err
	}
	return unary(ctx, r, req, audit.FileIntent{Action: "file.remove", Path: req.Msg.Path, Recursive: req.Msg.Recursive}, agentv1connect.FileServiceClient.Remove)
}

func (r fileRelay) Rename(ctx context.Context, req *connect.Request[agentv1.RenameRequest]) (*connect.Response[agentv1.RenameResponse], error) {
	// A rename deletes its source and creates its target.
	if err := r.allowFile(ctx, req.Header(), policy.OpDelete, &req.Msg.From, true); err != nil {
		return nil, err
	}
	if err := r.allowFile(ctx, req.Header(), policy.OpCreate, &req.Msg.To, true); err != nil {
		return nil, err
	}
	return unary(ctx, r, req, audit.FileIntent{Action: "file.rename", Path: req.Msg.From, To: req.Msg.To}, agentv1connect.FileServiceClient.Rename)
}

func (r fileRelay) Chmod(ctx context.Context, req *connect.Request[agentv1.ChmodRequest]) (*connect.Response[agentv1.ChmodResponse], error) {
	if err := r.allowFile(ctx, req.Header(), policy.OpChmod, &req.Msg.Path, false); err != nil {
		return nil, err
	}
	return unary(ctx, r, req, audit.FileIntent{Action: "file.chmod", Path: req.Msg.Path, Mode: req.Msg.Mode}, agentv1connect.FileServiceClient.Chmod)
}

func (r fileRelay) Chown(ctx context.Context, req *connect.Request[agentv1.ChownRequest]) (*connect.Response[agentv1.ChownResponse], error) {
	if err := r.allowFile(ctx, req.Header(), policy.OpChmod, &req.Msg.Path, false); err != nil {
		return nil, err
	}
	return unary(ctx, r, req, audit.FileIntent{Action: "file.chown", Path: req.Msg.Path, UID: &req.Msg.Uid, GID: &req.Msg.Gid}, agentv1connect.FileServiceClient.Chown)
}
