//go:build linux

package activity

import (
	"context"
	"errors"
	"sync"
	"time"
)

var (
	// ErrSuperseded ends a Serve when a newer one has started.
	ErrSuperseded = errors.New("activity: a newer stream took over")
	// ErrClosed ends a Serve when the Monitor is closed.
	ErrClosed = errors.New("activity: the monitor is closed")
)

// coalescer merges repeats: an open or a modify of a path that the same
// process already had reported less than window ago is not reported again.
// A create, delete or move of the path starts afresh.
type coalescer struct {
	window time.Duration
	last   map[coalesceKey]coalesceMark
}

type coalesceKey struct {
	op   Op
	path string
}

type coalesceMark struct {
	pid int
	at  time.Time
}

func newCoalescer(window time.Duration) *coalescer {
	return &coalescer{window: window, last: make(map[coalesceKey]coalesceMark)}
}

// keep reports whether ev is to be reported.
func (c *coalescer) keep(ev Event) bool {
	switch ev.Op {
	case Open, Modify:
		k := coalesceKey{ev.Op, ev.Path}
		if m, ok := c.last[k]; ok && m.pid == ev.Pid && ev.Time.Sub(m.at) < c.window {
			return false
		}
		c.last[k] = coalesceMark{ev.Pid, ev.Time}
	default:
		delete(c.last, coalesceKey{Open, ev.Path})
		delete(c.last, coalesceKey{Modify, ev.Path})
	}
	return true
}

// prune forgets marks older than the window.
func (c *coalescer) prune(now time.Time) {
	for k, m := range c.last {
		if now.Sub(m.at) >= c.window {
			delete(c.last, k)
		}
	}
}

// queue holds the events ready to be sent, up to a count and a size, and
// counts what it had to drop. One subscriber at a time takes from it.
type queue struct {
	maxEvents, maxBytes     int
	batchEvents, batchBytes int

	mu      sync.Mutex
	events  []Event
	bytes   int
	dropped uint64
	notify  chan struct{} // closed and replaced when events arrive
	sub     *subscriber
	closed  bool

	// waiting, when a test sets it, is called as next begins to wait.
	waiting func()
}

type subscriber struct {
	stop chan struct{} // closed when a newer subscriber takes over
}

func newQueue(o Options) *queue {
	return &queue{maxEvents: o.Queue, maxBytes: o.QueueBytes, batchEvents: o.MaxBatch, batchBytes: o.MaxBatchBytes,
		notify: make(chan struct{})}
}

func eventBytes(e Event) int { return len(e.Path) + len(e.ExecID) + 32 }

// push adds events (dropping, and counting, what does not fit) and
// dropped, and wakes the subscriber.
func (q *queue) push(events []Event, dropped uint64) {
	if len(events) == 0 && dropped == 0 {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.dropped = addSat(q.dropped, dropped)
	for _, e := range events {
		if len(q.events) >= q.maxEvents || q.bytes+eventBytes(e) > q.maxBytes {
			q.dropped = addSat(q.dropped, 1)
			continue
		}
		q.events = append(q.events, e)
		q.bytes += eventBytes(e)
	}
	close(q.notify)
	q.notify = make(chan struct{})
}

// requeue puts back, in front, a batch that could not be sent.
func (q *queue) requeue(b Batch) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.dropped = addSat(q.dropped, b.Dropped)
	keep := b.Events
	n, size := len(q.events), q.bytes
	for i, e := range keep {
		if n >= q.maxEvents || size+eventBytes(e) > q.maxBytes {
			q.dropped = addSat(q.dropped, uint64(len(keep)-i))
			keep = keep[:i]
			break
		}
		n, size = n+1, size+eventBytes(e)
	}
	q.events = append(append(make([]Event, 0, n), keep...), q.events...)
	q.bytes = size
}

// subscribe makes a new subscriber, ending the one before.
func (q *queue) subscribe() *subscriber {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.sub != nil {
		close(q.sub.stop)
	}
	q.sub = &subscriber{stop: make(chan struct{})}
	return q.sub
}

func (q *queue) unsubscribe(s *subscriber) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.sub == s {
		q.sub = nil
	}
}

func (q *queue) close() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.closed = true
	close(q.notify)
	q.notify = make(chan struct{})
}

// next waits for events (or a count of dropped ones) and takes a batch:
// at most batchEvents events, of at most batchBytes (but at least one).
func (q *queue) next(ctx context.Context, s *subscriber) (Batch, error) {
	for {
		q.mu.Lock()
		switch {
		case q.closed:
			q.mu.Unlock()
			return Batch{}, ErrClosed
		case q.sub != s:
			q.mu.Unlock()
			return Batch{}, ErrSuperseded
		case len(q.events) > 0 || q.dropped > 0:
			b := q.take()
			q.mu.Unlock()
			return b, nil
		}
		notify, waiting := q.notify, q.waiting
		q.mu.Unlock()
		if waiting != nil {
			waiting()
		}
		select {
		case <-ctx.Done():
			return Batch{}, ctx.Err()
		case <-s.stop:
			return Batch{}, ErrSuperseded
		case <-notify:
		}
	}
}

func (q *queue) take() Batch {
	n, size := 0, 0
	for n < len(q.events) && n < q.batchEvents {
		eb := eventBytes(q.events[n])
		if n > 0 && size+eb > q.batchBytes {
			break
		}
		n, size = n+1, size+eb
	}
	b := Batch{Events: append([]Event(nil), q.events[:n]...), Dropped: q.dropped}
	q.events = append(q.events[:0], q.events[n:]...)
	q.bytes -= size
	q.dropped = 0
	return b
}

// addSat adds without wrapping around.
func addSat(a, b uint64) uint64 {
	if a+b < a {
		return ^uint64(0)
	}
	return a + b
}
