//go:build linux

package transport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// dataStallLimit bounds a frame write to the data port that makes no
// progress: the host has stopped reading.
const dataStallLimit = 10 * time.Second

// DataPort is the guest's end of the data port (protocol.DataPortName):
// file content in frames (protocol/bulk.go), one transfer at a time in
// each direction. The port stays open for the agent's life; while the
// host is away a read sees EOF and the transfer under way fails, and the
// next one reads again.
type DataPort struct {
	f *os.File

	rsem chan struct{} // held by the one receiver
	fr   *protocol.FrameReader
	rbuf []byte
	// pending is a frame header read, its payload not, that belongs to
	// the next receiver.
	pending *protocol.Frame

	wmu  sync.Mutex // one sender
	wbuf []byte     // a frame header and its payload
}

// OpenDataPort opens the virtio-serial port named name.
func OpenDataPort(name string) (*DataPort, error) {
	path, err := FindSerialPort(name)
	if err != nil {
		return nil, err
	}
	fd, err := openPort(path)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	return NewDataPort(os.NewFile(uintptr(fd), path)), nil
}

// NewDataPort returns the data port on f, an open port (or, in tests, a
// pipe's end).
func NewDataPort(f *os.File) *DataPort {
	return &DataPort{f: f, fr: protocol.NewFrameReader(f), rsem: make(chan struct{}, 1)}
}

// Receive writes the content of transfer id to w, in order, and returns
// once its last frame has come. Frames of other transfers are passed
// over. A failed write to w does not stop the reading: the rest of the
// transfer is read and dropped, so the host is not left blocked, and the
// write's error returned. The host's abort returns protocol.ErrTransferAborted.
func (p *DataPort) Receive(ctx context.Context, id uint64, w io.Writer) (n int64, err error) {
	select {
	case p.rsem <- struct{}{}:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	defer func() { <-p.rsem }()
	defer interrupt(ctx, p.f.SetReadDeadline)()
	if p.rbuf == nil {
		p.rbuf = make([]byte, protocol.MaxDataFrameBytes)
	}
	var werr error
	for seq := uint32(0); ; {
		var f protocol.Frame
		var err error
		if p.pending != nil {
			f, p.pending = *p.pending, nil
		} else {
			f, _, err = p.fr.Next()
		}
		if err == io.EOF {
			// A port reads EOF while no host is connected, and the host's
			// connection reaches the guest after the call that names the
			// transfer may have: wait for it, under ctx.
			if err := waitHost(int(p.fd()), ctx.Done()); err != nil {
				return n, receiveErr(ctx, err)
			}
			continue
		}
		if err != nil {
			return n, receiveErr(ctx, err)
		}
		if f.ID != id {
			if seq > 0 && f.Seq == 0 {
				// The host sends one transfer at a time: after frames of
				// this one, the first frame of another means this one
				// ended without its last frame reaching here (a dropped
				// connection). The other's receiver takes it from here.
				p.pending = &f
				return n, errors.New("data port: the transfer ended before its last frame")
			}
			if err := p.fr.Skip(f); err != nil {
				return n, receiveErr(ctx, err)
			}
			continue
		}
		if f.Seq != seq {
			return n, fmt.Errorf("data port: frame %d of the transfer, expected %d", f.Seq, seq)
		}
		seq++
		if f.Flags&protocol.FrameAbort != 0 {
			return n, protocol.ErrTransferAborted
		}
		b, err := p.fr.Payload(f, p.rbuf)
		if err != nil {
			return n, receiveErr(ctx, err)
		}
		if werr == nil {
			var k int
			k, werr = w.Write(b)
			n += int64(k)
		}
		if f.Flags&protocol.FrameEnd != 0 {
			return n, werr
		}
	}
}

func receiveErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("data port: %w", err)
}

// Send sends what r holds, up to its EOF, as transfer id, in frames of
// up to protocol.MaxDataFrameBytes; the last one is marked FrameEnd. A
// failed read from r, or ctx ending (seen between frames), sends an
// aborting frame and returns the error. A frame the host does not take
// within the stall limit fails the transfer.
func (p *DataPort) Send(ctx context.Context, id uint64, r io.Reader) (n int64, err error) {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	// ctx is looked at between frames, never inside one: a frame cut
	// short would leave the host's reader inside it.
	if p.wbuf == nil {
		p.wbuf = make([]byte, protocol.FrameHeaderSize+protocol.MaxDataFrameBytes)
	}
	// The host's connection may reach the guest after the call that
	// names the transfer: a port whose host is away takes no writes.
	if err := waitHost(int(p.fd()), ctx.Done()); err != nil {
		return 0, fmt.Errorf("data port: no host: %w", err)
	}
	for seq := uint32(0); ; seq++ {
		k, rerr := io.ReadFull(r, p.wbuf[protocol.FrameHeaderSize:])
		var flags uint32
		switch {
		case rerr == io.EOF || rerr == io.ErrUnexpectedEOF:
			flags = protocol.FrameEnd
		case rerr != nil:
			return n, errors.Join(rerr, p.abort(id, seq))
		}
		if err := ctx.Err(); err != nil {
			return n, errors.Join(err, p.abort(id, seq))
		}
		protocol.AppendFrame(p.wbuf[:0], protocol.Frame{Flags: flags, ID: id, Seq: seq, Length: uint32(k)})
		if err := p.write(p.wbuf[:protocol.FrameHeaderSize+k]); err != nil {
			return n, fmt.Errorf("data port: %w", err)
		}
		n += int64(k)
		if flags != 0 {
			return n, nil
		}
	}
}

// abort ends transfer id with an aborting frame.
func (p *DataPort) abort(id uint64, seq uint32) error {
	h := protocol.AppendFrame(p.wbuf[:0], protocol.Frame{Flags: protocol.FrameAbort, ID: id, Seq: seq})
	return p.write(h)
}

// write writes b whole, each write to the port under the stall limit.
// The kernel takes at most 32 KiB per write to a port; os.File goes on
// until all of b is written.
func (p *DataPort) write(b []byte) error {
	p.f.SetWriteDeadline(time.Now().Add(dataStallLimit))
	_, err := p.f.Write(b)
	return err
}

// fd is the port's file descriptor, for a poll that does not read.
func (p *DataPort) fd() uintptr {
	var fd uintptr
	if rc, err := p.f.SyscallConn(); err == nil {
		rc.Control(func(f uintptr) { fd = f })
	}
	return fd
}

// Close closes the port.
func (p *DataPort) Close() error { return p.f.Close() }

// interrupt makes ctx's end cut short a blocked read or write through
// set (a deadline setter), and returns what undoes it.
func interrupt(ctx context.Context, set func(time.Time) error) func() {
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		set(time.Unix(1, 0))
		close(fired)
	})
	return func() {
		if !stop() {
			<-fired
		}
		set(time.Time{})
	}
}
