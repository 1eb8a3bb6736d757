//go:build linux

package files

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

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
