package agentlink

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// The data port carries file content beside the agent's stream on a
// virtio-serial VM (protocol/bulk.go). carreld runs one transfer at a time
// in each direction; a call that finds its direction busy uses the stream.
// What the guest sends on it is checked as strictly as the stream: a
// frame that is not the transfer's next one turns the port off for the
// link's life, and file content goes in the stream from then on.

// Bounds on the data port.
const (
	// dataStallLimit is how long one frame may take to cross in either
	// direction before the transfer fails and the connection is dropped;
	// a write to a larger send buffer may take longer (sendStall).
	dataStallLimit = 10 * time.Second
	// maxStaleBytes bounds what a receive passes over from transfers that
	// ended early before its own first frame.
	maxStaleBytes = 64 << 20
	// SendBufferBytes is the socket send buffer carreld asks for on its end
	// of the data port. The default (net.core.wmem_default, 208 KiB on
	// Debian) holds about a millisecond of a transfer: QEMU drains it
	// faster than a busy host wakes carreld to fill it again (the kernel
	// wakes a writer only once three quarters have gone), and the guest
	// waits. Linux caps the request at net.core.wmem_max, then doubles it
	// for its own accounting (see docs/operator-guide.md). Only bytes
	// queued count against it.
	SendBufferBytes = 4 << 20
	// minGuestRate is the slowest a guest may take a transfer's bytes
	// before a frame write fails (sendStall).
	minGuestRate = 256 << 10 // bytes a second
)

// sendStall is how long one frame write may take on a connection with
// sndbuf bytes of send buffer. A blocked write resumes only once three
// quarters of the buffer have drained, so it may wait for that and its
// own frame to reach the guest: the limit allows minGuestRate for that,
// and is never under dataStallLimit. At Debian's default buffer it is
// dataStallLimit; at 4 MiB (8 MiB in the kernel's count), 28 s.
func sendStall(sndbuf int) time.Duration {
	return max(dataStallLimit, time.Duration(sndbuf*3/4+protocol.MaxDataFrameBytes)*time.Second/minGuestRate)
}

// sendBuffer asks for SendBufferBytes on c's send buffer and returns the
// frame write limit for what it got: dataStallLimit where c has no
// socket to ask (a pipe, in tests).
func sendBuffer(c net.Conn) time.Duration {
	sc, ok := c.(interface {
		SetWriteBuffer(int) error
		syscall.Conn
	})
	if !ok {
		return dataStallLimit
	}
	// Best effort: a smaller buffer is slower, not wrong.
	sc.SetWriteBuffer(SendBufferBytes)
	rc, err := sc.SyscallConn()
	if err != nil {
		return dataStallLimit
	}
	n, gerr := 0, error(nil)
	if err := rc.Control(func(fd uintptr) { n, gerr = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF) }); err != nil || gerr != nil {
		return dataStallLimit
	}
	return sendStall(n)
}

// closeDrainLimit bounds, in all, Close's reading of what is left of a
// transfer: a guest that never ends it cannot hold the port.
var closeDrainLimit = dataStallLimit

// errDataPortOff is returned for a data port turned off.
var errDataPortOff = errors.New("data port off")

// ErrDataProtocol is wrapped by a transfer's error when the guest broke
// the data port's protocol.
var ErrDataProtocol = errors.New("the guest broke the data port's protocol")

// UseDataPort gives the link the data port dial reaches. The port is used
// once the agent's health reply says it has its end open.
func (l *Link) UseDataPort(dial func(ctx context.Context) (net.Conn, error)) {
	if dial == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	// An agent found running (carreld restarted) may have been inside a
	// frame of the last carreld's: the first transfers resync.
	l.data = &dataPort{dial: dial, link: l, send: make(chan struct{}, 1), recv: make(chan struct{}, 1),
		resyncOut: true, resyncIn: true}
}

// dataPort is carreld's end of the data port.
type dataPort struct {
	dial func(ctx context.Context) (net.Conn, error)
	link *Link
	send chan struct{} // held by the transfer going to the guest
	recv chan struct{} // held by the transfer coming from it

	mu   sync.Mutex
	conn net.Conn
	fr   *protocol.FrameReader
	// stall bounds one frame write on conn (sendStall).
	stall time.Duration
	// resyncOut and resyncIn are set when a connection is dropped, maybe
	// mid-frame. The guest's reader may be inside a frame, so the next
	// sender first writes a frame's worth of bytes that cannot start one;
	// the next receiver passes over what is left of the guest's frame.
	resyncOut, resyncIn bool
	off                 error
}

// dataPort returns the link's data port if the agent has its end open and
// it has not been turned off.
func (l *Link) dataPort() *dataPort {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.data == nil || l.info == nil || !l.info.DataPort || l.state != Ready {
		return nil
	}
	return l.data
}

// DataPortInUse reports whether file content goes on the data port: the
// link has one, the agent has its end open, and the guest has not broken
// its protocol.
func (l *Link) DataPortInUse() bool {
	p := l.dataPort()
	if p == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.off == nil
}

// connect returns the open connection, dialing if there is none, and
// whether the direction (out: to the guest) must resync first.
func (p *dataPort) connect(ctx context.Context, out bool) (net.Conn, *protocol.FrameReader, bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.off != nil {
		return nil, nil, false, p.off
	}
	if p.conn == nil {
		c, err := p.dial(ctx)
		if err != nil {
			return nil, nil, false, fmt.Errorf("data port: %w", err)
		}
		p.stall = sendBuffer(c)
		p.conn = c
		fr := protocol.NewFrameReader(c)
		fr.MaxSkip = 0
		p.fr = fr
	}
	resync := &p.resyncIn
	if out {
		resync = &p.resyncOut
	}
	r := *resync
	*resync = false
	return p.conn, p.fr, r, nil
}

// drop closes c if it is still the connection; the next transfer dials
// again.
func (p *dataPort) drop(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c != nil && p.conn == c {
		p.conn.Close()
		p.conn, p.fr = nil, nil
		p.resyncOut, p.resyncIn = true, true
	}
}

// keepResyncIn hands a resync the transfer did not use on to the next
// one on c.
func (p *dataPort) keepResyncIn(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conn == c {
		p.resyncIn = true
	}
}

// turnOff stops the port's use for the link's life: the guest broke its
// protocol.
func (p *dataPort) turnOff(c net.Conn, err error) {
	p.mu.Lock()
	first := p.off == nil
	if first {
		p.off = fmt.Errorf("%w: %w", errDataPortOff, err)
	}
	if c == nil {
		c = p.conn
	}
	p.mu.Unlock()
	p.drop(c)
	if first && !errors.Is(err, net.ErrClosed) {
		p.link.log.Warn("data port turned off: file content goes in the stream", "subsystem", "agentlink", "err", err)
	}
}

func newTransferID() uint64 {
	var b [8]byte
	for {
		rand.Read(b[:])
		if id := binary.LittleEndian.Uint64(b[:]); id != 0 {
			return id
		}
	}
}

// Outbound is a transfer of file content to the guest.
type Outbound struct {
	ID    uint64
	p     *dataPort
	conn  net.Conn
	stall time.Duration // bounds each frame write
	seq   uint32
	hdr   []byte
	err   error // the first failure; the transfer is over
	last  bool  // End or Abort has sent the last frame
	done  bool  // the port is given back
	// resync: the connection is new after one was dropped (dataPort).
	resync bool
	// interrupted is set by Interrupt, from another goroutine.
	interrupted atomic.Bool
	mu          sync.Mutex
	ended       bool // the port is released: Interrupt does nothing
}

// ErrInterrupted is a transfer's error after Interrupt.
var ErrInterrupted = errors.New("data port: the transfer was interrupted")

// Interrupt stops the transfer from another goroutine: a frame write under
// way fails at once (the connection is dropped, as the guest may be inside
// the frame), and so do later ones. The caller still Aborts it.
func (t *Outbound) Interrupt() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ended {
		return // the connection may be the next transfer's now
	}
	t.interrupted.Store(true)
	t.conn.SetWriteDeadline(time.Unix(1, 0))
}

// SendData starts a transfer to the guest on the data port, or returns nil
// when there is none to use now (no port, turned off, or busy): the caller
// sends the content in the stream. The caller must Abort it in the end,
// after End when the content was all sent, which gives the port back.
func (l *Link) SendData(ctx context.Context) *Outbound {
	p := l.dataPort()
	if p == nil {
		return nil
	}
	select {
	case p.send <- struct{}{}:
	default:
		return nil
	}
	c, _, resync, err := p.connect(ctx, true)
	if err != nil {
		<-p.send
		return nil
	}
	p.mu.Lock()
	stall := p.stall
	p.mu.Unlock()
	return &Outbound{ID: newTransferID(), p: p, conn: c, stall: stall, hdr: make([]byte, 0, protocol.FrameHeaderSize), resync: resync}
}

// Write sends b as the transfer's next frames.
func (t *Outbound) Write(b []byte) error {
	for len(b) > 0 || t.err != nil {
		if t.err != nil {
			return t.err
		}
		n := min(len(b), protocol.MaxDataFrameBytes)
		t.frame(0, b[:n])
		b = b[n:]
	}
	return nil
}

// End sends the transfer's last frame. The port stays the transfer's
// until Abort gives it back, which the caller does once the guest has
// answered the call that names the transfer: until the guest's receiver
// has started, the frames may all be sitting in the send buffer, and a
// receiver for the next transfer that started first would pass them over
// as left from an ended one.
func (t *Outbound) End() error {
	if !t.last && !t.done {
		t.frame(protocol.FrameEnd, nil)
		t.last = true
	}
	return t.err
}

// Abort tells the guest to drop the transfer, unless End was sent, and
// gives the port back. Every transfer ends with it.
func (t *Outbound) Abort() {
	if !t.last && !t.done {
		t.frame(protocol.FrameAbort, nil)
		t.last = true
	}
	t.release()
}

func (t *Outbound) frame(flags uint32, b []byte) {
	if t.resync {
		// Bytes that hold no magic, a frame's worth and a header more:
		// whatever frame the guest was inside ends within them. They go
		// with the first frame, once the guest has the call and reads.
		t.resync = false
		t.write(make([]byte, protocol.MaxDataFrameBytes+protocol.FrameHeaderSize))
	}
	if t.err != nil {
		return
	}
	t.hdr = protocol.AppendFrame(t.hdr[:0], protocol.Frame{Flags: flags, ID: t.ID, Seq: t.seq, Length: uint32(len(b))})
	t.seq++
	bufs := net.Buffers{t.hdr, b}
	t.send(func() error { _, err := bufs.WriteTo(t.conn); return err })
}

func (t *Outbound) write(b []byte) error {
	t.send(func() error { _, err := t.conn.Write(b); return err })
	return t.err
}

// send runs one write under the stall limit. The deadline is set before
// the interruption is looked at, so an Interrupt meanwhile cuts it short.
func (t *Outbound) send(write func() error) {
	t.conn.SetWriteDeadline(time.Now().Add(t.stall))
	err := ErrInterrupted
	if !t.interrupted.Load() {
		err = write()
	}
	if err != nil {
		if t.interrupted.Load() {
			err = ErrInterrupted
		}
		t.err = fmt.Errorf("data port: %w", err)
		t.p.drop(t.conn)
	}
}

func (t *Outbound) release() {
	if !t.done {
		t.done = true
		t.mu.Lock()
		t.ended = true
		t.mu.Unlock()
		<-t.p.send
	}
}

// Inbound is a transfer of file content from the guest.
type Inbound struct {
	ID    uint64
	p     *dataPort
	conn  net.Conn
	fr    *protocol.FrameReader
	seq   uint32
	stale int64
	// resync is how many bytes the first frame may follow: after a
	// connection dropped mid-frame, what is left of that frame.
	resync int64
	buf    []byte
	end    bool  // the last frame has come
	err    error // the transfer failed; the connection may be mid-frame
	done   bool
}

// ReceiveData starts a transfer from the guest on the data port, or
// returns nil when there is none to use now: the caller asks for the
// content in the stream. The caller must Close it.
func (l *Link) ReceiveData(ctx context.Context) *Inbound {
	p := l.dataPort()
	if p == nil {
		return nil
	}
	select {
	case p.recv <- struct{}{}:
	default:
		return nil
	}
	c, fr, resync, err := p.connect(ctx, false)
	if err != nil {
		<-p.recv
		return nil
	}
	t := &Inbound{ID: newTransferID(), p: p, conn: c, fr: fr}
	if resync {
		// The last connection was dropped mid-frame: what is left of
		// that frame may still come.
		t.resync = protocol.MaxDataFrameBytes + protocol.FrameHeaderSize
	}
	return t
}

// Next returns the transfer's next payload, valid until the next call, or
// io.EOF once its last frame has come. ctx ending cuts a wait short. A
// frame from the guest that breaks the protocol turns the port off.
func (t *Inbound) Next(ctx context.Context) ([]byte, error) {
	if t.err != nil {
		return nil, t.err
	}
	if t.end {
		return nil, io.EOF
	}
	stop := context.AfterFunc(ctx, func() { t.conn.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	for {
		t.conn.SetReadDeadline(time.Now().Add(dataStallLimit))
		// Looked at after the deadline is set, which would otherwise
		// undo the AfterFunc's: a guest that keeps sending stale frames
		// never leaves a read waiting for it.
		if err := ctx.Err(); err != nil {
			t.err = err
			return nil, err
		}
		t.fr.MaxSkip = t.resync
		f, skipped, err := t.fr.Next()
		t.resync -= skipped
		if err != nil {
			return nil, t.fail(ctx, err)
		}
		t.resync = 0
		if f.ID != t.ID {
			// Left over from a transfer this side gave up early.
			// Headers count too: empty frames are not free.
			cost := protocol.FrameHeaderSize + int64(f.Length)
			if t.seq > 0 || t.stale+cost > maxStaleBytes {
				return nil, t.violate(fmt.Errorf("a frame of another transfer (%d bytes passed over)", t.stale))
			}
			t.stale += cost
			if err := t.fr.Skip(f); err != nil {
				return nil, t.fail(ctx, err)
			}
			continue
		}
		if f.Seq != t.seq {
			return nil, t.violate(fmt.Errorf("frame %d of the transfer, expected %d", f.Seq, t.seq))
		}
		t.seq++
		if f.Flags&protocol.FrameAbort != 0 {
			t.end = true
			return nil, protocol.ErrTransferAborted
		}
		if t.buf == nil {
			t.buf = make([]byte, protocol.MaxDataFrameBytes)
		}
		b, err := t.fr.Payload(f, t.buf)
		if err != nil {
			return nil, t.fail(ctx, err)
		}
		if f.Flags&protocol.FrameEnd != 0 {
			t.end = true
			if len(b) == 0 {
				return nil, io.EOF
			}
		}
		return b, nil
	}
}

// fail ends the transfer on a read that failed: ctx ended, the guest
// stalled, or the connection broke. The connection may be mid-frame.
func (t *Inbound) fail(ctx context.Context, err error) error {
	switch {
	case errors.Is(err, protocol.ErrFrameMagic) || (err != nil && !isIOErr(err)):
		return t.violate(err)
	case ctx.Err() != nil:
		t.err = ctx.Err()
	default:
		t.err = fmt.Errorf("data port: %w", err)
	}
	return t.err
}

func isIOErr(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed)
}

func (t *Inbound) violate(err error) error {
	t.err = fmt.Errorf("%w: %w", ErrDataProtocol, err)
	t.p.turnOff(t.conn, err)
	return t.err
}

// Close ends the transfer. One begun but not at its last frame is read
// to it and dropped (the caller cancels the guest's call first, and the
// guest then ends it between frames); where that fails, the connection is
// dropped, and the next transfer may pass over what is left of a frame.
// One with no frame yet is left: the guest refused the call and sent
// nothing, or what it sent is passed over by the next transfer as stale.
func (t *Inbound) Close() {
	if t.done {
		return
	}
	t.done = true
	// One deadline for the whole drain: a guest sending frame after frame
	// would renew one per frame forever.
	t.conn.SetReadDeadline(time.Now().Add(closeDrainLimit))
	for t.err == nil && !t.end && t.seq > 0 {
		f, _, err := t.fr.Next()
		switch {
		case err != nil:
			t.fail(context.Background(), err)
		case f.ID != t.ID || f.Seq != t.seq:
			t.violate(fmt.Errorf("frame %d of transfer %#x, expected %d of %#x", f.Seq, f.ID, t.seq, t.ID))
		default:
			t.seq++
			t.end = f.Flags != 0
			if err := t.fr.Skip(f); err != nil {
				t.fail(context.Background(), err)
			}
		}
	}
	t.conn.SetReadDeadline(time.Time{})
	if t.err != nil {
		t.p.drop(t.conn)
	} else if t.seq == 0 && t.resync > 0 {
		// Nothing was read: what is left of the dropped frame is the
		// next transfer's to pass over.
		t.p.keepResyncIn(t.conn)
	}
	<-t.p.recv
}
