package client

import (
	"context"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// WatchOptions tunes Watch.
type WatchOptions struct {
	// Recursive watches every subdirectory too, including new ones.
	Recursive bool
	// MaxEventsPerSecond is the most events a second to be sent; the
	// rest are counted in WatchResponse.Dropped. 0 means carreld's default
	// (1000); carreld lowers values over its cap (10000).
	MaxEventsPerSecond uint32
}

// Watch streams changes below the directory path in vm to fn, one message
// at a time: the first, with no events, once the watch is in place. It
// runs until ctx ends (it returns ctx's error), fn returns an error (it
// returns that), the call fails, or the directory itself is removed or
// moved away (the last message reports its delete; Watch returns nil).
func (c *Client) Watch(ctx context.Context, vm, path string, opts WatchOptions, fn func(*agentv1.WatchResponse) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := c.Files.Watch(ctx, ForVM(vm, &agentv1.WatchRequest{Path: path, Recursive: opts.Recursive, MaxEventsPerSecond: opts.MaxEventsPerSecond}))
	if err != nil {
		return err
	}
	defer s.Close()
	for s.Receive() {
		if err := fn(s.Msg()); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return s.Err()
}
