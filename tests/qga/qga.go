// Package qga is a small client for QEMU's guest agent, qemu-ga, enough for
// the benchmarks that compare carrel's guest agent with it (tests/bench):
// guest-exec with guest-exec-status polling, and guest-file-open, -read,
// -write and -close.
//
// qemu-ga speaks QMP-style JSON over a byte stream, one command at a time:
// the client writes {"execute": ..., "arguments": ...} and reads one reply
// line, {"return": ...} or {"error": {"class", "desc"}}. Because a stream
// can carry a stale reply (an earlier client gave up on a command) or a
// half-parsed request, the client first sends 0xFF, which resets qemu-ga's
// parser, and guest-sync-delimited with a random id: the reply is 0xFF
// followed by that id, and everything before it is dropped. It syncs again
// whenever a call fails mid-stream.
//
// Replies come from the guest, so every one is bounded (MaxReply) and every
// call has a deadline (the context's, else DefaultTimeout).
package qga

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"time"
)

const (
	// DefaultTimeout bounds a call whose context has no deadline.
	DefaultTimeout = 60 * time.Second
	// MaxReadCount is the most guest-file-read returns in one reply: qemu-ga
	// refuses larger counts.
	MaxReadCount = 48 << 20
	// MaxReply is the longest reply line accepted: a MaxReadCount read in
	// base64 plus its JSON.
	MaxReply = MaxReadCount/3*4 + 4096
	// delimiter is the byte guest-sync-delimited's reply starts with, and
	// the byte that resets qemu-ga's parser when a client sends it.
	delimiter = 0xFF
)

// Error is a command's error reply.
type Error struct {
	Class string `json:"class"`
	Desc  string `json:"desc"`
}

func (e *Error) Error() string { return "qemu-ga: " + e.Class + ": " + e.Desc }

// ErrReplyTooLarge is returned for a reply line over MaxReply.
var ErrReplyTooLarge = errors.New("qemu-ga: reply too large")

// Client talks to one qemu-ga over a stream, usually the unix socket of the
// QEMU chardev behind its virtio-serial port. Calls are serialised.
type Client struct {
	mu       sync.Mutex
	conn     net.Conn
	r        *bufio.Reader
	w        *bufio.Writer
	needSync bool
}

// New returns a client on conn. The first call syncs the stream.
func New(conn net.Conn) *Client {
	return &Client{conn: conn, r: bufio.NewReaderSize(conn, 1<<20), w: bufio.NewWriterSize(conn, 1<<20), needSync: true}
}

// Dial connects to the unix socket at path and syncs with qemu-ga.
func Dial(ctx context.Context, path string) (*Client, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("qemu-ga: %w", err)
	}
	c := New(conn)
	if err := c.Sync(ctx); err != nil {
		conn.Close()
		return nil, err
	}
	return c, nil
}

// Close closes the stream.
func (c *Client) Close() error { return c.conn.Close() }

// Sync drops whatever is pending on the stream and waits until qemu-ga
// echoes a fresh random id.
func (c *Client) Sync(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sync(ctx)
}

func (c *Client) sync(ctx context.Context) (err error) {
	defer c.bound(ctx)(&err)
	c.needSync = true
	id := rand.Int64N(1 << 53) // exact in any JSON reader
	if err := c.w.WriteByte(delimiter); err != nil {
		return err
	}
	if err := c.send("guest-sync-delimited", map[string]int64{"id": id}); err != nil {
		return err
	}
	for {
		// Skip to the next delimiter, holding nothing we skip.
		skipped := 0
		for {
			frag, err := c.r.ReadSlice(delimiter)
			skipped += len(frag)
			if err == nil {
				break
			}
			if !errors.Is(err, bufio.ErrBufferFull) {
				return err
			}
			if skipped > MaxReply {
				return fmt.Errorf("qemu-ga sync: %d bytes without a delimiter", skipped)
			}
		}
		line, err := c.readLine()
		if err != nil {
			return err
		}
		var reply struct {
			Return *int64 `json:"return"`
		}
		if json.Unmarshal(line, &reply) == nil && reply.Return != nil && *reply.Return == id {
			c.needSync = false
			return nil
		}
		// A reply to an older sync: keep looking.
	}
}

// bound applies ctx's deadline (or DefaultTimeout) and cancellation to the
// stream for one call; the returned func undoes it and, on an error, marks
// the stream for a resync and reports a context error as such.
func (c *Client) bound(ctx context.Context) func(*error) {
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(DefaultTimeout)
	}
	c.conn.SetDeadline(deadline)
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		c.conn.SetDeadline(time.Unix(1, 0))
		close(fired)
	})
	return func(err *error) {
		if !stop() {
			<-fired // it must not land on the next call
		}
		c.conn.SetDeadline(time.Time{})
		if *err == nil {
			return
		}
		var qe *Error
		if !errors.As(*err, &qe) {
			// The stream is out of step, and a bufio.Writer keeps its
			// first error for good.
			c.needSync = true
			c.w.Reset(c.conn)
		}
		if ctx.Err() != nil {
			*err = fmt.Errorf("%w (%w)", ctx.Err(), *err)
		}
	}
}

// send writes one command and flushes it.
func (c *Client) send(command string, args any) error {
	req := struct {
		Execute   string `json:"execute"`
		Arguments any    `json:"arguments,omitempty"`
	}{command, args}
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	if _, err := c.w.Write(b); err != nil {
		return err
	}
	if err := c.w.WriteByte('\n'); err != nil {
		return err
	}
	return c.w.Flush()
}

// readLine returns the next reply line, at most MaxReply bytes.
func (c *Client) readLine() ([]byte, error) {
	var line []byte
	for {
		frag, err := c.r.ReadSlice('\n')
		if len(line)+len(frag) > MaxReply {
			return nil, ErrReplyTooLarge
		}
		line = append(line, frag...)
		if err == nil {
			return line, nil
		}
		if !errors.Is(err, bufio.ErrBufferFull) {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
}

// Call runs command with args (nil for none) and decodes its return value
// into result (nil to ignore it). An error reply is an *Error.
func (c *Client) Call(ctx context.Context, command string, args, result any) (err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.needSync {
		if err := c.sync(ctx); err != nil {
			return fmt.Errorf("%s: %w", command, err)
		}
	}
	defer c.bound(ctx)(&err)
	if err := c.send(command, args); err != nil {
		return fmt.Errorf("%s: %w", command, err)
	}
	line, err := c.readLine()
	if err != nil {
		return fmt.Errorf("%s: %w", command, err)
	}
	var reply struct {
		Return json.RawMessage `json:"return"`
		Error  *Error          `json:"error"`
	}
	if err := json.Unmarshal(bytes.TrimLeft(line, "\xff"), &reply); err != nil {
		return fmt.Errorf("%s: bad reply: %w", command, err)
	}
	if reply.Error != nil {
		return reply.Error
	}
	if reply.Return == nil {
		return fmt.Errorf("%s: reply has neither return nor error", command)
	}
	if result == nil {
		return nil
	}
	if err := json.Unmarshal(reply.Return, result); err != nil {
		return fmt.Errorf("%s: bad return value: %w", command, err)
	}
	return nil
}

// ExecStatus is guest-exec-status's reply.
type ExecStatus struct {
	Exited       bool   `json:"exited"`
	ExitCode     *int   `json:"exitcode,omitempty"`
	Signal       *int   `json:"signal,omitempty"`
	OutData      []byte `json:"out-data,omitempty"` // base64 on the wire
	ErrData      []byte `json:"err-data,omitempty"`
	OutTruncated bool   `json:"out-truncated,omitempty"`
	ErrTruncated bool   `json:"err-truncated,omitempty"`
}

// Exec starts path with args in the guest (guest-exec) and returns its pid.
// With captureOutput, qemu-ga collects stdout and stderr for
// guest-exec-status.
func (c *Client) Exec(ctx context.Context, path string, args []string, captureOutput bool) (int, error) {
	req := struct {
		Path          string   `json:"path"`
		Arg           []string `json:"arg,omitempty"`
		CaptureOutput bool     `json:"capture-output"`
	}{path, args, captureOutput}
	var ret struct {
		PID *int `json:"pid"`
	}
	if err := c.Call(ctx, "guest-exec", req, &ret); err != nil {
		return 0, err
	}
	if ret.PID == nil {
		return 0, errors.New("guest-exec: no pid in the reply")
	}
	return *ret.PID, nil
}

// ExecStatus asks about a process Exec started (guest-exec-status). Once it
// reports Exited, qemu-ga forgets the process.
func (c *Client) ExecStatus(ctx context.Context, pid int) (*ExecStatus, error) {
	var st ExecStatus
	if err := c.Call(ctx, "guest-exec-status", map[string]int{"pid": pid}, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// Run starts path with args, capturing its output, and polls
// guest-exec-status again as soon as each reply says it is still running.
// It returns the final status and how many polls it took.
func (c *Client) Run(ctx context.Context, path string, args ...string) (*ExecStatus, int, error) {
	pid, err := c.Exec(ctx, path, args, true)
	if err != nil {
		return nil, 0, err
	}
	for polls := 1; ; polls++ {
		st, err := c.ExecStatus(ctx, pid)
		if err != nil {
			return nil, polls, err
		}
		if st.Exited {
			return st, polls, nil
		}
	}
}

// FileOpen opens path in the guest with an fopen mode ("r", "w", ...) and
// returns qemu-ga's handle.
func (c *Client) FileOpen(ctx context.Context, path, mode string) (int64, error) {
	var h int64
	err := c.Call(ctx, "guest-file-open", map[string]string{"path": path, "mode": mode}, &h)
	return h, err
}

// FileClose closes a handle.
func (c *Client) FileClose(ctx context.Context, h int64) error {
	return c.Call(ctx, "guest-file-close", map[string]int64{"handle": h}, nil)
}

// FileRead reads up to count bytes (at most MaxReadCount) and reports
// whether the file ended.
func (c *Client) FileRead(ctx context.Context, h int64, count int) ([]byte, bool, error) {
	if count <= 0 || count > MaxReadCount {
		return nil, false, fmt.Errorf("guest-file-read: count %d is outside 1..%d", count, MaxReadCount)
	}
	var ret struct {
		Count int    `json:"count"`
		Buf   []byte `json:"buf-b64"`
		EOF   bool   `json:"eof"`
	}
	if err := c.Call(ctx, "guest-file-read", map[string]int64{"handle": h, "count": int64(count)}, &ret); err != nil {
		return nil, false, err
	}
	if ret.Count != len(ret.Buf) || ret.Count > count {
		return nil, false, fmt.Errorf("guest-file-read: asked for %d bytes, reply says %d and carries %d", count, ret.Count, len(ret.Buf))
	}
	return ret.Buf, ret.EOF, nil
}

// FileWrite writes data and returns how much qemu-ga wrote.
func (c *Client) FileWrite(ctx context.Context, h int64, data []byte) (int, error) {
	req := struct {
		Handle int64  `json:"handle"`
		Buf    []byte `json:"buf-b64"`
	}{h, data}
	var ret struct {
		Count int  `json:"count"`
		EOF   bool `json:"eof"`
	}
	if err := c.Call(ctx, "guest-file-write", req, &ret); err != nil {
		return 0, err
	}
	if ret.Count < 0 || ret.Count > len(data) {
		return 0, fmt.Errorf("guest-file-write: wrote %d of %d bytes", ret.Count, len(data))
	}
	return ret.Count, nil
}

// WriteFile creates or truncates path in the guest and writes everything r
// yields, chunk bytes per guest-file-write.
func (c *Client) WriteFile(ctx context.Context, path string, r io.Reader, chunk int) (n int64, err error) {
	if chunk <= 0 {
		return 0, fmt.Errorf("write %s: chunk %d", path, chunk)
	}
	h, err := c.FileOpen(ctx, path, "w")
	if err != nil {
		return 0, err
	}
	defer func() {
		if cerr := c.FileClose(ctx, h); err == nil {
			err = cerr
		}
	}()
	buf := make([]byte, chunk)
	for {
		k, rerr := io.ReadFull(r, buf)
		if k > 0 {
			w, err := c.FileWrite(ctx, h, buf[:k])
			n += int64(w)
			if err != nil {
				return n, err
			}
			if w != k {
				return n, fmt.Errorf("write %s: short write, %d of %d bytes", path, w, k)
			}
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			return n, nil
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// ReadFile copies path in the guest to w, chunk bytes per guest-file-read.
func (c *Client) ReadFile(ctx context.Context, path string, w io.Writer, chunk int) (n int64, err error) {
	h, err := c.FileOpen(ctx, path, "r")
	if err != nil {
		return 0, err
	}
	defer func() {
		if cerr := c.FileClose(ctx, h); err == nil {
			err = cerr
		}
	}()
	for {
		b, eof, err := c.FileRead(ctx, h, chunk)
		if err != nil {
			return n, err
		}
		k, err := w.Write(b)
		n += int64(k)
		if err != nil {
			return n, err
		}
		if eof || len(b) == 0 {
			return n, nil
		}
	}
}
