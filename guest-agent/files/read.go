//go:build linux

package files

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"syscall"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// Read streams a regular file from offset, length bytes or (length 0) to
// its end, in chunks of at most Options.ReadChunk. An offset at or past the
// end yields no messages. A request that names a transfer (bulk_id) gets
// the content on the data port instead, and no messages.
// CodeFailedPrecondition if path is not a regular
// file; CodeInvalidArgument for a negative offset or length.
func (s *Service) Read(ctx context.Context, req *connect.Request[agentv1.ReadRequest], stream *connect.ServerStream[agentv1.ReadResponse]) error {
	pl, err := s.resolve("read", req.Msg.GetPath(), readAccess)
	if err != nil {
		return err
	}
	defer pl.close()
	p := pl.path
	off, n := req.Msg.GetOffset(), req.Msg.GetLength()
	if off < 0 || n < 0 {
		return invalid("read %s: negative offset or length", p)
	}
	if n == 0 {
		n = math.MaxInt64 - off
	}
	// Check before opening: opening a device can have side effects, and
	// O_NONBLOCK keeps a FIFO swapped in meanwhile from blocking the open.
	if fi, err := pl.t.Stat(pl.name); err != nil {
		return fsError("read", p, err)
	} else if !fi.Mode().IsRegular() {
		return notRegular("read", p, fi)
	}
	f, err := pl.t.OpenFile(pl.name, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return fsError("read", p, err)
	}
	defer f.Close()
	if pl.sandboxed() {
		// Check what was opened, not what the path named a moment ago.
		resolved, err := filePath(f)
		if err != nil {
			return fsError("read", p, err)
		}
		if d, ok := pl.sb.DeniedAt(resolved); ok {
			return refused("read", p, "it resolves to %s, and %s is a secret path", resolved, d)
		}
	}
	if fi, err := f.Stat(); err != nil {
		return fsError("read", p, err)
	} else if !fi.Mode().IsRegular() {
		return notRegular("read", p, fi)
	}
	r := io.NewSectionReader(f, off, n)
	if id := req.Msg.GetBulkId(); id != 0 {
		if s.opts.Data == nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("read %s: the content was asked for on a data port, and this agent has none", p))
		}
		if _, err := s.opts.Data.Send(ctx, id, r); err != nil {
			return fsError("read", p, err)
		}
		return nil
	}
	buf := make([]byte, s.opts.ReadChunk)
	for {
		if err := ctx.Err(); err != nil {
			return fsError("read", p, err)
		}
		k, err := io.ReadFull(r, buf)
		if k > 0 {
			if err := stream.Send(&agentv1.ReadResponse{Data: buf[:k]}); err != nil {
				return err
			}
		}
		switch {
		case err == io.EOF || err == io.ErrUnexpectedEOF:
			return nil
		case err != nil:
			return fsError("read", p, err)
		}
	}
}

func notRegular(op, p string, fi fs.FileInfo) error {
	if fi.IsDir() {
		return fsError(op, p, syscall.EISDIR)
	}
	return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("%s %s: not a regular file", op, p))
}
