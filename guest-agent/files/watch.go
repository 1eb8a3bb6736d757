//go:build linux

package files

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/watch"
)

// MaxWatchRate caps the events a second one Watch may ask for.
const MaxWatchRate = 10_000

var watchOps = map[watch.Op]agentv1.WatchOp{
	watch.Create: agentv1.WatchOp_WATCH_OP_CREATE,
	watch.Modify: agentv1.WatchOp_WATCH_OP_MODIFY,
	watch.Delete: agentv1.WatchOp_WATCH_OP_DELETE,
	watch.Rename: agentv1.WatchOp_WATCH_OP_RENAME,
}

// Watch streams changes below a directory (see package watch for what is
// reported and how), at most the request's rate (default
// watch.DefaultRate, at most MaxWatchRate) a second. Names that are not
// UTF-8 are sent with "?" in place of each run of bad bytes.
// CodeFailedPrecondition if path is not a directory; CodeResourceExhausted
// when the kernel's inotify limits are reached.
//
// Under a sandbox the directory must resolve inside its root; events for
// secret paths beneath it are left out (and not counted as dropped).
// Subdirectories are watched as found, never through a symlink, so the
// watch stays in the directory's own tree.
func (s *Service) Watch(ctx context.Context, req *connect.Request[agentv1.WatchRequest], stream *connect.ServerStream[agentv1.WatchResponse]) error {
	pl, err := s.resolve("watch", req.Msg.GetPath(), readAccess)
	if err != nil {
		return err
	}
	p := pl.path
	resolved, err := pl.resolved("watch", true)
	if err == nil && pl.sandboxed() {
		// Refuses a symlink at p that leads out of the root.
		_, err = pl.t.Stat(pl.name)
		if err != nil {
			err = fsError("watch", p, err)
		}
	}
	pl.close()
	if err != nil {
		return err
	}
	rate := int(min(req.Msg.GetMaxEventsPerSecond(), MaxWatchRate))
	opts := watch.Options{Recursive: req.Msg.GetRecursive(), Rate: rate}
	err = watch.Run(ctx, p, opts, func(b watch.Batch) error {
		if n := len(b.Events); n > 0 && pl.sandboxed() {
			b.Events = slices.DeleteFunc(b.Events, func(e watch.Event) bool {
				return pl.deniedIn(resolved, relTo(p, e.Path)) || (e.OldPath != "" && pl.deniedIn(resolved, relTo(p, e.OldPath)))
			})
			if len(b.Events) == 0 && b.Dropped == 0 && b.UnwatchedDirs == 0 {
				return nil // only secrets: nothing to say
			}
		}
		return stream.Send(watchResponse(b))
	})
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.EMFILE), errors.Is(err, unix.ENOSPC):
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("watch %s: inotify limit reached: %w", p, err))
	}
	return fsError("watch", p, err)
}

// relTo returns the path of an event's path from the watched directory
// dir, which it begins with.
func relTo(dir, p string) string {
	if p == dir {
		return "."
	}
	return strings.TrimPrefix(strings.TrimPrefix(p, dir), "/")
}

func watchResponse(b watch.Batch) *agentv1.WatchResponse {
	msg := &agentv1.WatchResponse{Dropped: b.Dropped, UnwatchedDirs: b.UnwatchedDirs}
	for _, e := range b.Events {
		ev := &agentv1.WatchEvent{
			Op:           watchOps[e.Op],
			Path:         strings.ToValidUTF8(e.Path, "?"),
			IsDir:        e.IsDir,
			TimeUnixNano: e.Time.UnixNano(),
		}
		if e.OldPath != "" {
			ev.OldPath = strings.ToValidUTF8(e.OldPath, "?")
		}
		msg.Events = append(msg.Events, ev)
	}
	return msg
}
