//go:build linux

package files

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// Write takes a header, data messages and a commit (or, when the header
// names a transfer, the content on the data port and then the commit), writes the data to a
// temporary file beside the target, and only after the commit fsyncs it,
// renames it over the target and fsyncs the directory: readers see the old
// file or the new one, never a part. On any error, including the client
// cancelling or closing its side without a commit (CodeAborted), the
// target is untouched and the temporary file removed.
//
// The new file gets the header's mode; with mode 0 it keeps an existing
// regular file's mode, else gets 0644. It keeps an existing regular file's
// owner. A symlink at path is replaced, not followed.
// CodeInvalidArgument if the first message is not a header, a later one
// is, or anything follows the commit; CodeFailedPrecondition if path is a
// directory.
func (s *Service) Write(ctx context.Context, stream *connect.ClientStream[agentv1.WriteRequest]) (*connect.Response[agentv1.WriteResponse], error) {
	if !stream.Receive() {
		if err := stream.Err(); err != nil {
			return nil, err
		}
		return nil, invalid("write: no header")
	}
	hdr := stream.Msg().GetHeader()
	if hdr == nil {
		return nil, invalid("write: first message is not a header")
	}
	pl, err := s.resolve("write", hdr.GetPath(), writeAccess)
	if err != nil {
		return nil, err
	}
	defer pl.close()
	p := pl.path
	if hdr.GetMode() > modeBits {
		return nil, invalid("write %s: mode %#o has bits above %#o", p, hdr.GetMode(), modeBits)
	}
	if _, err := pl.resolved("write", false); err != nil {
		return nil, err
	}
	mode := hdr.GetMode()
	var existing *syscall.Stat_t // an existing regular file's, to keep
	switch fi, err := pl.t.Lstat(pl.name); {
	case err == nil && fi.IsDir():
		return nil, fsError("write", p, syscall.EISDIR)
	case err == nil && fi.Mode().IsRegular():
		existing, _ = fi.Sys().(*syscall.Stat_t)
	case err != nil && !errors.Is(err, fs.ErrNotExist):
		return nil, fsError("write", p, err)
	}
	if mode == 0 {
		mode = 0o644
		if existing != nil {
			mode = existing.Mode & modeBits
		}
	}
	dir := filepath.Dir(pl.name)
	if hdr.GetMakeParents() {
		if err := pl.t.MkdirAll(dir, 0o755); err != nil {
			return nil, fsError("write", p, err)
		}
	}

	f, tmp, err := createTemp(pl.t, dir)
	if err != nil {
		return nil, fsError("write", p, err)
	}
	done := false
	defer func() {
		if !done {
			f.Close()
			pl.t.Remove(tmp)
		}
	}()
	if err := f.Chmod(fileMode(mode)); err != nil {
		return nil, fsError("write", p, err)
	}
	if existing != nil {
		if err := keepOwner(f, existing); err != nil {
			return nil, fsError("write", p, err)
		}
	} else if o := s.opts.Owner; o != nil {
		if err := f.Chown(o.UID, o.GID); err != nil {
			return nil, fsError("write", p, err)
		}
	}
	var size int64
	if id := hdr.GetBulkId(); id != 0 {
		if s.opts.Data == nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("write %s: the content was sent on a data port, and this agent has none", p))
		}
		if size, err = s.opts.Data.Receive(ctx, id, f); err != nil {
			if errors.Is(err, protocol.ErrTransferAborted) {
				return nil, connect.NewError(connect.CodeAborted, fmt.Errorf("write %s: the host gave the write up; nothing was written", p))
			}
			return nil, fsError("write", p, err)
		}
	}
	committed := false
	for stream.Receive() {
		if committed {
			return nil, invalid("write %s: a message after the commit", p)
		}
		switch m := stream.Msg().GetMsg().(type) {
		case *agentv1.WriteRequest_Data:
			if hdr.GetBulkId() != 0 {
				return nil, invalid("write %s: a data message, with the content on the data port", p)
			}
			if _, err := f.Write(m.Data); err != nil {
				return nil, fsError("write", p, err)
			}
			size += int64(len(m.Data))
		case *agentv1.WriteRequest_Commit:
			committed = true
		default:
			return nil, invalid("write %s: a message after the header is neither data nor the commit", p)
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	if !committed {
		return nil, connect.NewError(connect.CodeAborted, fmt.Errorf("write %s: the stream ended without a commit; nothing was written", p))
	}
	if err := ctx.Err(); err != nil {
		return nil, fsError("write", p, err)
	}
	if err := f.Sync(); err != nil {
		return nil, fsError("write", p, err)
	}
	if err := f.Close(); err != nil {
		return nil, fsError("write", p, err)
	}
	if err := pl.t.Rename(tmp, pl.name); err != nil {
		return nil, fsError("write", p, err)
	}
	done = true
	if err := syncDir(pl.t, dir); err != nil {
		return nil, fsError("write", p, fmt.Errorf("written, but not durable: %w", err))
	}
	// No digest: carreld hashes what it forwarded, which a guest cannot
	// forge, and hashing here costs more than the write under TCG.
	return connect.NewResponse(&agentv1.WriteResponse{Size: size}), nil
}

// keepOwner gives f the owner and group in st where they differ.
func keepOwner(f *os.File, st *syscall.Stat_t) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if cur, ok := fi.Sys().(*syscall.Stat_t); ok && cur.Uid == st.Uid && cur.Gid == st.Gid {
		return nil
	}
	return f.Chown(int(st.Uid), int(st.Gid))
}

// createTemp creates a new file for Write in dir, in t: named after
// tempPattern, mode 0600.
func createTemp(t fileTree, dir string) (*os.File, string, error) {
	for range 10000 {
		name := filepath.Join(dir, strings.Replace(tempPattern, "*", strconv.FormatUint(uint64(rand.Uint32()), 10), 1))
		f, err := t.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		return f, name, err
	}
	return nil, "", &fs.PathError{Op: "createtemp", Path: filepath.Join(dir, tempPattern), Err: fs.ErrExist}
}

func syncDir(t fileTree, dir string) error {
	d, err := t.OpenFile(dir, os.O_RDONLY, 0)
	if err != nil {
		return err
	}
	return errors.Join(d.Sync(), d.Close())
}
