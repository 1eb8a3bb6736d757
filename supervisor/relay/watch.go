package relay

import (
	"context"
	"errors"
	"path"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
)

// Caps on a watch relayed from the guest.
const (
	// DefaultWatchRate is the events a second asked of the guest when the
	// client names no rate; MaxWatchRate is the most a client may ask.
	DefaultWatchRate = 1000
	MaxWatchRate     = 10_000
	// MaxWatchBatch is the most events in one message.
	MaxWatchBatch = 1024
	// watchRateWindow is how long a guest may average twice the rate
	// asked of it before its stream is ended.
	watchRateWindow = 5 * time.Second
	// watchFlushesPerSecond is how often a well-behaved agent sends a
	// message that is not full (it flushes every 50 ms).
	watchFlushesPerSecond = 20
)

// ErrWatchRate ends a watch whose guest sent more than it was asked for.
var ErrWatchRate = errors.New("guest exceeded the watch event rate")

// Watch relays a watch of a guest directory. Every message is checked
// (checkWatch), and the guest is held to twice the rate asked of it,
// averaged over watchRateWindow, in events and in messages; a guest over
// it has its stream ended with CodeResourceExhausted. Time this relay
// spends waiting on a slow client earns the guest that much more, since
// what the guest sent meanwhile arrives at once.
func (r fileRelay) Watch(ctx context.Context, req *connect.Request[agentv1.WatchRequest], out *connect.ServerStream[agentv1.WatchResponse]) error {
	p := req.Msg.Path
	if !strings.HasPrefix(p, "/") || strings.ContainsRune(p, 0) || len(p) > MaxPathBytes {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("watch: the path must be absolute, without NUL bytes, at most 4096 bytes"))
	}
	root := path.Clean(p)
	if err := r.allowFile(ctx, req.Header(), policy.OpWatch, &root, req.Msg.Recursive); err != nil {
		return err
	}
	rate := req.Msg.MaxEventsPerSecond
	if rate == 0 {
		rate = DefaultWatchRate
	}
	rate = min(rate, MaxWatchRate)

	c, done, err := r.files(req.Header())
	if err != nil {
		return err
	}
	rc := r.records(ctx, req.Header())
	ctx, cancel := context.WithCancel(ctx)
	s, err := c.Watch(ctx, connect.NewRequest(&agentv1.WatchRequest{Path: root, Recursive: req.Msg.Recursive, MaxEventsPerSecond: rate}))
	if err != nil {
		err = relayErr(ctx, done, err) // before cancel, which would hide a broken link
		cancel()
		return err
	}
	defer func() {
		cancel() // first, so that Close does not drain a flood
		s.Close()
	}()
	now := time.Now()
	events := newBucket(2*float64(rate), watchRateWindow, now)
	// Besides timed flushes, a full message (256 events, or fewer with long
	// paths) may go at any time.
	msgs := newBucket(2*(watchFlushesPerSecond+float64(rate)/32), watchRateWindow, now)
	for s.Receive() {
		msg := s.Msg()
		if err := checkWatch(root, req.Msg.Recursive, msg); err != nil {
			return err
		}
		now := time.Now()
		if !events.take(now, float64(len(msg.Events))) || !msgs.take(now, 1) {
			return connect.NewError(connect.CodeResourceExhausted, ErrWatchRate)
		}
		if err := rc.Watch(ctx, root, msg); err != nil {
			return err
		}
		if err := out.Send(msg); err != nil {
			return err
		}
		waited := time.Since(now)
		events.credit(waited)
		msgs.credit(waited)
	}
	return relayErr(ctx, done, s.Err())
}

// checkWatch checks one message of a watch of root.
func checkWatch(root string, recursive bool, msg *agentv1.WatchResponse) error {
	if len(msg.Events) > MaxWatchBatch {
		return errGuest("%d watch events in one message", len(msg.Events))
	}
	for _, e := range msg.Events {
		if e == nil {
			return errGuest("missing watch event")
		}
		switch e.Op {
		case agentv1.WatchOp_WATCH_OP_CREATE, agentv1.WatchOp_WATCH_OP_MODIFY, agentv1.WatchOp_WATCH_OP_DELETE:
			if e.OldPath != "" {
				return errGuest("old path on a %s event", e.Op)
			}
		case agentv1.WatchOp_WATCH_OP_RENAME:
			if err := checkWatchPath(root, recursive, e.OldPath); err != nil {
				return err
			}
		default:
			return errGuest("invalid watch op %d", e.Op)
		}
		if err := checkWatchPath(root, recursive, e.Path); err != nil {
			return err
		}
	}
	return nil
}

// checkWatchPath checks that p is a clean absolute path at or below root
// (just below it, unless recursive).
func checkWatchPath(root string, recursive bool, p string) error {
	switch {
	case len(p) > MaxPathBytes:
		return errGuest("path over %d bytes", MaxPathBytes)
	case !strings.HasPrefix(p, "/") || strings.ContainsRune(p, 0) || path.Clean(p) != p:
		return errGuest("invalid path %q", protocol.CleanText(p, 256))
	}
	in := p == root || strings.HasPrefix(p, root+"/") || (root == "/" && p != "/")
	if in && !recursive && p != root {
		in = path.Dir(p) == root
	}
	if !in {
		return errGuest("path %q outside the watched directory", protocol.CleanText(p, 256))
	}
	return nil
}

// bucket is a token bucket: rate tokens a second, holding at most window's
// worth, full to begin with.
type bucket struct {
	rate, cap, tokens float64
	last              time.Time
}

func newBucket(rate float64, window time.Duration, now time.Time) *bucket {
	c := rate * window.Seconds()
	return &bucket{rate: rate, cap: c, tokens: c, last: now}
}

// take spends n tokens, if there are that many.
func (b *bucket) take(now time.Time, n float64) bool {
	if d := now.Sub(b.last); d > 0 {
		// Refilling never takes away credit beyond the cap.
		if t := b.tokens + d.Seconds()*b.rate; t < b.cap {
			b.tokens = t
		} else {
			b.tokens = max(b.tokens, b.cap)
		}
		b.last = now
	}
	if b.tokens < n {
		return false
	}
	b.tokens -= n
	return true
}

// credit adds d's worth of tokens, beyond the cap if need be.
func (b *bucket) credit(d time.Duration) {
	b.tokens += d.Seconds() * b.rate
}
