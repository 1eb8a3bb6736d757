package protocol

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Bulk file data on the data port (DataPortName).
//
// A file's content can travel beside its RPC instead of inside it: the RPC
// (a write's header, a read's request) names a transfer id that carreld
// picks at random, and the content crosses the data port as frames of that
// id, in order. Each frame is a FrameHeaderSize-byte header, little-endian,
// then its payload:
//
//	magic  uint32  FrameMagic
//	flags  uint32  FrameEnd or FrameAbort on the last frame, else 0
//	id     uint64  the transfer's id (never 0)
//	seq    uint32  the frame's number in its transfer, from 0
//	length uint32  payload bytes, at most MaxDataFrameBytes
//
// A transfer is its frames up to one with FrameEnd (all of the content
// sent; it may carry the last of it) or FrameAbort (the sender gave up;
// the receiver drops what it has; it carries nothing). Only one transfer is under way on a port in each direction at a
// time. Frames of another id are left over from a transfer that ended
// early; the receiver skips them. After a reconnect a reader may land in
// the middle of a frame: it scans for the magic, and the id and sequence
// number keep a stray match from counting.
const (
	FrameMagic      = 0x4b4c5543 // "CULK" little-endian: carrel bulk
	FrameHeaderSize = 24
	// MaxDataFrameBytes is the most a data port frame carries: a file message's
	// worth.
	MaxDataFrameBytes = MaxMessageBytes

	FrameEnd   = 1 << 0
	FrameAbort = 1 << 1
	frameFlags = FrameEnd | FrameAbort
)

// Frame is a frame's header.
type Frame struct {
	Flags  uint32
	ID     uint64
	Seq    uint32
	Length uint32
}

// ErrTransferAborted is what a receiver returns for a transfer whose
// sender gave it up (FrameAbort).
var ErrTransferAborted = errors.New("data port: the sender aborted the transfer")

// ErrFrameMagic is returned by ParseFrame for bytes that do not start
// with FrameMagic.
var ErrFrameMagic = errors.New("data port: no frame magic")

// AppendFrame appends f's header to b.
func AppendFrame(b []byte, f Frame) []byte {
	b = binary.LittleEndian.AppendUint32(b, FrameMagic)
	b = binary.LittleEndian.AppendUint32(b, f.Flags)
	b = binary.LittleEndian.AppendUint64(b, f.ID)
	b = binary.LittleEndian.AppendUint32(b, f.Seq)
	return binary.LittleEndian.AppendUint32(b, f.Length)
}

// ParseFrame decodes the header at the start of b (at least
// FrameHeaderSize bytes) and checks it: the magic, known flags, an id,
// and a length within MaxDataFrameBytes. The payload is not looked at.
func ParseFrame(b []byte) (Frame, error) {
	if len(b) < FrameHeaderSize {
		return Frame{}, fmt.Errorf("data port: frame header of %d bytes", len(b))
	}
	if binary.LittleEndian.Uint32(b) != FrameMagic {
		return Frame{}, ErrFrameMagic
	}
	f := Frame{
		Flags:  binary.LittleEndian.Uint32(b[4:]),
		ID:     binary.LittleEndian.Uint64(b[8:]),
		Seq:    binary.LittleEndian.Uint32(b[16:]),
		Length: binary.LittleEndian.Uint32(b[20:]),
	}
	switch {
	case f.Flags&^frameFlags != 0 || f.Flags == frameFlags:
		return Frame{}, fmt.Errorf("data port: frame flags %#x", f.Flags)
	case f.Flags&FrameAbort != 0 && f.Length != 0:
		return Frame{}, errors.New("data port: an aborting frame with a payload")
	case f.ID == 0:
		return Frame{}, errors.New("data port: frame of transfer 0")
	case f.Length > MaxDataFrameBytes:
		return Frame{}, fmt.Errorf("data port: frame of %d bytes, over %d", f.Length, MaxDataFrameBytes)
	}
	return f, nil
}

// FrameReader reads frames from a data port.
type FrameReader struct {
	r *bufio.Reader
	// MaxSkip bounds the bytes Next passes over looking for a frame;
	// negative means no bound (the guest's side: what it reads comes from
	// carreld). Over the bound Next fails with ErrFrameMagic.
	MaxSkip int64
}

// NewFrameReader returns a reader of frames from r. Its buffer is one
// port buffer: a payload read into a larger slice goes straight from r.
func NewFrameReader(r io.Reader) *FrameReader {
	return &FrameReader{r: bufio.NewReaderSize(r, 4096), MaxSkip: -1}
}

// Next returns the next frame's header, past any bytes that do not start
// a valid one, and how many it passed over. Its payload is what Payload
// or Skip reads next.
func (fr *FrameReader) Next() (f Frame, skipped int64, err error) {
	for {
		b, err := fr.r.Peek(FrameHeaderSize)
		if err != nil {
			return Frame{}, skipped, err
		}
		f, err := ParseFrame(b)
		if err == nil {
			_, err = fr.r.Discard(FrameHeaderSize)
			return f, skipped, err
		}
		if fr.MaxSkip >= 0 && skipped >= fr.MaxSkip {
			return Frame{}, skipped, err
		}
		// Pass over what is buffered up to the next place the magic
		// could start.
		buf, _ := fr.r.Peek(fr.r.Buffered())
		n := 1
		if i := bytes.Index(buf[1:], frameMagic); i >= 0 {
			n += i
		} else {
			n = max(1, len(buf)-len(frameMagic)+1)
		}
		if fr.MaxSkip >= 0 {
			n = int(min(int64(n), fr.MaxSkip-skipped))
		}
		fr.r.Discard(n)
		skipped += int64(n)
	}
}

var frameMagic = binary.LittleEndian.AppendUint32(nil, FrameMagic)

// Payload reads f's payload into b, which must hold f.Length bytes.
func (fr *FrameReader) Payload(f Frame, b []byte) ([]byte, error) {
	b = b[:f.Length]
	_, err := io.ReadFull(fr.r, b)
	return b, noEOF(err)
}

// Skip passes over f's payload.
func (fr *FrameReader) Skip(f Frame) error {
	_, err := fr.r.Discard(int(f.Length))
	return noEOF(err)
}

// noEOF turns an EOF inside a frame into io.ErrUnexpectedEOF.
func noEOF(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}
