package transport

import (
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"time"
)

// Bounds of what a portWriter holds.
const (
	// maxQueued is the most a portWriter accepts before the port has
	// taken it; a Write beyond it waits, under the write deadline.
	maxQueued = 256 << 10
	// maxQueuedWrite is the largest Write that is queued. A larger one
	// (bulk file data) waits for the queue to empty and goes to the port
	// from the caller's buffer, saving a copy that costs more than the
	// write it would merge.
	maxQueuedWrite = 32 << 10
)

// portWriter writes to a virtio-serial port, merging small writes. Every
// write to a port is a notification the hypervisor handles while the vCPU
// waits, which under emulation costs about a millisecond; the HTTP/2
// server writes each frame as its own write (a message, then the trailers
// that end the stream), each after the last has returned. Here Write
// queues a small write and returns at once, as a socket's send buffer
// would, and one goroutine writes whatever has queued meanwhile as one
// write. Order is kept. The first failed write fails every later Write;
// the connection is then unusable, as a socket would be.
type portWriter struct {
	f deadlineWriter

	mu       sync.Mutex
	queued   []byte        // accepted, not yet written
	spare    []byte        // the buffer being written, reused next
	busy     bool          // a write to f is under way
	err      error         // the first failed write
	idle     chan struct{} // closed, and replaced, whenever a write ends
	deadline time.Time     // for a Write that waits
	// armed is the port's own write deadline as last set; only the
	// writer of the moment (busy) reads or sets it.
	armed time.Time
	// stallLimit is how long a write to the port may take nothing before
	// it fails, and the connection with it (defaultStallLimit).
	stallLimit time.Duration
}

// defaultStallLimit bounds a write to the port that makes no progress:
// the host has stopped reading. It matches the HTTP/2 server's
// WriteByteTimeout (protocol.HTTP2), which bounded these writes before
// the port's deadline was kept here.
const defaultStallLimit = 10 * time.Second

// deadlineWriter is the port: an *os.File.
type deadlineWriter interface {
	io.Writer
	SetWriteDeadline(time.Time) error
}

func newPortWriter(f deadlineWriter) *portWriter {
	return &portWriter{f: f, idle: make(chan struct{}), stallLimit: defaultStallLimit}
}

func (w *portWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for {
		switch {
		case w.err != nil:
			return 0, w.err
		case len(b) <= maxQueuedWrite && len(w.queued)+len(b) <= maxQueued:
			w.queued = append(w.queued, b...)
			if !w.busy {
				w.busy = true
				go w.drain()
			}
			return len(b), nil
		case len(b) > maxQueuedWrite && !w.busy:
			// Nothing is queued (queued data keeps busy set): write it
			// here, in order.
			w.busy = true
			w.mu.Unlock()
			n, err := w.writePort(b)
			w.mu.Lock()
			w.ended(err)
			return n, err
		}
		if err := w.wait(w.deadline); err != nil {
			return 0, err
		}
	}
}

// drain writes what is queued until nothing is. It first lets every
// goroutine that is ready run: on a one-vCPU guest these are the HTTP/2
// server's, about to queue the next frames of the same answer (a unary
// call's message is flushed, then its trailers follow a few goroutine
// hops later), which then leave in this write instead of one of their own.
// Only goroutines already ready run first, so nothing waits on a timer.
func (w *portWriter) drain() {
	runtime.Gosched()
	w.mu.Lock()
	defer w.mu.Unlock()
	for len(w.queued) > 0 && w.err == nil {
		buf := w.queued
		w.queued = w.spare[:0]
		w.mu.Unlock()
		_, err := w.writePort(buf)
		w.mu.Lock()
		w.spare = buf[:0]
		if err != nil {
			w.err = err
		}
		w.wakeWaiters()
	}
	w.queued = w.queued[:0]
	w.ended(nil)
}

// ended marks the write under way done. w.mu is held.
func (w *portWriter) ended(err error) {
	if err != nil && w.err == nil {
		w.err = err
	}
	w.busy = false
	w.wakeWaiters()
}

func (w *portWriter) wakeWaiters() {
	close(w.idle)
	w.idle = make(chan struct{})
}

// wait waits, with w.mu released, until a write ends or the deadline
// (none if zero) passes.
func (w *portWriter) wait(deadline time.Time) error {
	idle := w.idle
	w.mu.Unlock()
	defer w.mu.Lock()
	if deadline.IsZero() {
		<-idle
		return nil
	}
	d := time.Until(deadline)
	if d <= 0 {
		return os.ErrDeadlineExceeded
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-idle:
		return nil
	case <-t.C:
		return os.ErrDeadlineExceeded
	}
}

// close waits up to linger for what is queued to reach the port, as a
// socket's close sends what it holds (the HTTP/2 server's last frames
// before it hangs up), then fails every later Write. The caller closes the
// port after it, which ends a write still stuck.
func (w *portWriter) close(linger time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	deadline := time.Now().Add(linger)
	for w.busy && w.err == nil {
		if w.wait(deadline) != nil {
			break
		}
	}
	if w.err == nil {
		w.err = net.ErrClosed
	}
}

// SetWriteDeadline bounds how long a Write may wait for the queue. It
// does not touch the port: the HTTP/2 server sets and clears a deadline
// around every flush, and moving the port's deadline is a runtime timer
// operation that, in a guest under emulation, cost more than the queued
// write it bounded (7% of the agent's CPU in a loop of small calls).
// Writes to the port have a deadline of their own (writePort).
func (w *portWriter) SetWriteDeadline(t time.Time) error {
	w.mu.Lock()
	w.deadline = t
	w.mu.Unlock()
	return nil
}

// writePort writes b to the port, failing only when the port takes
// nothing for stallLimit; a write that makes progress goes on. The port's
// deadline moves only when less than half of stallLimit is left, not at
// every write. Only the writer of the moment (busy) calls it.
func (w *portWriter) writePort(b []byte) (int, error) {
	written := 0
	for {
		if now := time.Now(); w.armed.Sub(now) < w.stallLimit/2 {
			w.armed = now.Add(w.stallLimit)
			if err := w.f.SetWriteDeadline(w.armed); err != nil {
				return written, err
			}
		}
		n, err := w.f.Write(b[written:])
		written += n
		if err == nil || n == 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
			return written, err
		}
		w.armed = time.Time{} // it progressed, then ran out of time: arm again
	}
}
