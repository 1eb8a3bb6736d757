//go:build linux

package proctable

import (
	"context"
	"sort"
	"sync"
	"time"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// maxChunks caps the chunks an outbuf holds, whatever their size, so that
// output switching between stdout and stderr byte by byte stays bounded
// too.
const maxChunks = 4096

// outbuf is a detached command's output: the newest max bytes of it, in
// order, stdout and stderr interleaved as they were read. Every attach
// replays what is kept, then follows new output. Bytes are numbered from
// the command's start; those before the oldest one kept have been dropped.
//
// While nobody is attached, the oldest bytes are dropped to make room.
// While a client is attached, the bytes it has yet to read are never
// dropped: a full buffer makes the command wait for the client instead, as
// Exec does, so an attached client loses nothing.
type outbuf struct {
	mu       sync.Mutex
	cond     sync.Cond // signalled on every change
	max      int
	chunks   []chunk // oldest first, each at most protocol.ExecChunkBytes
	first    uint64  // number of the first byte kept
	end      uint64  // number of the byte after the last one written
	attached bool
	cursor   uint64 // number of the next byte for the attached client
	finished bool
	exit     *agentv1.ExitStatus // set when finished
}

type chunk struct {
	off    uint64 // number of data[0]
	stderr bool
	data   []byte
}

func (c chunk) event() *agentv1.ExecResponse {
	if c.stderr {
		return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stderr{Stderr: c.data}}
	}
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: c.data}}
}

func newOutbuf(max int) *outbuf {
	b := &outbuf{max: max}
	b.cond.L = &b.mu
	return b
}

// write takes a stdout or stderr event from the command (exec.Proc.Stream);
// it copies the bytes.
func (b *outbuf) write(m *agentv1.ExecResponse) error {
	var data []byte
	stderr := false
	switch e := m.Event.(type) {
	case *agentv1.ExecResponse_Stdout:
		data = e.Stdout
	case *agentv1.ExecResponse_Stderr:
		data, stderr = e.Stderr, true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for len(data) > 0 {
		n := min(len(data), protocol.ExecChunkBytes, b.max)
		for b.mustWait(n, stderr) {
			b.cond.Wait()
		}
		b.append(data[:n], stderr)
		data = data[n:]
	}
	b.cond.Broadcast()
	return nil
}

// mustWait reports whether writing n more bytes would drop bytes the
// attached client has yet to read.
func (b *outbuf) mustWait(n int, stderr bool) bool {
	if !b.attached {
		return false
	}
	if b.end+uint64(n) > b.cursor+uint64(b.max) {
		return true
	}
	if len(b.chunks) < maxChunks || b.coalesces(n, stderr) {
		return false
	}
	head := b.chunks[0]
	return head.off+uint64(len(head.data)) > b.cursor
}

// coalesces reports whether n bytes would join the last chunk.
func (b *outbuf) coalesces(n int, stderr bool) bool {
	if len(b.chunks) == 0 {
		return false
	}
	last := b.chunks[len(b.chunks)-1]
	return last.stderr == stderr && len(last.data)+n <= protocol.ExecChunkBytes
}

// append adds data and drops the oldest bytes beyond max, and the oldest
// chunks beyond maxChunks.
func (b *outbuf) append(data []byte, stderr bool) {
	if b.coalesces(len(data), stderr) {
		last := &b.chunks[len(b.chunks)-1]
		last.data = append(last.data, data...)
	} else {
		b.chunks = append(b.chunks, chunk{off: b.end, stderr: stderr, data: append([]byte(nil), data...)})
	}
	b.end += uint64(len(data))
	for b.end-b.first > uint64(b.max) {
		over := int(b.end - b.first - uint64(b.max))
		head := &b.chunks[0]
		if over < len(head.data) {
			head.data = head.data[over:]
			head.off += uint64(over)
			b.first += uint64(over)
		} else {
			b.dropHead()
		}
	}
	if len(b.chunks) > maxChunks {
		b.dropHead()
	}
}

func (b *outbuf) dropHead() {
	b.first += uint64(len(b.chunks[0].data))
	b.chunks[0] = chunk{}
	b.chunks = b.chunks[1:]
}

// finish records the exit status, after the last write.
func (b *outbuf) finish(exit *agentv1.ExitStatus) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.finished, b.exit = true, exit
	b.cond.Broadcast()
}

// attach marks a client attached, to read from the oldest byte kept, and
// returns that byte's number: how many bytes have been dropped. If a
// client is attached, it waits up to wait (or until ctx ends) for that one
// to detach; ok is false if it has not.
func (b *outbuf) attach(ctx context.Context, wait time.Duration) (dropped uint64, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.attached && wait > 0 {
		ctx, cancel := context.WithTimeout(ctx, wait)
		defer cancel()
		stop := context.AfterFunc(ctx, func() {
			b.mu.Lock()
			defer b.mu.Unlock()
			b.cond.Broadcast()
		})
		defer stop()
		for b.attached && ctx.Err() == nil {
			b.cond.Wait()
		}
	}
	if b.attached {
		return 0, false
	}
	b.attached, b.cursor = true, b.first
	return b.first, true
}

func (b *outbuf) detach() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.attached = false
	b.cond.Broadcast()
}

func (b *outbuf) isAttached() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.attached
}

// next waits for output the attached client has yet to read and returns
// it, at most one chunk, without consuming it (see consume), or, once
// everything is read, the exit status. It returns ctx's error if ctx ends
// first. The returned bytes are never modified.
func (b *outbuf) next(ctx context.Context) (chunk, *agentv1.ExitStatus, error) {
	stop := context.AfterFunc(ctx, func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		b.cond.Broadcast()
	})
	defer stop()
	b.mu.Lock()
	defer b.mu.Unlock()
	for b.cursor == b.end && !b.finished && ctx.Err() == nil {
		b.cond.Wait()
	}
	switch {
	case ctx.Err() != nil:
		return chunk{}, nil, ctx.Err()
	case b.cursor == b.end:
		return chunk{}, b.exit, nil
	}
	// The chunk holding the cursor: the last one starting at or before it.
	i := sort.Search(len(b.chunks), func(i int) bool { return b.chunks[i].off > b.cursor }) - 1
	c := b.chunks[i]
	skip := b.cursor - c.off
	c.off, c.data = b.cursor, c.data[skip:len(c.data):len(c.data)]
	return c, nil, nil
}

// consume marks n bytes read by the attached client.
func (b *outbuf) consume(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cursor += uint64(n)
	b.cond.Broadcast()
}
