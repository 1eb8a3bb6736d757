//go:build linux

// Package files serves carrel.agent.v1.FileService: file operations on
// absolute guest paths, done as the agent's own user (root for now).
//
// Symlinks: Stat, Chown, Remove, Rename and Write act on a final symlink
// itself (Write replaces the link with a regular file); Read, Chmod and List
// follow it. Symlinks below a List root are listed, never descended.
//
// Every error is a *connect.Error whose message names the operation and the
// path, e.g. "stat /x: no such file or directory".
package files

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/tarfs"
)

// Defaults for Options.
const (
	DefaultMaxListEntries = 100000
	DefaultMaxDepth       = 64
	DefaultListBatch      = 256
	DefaultReadChunk      = 256 << 10
)

const (
	// maxReadChunk leaves room for the ReadResponse framing within
	// protocol.MaxMessageBytes.
	maxReadChunk = protocol.MaxMessageBytes - 1024
	// listBatchBytes flushes a List batch early when long paths would
	// otherwise push it towards protocol.MaxMessageBytes.
	listBatchBytes = protocol.MaxMessageBytes / 2
	// modeBits are the bits a mode may carry: rwx for all, setuid, setgid,
	// sticky.
	modeBits = 0o7777
	// tempPattern names Write's temporary files, beside their targets.
	tempPattern = ".carrel-write-*"
)

// Options bounds what one call may do. Zero fields take the defaults.
// Write chunks are bounded by the handler's read limit
// (protocol.HandlerOptions: protocol.MaxMessageBytes per message).
type Options struct {
	// MaxListEntries caps the entries one List call returns; a request may
	// ask for fewer.
	MaxListEntries int
	// MaxDepth caps how deep a recursive List goes (1 = the directory's own
	// entries); a request may ask for less.
	MaxDepth int
	// ListBatch is the most entries in one ListResponse.
	ListBatch int
	// ReadChunk is the most bytes in one ReadResponse; values above
	// protocol.MaxMessageBytes less 1 KiB are lowered to that.
	ReadChunk int
	// Owner, if set, owns what the service creates: new files, new
	// directories and extracted archives (an existing file keeps its
	// owner). carrel-agent sets it to the agent user, so that what the
	// host puts in the guest belongs to the user commands run as.
	Owner *tarfs.Owner
}

// Service implements FileService. It is safe for concurrent use.
type Service struct {
	opts Options
}

var _ agentv1connect.FileServiceHandler = (*Service)(nil)

// New returns a Service with opts, defaults filled in.
func New(opts Options) *Service {
	if opts.MaxListEntries <= 0 {
		opts.MaxListEntries = DefaultMaxListEntries
	}
	if opts.MaxDepth <= 0 {
		opts.MaxDepth = DefaultMaxDepth
	}
	if opts.ListBatch <= 0 {
		opts.ListBatch = DefaultListBatch
	}
	if opts.ReadChunk <= 0 {
		opts.ReadChunk = DefaultReadChunk
	}
	opts.ReadChunk = min(opts.ReadChunk, maxReadChunk)
	return &Service{opts: opts}
}

// Stat describes path without following a final symlink. CodeNotFound if
// it does not exist.
func (s *Service) Stat(_ context.Context, req *connect.Request[agentv1.StatRequest]) (*connect.Response[agentv1.StatResponse], error) {
	p, err := cleanPath("stat", req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	fi, err := os.Lstat(p)
	if err != nil {
		return nil, fsError("stat", p, err)
	}
	info, err := fileInfo(p, fi)
	if err != nil {
		return nil, fsError("stat", p, err)
	}
	return connect.NewResponse(&agentv1.StatResponse{Info: info}), nil
}

// List streams the entries below a directory (not the directory itself) in
// batches of at most Options.ListBatch, depth first and by name within each
// directory. A symlink at path is followed; symlinks below it are listed,
// not descended. When the entry cap or the depth cap (recursive only) left
// something out, the last message has truncated set. An empty directory
// yields no messages. CodeFailedPrecondition if path is not a directory.
func (s *Service) List(ctx context.Context, req *connect.Request[agentv1.ListRequest], stream *connect.ServerStream[agentv1.ListResponse]) error {
	root, err := cleanPath("list", req.Msg.GetPath())
	if err != nil {
		return err
	}
	if fi, err := os.Stat(root); err != nil {
		return fsError("list", root, err)
	} else if !fi.IsDir() {
		return fsError("list", root, syscall.ENOTDIR)
	}
	maxEntries := limit(req.Msg.GetMaxEntries(), s.opts.MaxListEntries)
	maxDepth := 1
	if req.Msg.GetRecursive() {
		maxDepth = limit(req.Msg.GetMaxDepth(), s.opts.MaxDepth)
	}
	// The trailing slash makes WalkDir follow a symlink at root; paths
	// below come out clean.
	walkRoot := strings.TrimSuffix(root, "/") + "/"
	baseDepth := strings.Count(walkRoot, "/") - 1

	var (
		batch      []*agentv1.FileInfo
		batchBytes int
		count      int
		truncated  bool
	)
	flush := func(last bool) error {
		msg := &agentv1.ListResponse{Entries: batch, Truncated: last && truncated}
		batch, batchBytes = nil, 0
		return stream.Send(msg)
	}
	err = filepath.WalkDir(walkRoot, func(p string, d fs.DirEntry, err error) error {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if p == walkRoot {
			if err != nil {
				return fsError("list", root, err)
			}
			return nil
		}
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // removed while we walked
			}
			return fsError("list", p, err)
		}
		if count == maxEntries {
			truncated = true
			return fs.SkipAll
		}
		fi, err := d.Info()
		if err == nil {
			var info *agentv1.FileInfo
			if info, err = fileInfo(p, fi); err == nil {
				batch = append(batch, info)
				batchBytes += proto.Size(info)
				count++
			}
		}
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		} else if err != nil {
			return fsError("list", p, err)
		}
		if len(batch) >= s.opts.ListBatch || batchBytes >= listBatchBytes {
			if err := flush(false); err != nil {
				return err
			}
		}
		if d.IsDir() && strings.Count(p, "/")-baseDepth >= maxDepth {
			if req.Msg.GetRecursive() && !truncated && hasEntries(p) {
				truncated = true
			}
			return fs.SkipDir
		}
		return nil
	})
	if err != nil {
		return fsError("list", root, err)
	}
	if len(batch) > 0 || truncated {
		return flush(true)
	}
	return nil
}

// Read streams a regular file from offset, length bytes or (length 0) to
// its end, in chunks of at most Options.ReadChunk. An offset at or past the
// end yields no messages. CodeFailedPrecondition if path is not a regular
// file; CodeInvalidArgument for a negative offset or length.
func (s *Service) Read(ctx context.Context, req *connect.Request[agentv1.ReadRequest], stream *connect.ServerStream[agentv1.ReadResponse]) error {
	p, err := cleanPath("read", req.Msg.GetPath())
	if err != nil {
		return err
	}
	off, n := req.Msg.GetOffset(), req.Msg.GetLength()
	if off < 0 || n < 0 {
		return invalid("read %s: negative offset or length", p)
	}
	if n == 0 {
		n = math.MaxInt64 - off
	}
	// Check before opening: opening a device can have side effects, and
	// O_NONBLOCK keeps a FIFO swapped in meanwhile from blocking the open.
	if fi, err := os.Stat(p); err != nil {
		return fsError("read", p, err)
	} else if !fi.Mode().IsRegular() {
		return notRegular("read", p, fi)
	}
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return fsError("read", p, err)
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil {
		return fsError("read", p, err)
	} else if !fi.Mode().IsRegular() {
		return notRegular("read", p, fi)
	}
	r := io.NewSectionReader(f, off, n)
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

// Write takes a header, data messages and a commit, writes the data to a
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
	p, err := cleanPath("write", hdr.GetPath())
	if err != nil {
		return nil, err
	}
	if hdr.GetMode() > modeBits {
		return nil, invalid("write %s: mode %#o has bits above %#o", p, hdr.GetMode(), modeBits)
	}
	mode := hdr.GetMode()
	var existing *syscall.Stat_t // an existing regular file's, to keep
	switch fi, err := os.Lstat(p); {
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
	dir := filepath.Dir(p)
	if hdr.GetMakeParents() {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fsError("write", p, err)
		}
	}

	f, err := os.CreateTemp(dir, tempPattern)
	if err != nil {
		return nil, fsError("write", p, err)
	}
	done := false
	defer func() {
		if !done {
			f.Close()
			os.Remove(f.Name())
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
	committed := false
	for stream.Receive() {
		if committed {
			return nil, invalid("write %s: a message after the commit", p)
		}
		switch m := stream.Msg().GetMsg().(type) {
		case *agentv1.WriteRequest_Data:
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
	if err := os.Rename(f.Name(), p); err != nil {
		return nil, fsError("write", p, err)
	}
	done = true
	if err := syncDir(dir); err != nil {
		return nil, fsError("write", p, fmt.Errorf("written, but not durable: %w", err))
	}
	// No digest: carreld hashes what it forwarded, which a guest cannot
	// forge, and hashing here costs more than the write under TCG.
	return connect.NewResponse(&agentv1.WriteResponse{Size: size}), nil
}

// MakeDir creates a directory with exactly the given mode (0 means 0755;
// the umask does not apply). With parents, missing parents are created
// with 0755 and an existing directory (or symlink to one) is success, left
// as it is; without, anything existing is CodeAlreadyExists.
func (s *Service) MakeDir(_ context.Context, req *connect.Request[agentv1.MakeDirRequest]) (*connect.Response[agentv1.MakeDirResponse], error) {
	p, err := cleanPath("mkdir", req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	m := req.Msg.GetMode()
	if m > modeBits {
		return nil, invalid("mkdir %s: mode %#o has bits above %#o", p, m, modeBits)
	}
	if m == 0 {
		m = 0o755
	}
	if req.Msg.GetParents() {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return nil, fsError("mkdir", p, err)
		}
	}
	if err := os.Mkdir(p, fileMode(m)); err != nil {
		if req.Msg.GetParents() && errors.Is(err, fs.ErrExist) {
			if fi, serr := os.Stat(p); serr == nil && fi.IsDir() {
				return connect.NewResponse(&agentv1.MakeDirResponse{}), nil
			}
		}
		return nil, fsError("mkdir", p, err)
	}
	if err := os.Chmod(p, fileMode(m)); err != nil {
		return nil, fsError("mkdir", p, err)
	}
	if o := s.opts.Owner; o != nil {
		if err := os.Lchown(p, o.UID, o.GID); err != nil {
			return nil, fsError("mkdir", p, err)
		}
	}
	return connect.NewResponse(&agentv1.MakeDirResponse{}), nil
}

// Remove removes a file, a symlink (not its target) or an empty directory;
// with recursive, a whole tree. CodeNotFound if path does not exist (also
// with recursive); CodeFailedPrecondition for a non-empty directory without
// recursive; CodeInvalidArgument for "/".
func (s *Service) Remove(_ context.Context, req *connect.Request[agentv1.RemoveRequest]) (*connect.Response[agentv1.RemoveResponse], error) {
	p, err := cleanPath("remove", req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if p == "/" {
		return nil, invalid("remove /: refused")
	}
	if !req.Msg.GetRecursive() {
		err = os.Remove(p)
	} else if _, err = os.Lstat(p); err == nil {
		err = os.RemoveAll(p)
	}
	if err != nil {
		return nil, fsError("remove", p, err)
	}
	return connect.NewResponse(&agentv1.RemoveResponse{}), nil
}

// Rename moves from to to, replacing to if it is a file (or symlink);
// CodeAlreadyExists if to is a directory.
func (s *Service) Rename(_ context.Context, req *connect.Request[agentv1.RenameRequest]) (*connect.Response[agentv1.RenameResponse], error) {
	from, err := cleanPath("rename", req.Msg.GetFrom())
	if err != nil {
		return nil, err
	}
	to, err := cleanPath("rename", req.Msg.GetTo())
	if err != nil {
		return nil, err
	}
	if err := os.Rename(from, to); err != nil {
		return nil, fsError("rename", from+" to "+to, err)
	}
	return connect.NewResponse(&agentv1.RenameResponse{}), nil
}

// Chmod sets the mode of path (following a symlink) to exactly mode, which
// must fit in the low 12 bits (CodeInvalidArgument otherwise).
func (s *Service) Chmod(_ context.Context, req *connect.Request[agentv1.ChmodRequest]) (*connect.Response[agentv1.ChmodResponse], error) {
	p, err := cleanPath("chmod", req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if m := req.Msg.GetMode(); m > modeBits {
		return nil, invalid("chmod %s: mode %#o has bits above %#o", p, m, modeBits)
	}
	if err := os.Chmod(p, fileMode(req.Msg.GetMode())); err != nil {
		return nil, fsError("chmod", p, err)
	}
	return connect.NewResponse(&agentv1.ChmodResponse{}), nil
}

// Chown sets the owner and group of path, not following a final symlink;
// -1 leaves one unchanged. Ids must be -1 or in [0, 2^32-2]
// (CodeInvalidArgument otherwise; 2^32-1 is the kernel's "unchanged").
func (s *Service) Chown(_ context.Context, req *connect.Request[agentv1.ChownRequest]) (*connect.Response[agentv1.ChownResponse], error) {
	p, err := cleanPath("chown", req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	uid, gid := req.Msg.GetUid(), req.Msg.GetGid()
	for _, id := range []int64{uid, gid} {
		if id < -1 || id >= math.MaxUint32 {
			return nil, invalid("chown %s: id %d out of range", p, id)
		}
	}
	if err := os.Lchown(p, int(uid), int(gid)); err != nil {
		return nil, fsError("chown", p, err)
	}
	return connect.NewResponse(&agentv1.ChownResponse{}), nil
}

// cleanPath checks that p is a usable absolute path and cleans it.
func cleanPath(op, p string) (string, error) {
	switch {
	case p == "":
		return "", invalid("%s: empty path", op)
	case strings.IndexByte(p, 0) >= 0:
		return "", invalid("%s %q: path contains a NUL byte", op, p)
	case !filepath.IsAbs(p):
		return "", invalid("%s %q: path is not absolute", op, p)
	case len(p) >= unix.PathMax:
		return "", invalid("%s: path is %d bytes, the most is %d", op, len(p), unix.PathMax-1)
	}
	return filepath.Clean(p), nil
}

// fileInfo describes p from its Lstat result.
func fileInfo(p string, fi fs.FileInfo) (*agentv1.FileInfo, error) {
	info := &agentv1.FileInfo{
		Path:          p,
		Size:          fi.Size(),
		MtimeUnixNano: fi.ModTime().UnixNano(),
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		info.Mode = st.Mode & modeBits
		info.Uid, info.Gid = st.Uid, st.Gid
	}
	switch m := fi.Mode(); {
	case m.IsRegular():
		info.Type = agentv1.FileType_FILE_TYPE_REGULAR
	case m.IsDir():
		info.Type = agentv1.FileType_FILE_TYPE_DIRECTORY
	case m&fs.ModeSymlink != 0:
		info.Type = agentv1.FileType_FILE_TYPE_SYMLINK
		target, err := os.Readlink(p)
		if err != nil {
			return nil, err
		}
		info.LinkTarget = target
	default:
		info.Type = agentv1.FileType_FILE_TYPE_OTHER
	}
	return info, nil
}

// fileMode converts unix mode bits to an fs.FileMode that os.Chmod and
// os.Mkdir turn back into the same bits.
func fileMode(m uint32) fs.FileMode {
	fm := fs.FileMode(m & 0o777)
	if m&unix.S_ISUID != 0 {
		fm |= fs.ModeSetuid
	}
	if m&unix.S_ISGID != 0 {
		fm |= fs.ModeSetgid
	}
	if m&unix.S_ISVTX != 0 {
		fm |= fs.ModeSticky
	}
	return fm
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

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	return errors.Join(d.Sync(), d.Close())
}

// hasEntries reports whether the directory dir has at least one entry.
func hasEntries(dir string) bool {
	f, err := os.Open(dir)
	if err != nil {
		return false
	}
	defer f.Close()
	names, _ := f.Readdirnames(1)
	return len(names) > 0
}

// limit returns the request's limit if it is set and lower than ours.
func limit(req uint32, ours int) int {
	if req > 0 && int64(req) < int64(ours) {
		return int(req)
	}
	return ours
}

func invalid(format string, args ...any) error {
	return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf(format, args...))
}

func notRegular(op, p string, fi fs.FileInfo) error {
	if fi.IsDir() {
		return fsError(op, p, syscall.EISDIR)
	}
	return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("%s %s: not a regular file", op, p))
}

// fsError turns err from operating on what into a *connect.Error reading
// "op what: reason", with a code from the errno. A *connect.Error passes
// through unchanged.
func fsError(op, what string, err error) error {
	if ce := new(connect.Error); errors.As(err, &ce) {
		return ce
	}
	// Drop the os package's own "op path:" prefix; ours names the path as
	// the client gave it.
	reason := err
	var pe *fs.PathError
	var le *os.LinkError
	switch {
	case errors.As(err, &pe):
		reason = pe.Err
	case errors.As(err, &le):
		reason = le.Err
	}
	return connect.NewError(codeOf(err), fmt.Errorf("%s %s: %w", op, what, reason))
}

func codeOf(err error) connect.Code {
	switch {
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return connect.CodeInternal
	}
	switch errno {
	case unix.ENOENT:
		return connect.CodeNotFound
	case unix.EEXIST:
		return connect.CodeAlreadyExists
	case unix.EACCES, unix.EPERM:
		return connect.CodePermissionDenied
	case unix.ENOTDIR, unix.EISDIR, unix.ENOTEMPTY, unix.EXDEV,
		unix.EROFS, unix.EBUSY, unix.ELOOP, unix.ETXTBSY:
		return connect.CodeFailedPrecondition
	case unix.EINVAL, unix.ENAMETOOLONG:
		return connect.CodeInvalidArgument
	case unix.ENOSPC, unix.EDQUOT:
		return connect.CodeResourceExhausted
	}
	return connect.CodeInternal
}
