//go:build linux

package files

import (
	"context"
	"errors"
	"io/fs"
	"math"
	"path/filepath"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

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
