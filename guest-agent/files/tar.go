package files

import (
	"context"
	"errors"
	"io"
	"path/filepath"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/tarfs"
)

// chunkWriter sends what is written to it as ReadResponse chunks.
type chunkWriter struct {
	ctx    context.Context
	stream *connect.ServerStream[agentv1.ReadResponse]
}

func (w chunkWriter) Write(p []byte) (int, error) {
	if err := w.ctx.Err(); err != nil {
		return 0, err
	}
	if err := w.stream.Send(&agentv1.ReadResponse{Data: p}); err != nil {
		return 0, err
	}
	return len(p), nil
}

// ReadTar streams the tree at the request's path as a tar archive, in
// chunks of at most ReadChunk bytes. Sockets and devices are left out, and
// so are secret paths under a sandbox.
func (s *Service) ReadTar(ctx context.Context, req *connect.Request[agentv1.ReadTarRequest], stream *connect.ServerStream[agentv1.ReadResponse]) error {
	pl, err := s.resolve("read tar", req.Msg.GetPath(), readAccess)
	if err != nil {
		return err
	}
	defer pl.close()
	p := pl.path
	resolved, err := pl.resolved("read tar", false)
	if err != nil {
		return err
	}
	if _, err := pl.t.Lstat(pl.name); err != nil {
		return fsError("read tar", p, err)
	}
	// bufio-like batching: the archive writer makes many small writes.
	w := &batcher{out: chunkWriter{ctx, stream}, buf: make([]byte, 0, s.opts.ReadChunk)}
	if pl.sandboxed() {
		err = tarfs.PackRoot(w, pl.root, pl.name, tarfs.PackOptions{
			Name:    filepath.Base(p),
			Exclude: func(rel string) bool { return pl.deniedIn(resolved, filepath.FromSlash(rel)) },
		})
	} else {
		err = tarfs.Pack(w, p, nil)
	}
	if err != nil {
		if ctx.Err() != nil {
			return fsError("read tar", p, ctx.Err())
		}
		return fsError("read tar", p, errors.Unwrap(err))
	}
	return w.flush()
}

// batcher gathers small writes into chunks of cap(buf) bytes.
type batcher struct {
	out io.Writer
	buf []byte
}

func (b *batcher) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		k := copy(b.buf[len(b.buf):cap(b.buf)], p)
		b.buf = b.buf[:len(b.buf)+k]
		p = p[k:]
		if len(b.buf) == cap(b.buf) {
			if err := b.flush(); err != nil {
				return 0, err
			}
		}
	}
	return n, nil
}

func (b *batcher) flush() error {
	if len(b.buf) == 0 {
		return nil
	}
	_, err := b.out.Write(b.buf)
	b.buf = b.buf[:0]
	return err
}

// WriteTar extracts the archive in the data messages beneath the
// directory the header names (created with make_parents), as it streams
// in, through an os.Root. It is not atomic: entries extracted before an
// error, or before a missing commit is noticed, stay. The reply counts the
// archive's bytes.
func (s *Service) WriteTar(ctx context.Context, stream *connect.ClientStream[agentv1.WriteRequest]) (*connect.Response[agentv1.WriteResponse], error) {
	if !stream.Receive() {
		if err := stream.Err(); err != nil {
			return nil, err
		}
		return nil, invalid("write tar: no header")
	}
	hdr := stream.Msg().GetHeader()
	if hdr == nil {
		return nil, invalid("write tar: first message is not a header")
	}
	pl, err := s.resolve("write tar", hdr.GetPath(), writeAccess)
	if err != nil {
		return nil, err
	}
	defer pl.close()
	dir := pl.path
	resolved, err := pl.resolved("write tar", true)
	if err != nil {
		return nil, err
	}
	if err := pl.deniedBeneath("write tar", resolved); err != nil {
		return nil, err
	}
	if hdr.GetMakeParents() {
		if err := pl.t.MkdirAll(pl.name, 0o755); err != nil {
			return nil, fsError("write tar", dir, err)
		}
	}
	root, err := pl.t.OpenRoot(pl.name)
	if err != nil {
		return nil, fsError("write tar", dir, err)
	}
	defer root.Close()

	pr, pw := io.Pipe()
	var size int64
	committed := false
	recvErr := make(chan error, 1)
	go func() {
		err := func() error {
			for stream.Receive() {
				if committed {
					return invalid("write tar %s: a message after the commit", dir)
				}
				switch m := stream.Msg().GetMsg().(type) {
				case *agentv1.WriteRequest_Data:
					size += int64(len(m.Data))
					if _, err := pw.Write(m.Data); err != nil {
						return err
					}
				case *agentv1.WriteRequest_Commit:
					committed = true
				default:
					return invalid("write tar %s: a message after the header is neither data nor the commit", dir)
				}
			}
			if err := stream.Err(); err != nil {
				return err
			}
			if !committed {
				return connect.NewError(connect.CodeAborted, errors.New("write tar "+dir+": the stream ended without a commit"))
			}
			return nil
		}()
		pw.CloseWithError(err)
		recvErr <- err
	}()
	_, xerr := tarfs.Extract(pr, root, tarfs.Options{KeepSpecialBits: true, Owner: s.opts.Owner})
	if xerr == nil {
		io.Copy(io.Discard, pr) // the padding after the archive's end
	}
	pr.CloseWithError(io.ErrClosedPipe) // unblock the receiver if extraction stopped early
	rerr := <-recvErr
	switch {
	case rerr != nil && !errors.Is(rerr, io.ErrClosedPipe):
		return nil, rerr // the stream's fault; extraction saw it as a read error
	case xerr != nil:
		if errors.Is(xerr, tarfs.ErrUnsafe) {
			return nil, connect.NewError(connect.CodeInvalidArgument, xerr)
		}
		if pl.sandboxed() && escapes(xerr) {
			return nil, fsError("write tar", dir, xerr)
		}
		return nil, connect.NewError(codeOf(xerr), xerr)
	}
	return connect.NewResponse(&agentv1.WriteResponse{Size: size}), nil
}
