//go:build linux

package files

import (
	"context"
	"errors"
	"fmt"
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
func (s *Service) Watch(ctx context.Context, req *connect.Request[agentv1.WatchRequest], stream *connect.ServerStream[agentv1.WatchResponse]) error {
	p, err := cleanPath("watch", req.Msg.GetPath())
	if err != nil {
		return err
	}
	rate := int(min(req.Msg.GetMaxEventsPerSecond(), MaxWatchRate))
	opts := watch.Options{Recursive: req.Msg.GetRecursive(), Rate: rate}
	err = watch.Run(ctx, p, opts, func(b watch.Batch) error {
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
