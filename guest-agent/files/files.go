//go:build linux

// Package files serves carrel.agent.v1.FileService: file operations on
// absolute guest paths, done as the agent's own user (root for now).
//
// Symlinks: Stat, Chown, Remove, Rename and Write act on a final symlink
// itself (Write replaces the link with a regular file); Read, Chmod and List
// follow it. Symlinks below a List root are listed, never descended.
//
// Once the host has set a sandbox (Options.Sandbox), every path must lie
// under one of its roots, and not at or beneath one of its secret paths:
// reads (stat, list, read, read tar, watch) under any root, writes (write,
// mkdir, remove, rename, chmod, chown, write tar) under a read-write one.
// A path belongs to the longest root it lies under, and the operation goes
// through an os.Root there, so no symlink or ".." leads out of that root;
// an absolute symlink is refused even when it points inside. Paths are
// checked again as the kernel resolves them, so a symlink to a secret path
// is refused too (a symlink swapped in between that check and the
// operation can still reach a secret in the same root; the root itself
// always holds). Rename works within one root. Walks (list, read tar,
// watch) leave secret paths out; remove, rename and write tar refuse a tree
// with a secret path in it; a root itself cannot be removed or renamed.
// Everything refused is CodePermissionDenied, "refused by the guest
// sandbox". Before the first sandbox, the whole file system is open.
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
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
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
	// Sandbox, if set, confines every operation to the roots of the
	// sandbox in force (see the package comment). nil, or a Guard with no
	// sandbox yet, leaves the whole file system open.
	Sandbox *sandbox.Guard
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
	pl, err := s.resolve("stat", req.Msg.GetPath(), readAccess)
	if err != nil {
		return nil, err
	}
	defer pl.close()
	p := pl.path
	if _, err := pl.resolved("stat", false); err != nil {
		return nil, err
	}
	fi, err := pl.t.Lstat(pl.name)
	if err != nil {
		return nil, fsError("stat", p, err)
	}
	info, err := fileInfo(p, fi, func() (string, error) { return pl.t.Readlink(pl.name) })
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
	pl, err := s.resolve("list", req.Msg.GetPath(), readAccess)
	if err != nil {
		return err
	}
	defer pl.close()
	root := pl.path
	resolved, err := pl.resolved("list", true)
	if err != nil {
		return err
	}
	if fi, err := pl.t.Stat(pl.name); err != nil {
		return fsError("list", root, err)
	} else if !fi.IsDir() {
		return fsError("list", root, syscall.ENOTDIR)
	}
	maxEntries := limit(req.Msg.GetMaxEntries(), s.opts.MaxListEntries)
	maxDepth := 1
	if req.Msg.GetRecursive() {
		maxDepth = limit(req.Msg.GetMaxDepth(), s.opts.MaxDepth)
	}
	walk, t, err := walker(pl)
	if err != nil {
		return fsError("list", root, err)
	}
	if c, ok := t.(io.Closer); ok {
		defer c.Close()
	}

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
	err = walk(func(rel, name string, d fs.DirEntry, err error) error {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if rel == "." {
			if err != nil {
				return fsError("list", root, err)
			}
			return nil
		}
		p := pl.display(rel)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // removed while we walked
			}
			return fsError("list", p, err)
		}
		if pl.deniedIn(resolved, rel) {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		if count == maxEntries {
			truncated = true
			return fs.SkipAll
		}
		fi, err := d.Info()
		if err == nil {
			var info *agentv1.FileInfo
			if info, err = fileInfo(p, fi, func() (string, error) { return t.Readlink(name) }); err == nil {
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
		if d.IsDir() && strings.Count(rel, "/")+1 >= maxDepth {
			if req.Msg.GetRecursive() && !truncated && hasEntries(t, name) {
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

// walkFunc is called for each entry of a walk: rel is its path from the
// walked directory ("." for the directory itself), name what the walker's
// tree calls it.
type walkFunc func(rel, name string, d fs.DirEntry, err error) error

// walker walks the directory at the place, following a symlink there but
// none below it, depth first and by name: through the whole file system
// without a sandbox, else through an os.Root at the directory, which
// entries cannot lead out of. The tree returned reaches the entries by
// their names; close it if it is an io.Closer.
func walker(pl *place) (func(walkFunc) error, fileTree, error) {
	if !pl.sandboxed() {
		// The trailing slash makes WalkDir follow a symlink at the
		// directory; paths below come out clean.
		walkRoot := strings.TrimSuffix(pl.path, "/") + "/"
		return func(fn walkFunc) error {
			return filepath.WalkDir(walkRoot, func(p string, d fs.DirEntry, err error) error {
				rel := "."
				if p != walkRoot {
					rel = p[len(walkRoot):]
				}
				return fn(rel, p, d, err)
			})
		}, hostTree{}, nil
	}
	sub, err := pl.root.OpenRoot(pl.name)
	if err != nil {
		return nil, nil, err
	}
	return func(fn walkFunc) error {
		return fs.WalkDir(sub.FS(), ".", func(rel string, d fs.DirEntry, err error) error {
			return fn(rel, rel, d, err)
		})
	}, sub, nil
}

// Read streams a regular file from offset, length bytes or (length 0) to
// its end, in chunks of at most Options.ReadChunk. An offset at or past the
// end yields no messages. CodeFailedPrecondition if path is not a regular
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

// MakeDir creates a directory with exactly the given mode (0 means 0755;
// the umask does not apply). With parents, missing parents are created
// with 0755 and an existing directory (or symlink to one) is success, left
// as it is; without, anything existing is CodeAlreadyExists.
func (s *Service) MakeDir(_ context.Context, req *connect.Request[agentv1.MakeDirRequest]) (*connect.Response[agentv1.MakeDirResponse], error) {
	pl, err := s.resolve("mkdir", req.Msg.GetPath(), writeAccess)
	if err != nil {
		return nil, err
	}
	defer pl.close()
	p := pl.path
	if _, err := pl.resolved("mkdir", false); err != nil {
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
		if err := pl.t.MkdirAll(filepath.Dir(pl.name), 0o755); err != nil {
			return nil, fsError("mkdir", p, err)
		}
	}
	// The umask narrows the mode here; Chmod sets it exactly.
	if err := pl.t.Mkdir(pl.name, fileMode(m)&fs.ModePerm); err != nil {
		if req.Msg.GetParents() && errors.Is(err, fs.ErrExist) {
			if fi, serr := pl.t.Stat(pl.name); serr == nil && fi.IsDir() {
				return connect.NewResponse(&agentv1.MakeDirResponse{}), nil
			}
		}
		return nil, fsError("mkdir", p, err)
	}
	if err := pl.t.Chmod(pl.name, fileMode(m)); err != nil {
		return nil, fsError("mkdir", p, err)
	}
	if o := s.opts.Owner; o != nil {
		if err := pl.t.Lchown(pl.name, o.UID, o.GID); err != nil {
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
	pl, err := s.resolve("remove", req.Msg.GetPath(), writeAccess)
	if err != nil {
		return nil, err
	}
	defer pl.close()
	p := pl.path
	if p == "/" {
		return nil, invalid("remove /: refused")
	}
	if pl.isRoot() {
		return nil, refused("remove", p, "it is a root of the sandbox")
	}
	resolved, err := pl.resolved("remove", false)
	if err != nil {
		return nil, err
	}
	if err := pl.deniedBeneath("remove", resolved); err != nil {
		return nil, err
	}
	if !req.Msg.GetRecursive() {
		err = pl.t.Remove(pl.name)
	} else if _, err = pl.t.Lstat(pl.name); err == nil {
		err = pl.t.RemoveAll(pl.name)
	}
	if err != nil {
		return nil, fsError("remove", p, err)
	}
	return connect.NewResponse(&agentv1.RemoveResponse{}), nil
}

// Rename moves from to to, replacing to if it is a file (or symlink);
// CodeAlreadyExists if to is a directory.
func (s *Service) Rename(_ context.Context, req *connect.Request[agentv1.RenameRequest]) (*connect.Response[agentv1.RenameResponse], error) {
	sb := s.opts.Sandbox.Current() // one sandbox for both paths
	src, err := resolveIn(sb, "rename", req.Msg.GetFrom(), writeAccess)
	if err != nil {
		return nil, err
	}
	defer src.close()
	dst, err := resolveIn(sb, "rename", req.Msg.GetTo(), writeAccess)
	if err != nil {
		return nil, err
	}
	defer dst.close()
	from, to := src.path, dst.path
	if src.sandboxed() {
		if src.rootPath != dst.rootPath {
			return nil, refused("rename", from+" to "+to, "they lie under different roots (%s and %s)", src.rootPath, dst.rootPath)
		}
		for _, pl := range []*place{src, dst} {
			if pl.isRoot() {
				return nil, refused("rename", from+" to "+to, "%s is a root of the sandbox", pl.path)
			}
			resolved, err := pl.resolved("rename", false)
			if err != nil {
				return nil, err
			}
			if err := pl.deniedBeneath("rename", resolved); err != nil {
				return nil, err
			}
		}
	}
	if err := src.t.Rename(src.name, dst.name); err != nil {
		return nil, fsError("rename", from+" to "+to, err)
	}
	return connect.NewResponse(&agentv1.RenameResponse{}), nil
}

// Chmod sets the mode of path (following a symlink) to exactly mode, which
// must fit in the low 12 bits (CodeInvalidArgument otherwise).
func (s *Service) Chmod(_ context.Context, req *connect.Request[agentv1.ChmodRequest]) (*connect.Response[agentv1.ChmodResponse], error) {
	pl, err := s.resolve("chmod", req.Msg.GetPath(), writeAccess)
	if err != nil {
		return nil, err
	}
	defer pl.close()
	p := pl.path
	if m := req.Msg.GetMode(); m > modeBits {
		return nil, invalid("chmod %s: mode %#o has bits above %#o", p, m, modeBits)
	}
	if _, err := pl.resolved("chmod", true); err != nil {
		return nil, err
	}
	if err := pl.t.Chmod(pl.name, fileMode(req.Msg.GetMode())); err != nil {
		return nil, fsError("chmod", p, err)
	}
	return connect.NewResponse(&agentv1.ChmodResponse{}), nil
}

// Chown sets the owner and group of path, not following a final symlink;
// -1 leaves one unchanged. Ids must be -1 or in [0, 2^32-2]
// (CodeInvalidArgument otherwise; 2^32-1 is the kernel's "unchanged").
func (s *Service) Chown(_ context.Context, req *connect.Request[agentv1.ChownRequest]) (*connect.Response[agentv1.ChownResponse], error) {
	pl, err := s.resolve("chown", req.Msg.GetPath(), writeAccess)
	if err != nil {
		return nil, err
	}
	defer pl.close()
	p := pl.path
	uid, gid := req.Msg.GetUid(), req.Msg.GetGid()
	for _, id := range []int64{uid, gid} {
		if id < -1 || id >= math.MaxUint32 {
			return nil, invalid("chown %s: id %d out of range", p, id)
		}
	}
	if _, err := pl.resolved("chown", false); err != nil {
		return nil, err
	}
	if err := pl.t.Lchown(pl.name, int(uid), int(gid)); err != nil {
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

// fileInfo describes p from its Lstat result; readlink reads it if it is
// a symlink.
func fileInfo(p string, fi fs.FileInfo, readlink func() (string, error)) (*agentv1.FileInfo, error) {
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
		target, err := readlink()
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

// hasEntries reports whether the directory dir in t has at least one
// entry.
func hasEntries(t fileTree, dir string) bool {
	f, err := t.OpenFile(dir, os.O_RDONLY, 0)
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
	if escapes(err) {
		return refused(op, what, "a symlink or \"..\" in the path leads out of its root (symlinks must be relative and stay inside)")
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
