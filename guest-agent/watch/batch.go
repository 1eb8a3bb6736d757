package watch

import (
	"time"
)

// batcher gathers events into Batches: it merges repeated writes, holds
// events to the rate, and sends a batch when it is full or has waited its
// interval.
type batcher struct {
	opts Options
	send func(Batch) error
	err  error // the first send error; nothing is sent after it

	tokens float64
	last   time.Time

	cur   Batch
	bytes int
	// lastOp is the last op sent in cur for each path, to merge writes.
	lastOp  map[string]Op
	flushAt time.Time // zero: nothing waits
}

// eventOverhead approximates an event's encoding beyond its paths.
const eventOverhead = 32

func newBatcher(opts Options, send func(Batch) error, now time.Time) *batcher {
	return &batcher{opts: opts, send: send, tokens: float64(opts.Rate), last: now, lastOp: map[string]Op{}}
}

// add queues e, or counts it as dropped when it is over the rate or its
// paths are too long to send. A write to a path whose last event in the
// batch is a write is merged into it, and costs nothing.
func (b *batcher) add(e Event) {
	if b.err != nil {
		return
	}
	if e.Op == Modify && b.lastOp[e.Path] == Modify {
		return
	}
	if len(e.Path) > MaxPathBytes || len(e.OldPath) > MaxPathBytes || !b.take(e.Time) {
		b.drop(1, e.Time)
		return
	}
	b.cur.Events = append(b.cur.Events, e)
	b.bytes += len(e.Path) + len(e.OldPath) + eventOverhead
	b.lastOp[e.Path] = e.Op
	if e.Op == Rename {
		b.lastOp[e.OldPath] = Rename
	}
	b.arm(e.Time)
	if len(b.cur.Events) >= b.opts.MaxBatch || b.bytes >= b.opts.MaxBatchBytes {
		b.flush(false)
	}
}

// take spends one token of the rate's bucket, which holds a second's
// worth.
func (b *batcher) take(now time.Time) bool {
	if d := now.Sub(b.last); d > 0 {
		b.tokens = min(b.tokens+d.Seconds()*float64(b.opts.Rate), float64(b.opts.Rate))
		b.last = now
	}
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

func (b *batcher) drop(n uint64, now time.Time) {
	b.cur.Dropped += n
	b.arm(now)
}

func (b *batcher) unwatched(now time.Time) {
	b.cur.UnwatchedDirs++
	b.arm(now)
}

// arm starts the wait for the current batch, if it has not started.
func (b *batcher) arm(now time.Time) {
	if b.flushAt.IsZero() {
		b.flushAt = now.Add(b.opts.FlushInterval)
	}
}

// due reports whether the current batch has waited long enough.
func (b *batcher) due(now time.Time) bool {
	return !b.flushAt.IsZero() && !now.Before(b.flushAt)
}

// flush sends the current batch, if it holds anything or always is set.
func (b *batcher) flush(always bool) {
	b.flushAt = time.Time{}
	if b.err != nil || (!always && len(b.cur.Events) == 0 && b.cur.Dropped == 0 && b.cur.UnwatchedDirs == 0) {
		return
	}
	cur := b.cur
	b.cur, b.bytes = Batch{}, 0
	clear(b.lastOp)
	b.err = b.send(cur)
}
