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
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

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
	// DefaultReadChunk fills a message: fewer, larger messages cost the
	// guest less per byte.
	DefaultReadChunk = maxReadChunk
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
	// Data, if set, carries the content of writes and reads that name a
	// transfer (WriteHeader.bulk_id, ReadRequest.bulk_id) beside the
	// stream. nil refuses such calls with CodeFailedPrecondition.
	Data DataPort
}

// DataPort carries file content in frames beside the RPC
// (transport.DataPort on the data port).
type DataPort interface {
	// Receive writes transfer id's content to w and returns once it has
	// all come.
	Receive(ctx context.Context, id uint64, w io.Writer) (int64, error)
	// Send sends r's content, to its EOF, as transfer id.
	Send(ctx context.Context, id uint64, r io.Reader) (int64, error)
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
