package audit

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"sync"
)

const (
	frameHeaderSize = 8
	maxFrameSize    = frameHeaderSize + MaxRecordSize
	// maxBatchBytes caps one group commit's write. A torn tail can only
	// come from the last, unacknowledged, write, so it is never longer
	// than maxTornBytes; damage beyond that reach is corruption.
	maxBatchBytes = 4 << 20
	maxTornBytes  = maxBatchBytes + maxFrameSize
	readBufSize   = 4 << 20
)

var castagnoli = sync.OnceValue(func() *crc32.Table { return crc32.MakeTable(crc32.Castagnoli) })

// putFrameHeader fills the 8 bytes before payload.
func putFrameHeader(hdr, payload []byte) {
	binary.LittleEndian.PutUint32(hdr[0:4], uint32(len(payload)))
	binary.LittleEndian.PutUint32(hdr[4:8], crc32.Checksum(payload, castagnoli()))
}

// frameError is a frame that cannot be read: where, and why.
type frameError struct {
	off    int64
	reason string
	crc    bool // only the CRC is wrong; the payload is n bytes
	n      int
}

func (e *frameError) Error() string { return fmt.Sprintf("frame at offset %d: %s", e.off, e.reason) }

// frameReader reads frames from records.log sequentially through a large
// buffer.
type frameReader struct {
	r        io.ReaderAt
	size     int64 // bytes of the file to read
	off      int64 // file offset of buf[pos]
	buf      []byte
	pos, end int
}

func newFrameReader(r io.ReaderAt, size int64) *frameReader {
	// No frame is longer than the file: a small file needs a small buffer.
	return &frameReader{r: r, size: size, buf: make([]byte, min(readBufSize, max(size, 0)))}
}

// fill makes at least n bytes available at pos, or as many as the file
// has left; it returns how many are.
func (fr *frameReader) fill(n int) (int, error) {
	if fr.end-fr.pos >= n {
		return fr.end - fr.pos, nil
	}
	copy(fr.buf, fr.buf[fr.pos:fr.end])
	fr.end -= fr.pos
	fr.pos = 0
	for fr.end < n && fr.off+int64(fr.end) < fr.size {
		want := min(int64(len(fr.buf)-fr.end), fr.size-fr.off-int64(fr.end))
		if want <= 0 {
			break
		}
		k, err := fr.r.ReadAt(fr.buf[fr.end:fr.end+int(want)], fr.off+int64(fr.end))
		fr.end += k
		if errors.Is(err, io.EOF) {
			fr.size = fr.off + int64(fr.end) // the file ends sooner than it said
			break
		}
		if err != nil {
			return fr.end, fmt.Errorf("read records.log at %d: %w", fr.off+int64(fr.end), err)
		}
	}
	return fr.end, nil
}

// next returns the next frame's payload, valid until the following call,
// and its offset. At the end of the file it returns io.EOF; a bad frame
// is a *frameError, and the reader stays at it.
func (fr *frameReader) next() ([]byte, int64, error) {
	off := fr.off
	avail, err := fr.fill(frameHeaderSize)
	if err != nil {
		return nil, off, err
	}
	switch {
	case avail == 0:
		return nil, off, io.EOF
	case avail < frameHeaderSize:
		return nil, off, &frameError{off: off, reason: fmt.Sprintf("cut short: %d of %d header bytes", avail, frameHeaderSize)}
	}
	h := fr.buf[fr.pos : fr.pos+frameHeaderSize]
	n := binary.LittleEndian.Uint32(h[0:4])
	sum := binary.LittleEndian.Uint32(h[4:8])
	if n == 0 || n > MaxRecordSize {
		return nil, off, &frameError{off: off, reason: fmt.Sprintf("impossible length %d", n)}
	}
	total := frameHeaderSize + int(n)
	if avail, err = fr.fill(total); err != nil {
		return nil, off, err
	}
	if avail < total {
		return nil, off, &frameError{off: off, reason: fmt.Sprintf("cut short: %d of %d bytes", avail, total)}
	}
	p := fr.buf[fr.pos+frameHeaderSize : fr.pos+total]
	if crc32.Checksum(p, castagnoli()) != sum {
		return nil, off, &frameError{off: off, reason: "crc mismatch", crc: true, n: int(n)}
	}
	fr.pos += total
	fr.off += int64(total)
	return p, off, nil
}

// seek moves the reader to off.
func (fr *frameReader) seek(off int64) {
	fr.off, fr.pos, fr.end = off, 0, 0
}

var payloadStart = []byte(`{"seq":`)

// resync finds the first offset after from where a good frame starts
// (valid length and CRC, payload beginning like a record), or -1.
func (fr *frameReader) resync(from int64) (int64, error) {
	win := make([]byte, min(1<<20, max(fr.size-from, 0)))
	probe := newFrameReader(fr.r, fr.size)
	pos := from + 1
	for pos+frameHeaderSize < fr.size {
		n, err := fr.r.ReadAt(win[:min(int64(len(win)), fr.size-pos)], pos)
		if err != nil && !errors.Is(err, io.EOF) {
			return -1, fmt.Errorf("read records.log at %d: %w", pos, err)
		}
		w := win[:n]
		for i := frameHeaderSize; i < len(w); {
			k := bytes.Index(w[i:], payloadStart)
			if k < 0 {
				break
			}
			start := pos + int64(i+k) - frameHeaderSize
			probe.seek(start)
			if _, _, err := probe.next(); err == nil {
				return start, nil
			}
			i += k + 1
		}
		if n <= frameHeaderSize+len(payloadStart) {
			break
		}
		pos += int64(n - frameHeaderSize - len(payloadStart))
	}
	return -1, nil
}
